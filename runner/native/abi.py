"""The native library's ABI as ctypes sees it: the mirror of runner_native.h's structs, the
entry points bound with their signatures, and the handshake that checks both sides agree.

`load(library)` binds a library (default: the one preloaded into this process,
runner/native/preload.py) and checks, before anything calls it, that its
`runner_native_abi_version()` is `ABI_VERSION` and that every struct has the same size and
the same fields, in the same order at the same offsets, as the mirror here
(`runner_native_field`, runner/native/abi.c). On any difference it logs one line saying what
differs and returns None: the decoder layers then stay on MLX's path (products still go
through the library's cblas_sgemm, whose ABI is the BLAS's). A change to a struct or a
signature is made on both sides, with the version bumped (runner_native.h says so).
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
from typing import Any

log = logging.getLogger(__name__)

ABI_VERSION = 27  # RUNNER_NATIVE_ABI_VERSION in runner_native.h

F32 = ctypes.POINTER(ctypes.c_float)

# The weight formats of runner_native.h (struct step_weight's `format`, and `scale_format`).
F32_FORMAT, AFFINE, Q6K, Q4K, Q5K, Q3K, Q2K, IQ4XS, IQ4NL = 0, 3, 4, 5, 6, 7, 8, 9, 10
# GGML's grid i-quants (W_IQ2XXS .. W_IQ1M)
IQ2XXS, IQ2XS, IQ2S, IQ3XXS, IQ3S, IQ1S, IQ1M = 11, 12, 13, 14, 15, 16, 17
# GGML's F16 and BF16 matrices as a GGUF stores them (W_GF16, W_GBF16: row-major halves, not
# the panels of W_F16 / W_BF16)
GF16, GBF16 = 19, 20
# Each GGML type whose blocks products read, by its name (runner/sources/gguf/quants.py): its
# weight format
BLOCK_FORMATS = {
    "Q6_K": Q6K, "Q4_K": Q4K, "Q5_K": Q5K, "Q3_K": Q3K, "Q2_K": Q2K, "IQ4_XS": IQ4XS,
    "IQ4_NL": IQ4NL, "IQ2_XXS": IQ2XXS, "IQ2_XS": IQ2XS, "IQ2_S": IQ2S, "IQ3_XXS": IQ3XXS,
    "IQ3_S": IQ3S, "IQ1_S": IQ1S, "IQ1_M": IQ1M, "F16": GF16, "BF16": GBF16,
}  # fmt: skip
# The half-precision formats (W_F16, W_BF16): those tried, in order, for exact copies of float32
# weights, and the formats of an affine quantization's scales and biases beside float32.
HALF_FORMATS = {"float16": 1, "bfloat16": 2}
SCALE_FORMATS = {"float32": F32_FORMAT, **HALF_FORMATS}
# W_E8M0: the scales of AFFINE's mxfp4 mode (MLX's mode "mxfp4": a byte e a group of 32,
# 2^(e - 127); e2m1 codes; no biases)
E8M0 = 18
PRODUCTS = ("q", "k", "v", "o", "gate", "up", "down")  # a layer's weight matrices
# The gated MLP's activations (step_args' `activation`: ACT_SILU, ACT_GELU_TANH, ACT_SWIGLU_OAI)
ACTIVATIONS = {"silu": 0, "gelu_tanh": 1, "swiglu_oai": 2}


class Weight(ctypes.Structure):  # struct step_weight
    _fields_ = [
        ("format", ctypes.c_int),
        ("bits", ctypes.c_int),
        ("group", ctypes.c_int),
        ("scale_format", ctypes.c_int),
        ("data", ctypes.c_void_p),
        ("scales", ctypes.c_void_p),
        ("biases", ctypes.c_void_p),
        ("f32", F32),
    ]


class Experts(ctypes.Structure):  # struct step_experts
    _fields_ = [
        ("count", ctypes.c_int),
        ("top_k", ctypes.c_int),
        ("norm_topk", ctypes.c_int),
        ("intermediate", ctypes.c_int),
        ("router", Weight),
        ("gate", Weight),
        ("up", Weight),
        ("down", Weight),
        ("gate_up_stride", ctypes.c_long * 2),
        ("down_stride", ctypes.c_long * 2),
        ("router_bias", F32),
        ("gate_bias", F32),
        ("up_bias", F32),
        ("down_bias", F32),
    ]


class Layer(ctypes.Structure):  # struct step_layer
    _fields_ = [
        *(
            (name, F32)
            for name in (
                "input_norm", "q_bias", "k_bias", "v_bias", "o_bias", "q_norm", "k_norm",
                "post_norm", "attn_out_norm", "mlp_out_norm",
            )
        ),
        *((name, Weight) for name in PRODUCTS),
        ("rope_table", ctypes.c_int),
        ("experts", ctypes.POINTER(Experts)),
        ("sinks", F32),
    ]  # fmt: skip


class Cache(ctypes.Structure):  # struct step_cache
    _fields_ = [
        ("keys", ctypes.c_void_p),
        ("values", ctypes.c_void_p),
        ("head_stride", ctypes.c_long),
        ("start", ctypes.c_int),
        ("window", ctypes.c_int),
        ("append_keys", ctypes.c_void_p),
        ("append_values", ctypes.c_void_p),
        ("wrap", ctypes.c_int),
        ("keys2", ctypes.c_void_p),
        ("values2", ctypes.c_void_p),
    ]


class Args(ctypes.Structure):  # struct step_args
    _fields_ = [
        *(
            (name, ctypes.c_int)
            for name in (
                "batch", "tokens", "hidden", "heads", "kv_heads", "head_dim", "intermediate",
                "layers", "offset", "rope_dims", "activation",
            )
        ),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        ("act_alpha", ctypes.c_float),
        ("act_limit", ctypes.c_float),
        ("softcap", ctypes.c_float),
        ("cos", F32),
        ("sin", F32),
        ("query_scale", F32),
        ("layer", ctypes.POINTER(Layer)),
        ("cache", ctypes.POINTER(Cache)),
        ("final_norm", F32),
        ("x", F32),
        ("new_keys", F32),
        ("new_values", F32),
        ("scratch", F32),
        ("decode", ctypes.c_int),
    ]  # fmt: skip


STRUCTS: dict[str, type[ctypes.Structure]] = {
    "step_weight": Weight,
    "step_experts": Experts,
    "step_layer": Layer,
    "step_cache": Cache,
    "step_args": Args,
}


@dataclasses.dataclass(frozen=True)
class Functions:
    """A checked library's entry points, with their signatures."""

    step: Any  # runner_decoder_step
    scratch: Any  # runner_step_scratch_floats
    half_weights: bool  # whether its products read half-precision copies (AVX2 + F16C)
    limb_products: bool  # whether decode steps' GGML block products take limbs (AVX2, VNNI)
    affine_limbs: bool  # whether their 5-bit affine products do too (VNNI and VBMI, AVX2)
    narrow_panels: Any
    panel_halves: Any
    weight_product: Any  # runner_weight_product(m, n, k, a, POINTER(Weight), c, decode)
    weight_supported: Any  # runner_weight_supported(POINTER(Weight), n, k)
    amx_products: Any  # runner_amx_products(set): 1 where a forward's Q4_K, Q5_K rows take AMX


