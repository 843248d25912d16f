"""The native library's boundary (runner/native/runner_native.h, abi.py) and its
instruction-set paths.

- The handshake: a library whose structs differ from the ctypes mirror on either side, or
  whose version differs, is refused at load with a line saying what differs, and the decoder
  layers stay on MLX's path.
- Every x86-64 level's build (-march=native picks one path per machine) is built and, where
  this CPU can execute it, computes: its products equal float64 ones (float32, half panels,
  and MLX's affine quantization, summed exactly as its tiles define), and its decoder step
  equals MLX's path on a tiny model (float, half copies, quantized). An arm64 build is
  compiled where a cross compiler is installed (scripts/setup installs one when it can).
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import logging
import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from runner.backend import Backend, native_step
from runner.native import abi, build
from tests.quantized_models import (
    AFFINE_LANES,
    SCALE_DTYPES,
    Affine,
    Mxfp4,
    affine_in_order,
    amx_turned_off,
    load_quantized_model,
    weight_times,
)
from tests.test_native_step import WINDOWED, windowed_config
from tests.tiny import load_tiny_model

COMPILER = build.compiler()
# GGML's grid i-quants (their blocks random: tests/gguf_models.py's grid_blocks)
GRID_NAMES = ("IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M")
needs_compiler = pytest.mark.skipif(COMPILER is None, reason="needs a C compiler")
X86 = platform.machine() == "x86_64"


def compile_with(tmp: Path, flags: list[str], edit: dict[str, tuple[str, str]] | None = None):
    """The library built from a copy of the sources (each `edit`: file -> (old, new) text),
    with `flags`; its path."""
    sources = tmp / "src"
    shutil.copytree(build.SOURCE_DIR, sources, ignore=shutil.ignore_patterns("*.py", "__*"))
    for name, (old, new) in (edit or {}).items():
        text = (sources / name).read_text()
        assert old in text, f"{name} has no {old!r}"
        (sources / name).write_text(text.replace(old, new))
    target = tmp / "library.so"
    command = [COMPILER, *flags, f"-I{sources}", "-o", str(target)]
    command += [str(p) for p in sorted(sources.glob("*.c"))] + ["-ldl", "-lm"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return target


def native_flags(march: str = "native") -> list[str]:
    """The library's flags for `march` (a level with `+vnni`: that level and -mavx512vnni;
    `+vnni+vbmi`: -mavx512vbmi too; `+avxvnni`: -mavxvnni; `+amx-tile`: -mamx-tile)."""
    arch, *extras = march.split("+")
    flags = [f"-march={arch}" if f == build.MARCH else f for f in build.DISPATCH_FLAGS]
    return flags + [f"-m{e}" if e.startswith(("avx", "amx")) else f"-mavx512{e}" for e in extras]


def open_library(path: Path) -> ctypes.CDLL:
    return ctypes.CDLL(str(path), mode=os.RTLD_LOCAL)


# --- the handshake ---------------------------------------------------------------------------


@needs_compiler
def test_the_library_and_the_mirror_agree(tmp_path: Path) -> None:
    library = open_library(compile_with(tmp_path, native_flags()))
    assert abi.differences(library) == []
    assert abi.load(library) is not None


def swapped(mirror: type[ctypes.Structure], a: str, b: str) -> type[ctypes.Structure]:
    fields = list(mirror._fields_)
    names = [f[0] for f in fields]
    i, j = names.index(a), names.index(b)
    fields[i], fields[j] = fields[j], fields[i]
    return type(mirror.__name__, (ctypes.Structure,), {"_fields_": fields})


@needs_compiler
@pytest.mark.parametrize(
    ("struct", "change", "said"),
    [
        ("step_args", lambda m: swapped(m, "eps", "scale"), "eps@48 (C: 44)"),
        ("step_weight", lambda m: swapped(m, "scales", "biases"), "scales@32 (C: 24)"),
        ("step_cache", lambda m: swapped(m, "keys", "values"), "keys@8 (C: 0)"),
        (  # a field added on the Python side only
            "step_layer",
            lambda m: type(
                "L", (ctypes.Structure,), {"_fields_": [*m._fields_, ("x", ctypes.c_double)]}
            ),
            "struct step_layer: 440 bytes, the mirror 448",
        ),
    ],
)
def test_a_mirror_changed_on_the_python_side_only_is_refused(
    tmp_path: Path, struct: str, change: Any, said: str
) -> None:
    library = open_library(compile_with(tmp_path, native_flags()))
    structs = {**abi.STRUCTS, struct: change(abi.STRUCTS[struct])}
    found = abi.differences(library, structs)
    assert any(said in line for line in found), found


APPEND = "    const float *keys2, *values2;\n};"
VERSION = "#define RUNNER_NATIVE_ABI_VERSION"


@needs_compiler
@pytest.mark.parametrize(
    ("edit", "said"),
    [
        (  # a field added to a struct in C only (abi.c's table unchanged)
            {"runner_native.h": (APPEND, APPEND.replace("\n};", "\n    int extra;\n};"))},
            "struct step_cache: 80 bytes, the mirror 72",
        ),
        (  # two fields of one type swapped in C only: sizes agree, offsets do not
            {"runner_native.h": ("float eps, scale;", "float scale, eps;")},
            "struct step_args: fields differ: eps@",
        ),
        (  # the version moved without the mirror
            {"runner_native.h": (f"{VERSION} {abi.ABI_VERSION}", f"{VERSION} 99")},
            f"ABI version 99, the runner expects {abi.ABI_VERSION}",
        ),
        (  # a weight's fields reordered in C only
            {"runner_native.h": ("int bits, group, scale", "int group, bits, scale")},
            "struct step_weight: fields differ: bits@",
        ),
    ],
)  # fmt: skip
def test_a_struct_changed_on_the_c_side_only_is_refused(
    tmp_path: Path, edit: dict, said: str, caplog: pytest.LogCaptureFixture
) -> None:
    library = open_library(compile_with(tmp_path, native_flags(), edit))
    assert any(said in line for line in abi.differences(library)), abi.differences(library)
    with caplog.at_level(logging.WARNING, logger="runner.native.abi"):
        assert abi.load(library) is None
    assert "decoder layers stay on MLX's path" in caplog.text and said in caplog.text


def test_a_library_without_the_handshake_is_not_bound() -> None:
    libc = ctypes.CDLL(None)  # this process: the preloaded library may be in it, or not
    assert abi.differences(ctypes.CDLL("libm.so.6"))[0].startswith("no runner_native_abi")
    assert abi.load(ctypes.CDLL("libm.so.6")) is None
    del libc


# --- every instruction-set path ----------------------------------------------------------------

# x86-64 levels, what this build computes with, and the CPU flags a machine needs to run it
LEVELS = {
    "x86-64": ("sse", set()),
    "x86-64-v2": ("sse", {"sse4_2", "popcnt", "ssse3"}),
    "x86-64-v3": ("avx2", {"avx2", "fma", "f16c", "bmi2", "movbe"}),
    # with AVX-VNNI (Alder Lake and later Intel cores, Zen 5): its limbs by vpdpbusd
    "x86-64-v3+avxvnni": ("avx2", {"avx2", "fma", "f16c", "bmi2", "movbe", "avx_vnni"}),
    "x86-64-v4": ("avx512", {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}),
    # with VNNI (Cascade Lake and later): decode steps' GGML block products by limbs
    "x86-64-v4+vnni": (
        "avx512",
        {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx512_vnni"},
    ),
    # and VBMI (Zen 4, Ice Lake and later): their 5-bit affine products by limbs too
    "x86-64-v4+vnni+vbmi": (
        "avx512",
        {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx512_vnni", "avx512vbmi"},
    ),
    # and AMX (Sapphire Rapids and later Xeons): Q4_K products of a forward's rows by its tiles
    "x86-64-v4+vnni+amx-tile+amx-int8": (
        "avx512",
        {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx512_vnni"}
        | {"amx_tile", "amx_int8"},
    ),
}


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    match = re.search(r"^flags\s*:(.*)$", text, re.M)
    return set(match.group(1).split()) if match else set()


@pytest.fixture(scope="module", params=list(LEVELS))
def level_library(request, tmp_path_factory) -> tuple[str, ctypes.CDLL | None]:
    """Each level's build; loaded when this CPU can execute it."""
    if COMPILER is None or not X86:
        pytest.skip("needs x86-64 and a C compiler")
    march = request.param
    path = compile_with(tmp_path_factory.mktemp(march), native_flags(march))
    runs = LEVELS[march][1] <= cpu_flags()
    return march, open_library(path) if runs else None


