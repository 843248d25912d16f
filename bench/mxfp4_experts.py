"""`python -m bench.mxfp4_experts`: a gpt-oss-shaped model whose experts are in MLX's mxfp4 mode
(as Ollama's gpt-oss GGUFs store them, MXFP4, and mlx-community's conversions), its experts
computed by MLX's CPU `gather_qmm` against the runner's library (runner/backend/
library_products.py, `AffineSwitchLinear`), in the same process, alternating.

The shape is gpt-oss-20b's (hidden 2880, experts of 2880, 64 query heads of 64, 8 KV heads, 4
experts a token, sliding and full layers alternating) with fewer layers and experts (a token's
work is its 4 experts a layer, whatever their number; random weights, float32 elsewhere);
mlx-lm's `gpt_oss.Model`, its experts quantized by `nn.quantize(mode="mxfp4")`. Each round
times a 64-token prompt and 8 decode tokens (median ms a token) with MLX's products, then
with the library's (the same layers, their class swapped by `compute_affine` and back).

    python -m bench.mxfp4_experts --layers 4 --experts 8 --rounds 2
"""

from __future__ import annotations

import argparse
import statistics
import time

PROMPT, DECODE = 64, 8


def build(layers: int, experts: int, hidden: int = 2880):
    """mlx-lm's gpt-oss of gpt-oss-20b's shape (`hidden` for the experts' and the model's
    width: smaller in the tests), `layers` layers of `experts` experts, experts in mxfp4."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm.models import gpt_oss

    kinds = ["sliding_attention", "full_attention"] * layers
    args = gpt_oss.ModelArgs(
        model_type="gpt_oss", num_hidden_layers=layers, num_local_experts=experts,
        num_experts_per_tok=4, vocab_size=1024, rms_norm_eps=1e-5, hidden_size=hidden,
        intermediate_size=hidden, head_dim=64, num_attention_heads=64, num_key_value_heads=8,
        sliding_window=128, rope_theta=150000, rope_scaling=None, layer_types=kinds[:layers],
    )  # fmt: skip
    model = gpt_oss.Model(args)
    model.set_dtype(mx.float32)
    nn.quantize(
        model, group_size=32, bits=4, mode="mxfp4",
        class_predicate=lambda path, m: "experts" in path and hasattr(m, "to_quantized"),
    )  # fmt: skip
    mx.eval(model.parameters())
    return model


def timed(model) -> tuple[float, float]:
    """ms of a 64-token prompt, and the median ms of 8 decode tokens after it."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    started = time.perf_counter()
    mx.eval(model(mx.array([list(range(1, PROMPT + 1))]), cache=cache))
    prompt = time.perf_counter() - started
    steps = []
    for token in range(DECODE):
        started = time.perf_counter()
        mx.eval(model(mx.array([[token + 7]]), cache=cache))
        steps.append(time.perf_counter() - started)
    return prompt * 1e3, statistics.median(steps) * 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.mxfp4_experts", description=__doc__)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=2880, help=argparse.SUPPRESS)  # tests
    args = parser.parse_args(argv)
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear

    from runner.backend import Backend, library_products
    from runner.models import quantized

    products = library_products.for_backend(Backend.for_device())
    if products is None:
        raise SystemExit("needs the runner's native library preloaded (runner/native/preload.py)")
    model = build(args.layers, args.experts, args.hidden)
    switch = [m for _, m in model.named_modules() if isinstance(m, QuantizedSwitchLinear)]
    timed(model)  # untimed: the first forward's allocations
    for r in range(args.rounds):
        for way in ("MLX gather_qmm", "library"):
            for layer in switch:  # the same layers either way
                layer.__class__, layer.products = QuantizedSwitchLinear, None
            if way == "library" and quantized.compute_affine(model, products) != len(switch):
                raise SystemExit("the library does not read these experts")
            prompt, decode = timed(model)
            print(
                f"round {r + 1} {way:>15}: {PROMPT}-token prompt {prompt:8.1f} ms, "
                f"decode {decode:7.1f} ms a token",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