def _layout(library: ctypes.CDLL, type_name: str) -> tuple[int, list[tuple[str, int]]]:
    """The C side of struct `type_name`: its size and its (field, offset) pairs in order."""
    field = library.runner_native_field
    field.argtypes = [
        ctypes.c_char_p,
        ctypes.c_int,
        ctypes.POINTER(ctypes.c_char_p),
        ctypes.POINTER(ctypes.c_long),
    ]
    field.restype = ctypes.c_int
    name, offset = ctypes.c_char_p(), ctypes.c_long()
    if not field(type_name.encode(), -1, ctypes.byref(name), ctypes.byref(offset)):
        return -1, []
    size, fields = offset.value, []
    for index in range(1000):
        if not field(type_name.encode(), index, ctypes.byref(name), ctypes.byref(offset)):
            break
        fields.append(((name.value or b"").decode(), offset.value))
    return size, fields


def differences(
    library: ctypes.CDLL, structs: dict[str, type[ctypes.Structure]] = STRUCTS
) -> list[str]:
    """What differs between `library`'s ABI and the mirror (`structs`), one line each."""
    try:
        version = library.runner_native_abi_version
    except AttributeError:
        return ["no runner_native_abi_version: not the runner's native library, or an old one"]
    version.restype = ctypes.c_int
    if version() != ABI_VERSION:
        return [f"ABI version {version()}, the runner expects {ABI_VERSION}"]
    found = []
    for type_name, mirror in structs.items():
        size, fields = _layout(library, type_name)
        ours = [(name, getattr(mirror, name).offset) for name, *_ in mirror._fields_]
        if size != ctypes.sizeof(mirror):
            found.append(f"struct {type_name}: {size} bytes, the mirror {ctypes.sizeof(mirror)}")
        if fields != ours:
            theirs = dict(fields)
            wrong = [f"{n}@{o} (C: {theirs.get(n, 'none')})" for n, o in ours if theirs.get(n) != o]
            extra = [n for n, _ in fields if n not in dict(ours)]
            found.append(
                f"struct {type_name}: fields differ: {', '.join(wrong) or 'order'}"
                + (f"; only in C: {', '.join(extra)}" if extra else "")
            )
    return found


