"""`python -m bench.native_step`: short forwards through the native decoder step against MLX.

The CPU backend runs forwards of up to `native_step_max_tokens` tokens of Llama-shaped
models in one native call (runner/backend/native_step.py). This measures where that pays:
the same model loaded twice (the step on, and off), a prompt of `--cached` tokens in each
one's cache, then forwards of T new tokens after it with the head over the last row (a
decode step is T = 1), best of `--repeats`, in interleaved rounds; each T's MLX time as a
ratio to the native one. The threshold in runner/backend/__init__.py comes from this.

    python -m bench.native_step --model default --tokens 1,4,8,16,24,32,48,64

`--quantize BITS:GROUP` compares a quantization of the model instead, made as
`mlx_lm.convert(..., quantize=True, q_bits=BITS, q_group_size=GROUP)` makes one (its weights
in float16, every linear layer and the embedding quantized by mlx-lm's `quantize_model`,
written as a converted model and loaded by the runner): the quantized model through the
native step (`q-native`), through MLX's path (`q-mlx`: its CPU quantized_matmul; its
prompt's cache is the native one's, and it runs once a round, being slow), and the float
model through the native step (`float`, with its half copies): each time, and q-native's as a
ratio to float's (the issue's target: at most 1.3, below 1 for a decode step).

    python -m bench.native_step --model default --tokens 1,15 --quantize 4:64
    python -m bench.native_step --model qwen3-0.6b --tokens 1,15 --quantize 4:64

`--halves` compares a half-precision checkpoint's layouts on the CPU (runner/models/halves.py):
`widened` (float32 weights with the step's exact half copies), `float32` (without the copies:
what the runner held before the stored layout where memory was short) and `stored` (the
matrices as the checkpoint stores them), each with its resident bytes (parameters and copies);
each time as a ratio to widened's.

    python -m bench.native_step --model qwen3-0.6b --tokens 1,18,128 --halves

A forward of one token runs as a decode step (inside the model's `decode_steps`, as the
runner's generation runs them: a quantized or stored model's limbs or rows' stream tiles).

`--window N` windows every layer of the model at N positions (a Llama becomes the Mistral of
the same weights, a Qwen gets `layer_types` all sliding): its layers' caches are then
mlx-lm's rotating rings, read and masked by the step (docs/DESIGN.md §4.2), reset to the
prompt's state before every forward.

    python -m bench.native_step --model default --tokens 1,15,64 --window 256
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from runner.native import preload


def quantized_dir(source: Path, into: Path, bits: int, group: int) -> Path:
    """`source` (a model directory) quantized as mlx_lm.convert quantizes it, written at
    `into`: weights in float16, mlx-lm's `quantize_model` (affine), mlx-lm's save."""
    import mlx.core as mx
    from mlx.utils import tree_map
    from mlx_lm.utils import load_model, quantize_model, save_config, save_model

    module, config = load_model(source)
    module.update(
        tree_map(
            lambda a: a.astype(mx.float16) if mx.issubdtype(a.dtype, mx.floating) else a,
            module.parameters(),
        )
    )
    module, config = quantize_model(module, config, group, bits)
    into.mkdir(parents=True, exist_ok=True)
    save_model(into, module)
    save_config(config, into / "config.json")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (source / name).exists():
            shutil.copy(source / name, into / name)
    return into


def windowed_dir(source: Path, into: Path, window: int) -> Path:
    """`source` (a Llama or Qwen model directory) with every layer windowed at `window`
    positions, written at `into` (the weights and tokenizer linked, not copied)."""
    import json

    config = json.loads((source / "config.json").read_text())
    layers = config["num_hidden_layers"]
    if config.get("model_type") == "llama":  # the Mistral of the same weights
        config |= {"architectures": ["MistralForCausalLM"], "model_type": "mistral"}
        config.pop("layer_types", None)
    else:
        config["layer_types"] = ["sliding_attention"] * layers
        config["use_sliding_window"] = True
    config["sliding_window"] = window
    into.mkdir(parents=True, exist_ok=True)
    for item in source.iterdir():
        if item.name != "config.json":
            (into / item.name).symlink_to(item.resolve())
    (into / "config.json").write_text(json.dumps(config, indent=2))
    return into


def model_path(name: str) -> Path:
    """A model directory: `default`, a bench shape (bench/models.py SHAPES, by name or
    shape name: random weights, written once), or a path."""
    from bench.models import SHAPES, write_model_dir
    from runner.sources.default_model import cache_root, resolve_default_model

    if name == "default":
        return Path(resolve_default_model())
    shapes = {s.name: s for s in SHAPES.values()} | SHAPES
    if name in shapes:
        shape = shapes[name]
        return write_model_dir(shape, cache_root() / "bench-models" / shape.name)
    return Path(name)


def build_with_halves(path: Path, backend: Any, layout: str) -> Any:
    """The model at `path` for `backend` with its half-precision matrices `widened`, `stored`
    (runner/models/halves.py) or `float32` (widened without the step's half copies)."""
    import os

    from runner.models import build_model, halves
    from runner.sources.loader import load_model_source

    if layout == "float32":
        backend, layout = backend.replace(native_half_formats=()), "widened"
    before = os.environ.get(halves.SETTING)
    os.environ[halves.SETTING] = layout
    try:
        return build_model(load_model_source(str(path)), backend)
    finally:
        if before is None:
            del os.environ[halves.SETTING]
        else:
            os.environ[halves.SETTING] = before


def resident_bytes(model: Any) -> int:
    """The model's parameters' bytes and its native step's half copies'."""
    from mlx.utils import tree_flatten

    step = getattr(model, "_native", None)
    copies = sum(c.nbytes for c in getattr(step, "half_copies", []))
    return sum(v.nbytes for _, v in tree_flatten(model.module.parameters())) + copies


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    preload.reexec_preloaded("bench.native_step", argv)  # the BLAS is chosen at process start
    p = argparse.ArgumentParser(prog="python -m bench.native_step", description=__doc__)
    p.add_argument("--model", default="default", help="a model directory, `default`, or a shape")
    p.add_argument("--cached", type=int, default=480)
    p.add_argument("--tokens", default="1,4,16,64,128,256,512")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--quantize", default=None, help="BITS:GROUP (e.g. 4:64): see above")
    p.add_argument("--window", type=int, default=None, help="window every layer: see above")
    p.add_argument("--halves", action="store_true", help="the half layouts: see above")
    p.add_argument(
        "--no-q-mlx", action="store_true", help="with --quantize: leave out q-mlx (slow)"
    )
    args = p.parse_args(argv)

    import mlx.core as mx
    import numpy as np
    from mlx_lm.models.cache import RotatingKVCache

    from runner.backend import Backend
    from runner.models import build_model
    from runner.sources.loader import load_model_source

    path = model_path(args.model)
    sizes = [int(t) for t in args.tokens.split(",")]
    native_backend = Backend.cpu().replace(native_step_max_tokens=max(sizes))
    mlx_backend = Backend.cpu().replace(native_step_max_tokens=None)
    scratch = tempfile.TemporaryDirectory()
    if args.window:
        path = windowed_dir(path, Path(scratch.name) / "windowed", args.window)
    if args.quantize:
        bits, group = (int(x) for x in args.quantize.split(":"))
        qpath = quantized_dir(path, Path(scratch.name) / "q", bits, group)
        systems = {
            "q-native": build_model(load_model_source(str(qpath)), native_backend),
            "q-mlx": build_model(load_model_source(str(qpath)), mlx_backend),
            "float": build_model(load_model_source(str(path)), native_backend),
        }
        if args.no_q_mlx:
            del systems["q-mlx"]
    elif args.halves:
        systems = {
            name: build_with_halves(path, native_backend, name)
            for name in ("widened", "float32", "stored")
        }
    else:
        source = load_model_source(str(path))
        systems = {
            "native": build_model(source, native_backend),
            "mlx": build_model(source, mlx_backend),
        }
    first = next(iter(systems.values()))
    if getattr(first, "_native", None) is None:
        raise SystemExit("this model (or this machine: no dispatch library) has no native step")
    rng = np.random.default_rng(0)
    prompt = rng.integers(100, 5000, size=args.cached + max(sizes)).tolist()
    prompt_caches: dict[str, Any] = {}

    def cached(name: str, model: Any) -> list[Any]:
        """Caches holding the prompt: computed by `model`, or for q-mlx (MLX's quantized
        product at ~1 GFLOP/s) copies of q-native's, the same quantized model's."""
        caches = model.make_caches()
        if not args.cached:
            return caches
        if name == "q-mlx":
            for mine, theirs in zip(caches, prompt_caches["q-native"], strict=True):
                mine.update_and_fetch(
                    theirs.keys[..., : args.cached, :], theirs.values[..., : args.cached, :]
                )
            return caches
        # in forwards the native step takes, as the runner's chunked prefill feeds it: one
        # forward past its limit would run MLX's path (for a quantized model, MLX's CPU
        # quantized_matmul: minutes for a 0.6B's prompt)
        step = max(sizes)
        for start in range(0, args.cached, step):
            chunk = prompt[start : min(start + step, args.cached)]
            mx.eval(model.hidden(mx.array([chunk], dtype=mx.int32), caches))
        prompt_caches[name] = caches
        return caches

    def prompt_state(caches: list[Any]) -> list[Any]:
        """What resets `caches` to the prompt: an offset (a KV cache's rewind), or a rotating
        ring's whole state (a wrapped ring cannot be rewound)."""
        return [c.state if isinstance(c, RotatingKVCache) else args.cached for c in caches]

    def timed(name: str, model: Any, t: int) -> float:
        caches = cached(name, model)
        state = prompt_state(caches)
        best = float("inf")
        for _ in range(1 if name == "q-mlx" else args.repeats):
            for c, s in zip(caches, state, strict=True):
                if isinstance(c, RotatingKVCache):  # fresh views: MLX's writes into the
                    # ring rebind the array object the cache holds, which must not be ours
                    keys, values, *rest = s
                    c.state = (keys[:], values[:], *rest)
                else:
                    c.offset = s
            new = mx.array([prompt[args.cached : args.cached + t]], dtype=mx.int32)
            started = time.perf_counter()
            with model.decode_steps() if t == 1 else contextlib.nullcontext():
                hidden = model.hidden(new, caches)
                mx.eval(model.unembed(hidden[:, -1:]))
            best = min(best, time.perf_counter() - started)
        return best

    best: dict[tuple[int, str], float] = {}
    started = time.strftime("%Y-%m-%d %H:%M")
    for _ in range(args.rounds):  # interleaved: the machine's load drifts
        for t in sizes:
            for name, model in systems.items():
                key = (t, name)
                best[key] = min(best.get(key, float("inf")), timed(name, model, t))
    print(
        f"model {path}{f' quantized {args.quantize}' if args.quantize else ''}"
        f"{f' windowed at {args.window}' if args.window else ''}: {args.cached} "
        f"tokens cached, then T new; best of {args.repeats} x {args.rounds} rounds (q-mlx: 1 "
        f"x {args.rounds}), {started}; ms for the forward and the head's last row"
    )
    if args.halves:
        for name, model in systems.items():
            print(f"{name}: {resident_bytes(model) / 2**20:.1f} MB of weights")
    for t in sizes:
        ms = {name: best[(t, name)] * 1e3 for name in systems}
        cells = "  ".join(f"{name} {v:8.1f} ms" for name, v in ms.items())
        if args.halves:
            ratios = "  ".join(f"{n}/widened x{ms[n] / ms['widened']:.2f}" for n in systems)
        elif args.quantize:
            ratios = f"q-native/float x{ms['q-native'] / ms['float']:.2f}"
            if "q-mlx" in ms:
                ratios += f"  q-mlx/q-native x{ms['q-mlx'] / ms['q-native']:.1f}"
        else:
            ratios = f"mlx/native x{ms['mlx'] / ms['native']:.2f}"
        print(f"T={t:3d}  {cells}  {ratios}")
    scratch.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
