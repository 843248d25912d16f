"""Golden candidate logits of the real default model from Hugging Face transformers.

`python -m tests.golden.default_model` loads, in transformers (CPU PyTorch, float32), a
checkpoint of the exact values the runner loads from the default model's Q4_1 GGUF (its blocks
dequantized as llama.cpp does, in float32: `exact_checkpoint`), scores the demo's decisions
plus a long prompt, and writes tests/data/golden/default_model.json: for each row its token
ids, candidate ids and float32 candidate logits at the last position.
"""

from __future__ import annotations

import json
from pathlib import Path

from tools.demo import DECISIONS

GOLDEN = Path(__file__).resolve().parents[1] / "data" / "golden" / "default_model.json"
LONG_PROMPT = (
    "The following is a long passage about the history of astronomy. " * 40
    + "Question: Is this passage about astronomy?\nAnswer:"
)


def rows_spec() -> list[dict]:
    return [*DECISIONS["rows"], {"prompt": LONG_PROMPT, "candidates": [" Yes", " No"]}]


def reference_rows(model_dir: Path, rows: list[dict], tokenizer) -> list[dict]:
    """The transformers forward: full-vocabulary logits at the last position, then the ids."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    out = []
    for row in rows:
        tokens = tokenizer.encode(row["prompt"])
        ids = [tokenizer.encode(row["prompt"] + c)[-1] for c in row["candidates"]]
        with torch.no_grad():
            logits = model(torch.tensor([tokens])).logits[0, -1]
        out.append({**row, "tokens": tokens, "ids": ids, "logits": logits[ids].tolist()})
    return out


def exact_checkpoint(out: Path) -> Path:
    """A float32 checkpoint of the default model's GGUF values (what `--model default`
    computes with), in `out`."""
    from runner.sources.default_model import GGUF_NAME
    from tools.default_model import convert_gguf, prepare_default_model

    convert_gguf(prepare_default_model() / GGUF_NAME, out, dtype="float32")
    return out


def main() -> None:
    import tempfile

    from runner.sources.loader import load_model_source
    from runner.text.tokenizer import Tokenizer

    source = load_model_source("default")
    tokenizer = Tokenizer(source.tokenizer_json, tokenizer_config=source.tokenizer_config)
    with tempfile.TemporaryDirectory() as tmp:
        rows = reference_rows(exact_checkpoint(Path(tmp)), rows_spec(), tokenizer)
    GOLDEN.write_text(json.dumps({"model": "SmolLM2-135M-Instruct", "rows": rows}, indent=1))
    print(f"wrote {GOLDEN}")


if __name__ == "__main__":
    main()
