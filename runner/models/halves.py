"""A half-precision checkpoint's matrices on the CPU: widened, or held as the file stores them.

On the CPU the runner computes in float32 (the reference's numbers), and a float16 / bfloat16
checkpoint's matrices (most Hugging Face checkpoints) have two layouts there:
- widened: float32 weights for MLX's path, and exact half copies of them beside, which the
  native step's short forwards and decode steps read as panels (runner/backend/native_step.py):
  3x the file's bytes, the fastest products;
- stored: each decoder matrix (the layers' projections, the embedding, the head, a mixture's
  stacked experts) kept as its own bytes in a `GGMLLinear` / `GGMLEmbedding` /
  `GGMLSwitchLinear` of type F16 / BF16, as a GGUF's half tensors are
  (runner/models/quantized.py): the native step reads them by rows (the library's W_GF16 /
  W_GBF16 formats: every value widened exactly, the same float32 numbers), and the library
  computes MLX's path's products from them: 1x the file, decode steps ~1.1x and products of a
  few rows ~1.3x the widened layout's time (docs/DESIGN.md §4).
A 7B bfloat16 checkpoint (14 GB) takes ~42 GB widened, or ~28 as float32 alone where the
copies do not fit (what the runner held before): more than many machines have; stored, 14.

A mixture's stacked experts get no half copies when widened (float32 alone: 2x their bytes,
read at 4 bytes a weight by every token's experts), so stored they are both smaller and faster
(a Qwen3-30B-A3B-shaped model: decode steps 0.65x, prompts 0.77x the time).

`OLLAMA_MLX_RUNNER_HALF_WEIGHTS` chooses: `auto` (the default) stores stacked experts (where
the library widens halves in vector registers: AVX2 + F16C), and widens the other matrices
while that takes at most WIDENED_MEMORY_SHARE of the memory available at load (the experts'
bytes included), else stores them too; `stored` and `widened` say which for all. Only for a
family the native step serves, on a backend that runs it, not sharded; where the step then
declines the module, the matrices are widened after all (`widen`), MLX's path computing as it
always did.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten
from mlx_lm.models.switch_layers import SwitchLinear

from runner.backend import native_step
from runner.models import quantized
from runner.models.quantized import (
    BLOCKS,
    GGML_TYPE,
    BlockProducts,
    GGMLEmbedding,
    GGMLLinear,
    GGMLSwitchLinear,
)
from runner.native import abi
from runner.sources.source import ModelLoadError

log = logging.getLogger(__name__)

SETTING = "OLLAMA_MLX_RUNNER_HALF_WEIGHTS"
LAYOUTS = ("auto", "stored", "widened")
# The widened layout's 3x the halves' bytes at most this share of the memory available at
# load (the same bound as the half copies' own: they are made while at most half of what is
# left after the float32 weights, runner/backend/native_step.py)
WIDENED_MEMORY_SHARE = 0.75
GGML_TYPES = {dtype: name for name, dtype in quantized.HALF_TYPES.items()}  # F16, BF16


def setting() -> str:
    """The layout asked for by the environment; ModelLoadError for an unknown one."""
    value = os.environ.get(SETTING, "auto").strip().lower() or "auto"
    if value not in LAYOUTS:
        raise ModelLoadError(f"{SETTING}={value!r}: expected one of {', '.join(LAYOUTS)}")
    return value


def decoder_halves(
    module: nn.Module, weights: dict[str, Any], products: BlockProducts
) -> dict[str, str]:
    """The decoder's plain linear and embedding layers and mlx-lm switch layers (stacked
    experts) (under `model.`, and `lm_head`: what a native step reads) whose weight in
    `weights` is a float16 / bfloat16 matrix (a switch layer's: [experts, out, in]) that
    `products` reads, each with its GGML type (F16, BF16)."""
    found: dict[str, str] = {}
    for path, layer in module.named_modules():
        kind = type(layer)
        if kind not in (nn.Linear, nn.Embedding, SwitchLinear):
            continue
        if not (path == "lm_head" or path.startswith("model.")):
            continue
        weight = weights.get(f"{path}.weight")
        if not isinstance(weight, mx.array) or weight.ndim != (3 if kind is SwitchLinear else 2):
            continue
        ggml_type = GGML_TYPES.get(weight.dtype)
        if ggml_type and products.reads(ggml_type, int(weight.shape[-2]), int(weight.shape[-1])):
            found[path] = ggml_type
    return found


def vector_halves() -> bool:
    """Whether the preloaded library widens halves in vector registers (AVX2 + F16C)."""
    functions = abi.load()
    return functions is not None and bool(functions.half_weights)


def stores(half_bytes: int, layout: str, available: int | None, other_bytes: int = 0) -> bool:
    """Whether matrices of `half_bytes` (3x widened, with the step's copies) are stored under
    `layout`, beside `other_bytes` held anyway, with `available` bytes of memory (None:
    unknown, and so widened under `auto`)."""
    if layout != "auto":
        return layout == "stored"
    needed = 3 * half_bytes + other_bytes
    return available is not None and needed > WIDENED_MEMORY_SHARE * available


def store(
    module: nn.Module, weights: dict[str, Any], paths: dict[str, str], products: BlockProducts
) -> None:
    """The layers at `paths` (`decoder_halves`) become GGMLLinear / GGMLEmbedding /
    GGMLSwitchLinear over their weights' own bytes, computed by `products`. Before the weights
    are loaded."""
    layers = dict(module.named_modules())
    switches: list[tuple[str, nn.Module]] = []
    for path, ggml_type in paths.items():
        blocks = weights.pop(f"{path}.weight").view(mx.uint8)
        weights[f"{path}.{BLOCKS}"] = blocks
        layer = layers[path]
        if type(layer) is SwitchLinear:  # (adopt_blocks knows stacked experts by a GGUF's names)
            experts, rows, _ = blocks.shape
            stack = GGMLSwitchLinear(layer.input_dims, rows, experts, "bias" in layer, ggml_type)
            stack.products = products
            switches.append((path, stack))
    if switches:
        module.update_modules(tree_unflatten(switches))
    matrices = {p: t for p, t in paths.items() if type(layers[p]) is not SwitchLinear}
    quantization = {path: {GGML_TYPE: t} for path, t in matrices.items()}
    quantized.adopt_blocks(module, weights, quantization, matrices, True, products)


def store_if_chosen(module: nn.Module, weights: dict[str, Any], products: BlockProducts) -> bool:
    """`store` the decoder's half matrices where the setting and the memory say so; whether
    it did."""
    layout = setting()
    paths = decoder_halves(module, weights, products)
    if not paths or layout == "widened":
        return False
    layers = dict(module.named_modules())
    # stacked experts widened get no half copies (float32 only: 2x the bytes, and a step reads
    # each token's experts at 4 bytes a weight), so under `auto` they are always stored where
    # the library widens halves in vector registers (a build without AVX2 + F16C widens them
    # a value at a time: there the experts go with the other matrices)
    vector = vector_halves()
    stacks = {p: t for p, t in paths.items() if vector and type(layers[p]) is SwitchLinear}
    matrices = {p: t for p, t in paths.items() if p not in stacks}
    stack_bytes = sum(weights[f"{p}.weight"].nbytes for p in stacks)
    half_bytes = sum(weights[f"{p}.weight"].nbytes for p in matrices)
    available = native_step.available_memory()
    chosen = stacks | (matrices if stores(half_bytes, layout, available, stack_bytes) else {})
    if not chosen:
        return False
    store(module, weights, chosen, products)
    log.info(
        "half-precision matrices held as stored: %d MB of %d (%s MB available)",
        sum(weights[f"{p}.{BLOCKS}"].nbytes for p in chosen) >> 20,
        (stack_bytes + half_bytes) >> 20, "?" if available is None else available >> 20,
    )  # fmt: skip
    return True


def widen(module: nn.Module) -> bool:
    """Every half GGMLLinear / GGMLEmbedding / GGMLSwitchLinear of `module` (`store`'s) an
    nn.Linear / nn.Embedding / SwitchLinear of its float32 values again (where no native step
    reads them); whether there was one."""
    switches: list[tuple[str, nn.Module]] = []
    for path, layer in module.named_modules():
        if isinstance(layer, GGMLSwitchLinear) and layer.ggml_type in quantized.HALF_TYPES:
            blocks = layer[BLOCKS]
            experts, rows, _ = blocks.shape
            columns = quantized.block_columns(layer.ggml_type, blocks.shape[-1])
            plain = SwitchLinear(columns, rows, experts, bias="bias" in layer)
            plain.weight = quantized.dequantize_half(blocks, layer.ggml_type)
            if "bias" in layer:
                plain.bias = layer["bias"]
            switches.append((path, plain))
    if switches:
        module.update_modules(tree_unflatten(switches))
        mx.eval(module.parameters())
    halves = any(
        isinstance(m, (GGMLLinear, GGMLEmbedding)) and m.ggml_type in quantized.HALF_TYPES
        for _, m in module.named_modules()
    )
    released = halves and quantized.release_blocks(module)
    return bool(switches) or released
