"""Golden candidate logits of the real default model from Hugging Face transformers.

`python -m tests.golden.default_model` loads the prepared SmolLM2-135M-Instruct directory in
transformers (CPU PyTorch, float32, the same dequantized weights the runner loads), scores
the demo's decisions plus a long prompt, and writes tests/data/golden/default_model.json:
for each row its token ids, candidate ids and float32 candidate logits at the last position.
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


def main() -> None:
    from runner.sources.loader import load_model_source
    from runner.text.tokenizer import Tokenizer
    from tools.default_model import prepare_default_model

    model_dir = prepare_default_model()
    source = load_model_source(str(model_dir))
    tokenizer = Tokenizer(source.tokenizer_json, tokenizer_config=source.tokenizer_config)
    rows = reference_rows(model_dir, rows_spec(), tokenizer)
    GOLDEN.write_text(json.dumps({"model": "SmolLM2-135M-Instruct", "rows": rows}, indent=1))
    print(f"wrote {GOLDEN}")


if __name__ == "__main__":
    main()
