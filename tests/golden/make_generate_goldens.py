"""Regenerate the greedy-generation goldens with Hugging Face transformers.

    python tests/golden/make_generate_goldens.py   # tests/data/golden/generate_<arch>.json

Each golden is what `model.generate(do_sample=False)` (CPU PyTorch, float32, eager attention)
produces on the tiny model of tests/tiny.py from a fixed prompt of PROMPT_LENGTH random ids:
the new token ids up to EOS (excluded) or MAX_NEW_TOKENS, and whether it stopped at EOS. The
prompt is longer than Gemma3's sliding window (8), so its ring wraps while generating.
`min_margin` (the smallest top-1 minus top-2 logit over the steps) is kept to show that
float32 rounding cannot flip a choice. tests/test_generate_golden.py imports
`reference_generation` for its live tier.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for tiny.py
from tiny import GOLDEN, TINY_ARCHITECTURES, write_tiny_model

PROMPT_LENGTH = 20
MAX_NEW_TOKENS = 12
PROMPT_SEED = 2024
EOS_ID = 2  # <|im_end|>, the tiny models' eos_token_id


def golden_prompt(vocab_size: int = 384) -> list[int]:
    rng = np.random.default_rng(PROMPT_SEED)
    return [int(t) for t in rng.integers(3, vocab_size, PROMPT_LENGTH)]  # no special ids


# Options of each case, as the runner reads them, and the transformers generate() arguments
# that mean the same: transformers' repetition penalty covers the whole sequence (prompt
# included) once per distinct token, which is Go's repeat_penalty with repeat_last_n < 0.
CASES: list[tuple[dict[str, Any], dict[str, Any]]] = [
    ({}, {}),
    ({"repeat_penalty": 1.5, "repeat_last_n": -1}, {"repetition_penalty": 1.5}),
]


def reference_generation(
    model_dir: Path, prompt: list[int], hf_args: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Greedy generation of the transformers model in `model_dir`."""
    import torch
    import transformers

    arch = json.loads((Path(model_dir) / "config.json").read_text())["architectures"][0]
    model = getattr(transformers, arch).from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    )
    model.eval()
    ids = torch.tensor([prompt], dtype=torch.int64)
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=MAX_NEW_TOKENS,
            eos_token_id=EOS_ID,
            pad_token_id=0,
            output_scores=True,
            return_dict_in_generate=True,
            **(hf_args or {}),
        )
    new = [int(t) for t in out.sequences[0, len(prompt) :]]
    eos = EOS_ID in new
    if eos:
        new = new[: new.index(EOS_ID)]
    margins = [float(s[0].topk(2).values[0] - s[0].topk(2).values[1]) for s in out.scores]
    return {"generated": new, "eos": eos, "min_margin": min(margins)}


def reference_cases(model_dir: Path) -> dict[str, Any]:
    prompt = golden_prompt()
    cases = [
        {"options": options, **reference_generation(model_dir, prompt, hf_args)}
        for options, hf_args in CASES
    ]
    return {"prompt": prompt, "max_new_tokens": MAX_NEW_TOKENS, "cases": cases}


def write_golden(arch: str) -> Path:
    with tempfile.TemporaryDirectory() as tmp:
        golden = reference_cases(write_tiny_model(arch, Path(tmp)))
    path = GOLDEN / f"generate_{arch}.json"
    path.write_text(json.dumps(golden) + "\n")
    return path


def main() -> None:
    only = sys.argv[1:]  # architectures; all by default
    for arch in only or TINY_ARCHITECTURES:
        path = write_golden(arch)
        for case in json.loads(path.read_text())["cases"]:
            eos = " (EOS)" if case["eos"] else ""
            print(path.name, case["options"], case["generated"], eos, f"{case['min_margin']:.2g}")


if __name__ == "__main__":
    main()