def test_every_level_builds_with_its_path(level_library) -> None:
    """Every x86-64 level builds, not only this CPU's: a macro only the half-panel path
    defined, used outside it, once broke the build on every CPU without AVX2 + F16C."""
    march, library = level_library
    if library is None:
        pytest.skip(f"this CPU cannot run {march}")
    assert abi.level(library) == LEVELS[march][0]
    functions = abi.load(library)
    assert functions is not None
    assert functions.half_weights == (LEVELS[march][0] in ("avx2", "avx512"))
    # limbs: AVX2 (vpmaddubsw, or AVX-VNNI's vpdpbusd) and AVX512-VNNI; not AVX-512 without
    # it; 5-bit codes' on AVX2 (vpshufb) and with VBMI (vpmultishiftqb)
    avx2 = LEVELS[march][0] == "avx2"
    assert functions.limb_products == (avx2 or "+vnni" in march)
    assert functions.affine_limbs == (avx2 or march.endswith("+vbmi"))
    if "+amx" not in march:  # AMX's tiles: only a build with them (and a machine that runs them)
        assert functions.amx_products(-1) == 0


@pytest.mark.parametrize("m", [1, 3, 15, 40])
def test_every_level_computes_products(level_library, m: int) -> None:
    """runner_weight_product (the head; every product of the step goes the same way) and
    the interposed cblas_sgemm on the shapes it computes itself, against float64."""
    march, library = level_library
    if library is None:
        pytest.skip(f"this CPU cannot run {march}")
    functions = abi.load(library)
    assert functions is not None
    rng = np.random.default_rng(m)
    n, k = 100, 72
    a = rng.standard_normal((m, k), dtype=np.float32)
    w = rng.standard_normal((n, k), dtype=np.float32)
    expected = a.astype(np.float64) @ w.astype(np.float64).T
    c = np.zeros((m, n), np.float32)
    pointer = abi.F32
    f32 = abi.Weight(format=abi.F32_FORMAT, data=w.ctypes.data)
    assert (
        functions.weight_product(
            m, n, k, a.ctypes.data_as(pointer), ctypes.byref(f32), c.ctypes.data_as(pointer), 0
        )
        == 0
    )
    assert np.abs(c - expected).max() < 1e-4
    if functions.half_weights:  # the same values through exact float16 panels
        w16 = w.astype(np.float16).astype(np.float32)
        panels = np.empty(functions.panel_halves(n, k), np.uint16)
        assert functions.narrow_panels(w16.ctypes.data_as(pointer), n, k, panels.ctypes.data, 1)
        c16 = np.zeros((m, n), np.float32)
        half = abi.Weight(format=abi.HALF_FORMATS["float16"], data=panels.ctypes.data)
        functions.weight_product(
            m, n, k, a.ctypes.data_as(pointer), ctypes.byref(half), c16.ctypes.data_as(pointer), 0
        )
        assert np.abs(c16 - a.astype(np.float64) @ w16.astype(np.float64).T).max() < 1e-4
    sgemm = library.cblas_sgemm
    sgemm.argtypes = [ctypes.c_int] * 6 + [
        ctypes.c_float,
        pointer,
        ctypes.c_int,
        pointer,
        ctypes.c_int,
        ctypes.c_float,
        pointer,
        ctypes.c_int,
    ]
    out = np.full((m, n), 2.0, np.float32)
    sgemm(
        101,
        111,
        112,
        m,
        n,
        k,
        0.5,
        a.ctypes.data_as(pointer),
        k,
        w.ctypes.data_as(pointer),
        k,
        1.0,
        out.ctypes.data_as(pointer),
        n,
    )
    assert np.abs(out - (0.5 * expected + 2.0)).max() < 1e-4