def level(library: ctypes.CDLL | None = None) -> str | None:
    """The instruction-set path `library` (default: the preloaded one) computes with:
    "avx512", "avx2", "avx", "sse", "neon" or "generic" (runner_native.h); None without one."""
    try:
        library = ctypes.CDLL(None) if library is None else library
        function = library.runner_native_level
    except (OSError, AttributeError):
        return None
    function.restype = ctypes.c_char_p
    return (function() or b"").decode() or None


def load(library: ctypes.CDLL | None = None) -> Functions | None:
    """`library`'s entry points (default: the library preloaded into this process), or None
    when there is none there, or when its ABI differs from the mirror (logged)."""
    try:
        library = ctypes.CDLL(None) if library is None else library
        library.runner_native_abi_version  # noqa: B018  (present, or not the library)
    except (OSError, AttributeError):
        return None
    problems = differences(library)
    if problems:
        log.warning(
            "the native library's ABI differs from the runner's (%s): the decoder layers "
            "stay on MLX's path",
            "; ".join(problems),
        )
        return None
    step, scratch = library.runner_decoder_step, library.runner_step_scratch_floats
    half, narrow_panels = library.runner_half_weights, library.runner_narrow_panels
    panel_halves, weight_product = library.runner_panel_halves, library.runner_weight_product
    step.argtypes = scratch.argtypes = [ctypes.POINTER(Args)]
    step.restype, scratch.restype = ctypes.c_int, ctypes.c_long
    half.restype = ctypes.c_int
    limbs = library.runner_limb_products
    limbs.restype = ctypes.c_int
    narrow_panels.argtypes = [F32, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
    narrow_panels.restype = ctypes.c_int
    panel_halves.argtypes = [ctypes.c_int, ctypes.c_int]
    panel_halves.restype = ctypes.c_long
    weight_product.argtypes = [
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        F32,
        ctypes.POINTER(Weight),
        F32,
        ctypes.c_int,
    ]
    weight_product.restype = ctypes.c_int
    supported = library.runner_weight_supported
    supported.argtypes = [ctypes.POINTER(Weight), ctypes.c_int, ctypes.c_int]
    supported.restype = ctypes.c_int
    amx = library.runner_amx_products
    amx.argtypes, amx.restype = [ctypes.c_int], ctypes.c_int
    return Functions(
        step,
        scratch,
        bool(half()),
        bool(limbs() & 1),
        bool(limbs() & 2),
        narrow_panels,
        panel_halves,
        weight_product,
        supported,
        amx,
    )