def affine_level(level_library) -> tuple[abi.Functions, tuple[int, bool]]:
    """The level's functions and its affine tiles' lanes (AFFINE_LANES), skipping where this
    CPU cannot run it."""
    march, library = level_library
    if library is None:
        pytest.skip(f"this CPU cannot run {march}")
    functions = abi.load(library)
    assert functions is not None
    return functions, AFFINE_LANES[LEVELS[march][0]]


@pytest.mark.parametrize(
    ("bits", "group"), [(2, 64), (3, 32), (3, 128), (4, 32), (4, 64), (5, 32), (6, 64), (8, 128)]
)
def test_every_level_computes_affine_products(level_library, bits: int, group: int) -> None:
    """runner_weight_product on MLX's affine quantization (scales in each format): exactly
    the sums the level's tiles define (its lanes, fused or not), the same bits for any number
    of rows, and within 1e-4 of the float64 product of mx.dequantize's values."""
    functions, lanes = affine_level(level_library)
    rng = np.random.default_rng(bits * group)
    n, k = 45, 384
    a = rng.normal(size=(41, k)).astype(np.float32)
    for scales in SCALE_DTYPES:
        w = Affine(rng.normal(size=(n, k)).astype(np.float32), bits, group, scales)
        with amx_turned_off(functions):  # the float tiles (AMX's: test_affine_rows_by_amx_tiles)
            c = w.times(functions, a)
            np.testing.assert_array_equal(c, affine_in_order(a, w.values, bits, *lanes))
            for m in (1, 2, 3, 7):
                np.testing.assert_array_equal(w.times(functions, a[:m]), c[:m])
        want = a.astype(np.float64) @ w.values.astype(np.float64).T
        assert np.abs(c - want).max() <= 1e-4 * np.abs(want).max()
        if bits != 5 or not functions.affine_limbs:  # decode rows take the float tiles
            np.testing.assert_array_equal(w.times(functions, a, decode=True), c)


def test_every_level_computes_mxfp4_products(level_library) -> None:
    """runner_weight_product on MLX's mxfp4 mode (e2m1 codes, e8m0 scales: gpt-oss's
    experts): the sums the level's 4-bit tiles define over mx.dequantize's values (exact in
    float32, subnormal to 2^100 here), the same bits for any number of rows and as a decode
    step's rows, within 1e-6 of the float64 product's scale; and the formats the library
    refuses (another group, bits, or biases beside e8m0 scales)."""
    functions, lanes = affine_level(level_library)
    rng = np.random.default_rng(4)
    n, k = 45, 384
    a = rng.normal(size=(41, k)).astype(np.float32)
    shift = np.resize(np.array([-200, -120, -40, 0, 20, 100]), n)  # e from 0 to ~226
    w = Mxfp4(rng.normal(size=(n, k)).astype(np.float32), shift)
    assert (w.arrays[1] == 0).any() and np.isfinite(w.values).all()
    c = w.times(functions, a)
    np.testing.assert_array_equal(c, affine_in_order(a, w.values, 4, *lanes))
    for m in (1, 2, 3, 7):
        np.testing.assert_array_equal(w.times(functions, a[:m]), c[:m])
    np.testing.assert_array_equal(w.times(functions, a, decode=True), c)
    want = a.astype(np.float64) @ w.values.astype(np.float64).T
    scale = np.abs(a).astype(np.float64) @ np.abs(w.values).astype(np.float64).T
    assert (np.abs(c - want) <= 1e-6 * scale).all()
    weight = w.weight
    for field, value in (("group", 64), ("bits", 8), ("biases", w.arrays[1].ctypes.data)):
        refused = abi.Weight(**{f: getattr(weight, f) for f, _ in abi.Weight._fields_})
        setattr(refused, field, value)
        assert not functions.weight_supported(ctypes.byref(refused), n, k), field
    assert functions.weight_supported(ctypes.byref(weight), n, k)


def ggml_level(level_library, ggml_type: str) -> tuple[str, abi.Functions, Any, int, Any]:
    """The level's march and functions (skipping where this CPU cannot run it), and
    `ggml_type`'s quants kind, weight format and quantizer (tests/gguf_models.py)."""
    from runner.sources.gguf import quants
    from tests.gguf_models import (
        T,
        grid_blocks,
        quantize_iq4_nl,
        quantize_iq4_xs,
        quantize_q2_k,
        quantize_q3_k,
        quantize_q4_k,
        quantize_q5_k,
        quantize_q6_k,
    )

    march, library = level_library
    if library is None:
        pytest.skip(f"this CPU cannot run {march}")
    functions = abi.load(library)
    assert functions is not None
    kind, form, quantize = {
        "Q6_K": (quants.Q6_K, abi.Q6K, quantize_q6_k),
        "Q4_K": (quants.Q4_K, abi.Q4K, quantize_q4_k),
        "Q5_K": (13, abi.Q5K, quantize_q5_k),
        "Q3_K": (quants.Q3_K, abi.Q3K, quantize_q3_k),
        "Q2_K": (quants.Q2_K, abi.Q2K, quantize_q2_k),
        "IQ4_XS": (quants.IQ4_XS, abi.IQ4XS, quantize_iq4_xs),
        "IQ4_NL": (quants.IQ4_NL, abi.IQ4NL, quantize_iq4_nl),
        **{
            name: (getattr(quants, name), getattr(abi, name.replace("_", "")), None)
            for name in GRID_NAMES
        },
        "F16": (quants.F16, abi.GF16, half_rows),
        "BF16": (quants.BF16, abi.GBF16, functools.partial(half_rows, bfloat16=True)),
    }[ggml_type]
    if quantize is None:  # random blocks (tests/gguf_models.py: grid_blocks)
        quantize = functools.partial(grid_blocks, ggml_type=getattr(T, ggml_type))
    return march, functions, kind, form, quantize


def half_rows(values: np.ndarray, bfloat16: bool = False) -> np.ndarray:
    """A GGUF's F16 (BF16) matrix of `values` as its bytes [rows, 2 columns]: float16, or
    bfloat16 rounded to nearest even from float32's bits (as gguf-py writes it)."""
    if not bfloat16:
        return values.astype(np.float16).view(np.uint8)
    bits = np.ascontiguousarray(values, np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    return rounded.view(np.uint8)


@pytest.mark.parametrize(
    "ggml_type",
    ["Q6_K", "Q4_K", "Q5_K", "Q3_K", "Q2_K", "IQ4_XS", "IQ4_NL", *GRID_NAMES, "F16", "BF16"],
)
def test_every_level_computes_ggml_block_products(level_library, ggml_type: str) -> None:
    """runner_weight_product on GGML Q6_K, Q4_K, Q5_K, Q3_K, Q2_K, IQ4_XS and IQ4_NL blocks and
    the grid i-quants' (random blocks: every index, sign and scale bit) as a GGUF stores
    them, and on a GGUF's F16 and BF16 matrices as stored (W_GF16, W_GBF16: row-major
    halves): exactly the sums the level's block tiles define (the values in order of
    k, its lanes, fused or not), the same bits for any number of rows (the stream tiles of one
    and two rows, the block tiles of more), and within 1e-4 of the float64 product of
    llama.cpp's values (runner/sources/gguf/quants.py's dequantization, checked against
    gguf-py's). The halves, where the build has half panels, take the panel tiles (panels made
    a block at a time: each value the sum in order of k, one fused step a weight); a decode
    step's rows of them the stream tiles (the block tiles' lanes) where the build has limbs.
    A decode step's rows take the same tiles where the build has no limbs, and always for
    IQ4_NL (which has none); IQ4_NL's and the halves' rows need only be whole 32s (576:
    SmolLM2's)."""
    from runner.sources.gguf import quants

    march, functions, kind, form, quantize = ggml_level(level_library, ggml_type)
    lanes = AFFINE_LANES[LEVELS[march][0]]
    rng = np.random.default_rng(6)
    # n not a whole number of blocks of rows; IQ4_NL's k not whole 256s
    n, k = 45, 576 if ggml_type in ("IQ4_NL", "F16", "BF16") else 512
    blocks = np.ascontiguousarray(quantize(rng.normal(size=(n, k)).astype(np.float32)))
    values = quants.dequantize(blocks.reshape(-1), kind, (n, k))
    weight = abi.Weight(format=form, data=blocks.ctypes.data)
    a = rng.normal(size=(41, k)).astype(np.float32)

    def times(rows: np.ndarray) -> np.ndarray:
        return weight_times(functions, weight, (n, k), rows)

    halves = ggml_type in ("F16", "BF16")
    in_order = (1, True) if halves and functions.half_weights else lanes  # the panels' order
    with amx_turned_off(functions):  # the float tiles (AMX's: test_k_quant_rows_by_amx_tiles)
        c = times(a)
        np.testing.assert_array_equal(c, affine_in_order(a, values, 8, *in_order))
        for m in (1, 2, 3, 7):
            np.testing.assert_array_equal(times(a[:m]), c[:m])
        many = np.concatenate([a] * 16)  # 656 rows: chunks of rows (quantized.c: chunk_bytes)
        np.testing.assert_array_equal(times(many), np.concatenate([c] * 16))
        want = a.astype(np.float64) @ values.astype(np.float64).T
        assert np.abs(c - want).max() <= 1e-4 * np.abs(want).max()
        short = abi.Weight(format=form, data=blocks.ctypes.data)  # k not whole blocks: refused
        assert not functions.weight_supported(ctypes.byref(short), n, 300)
        decode = weight_times(functions, weight, (n, k), a, decode=True)
        if not functions.limb_products or ggml_type == "IQ4_NL":
            # the float tiles: the same bits
            np.testing.assert_array_equal(decode, c)
        elif halves:  # the stream tiles
            np.testing.assert_array_equal(decode, affine_in_order(a, values, 8, *lanes))


def limb_operands(kind, form, quantize, rows: int, seed: int):
    """Blocks of W [45, 768] (45: rows of W not whole blocks of tiles), llama.cpp's values of
    them in float64, their step_weight, and `rows` rows of A whose runs try the limbs: an
    outlier (its run's step coarse, the others' not), a run of zeros, tiny values (steps far
    below float32's normal range), runs of very different sizes in one row."""
    from runner.sources.gguf import quants

    rng = np.random.default_rng(seed)
    n, k = 45, 768
    blocks = np.ascontiguousarray(quantize(rng.normal(size=(n, k)).astype(np.float32)))
    values = quants.dequantize(blocks.reshape(-1), kind, (n, k)).astype(np.float64)
    a = rng.normal(size=(rows, k)).astype(np.float32)
    a[1, k // 3] = 40.0
    a[2, 32:64] = 0.0
    a[3] *= np.float32(1e-30)
    a[4, ::7] *= -1000.0
    return blocks, values, abi.Weight(format=form, data=blocks.ctypes.data), a


def assert_within_limb_bound(got: np.ndarray, a: np.ndarray, values: np.ndarray) -> None:
    """Every value within what rounding each run of 32 of A to a / 16384 (a = max |x| / 127)
    leaves, 1 / 32768 of a step at most, times sum |w|, plus float32 rounding of sum |w x|;
    and far closer than llama.cpp's 8-bit activations (1 / 254 of the run's largest value)."""
    x = a.astype(np.float64)
    want = x @ values.T
    runs = np.repeat(np.abs(x).reshape(len(a), -1, 32).max(-1), 32, axis=1)  # max |x| of t's run
    step = runs / 127 / 16384  # the last limb's step
    bound = (step / 2 * 1.01) @ np.abs(values).T + 1e-6 * (np.abs(x) @ np.abs(values).T)
    assert np.all(np.abs(got - want) <= bound), np.max(np.abs(got - want) / bound)
    eight_bits = (runs / 254) @ np.abs(values).T
    assert np.abs(got - want).max() < 1e-3 * eight_bits.max()


@pytest.mark.parametrize("ggml_type", ["Q4_K", "Q5_K"])
def test_k_quant_rows_by_amx_tiles(level_library, ggml_type: str) -> None:
    """Where a build has AMX's tiles and the machine runs them (runner/native/amx.c), Q4_K
    and Q5_K products of a forward's rows take them: A's values as the decode steps' three
    8-bit limbs a run of 32, each run's products summed exactly by the tiles. Every value
    within the limbs' bound of the float64 product of llama.cpp's values; not the float
    tiles' bits; the same bits for any number of rows (whole groups of the tiles' rows and a
    last group of fewer), each row alone, and rows past the pool's chunks; rows of W not a
    whole number of 16s; a row with an infinite or NaN value takes the float tiles (no limbs
    hold it); a decode step's rows keep the VNNI limbs, AMX or not; turned off, the float
    tiles' bits again."""
    march, functions, kind, form, quantize = ggml_level(level_library, ggml_type)
    if not functions.amx_products(-1):
        pytest.skip(f"{march}: no AMX tiles in this build, or this machine does not run them")
    _blocks, values, weight, a = limb_operands(kind, form, quantize, 41, 12)  # _blocks: read
    n, k = values.shape  # 2 blocks of 16 rows of W and 13; 24 runs of 32

    def times(rows: np.ndarray, decode: bool = False) -> np.ndarray:
        return weight_times(functions, weight, (n, k), rows, decode=decode)

    got, decode = times(a), times(a, decode=True)
    with amx_turned_off(functions):
        tiles, decode_without = times(a), times(a, decode=True)
    assert_within_limb_bound(got, a, values)
    assert not np.array_equal(got, tiles)  # the tiles' limbs, not the float tiles
    np.testing.assert_array_equal(decode, decode_without)  # decode steps: the VNNI limbs
    for m in (1, 2, 3, 5, 6, 16, 17, 21, 32, 40):
        np.testing.assert_array_equal(times(a[:m]), got[:m], err_msg=f"{m} rows")
    for i in range(len(a)):
        np.testing.assert_array_equal(times(a[i : i + 1]), got[i : i + 1])
    many = np.concatenate([a] * 16)  # 656 rows: every pool thread's share of the columns
    np.testing.assert_array_equal(times(many), np.concatenate([got] * 16))
    for bad in (np.inf, -np.inf, np.nan):
        nonfinite = a.copy()
        nonfinite[5, 100] = bad
        with amx_turned_off(functions):
            floats = times(nonfinite)
        np.testing.assert_array_equal(times(nonfinite), floats)
    with amx_turned_off(functions):
        np.testing.assert_array_equal(times(a), tiles)


def test_affine_rows_by_amx_tiles(level_library) -> None:
    """Where a build has AMX's tiles and the machine runs them, products of a forward's rows
    from MLX's affine codes of 2 to 5 bits (codes below 32) take them as Q4_K's do
    (`assert_affine_rows_by_amx_tiles`): the AMX level, whose packed codes are unpacked by
    unit loads (no VBMI)."""
    march, library = level_library
    if library is None:
        pytest.skip(f"this CPU cannot run {march}")
    functions = abi.load(library)
    assert functions is not None
    if not functions.amx_products(-1):
        pytest.skip(f"{march}: no AMX tiles in this build, or this machine does not run them")
    assert_affine_rows_by_amx_tiles(functions)


def test_affine_rows_by_amx_tiles_in_the_runners_build() -> None:
    """The same for the library the runner preloads (built for this CPU: on an AMX machine
    with VBMI, whose packed codes are unpacked by vpermb and vpmultishiftqb)."""
    functions = abi.load()
    if functions is None or not functions.amx_products(-1):
        pytest.skip("the runner's library has no AMX tiles here, or this machine does not run them")
    assert_affine_rows_by_amx_tiles(functions)


def assert_affine_rows_by_amx_tiles(functions: abi.Functions) -> None:
    """Every value within the limbs' bound of the float64 product of mx.dequantize's values,
    in every scale format; not the float tiles' bits; the same bits for any number of rows,
    each row alone, and rows past the pool's chunks; rows of W not a whole number of 16s; a
    row with an infinite or NaN value takes the float tiles; a decode step's rows keep the
    stream tiles (or 5 bits' limbs), AMX or not; 6- and 8-bit codes never take them."""
    rng = np.random.default_rng(9)
    n, k = 45, 640  # 2 blocks of 16 rows of W and 13; 20 runs of 32
    a = rng.normal(size=(41, k)).astype(np.float32)
    a[1, k // 3] = 40.0  # an outlier, a run of zeros, tiny values, runs of very different sizes
    a[2, 32:64] = 0.0
    a[3] *= np.float32(1e-30)
    a[4, ::7] *= -1000.0
    cases = [(2, 128, "float16"), (3, 32, "bfloat16"), (4, 64, "float32"), (4, 32, "float16")]
    for bits, group, scales in [*cases, (5, 128, "bfloat16"), (5, 64, "float32")]:
        w = Affine(rng.normal(size=(n, k)).astype(np.float32), bits, group, scales)

        def times(rows: np.ndarray, decode: bool = False, w: Affine = w) -> np.ndarray:
            return w.times(functions, rows, decode)

        got, decode = times(a), times(a, decode=True)
        with amx_turned_off(functions):
            tiles, decode_without = times(a), times(a, decode=True)
        x, values = a.astype(np.float64), w.values.astype(np.float64)
        runs = np.repeat(np.abs(x).reshape(len(a), -1, 32).max(-1), 32, axis=1)
        terms = np.abs(w.scaled_codes) + np.abs(w.biases)  # |s q| + |b| of each weight
        bound = (runs / 127 / 16384 / 2 * 1.01) @ np.abs(values).T + 1e-6 * (np.abs(x) @ terms.T)
        assert np.all(np.abs(got - x @ values.T) <= bound)
        assert not np.array_equal(got, tiles)  # the tiles' limbs, not the float tiles
        np.testing.assert_array_equal(decode, decode_without)
        for m in (1, 2, 3, 8, 9, 16, 17, 40):
            np.testing.assert_array_equal(times(a[:m]), got[:m], err_msg=f"{m} rows")
        for i in range(len(a)):
            np.testing.assert_array_equal(times(a[i : i + 1]), got[i : i + 1])
    many = np.concatenate([a] * 16)  # 656 rows: every pool thread's share of the columns
    np.testing.assert_array_equal(times(many), np.concatenate([got] * 16))
    for bad in (np.inf, np.nan):
        nonfinite = a.copy()
        nonfinite[5, 100] = bad
        with amx_turned_off(functions):
            floats = times(nonfinite)
        np.testing.assert_array_equal(times(nonfinite), floats)
    for wide in (6, 8):
        w = Affine(rng.normal(size=(n, k)).astype(np.float32), wide, 64)
        with amx_turned_off(functions):
            floats = w.times(functions, a)
        np.testing.assert_array_equal(w.times(functions, a), floats)


def test_amx_tiles_turned_off_by_the_environment(tmp_path) -> None:
    """OLLAMA_MLX_RUNNER_AMX=0 keeps a process off AMX's tiles (a machine whose tile loads
    fault, or a comparison: bench.sgemm's `-noamx` settings); without it the library
    answers as its build and machine allow, and a fresh process probes the same way."""
    path = build.library()
    if path is None:
        pytest.skip("no C compiler")
    ask = (
        "import ctypes, sys; from runner.native import abi; "
        f"f = abi.load(ctypes.CDLL({path!r})); print(f.amx_products(-1))"
    )

    def answer(**env: str) -> int:
        environ = {k: v for k, v in os.environ.items() if k != "OLLAMA_MLX_RUNNER_AMX"}
        out = subprocess.run(
            [sys.executable, "-c", ask], env={**environ, **env}, capture_output=True, text=True
        )
        assert out.returncode == 0, out.stderr
        return int(out.stdout.strip().splitlines()[-1])

    assert answer(OLLAMA_MLX_RUNNER_AMX="0") == 0
    functions = abi.load(open_library(Path(path)))
    assert functions is not None
    assert answer() == functions.amx_products(-1)


@pytest.mark.parametrize(
    "ggml_type", ["Q6_K", "Q4_K", "Q5_K", "Q3_K", "Q2_K", "IQ4_XS", *GRID_NAMES]
)
def test_decode_products_by_limbs_are_within_their_bound(level_library, ggml_type: str) -> None:
    """A decode step's GGML block products on a build with limbs (runner/native/quantized.c:
    A's values as three 8-bit limbs a run of 32, the codes' products summed in integers):
    every value within the limbs' bound of the float64 product of llama.cpp's values (what
    rounding each run's values to a / 16384, a = max |x| / 127, leaves: 1 / 32768 of a step
    at most, times sum |w|, plus float32 rounding of sum |w x|), far closer than 8-bit
    activations (llama.cpp's: 1 / 254 of the run's largest value); not the float tiles' bits;
    the same bits for any number of rows and each row alone; an A with an infinite or NaN
    value takes the float tiles (the limbs hold neither; a NaN once slipped through the
    run's max on AVX-512 and came out a finite value)."""

    _, functions, kind, form, quantize = ggml_level(level_library, ggml_type)
    if not functions.limb_products:
        return  # its decode products are the float tiles' (the test above)
    _blocks, values, weight, a = limb_operands(kind, form, quantize, 9, 8)  # _blocks: read
    n, k = values.shape

    def times(rows: np.ndarray, decode: bool = True) -> np.ndarray:
        return weight_times(functions, weight, (n, k), rows, decode=decode)

    got, tiles = times(a), times(a, decode=False)
    assert_within_limb_bound(got, a, values)
    assert not np.array_equal(got, tiles)  # the limbs, not the float tiles
    for m in (1, 2, 5):
        np.testing.assert_array_equal(times(a[:m]), got[:m])
    for i in range(len(a)):
        np.testing.assert_array_equal(times(a[i : i + 1]), got[i : i + 1])
    for bad in (np.inf, -np.inf, np.nan):
        nonfinite = a.copy()
        nonfinite[5, 100] = bad
        np.testing.assert_array_equal(times(nonfinite), times(nonfinite, decode=False))


@pytest.mark.parametrize(("group", "k"), [(32, 640), (64, 640), (128, 640), (64, 1024)])
def test_decode_products_of_5_bit_codes_by_limbs_are_within_their_bound(
    level_library, group: int, k: int
) -> None:
    """A decode step's products of MLX's 5-bit affine codes (GGUF's Q5_0, Q5_1 and Q5_K map
    onto them) on a build with their limbs (AVX512-VNNI and VBMI, or AVX2): x (s q + b) as the
    limbs' integer sums times s, plus b times each run's sum of x; every value within the limbs'
    bound of the float64 product of mx.dequantize's values (k = 640: a last block of 4 runs),
    in every scale format; not the float tiles' bits; the same bits for any number of rows
    and each row alone; an infinite or NaN value, or rows of k not whole pairs of runs, take
    the float tiles."""
    march, library = level_library
    if library is None:
        pytest.skip(f"this CPU cannot run {march}")
    functions = abi.load(library)
    assert functions is not None
    if not functions.affine_limbs:
        return  # decode takes the float tiles (test_every_level_computes_affine_products)
    rng = np.random.default_rng(group + k)
    n = 45
    a = rng.normal(size=(9, k)).astype(np.float32)
    a[1, k // 3] = 40.0  # an outlier: its run's step is coarse, the others' are not
    a[2, 32:64] = 0.0  # a run of zeros
    a[3] *= np.float32(1e-30)  # tiny values
    a[4, ::7] *= -1000.0  # runs of very different sizes in one row
    x = a.astype(np.float64)
    runs = np.repeat(np.abs(x).reshape(len(a), -1, 32).max(-1), 32, axis=1)
    step = runs / 127 / 16384  # the last limb's step

    def times(w: Affine, rows: np.ndarray, decode: bool = True) -> np.ndarray:
        return w.times(functions, rows, decode)

    for scales in SCALE_DTYPES:
        w = Affine(rng.normal(size=(n, k)).astype(np.float32), 5, group, scales)
        values = w.values.astype(np.float64)
        got, tiles = times(w, a), times(w, a, decode=False)
        want = x @ values.T
        terms = np.abs(w.scaled_codes) + np.abs(w.biases)  # |s q| + |b| of each weight
        bound = (step / 2 * 1.01) @ np.abs(values).T + 1e-6 * (np.abs(x) @ terms.T)
        assert np.all(np.abs(got - want) <= bound), np.max(np.abs(got - want) / bound)
        eight_bits = (runs / 254) @ np.abs(values).T  # llama.cpp's rounding of the activations
        assert np.abs(got - want).max() < 1e-3 * eight_bits.max()
        assert not np.array_equal(got, tiles)  # the limbs, not the float tiles
        for m in (1, 2, 5):
            np.testing.assert_array_equal(times(w, a[:m]), got[:m])
        for i in range(len(a)):
            np.testing.assert_array_equal(times(w, a[i : i + 1]), got[i : i + 1])
    for bad in (np.inf, np.nan):
        nonfinite = a.copy()
        nonfinite[5, 100] = bad
        np.testing.assert_array_equal(times(w, nonfinite), times(w, nonfinite, decode=False))
    odd = Affine(rng.normal(size=(n, k - 32)).astype(np.float32), 5, 32)  # k % 64 == 32
    np.testing.assert_array_equal(times(odd, a[:, 32:]), times(odd, a[:, 32:], decode=False))


# (checkpoint dtype, quantization): float32, bfloat16 (half copies where the level has them),
# and mlx-lm quantizations (tests/test_native_step.py) of every width the step reads
STEP_CHECKPOINTS = [
    ("float32", None),
    ("bfloat16", None),
    ("float16", (4, 64)),
    ("float32", (5, 32)),
    ("bfloat16", (8, 128)),
]


@pytest.mark.parametrize(("dtype", "quantization"), STEP_CHECKPOINTS)
def test_every_level_computes_the_decoder_step(
    level_library, dtype: str, quantization: tuple[int, int] | None, tmp_path: Path
) -> None:
    """A tiny Llama's prompt and decode steps through the level's decoder step and head equal
    MLX's path (float32 rounding): float32 weights, half copies of a bfloat16 checkpoint where
    the level has them, and the codes of mlx-lm's affine quantizations."""
    march, library = level_library
    if library is None:
        pytest.skip(f"this CPU cannot run {march}")
    functions = abi.load(library)
    assert functions is not None
    # MLX's path as the runner takes it under the dispatch (no numpy gemv)
    backend = Backend.cpu().replace(native_step_max_tokens=None, gemv=False)
    if quantization:
        plain = load_quantized_model(
            "LlamaForCausalLM", tmp_path / "q", *quantization, dtype, backend=backend
        )
    else:
        plain = load_tiny_model("LlamaForCausalLM", tmp_path, backend=backend, dtype=dtype)
    step = native_step.build(
        plain.module, plain.KERNELS, 8, ("float16", "bfloat16"), functions=functions
    )
    assert step is not None
    half = functions.half_weights and dtype != "float32" and not quantization
    assert step.half_format == (dtype if half else None)
    assert step.quantized == (7 * step.layers if quantization else 0)

    chunks = [[5, 6, 7, 8, 9, 10, 11], [12], [13], [14, 15]]
    assert_step_equals_mlx(plain, step, chunks)


def assert_step_equals_mlx(plain: Any, step: Any, chunks: list[list[int]]) -> None:
    """`chunks` forwarded into fresh caches through `step` (each forward must be the
    step's) and through MLX's path: logits within 1e-4 and hidden states within 1e-4
    relative at every chunk."""

    def run(native: Any) -> list[np.ndarray]:
        plain._native = native
        caches, out = plain.make_caches(), []
        for tokens in chunks:
            hidden = plain.hidden(mx.array([tokens], dtype=mx.int32), caches)
            out += [np.array(hidden), np.array(plain.unembed(hidden))]
        return out

    taken = []

    def counted(tokens: mx.array, caches: list[Any]) -> Any:
        result = step(tokens, caches)
        taken.append(result is not None)
        return result

    counted.unembed = step.unembed  # type: ignore[attr-defined]
    counted.half_format = step.half_format  # type: ignore[attr-defined]
    native, mlx_path = run(counted), run(None)
    assert all(taken) and len(taken) == len(chunks)
    for i, (got, want) in enumerate(zip(native, mlx_path, strict=True)):
        logits = i % 2 == 1  # run() appends hidden states, then logits
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=0 if logits else 1e-4)


@pytest.mark.parametrize("arch", WINDOWED)
def test_every_level_computes_sliding_windows(level_library, arch: str, tmp_path: Path) -> None:
    """Sliding-window layers (windows of 8; Qwen2's first layer full) through the level's
    step equal MLX's path: a chunk longer than the window (row items, its own keys
    windowed), decode steps that wrap the ring (split items), chunks over a wrapped ring;
    with Gemma2's soft-capped scores and Gemma's norms, GELU and rotary tables,
    Ministral3's queries scaled by position (from 16 on; windowed at 8 here too) and Phi3's
    fused projections and partial longrope."""
    march, library = level_library
    if library is None:
        pytest.skip(f"this CPU cannot run {march}")
    functions = abi.load(library)
    assert functions is not None
    backend = Backend.cpu().replace(native_step_max_tokens=None, gemv=False)
    plain = load_tiny_model(arch, tmp_path, backend=backend, config=windowed_config(arch))
    step = native_step.build(
        plain.module, plain.KERNELS, 16, (), functions=functions, shape=plain.native_shape()
    )
    assert step is not None
    prompt = [int(t) for t in np.random.default_rng(3).integers(3, 300, size=40)]
    cuts = [0, 13, 14, 15, 16, 17, 18, 21, 30, 31, 40]
    assert_step_equals_mlx(plain, step, [prompt[a:b] for a, b in itertools.pairwise(cuts)])


@pytest.mark.skipif(shutil.which("aarch64-linux-gnu-gcc") is None, reason="no arm64 cross compiler")
def test_the_library_compiles_for_arm64(tmp_path: Path) -> None:
    """arm64 Linux (no AVX: 128-bit vectors, no half panels) at least compiles; nothing here
    can execute it."""
    flags = [f for f in build.DISPATCH_FLAGS if f != build.MARCH] + ["-march=armv8-a"]
    global COMPILER
    saved, COMPILER = COMPILER, "aarch64-linux-gnu-gcc"
    try:
        path = compile_with(tmp_path, flags)
    finally:
        COMPILER = saved
    assert path.read_bytes()[:4] == b"\x7fELF" and path.read_bytes()[18] == 183  # EM_AARCH64
