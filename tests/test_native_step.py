"""The native decoder step (runner/backend/native_step.py) computes what MLX's path computes.

Each test loads the same tiny model twice, with the native step and without it, and runs the
same forwards through both: prompts in chunks the step takes and chunks it leaves to MLX,
decode steps across a cache buffer's growth (mlx-lm grows KV buffers 256 positions at a
time), a cache rewound and refilled. Hidden states, logits and the caches' contents agree
within float32 rounding, and the step must actually have run (counted). The models are float
checkpoints (float32, and half-precision ones the step reads through exact half copies) and
mlx-lm quantizations of them (affine: 2, 3, 4, 5, 6 and 8 bits, groups of 32, 64 and 128, scales in
float32, float16 and bfloat16), whose codes the step reads where MLX keeps them.
"""

from __future__ import annotations

import ctypes
import itertools
import json
import shutil
import sys
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from runner.backend import Backend
from runner.native import abi, preload
from tests.gguf_models import moe_checkpoint, quantized_moe
from tests.quantized_models import (
    AFFINE_LANES,
    QUANTIZED_DIMS,
    SCALE_DTYPES,
    Affine,
    Mxfp4,
    affine_in_order,
    amx_turned_off,
    load_quantized_model,
)
from tests.tiny import load_tiny_model, prefix_cache, tiny_config

pytestmark = pytest.mark.skipif(
    not preload.dispatch_active(), reason="needs the runner's dispatch library preloaded"
)


def half_weights() -> bool:
    """Whether the dispatch's products read half-precision weights on this CPU (AVX2 + F16C:
    every x86-64 machine this project runs on; elsewhere the step keeps float32 only)."""

    functions = abi.load()
    return functions is not None and functions.half_weights


needs_half = pytest.mark.skipif(
    preload.dispatch_active() and not half_weights(), reason="no AVX2 + F16C on this CPU"
)


def cpu_flags() -> set[str] | None:
    """The CPU's feature flags from /proc/cpuinfo (Linux x86), or None."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return None


@pytest.mark.skipif(cpu_flags() is None, reason="no /proc/cpuinfo flags (not Linux x86)")
def test_every_avx2_f16c_cpu_gets_half_weights():
    """The half panels (half the bytes a short forward reads) on every CPU with AVX2 and
    F16C, AVX-512 ones included: built with 512-bit vectors the dispatch had none there
    (and these tests' half-weight cases skipped themselves)."""
    flags = cpu_flags()
    assert flags is not None
    assert half_weights() == ({"avx2", "f16c"} <= flags), sorted(f for f in flags if "avx" in f)


ARCHES = ["LlamaForCausalLM", "Qwen3ForCausalLM"]
# (family, checkpoint dtype): half-precision checkpoints get the step's exact half copies
# (Llama's untied head in bfloat16, Qwen3's tied one in float16)
CHECKPOINTS = [
    ("LlamaForCausalLM", "float32"),
    ("Qwen3ForCausalLM", "float32"),
    ("LlamaForCausalLM", "bfloat16"),
    ("Qwen3ForCausalLM", "float16"),
]
# (family, checkpoint dtype, bits, group size): mlx-lm's quantization of the checkpoint, its
# scales and biases in the checkpoint's dtype (Llama's untied head and Qwen3's tied
# embedding quantized too, as mlx_lm.convert quantizes them)
QUANTIZED = [
    ("LlamaForCausalLM", "float16", 4, 64),
    ("Qwen3ForCausalLM", "float32", 4, 32),
    ("LlamaForCausalLM", "float32", 8, 64),
    ("Qwen3ForCausalLM", "float16", 5, 32),
    ("LlamaForCausalLM", "bfloat16", 4, 128),
]
# Qwen3-MoE's mixtures of experts (a dense first layer, then 8 experts a layer, 3 a token,
# their probabilities renormalised): float32 experts beside bfloat16 attention weights (their
# half copies), and mlx-lm's 4-bit quantization (QuantizedSwitchLinear experts, its 8-bit
# router)
MOE = "Qwen3MoeForCausalLM"
MOE_DIMS = {
    "num_local_experts": 8, "num_experts_per_tok": 3, "mlp_only_layers": [0],
    "num_hidden_layers": 3, "moe_intermediate_size": 64,
}  # fmt: skip
MOE_PAIRS = [
    (MOE, "float32"), (MOE, "bfloat16"), (MOE, "float16", 4, 64), (MOE, "float32", 4, 32, "mxfp4"),
]  # fmt: skip
MAX_TOKENS = 8


class Counting:
    """Wraps a model's native step, counting the forwards it took."""

    def __init__(self, step: Any):
        self.step, self.taken, self.declined = step, 0, 0

    def __call__(self, tokens: mx.array, caches: list[Any]) -> mx.array | None:
        out = self.step(tokens, caches)
        if out is None:
            self.declined += 1
        else:
            self.taken += 1
        return out

    def __getattr__(self, name: str) -> Any:  # the head (`unembed`), the step's fields
        return getattr(self.step, name)


def load_moe(path: Any, dtype: str, quantization: list[Any], backend: Backend) -> Any:
    """A tiny Qwen3-MoE of MOE_DIMS (widened to QUANTIZED_DIMS, its experts 128 wide, for a
    quantization: mlx-lm's, `quantization` = [bits, group] or [bits, group, mode]), loaded
    by the runner."""
    from runner.models import build_model
    from runner.sources.loader import load_local_dir

    if not quantization:
        return build_model(load_local_dir(moe_checkpoint(path, MOE_DIMS, dtype)), backend)
    dims = MOE_DIMS | QUANTIZED_DIMS | {"moe_intermediate_size": 128}
    checkpoint = moe_checkpoint(path.with_name(path.name + "-float"), dims)
    written = quantized_moe(checkpoint, path, *quantization[:2], dtype, *quantization[2:])
    return build_model(load_local_dir(written), backend)


@pytest.fixture(params=[*CHECKPOINTS, *QUANTIZED, *MOE_PAIRS], ids=lambda c: "-".join(map(str, c)))
def pair(request, tmp_path):
    arch, dtype, *quantization = request.param
    on = Backend.cpu().replace(native_step_max_tokens=MAX_TOKENS)
    off = Backend.cpu().replace(native_step_max_tokens=None)
    if arch == MOE:
        native = load_moe(tmp_path / "a", dtype, quantization, on)
        plain = load_moe(tmp_path / "b", dtype, quantization, off)
    elif quantization:
        native = load_quantized_model(arch, tmp_path / "a", *quantization, dtype, backend=on)
        plain = load_quantized_model(arch, tmp_path / "b", *quantization, dtype, backend=off)
    else:
        native = load_tiny_model(arch, tmp_path / "a", backend=on, dtype=dtype)
        plain = load_tiny_model(arch, tmp_path / "b", backend=off, dtype=dtype)
    assert native._native is not None and plain._native is None
    half = dtype != "float32" and half_weights() and not quantization
    assert native._native.half_format == (dtype if half else None)
    # every product read from its codes (a layer's experts: its router and three stacks, one
    # more than a gated MLP's), and the (quantized) head computed natively too; a half
    # checkpoint's stacked experts are read as stored (runner/models/halves.py)
    sparse = sum(e is not None for e in native._native._experts)
    assert sparse == (native._native.layers - 1 if arch == MOE else 0)
    products = 7 * native._native.layers + sparse
    stored_stacks = 3 * sparse if dtype != "float32" else 0
    assert native._native.quantized == (products if quantization else stored_stacks)
    assert native._native._head is not None or not (half or quantization)
    native._native = Counting(native._native)
    return native, plain


def forward(model: Any, caches: list[Any], tokens: list[int]) -> np.ndarray:
    hidden = model.hidden(mx.array([tokens], dtype=mx.int32), caches)
    logits = model.unembed(hidden)
    mx.eval(hidden, logits)
    return np.array(logits)


def chunks_equal(
    native: Any, plain: Any, prompt: list[int], cuts: list[int]
) -> tuple[list[Any], list[Any]]:
    """`prompt` forwarded in the chunks between `cuts` by both models into fresh caches, the
    logits of every chunk within 1e-4; the two models' caches."""
    a, b = native.make_caches(), plain.make_caches()
    for start, stop in itertools.pairwise(cuts):
        got, want = forward(native, a, prompt[start:stop]), forward(plain, b, prompt[start:stop])
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
    return a, b


def assert_rows_over_caches_equal(
    native: tuple[Any, list[Any]], plain: tuple[Any, list[Any]], suffixes: list[list[int]]
) -> None:
    """Rows of `suffixes` batched over each model's caches (runner/cache/batch.py, as scoring
    batches them) give the same hidden states within 1e-4."""
    from runner.cache.batch import broadcast, forward_suffixes
    from runner.cache.kinds import kind_of

    rows = []
    for model, caches in (native, plain):
        batch = broadcast([kind_of(c) for c in caches], caches, len(suffixes))
        rows.append(np.array(forward_suffixes(model, batch, suffixes)))
    np.testing.assert_allclose(rows[0], rows[1], atol=1e-4, rtol=1e-4)


def assert_caches_equal(a: list[Any], b: list[Any]) -> None:
    """Keys and values within 2e-5, or 1e-4 of their size (the logits' grade: on an AMX
    machine a forward's rows of 4-bit codes take the tiles' limbs, within ~1e-6 of sum |w x|
    where the float tiles are within ~1e-7)."""
    assert [c.offset for c in a] == [c.offset for c in b]
    for x, y in zip(a, b, strict=True):
        n = x.offset
        np.testing.assert_allclose(
            np.array(x.keys[..., :n, :]), np.array(y.keys[..., :n, :]), atol=2e-5, rtol=1e-4
        )
        np.testing.assert_allclose(
            np.array(x.values[..., :n, :]), np.array(y.values[..., :n, :]), atol=2e-5, rtol=1e-4
        )


def test_chunks_and_decode_steps_equal_mlx(pair):
    native, plain = pair
    rng = np.random.default_rng(0)
    prompt = rng.integers(3, 300, size=300).tolist()
    # 0..5 (native, empty cache), 5..250 (MLX), 250..258 (native, grows the buffer), then
    # decode steps to 290 (native)
    cuts = [0, 5, 250, 258, *range(259, 291)]
    assert_caches_equal(*chunks_equal(native, plain, prompt, cuts))
    assert native._native.taken == len(cuts) - 2  # all but the 245-token chunk
    assert native._native.declined == 1


def test_long_forwards_equal_mlx_however_attention_splits_its_work(tmp_path):
    """The native attention (runner/native/decoder_step.c) takes many query rows as row
    items (blocks of up to 24 rows against all their keys in chunks of 64, online softmax),
    few rows as split items (blocks of 48 rows, keys in chunks of 128, the cached positions
    in up to 16 ranges merged afterwards): forwards long enough for several of each, with
    and without cached positions, equal MLX's path. The tiny models have 2 query heads per
    KV head, 2 KV heads: 8 tokens make 16 rows a group, 2 split items; 37 tokens 74 rows,
    4 row blocks a group. Qwen3-MoE's experts take hundreds of rows each there (the BLAS's
    products of float32 experts)."""
    for arch in [*ARCHES, MOE]:
        backend = Backend.cpu().replace(native_step_max_tokens=512)
        native = load_tiny_model(arch, tmp_path / arch / "a", backend=backend)
        plain = load_tiny_model(
            arch, tmp_path / arch / "b", backend=Backend.cpu().replace(native_step_max_tokens=None)
        )
        native._native = Counting(native._native)
        prompt = np.random.default_rng(1).integers(3, 300, size=1998).tolist()
        # 300 tokens on an empty cache (row items: own keys only, 5 causal chunks), 1500 by
        # MLX's path (> 512), 150 after 1800 cached (row items: 29 chunks), 37 more (row
        # items), 8 (split items: 8 ranges of the cached keys, 16 rows a block), then
        # decode steps (split items: 8 ranges)
        cuts = [0, 300, 1800, 1950, 1987, 1995, 1996, 1997, 1998]
        assert_caches_equal(*chunks_equal(native, plain, prompt, cuts))
        assert native._native.taken == len(cuts) - 2


@pytest.mark.parametrize(
    "head_dim, heads, kv_heads", [(48, 8, 2), (80, 4, 1), (128, 8, 4), (64, 9, 3), (32, 4, 4)]
)
def test_attention_of_other_head_sizes_equals_mlx(head_dim, heads, kv_heads, tmp_path):
    """Head sizes past the tiny models' 16: rows of 48 and 80 values end in a one-vector
    remainder of the 4-vector tiles (and their keys in 3 or 5 cache lines, which the row
    items prefetch), 128 is Qwen3's. Row items (37 tokens, batched rows of 9 tokens) and
    split items (2 tokens, decode steps) over a cache of 300 positions equal MLX's path.
    A decode step's rows a group take the few-row scores: 3 (SmolLM2's 9 heads over 3) the
    3x4 tiles, 2 the 2x6, 1 (as many KV heads as heads) the 1x8."""

    config = tiny_config("LlamaForCausalLM") | {
        "head_dim": head_dim,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
    }
    # the next multiple of the heads (config checks; 9 heads: 72)
    config["hidden_size"] = -(-config["hidden_size"] // heads) * heads
    backend = Backend.cpu().replace(native_step_max_tokens=64)
    native = load_tiny_model("LlamaForCausalLM", tmp_path / "a", backend=backend, config=config)
    plain = load_tiny_model(
        "LlamaForCausalLM",
        tmp_path / "b",
        backend=Backend.cpu().replace(native_step_max_tokens=None),
        config=config,
    )
    native._native = Counting(native._native)
    prompt = np.random.default_rng(2).integers(3, 300, size=342).tolist()
    a, b = native.make_caches(), plain.make_caches()
    # 300 by MLX's path (> 64), 37 (row items), 2 (split items), then decode steps
    for start, stop in itertools.pairwise([0, 300, 337, 339, 340, 341, 342]):
        got, want = forward(native, a, prompt[start:stop]), forward(plain, b, prompt[start:stop])
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
    assert_caches_equal(a, b)
    assert native._native.taken == 5
    suffixes = [prompt[i : i + 9] for i in range(0, 36, 9)]  # 4 batched rows over 342
    assert_rows_over_caches_equal((native, a), (plain, b), suffixes)
    assert native._native.taken == 6


def test_greedy_decode_equals_mlx_token_for_token(pair):
    native, plain = pair
    outputs = []
    for model in (native, plain):
        caches = model.make_caches()
        logits = forward(model, caches, [5, 17, 42, 9, 100, 7])
        tokens = []
        for _ in range(40):
            token = int(np.argmax(logits[0, -1]))
            tokens.append(token)
            logits = forward(model, caches, [token])
        outputs.append(tokens)
    assert outputs[0] == outputs[1]
    assert native._native.taken == 41


def test_a_rewound_cache_is_refilled_as_mlx_refills_it(pair):
    """A prefix cache rewinds a live cache by lowering its offset (runner/cache/kinds.py):
    the step must read only the positions below it and append from there."""
    native, plain = pair
    prompt = list(range(10, 40))
    a, b = native.make_caches(), plain.make_caches()
    forward(native, a, prompt[:20])  # MLX path (20 > 8)
    forward(plain, b, prompt[:20])
    for c in (*a, *b):
        c.offset = 12  # rewind
    got = forward(native, a, [77, 78, 79])
    want = forward(plain, b, [77, 78, 79])
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
    assert_caches_equal(a, b)


def test_one_row_appends_in_place_and_never_into_a_snapshot(pair):
    """One row's caches are written in place (no MLX operation a step), but only into
    buffers the step allocated: a cache restored from one trie snapshot is a view of the
    snapshot's memory (a concatenation of one array is that array), and a live rewind below
    the snapshot's end must not write into it."""
    from runner.cache.kinds import kind_of

    native, plain = pair
    caches = native.make_caches()
    forward(native, caches, [10, 11, 12, 13, 14, 15])
    kinds = [kind_of(c) for c in caches]
    snaps = [k.capture(c, 0, 6) for k, c in zip(kinds, caches, strict=True)]
    mx.eval(*(a for s in snaps for a in s.arrays))
    saved = [[np.array(a) for a in s.arrays] for s in snaps]

    restored = native.make_caches()
    for kind, cache, snap in zip(kinds, restored, snaps, strict=True):
        kind.install(cache, [snap], 6)
        kind.rewind(cache, 6, 3)
    got = forward(native, restored, [77, 78])
    for snap, before in zip(snaps, saved, strict=True):
        for array, copy in zip(snap.arrays, before, strict=True):
            np.testing.assert_array_equal(np.array(array), copy)
    reference = plain.make_caches()
    want = forward(plain, reference, [10, 11, 12, 77, 78])
    np.testing.assert_allclose(got[0, -1], want[0, -1], atol=1e-4, rtol=1e-4)
    assert_caches_equal(restored, reference)

    # decode steps within a buffer's room keep the buffers: nothing is copied or re-made
    buffers = [(c.keys, c.values) for c in restored]
    for token in (5, 6, 7):
        forward(native, restored, [token])
        assert all(
            c.keys is k and c.values is v for c, (k, v) in zip(restored, buffers, strict=True)
        )


def test_caches_grown_after_rewinds_round_after_round(tmp_path):
    """What bench/native_step.py does: fresh caches each round, a prompt, then forwards
    rewound to it that outgrow the buffers. Freed buffers come back from MLX's allocator at
    the same addresses; growing must still be right (and not mistake them for aliases)."""
    backend = Backend.cpu().replace(native_step_max_tokens=64)
    native = load_tiny_model("LlamaForCausalLM", tmp_path / "a", backend=backend)
    plain = load_tiny_model(
        "LlamaForCausalLM",
        tmp_path / "b",
        backend=Backend.cpu().replace(native_step_max_tokens=None),
    )
    prompt = list(range(3, 300))
    for size in (1, 16, 64, 1, 64):
        a, b = native.make_caches(), plain.make_caches()
        forward(native, a, prompt[:240])  # MLX's path (> 64)
        forward(plain, b, prompt[:240])
        for _ in range(3):
            for c in (*a, *b):
                c.offset = 240
            got = forward(native, a, prompt[240 : 240 + size])
            want = forward(plain, b, prompt[240 : 240 + size])
            np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
        assert_caches_equal(a, b)


@pytest.mark.slow  # the real default model
def test_growing_real_sized_caches_round_after_round(default_model_dir):
    """The same with the default model's buffer sizes, where MLX's allocator hands a freed
    cache buffer out again within one growth (bench/native_step.py once stopped on it: a
    check took the reused address for an alias). Rewound forwards are deterministic."""
    from runner.models import build_model
    from runner.sources.loader import load_model_source

    model = build_model(
        load_model_source(str(default_model_dir)),
        Backend.cpu().replace(native_step_max_tokens=512),
    )
    prompt = np.random.default_rng(0).integers(100, 5000, size=480 + 512).tolist()
    for size in (1, 16, 64, 128, 512):
        caches = model.make_caches()
        mx.eval(model.hidden(mx.array([prompt[:480]], dtype=mx.int32), caches))
        rounds = []
        for _ in range(2):
            for c in caches:
                c.offset = 480
            new = mx.array([prompt[480 : 480 + size]], dtype=mx.int32)
            rounds.append(np.array(model.hidden(new, caches)))
        np.testing.assert_array_equal(rounds[0], rounds[1])


def test_what_it_does_not_serve_goes_to_mlx_unchanged(pair):
    native, _ = pair
    caches = native.make_caches()
    before = native._native.taken
    two_rows = mx.array([[3, 4, 5], [6, 7, 8]], dtype=mx.int32)  # batched rows
    assert native._native(two_rows, native.make_caches()) is None
    assert native._native(mx.array([list(range(3, 3 + MAX_TOKENS + 1))]), caches) is None
    assert native._native(mx.array([[3, 4]]), None) is None  # no caches
    past_the_table = native.vocab_size + 5  # MLX's path decides what such an id means
    assert native._native(mx.array([[3, past_the_table]]), caches) is None
    assert all(c.offset == 0 for c in caches)  # declining changed nothing
    assert native._native.taken == before


# Families with sliding-window layers (tests/data/configs: window 8): Mistral windows every
# layer, this Qwen2 its last two of three; Gemma2 (soft-capped attention, alternate windows)
# and Gemma3 (three of four windowed, local and global rotary tables), both with Gemma's
# four norms a layer scaling by 1 + weight, GELU MLPs and scaled embeddings; Ministral3
# (YaRN rotary tables, queries scaled by position from 16 on), windowed here at 8 too; Phi3
# (fused q/k/v and gate/up projections, longrope tables rotating 12 of 16 dims).
WINDOWED = [
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "Ministral3ForCausalLM",
    "Phi3ForCausalLM",
]


def windowed_config(arch: str) -> dict[str, Any]:
    """`arch`'s tiny config, windowed at 8 where it has no window of its own (Ministral3)."""
    config = tiny_config(arch)
    if config.get("sliding_window") is None:
        config["sliding_window"] = 8
    return config


def forward_both(model: Any, caches: list[Any], tokens: list[int]) -> tuple[np.ndarray, ...]:
    """The hidden states and the logits of a forward: Gemma's final soft-caps (0.5 in the
    tiny configs) squash the logits, so the hidden states are compared too."""
    hidden = model.hidden(mx.array([tokens], dtype=mx.int32), caches)
    logits = model.unembed(hidden)
    mx.eval(hidden, logits)
    return np.array(hidden), np.array(logits)


def assert_chunks_equal(
    native: Any, plain: Any, prompt: list[int], cuts: list[int], rings: bool = False
) -> None:
    """`prompt` forwarded in the chunks between `cuts` by both models into fresh caches:
    hidden states and logits agree at every chunk (and the rings after each, if `rings`),
    and the caches at the end."""
    a, b = native.make_caches(), plain.make_caches()
    for start, stop in itertools.pairwise(cuts):
        chunk = prompt[start:stop]
        got, want = forward_both(native, a, chunk), forward_both(plain, b, chunk)
        for x, y in zip(got, want, strict=True):
            np.testing.assert_allclose(x, y, atol=1e-4, rtol=1e-4)
        if rings:
            assert_rings_equal(a, b)
    assert_rings_equal(a, b)


def windowed_pair(arch: str, path: Any, max_tokens: int, **config: Any) -> tuple[Any, Any]:
    on = Backend.cpu().replace(native_step_max_tokens=max_tokens)
    off = Backend.cpu().replace(native_step_max_tokens=None)
    edited = windowed_config(arch) | config
    native = load_tiny_model(arch, path / "a", backend=on, config=edited)
    plain = load_tiny_model(arch, path / "b", backend=off, config=edited)
    assert native._native is not None
    native._native = Counting(native._native)
    return native, plain


def assert_rings_equal(a: list[Any], b: list[Any]) -> None:
    """Rotating caches hold the same positions in the same slots, as MLX's path leaves them
    (the native step appends to them through mlx-lm's own update); KV caches as ever."""
    from mlx_lm.models.cache import RotatingKVCache

    rings = [(x, y) for x, y in zip(a, b, strict=True) if type(x) is RotatingKVCache]
    assert rings and all(type(y) is RotatingKVCache for _, y in rings)
    for x, y in rings:
        assert (x.offset, x._idx, x.keys.shape) == (y.offset, y._idx, y.keys.shape)
        np.testing.assert_allclose(np.array(x.keys), np.array(y.keys), atol=2e-5)
        np.testing.assert_allclose(np.array(x.values), np.array(y.values), atol=2e-5)
    plain = [(x, y) for x, y in zip(a, b, strict=True) if type(x) is not RotatingKVCache]
    if plain:
        assert_caches_equal(*map(list, zip(*plain, strict=True)))


@pytest.mark.parametrize("arch", WINDOWED)
def test_sliding_windows_equal_mlx(arch, tmp_path):
    """Sliding-window layers through the step: chunks that cross the window, decode steps
    that wrap the ring (mlx-lm writes a step in place at its `_idx`), chunks after it has
    wrapped (mlx-lm keeps the last window - 1 positions in order, then appends), and a
    chunk longer than the window (its own keys windowed too). Every forward is the step's."""
    native, plain = windowed_pair(arch, tmp_path, 16)
    prompt = np.random.default_rng(0).integers(3, 300, size=120).tolist()
    cuts = [0, 3, 6, 13, *range(14, 24), 30, 31, 32, 45, 46, *range(47, 60), 61, 76, 77, 80]
    assert_chunks_equal(native, plain, prompt, cuts, rings=True)
    assert native._native.taken == len(cuts) - 1
    assert native._native.declined == 0


def test_a_windowed_mixture_of_experts_equals_mlx(tmp_path):
    """Qwen3-MoE with `use_sliding_window` (every layer windowed at 8, rotating caches): its
    experts and its rings through the step, as the windowed families' above."""
    native, plain = windowed_pair(MOE, tmp_path, 16, use_sliding_window=True)
    assert sum(e is not None for e in native._native._experts) == 2  # the first layer dense
    prompt = np.random.default_rng(4).integers(3, 300, size=60).tolist()
    cuts = [0, 3, 13, *range(14, 24), 30, 31, 45, 46, *range(47, 52)]
    assert_chunks_equal(native, plain, prompt, cuts, rings=True)
    assert native._native.taken == len(cuts) - 1


def test_a_wrapped_ring_is_read_in_place_in_two_runs(tmp_path):
    """Once a ring has wrapped, the positions a step's queries see lie in two runs of it: the
    step reads both where they are (struct step_cache's `wrap`), no copy made; together they
    are the positions in order, as mlx-lm orders its ring."""
    from mlx_lm.models.cache import RotatingKVCache

    native, _ = windowed_pair("MistralForCausalLM", tmp_path, 16)
    caches = native.make_caches()
    prompt = np.random.default_rng(3).integers(3, 300, size=13).tolist()
    forward(native, caches, prompt[:8])
    for token in prompt[8:]:  # decode steps write in place at the ring's `_idx`
        forward(native, caches, [token])
    ring = caches[0]
    assert type(ring) is RotatingKVCache and 0 < ring._idx < ring.max_size
    mx.eval(ring.keys, ring.values)
    start, (keys, values), rest = native._native._window_view(ring, ring.offset, 1)
    assert start == ring.offset - ring.max_size + 1 and rest is not None
    for run, array in (
        (keys, ring.keys),
        (values, ring.values),
        *zip(rest, (ring.keys, ring.values), strict=True),
    ):
        assert np.shares_memory(run, np.asarray(array))
    ordered = np.array(ring._temporal_order(ring.keys))[0, :, -(ring.offset - start) :]
    np.testing.assert_array_equal(np.concatenate([keys, rest[0]], axis=1), ordered)


@pytest.mark.parametrize("arch", WINDOWED)
def test_long_windowed_forwards_equal_mlx(arch, tmp_path):
    """Windows that span several of the attention's key chunks (row items: 64 keys; split
    items: 128, the cache in ranges): rows whose window starts inside a chunk, chunks that
    some rows of a block see and others do not, windows inside a forward's own keys."""
    native, plain = windowed_pair(arch, tmp_path, 512, sliding_window=150)
    prompt = np.random.default_rng(1).integers(3, 300, size=1300).tolist()
    # 300 on an empty cache (own keys windowed), 37 over 300 cached (row items), 7 (split
    # items), decode steps, 261 more, 600 by MLX's path (> 512), then 40 and decode
    cuts = [0, 300, 337, 344, 345, 346, 607, 1207, 1247, 1248, 1249]
    assert_chunks_equal(native, plain, prompt, cuts)
    assert native._native.taken == len(cuts) - 2
    assert native._native.declined == 1


def test_a_quantized_phi3s_fused_projections_are_read_as_row_ranges(tmp_path):
    """Phi3's fused qkv_proj and gate_up_proj in mlx-lm's 4-bit quantization: the step reads
    each part's rows of the codes, scales and biases where MLX keeps them (every product
    quantized), and equals MLX's path."""
    from runner.models import build_model
    from runner.sources.loader import load_local_dir
    from tests.quantized_models import write_quantized_model

    config = tiny_config("Phi3ForCausalLM")
    path = write_quantized_model("Phi3ForCausalLM", tmp_path / "q", 4, 32, "float16", config=config)
    on = Backend.cpu().replace(native_step_max_tokens=16)
    native = build_model(load_local_dir(path), on)
    plain = build_model(load_local_dir(path), Backend.cpu().replace(native_step_max_tokens=None))
    assert native._native is not None
    assert native._native.quantized == 7 * native._native.layers
    native._native = Counting(native._native)
    prompt = np.random.default_rng(2).integers(3, 300, size=40).tolist()
    assert_chunks_equal(native, plain, prompt, [0, 5, 13, 14, 15, 16, 20, 30, 31, 40])
    assert native._native.taken == 9


@pytest.mark.parametrize("arch", WINDOWED)
def test_windowed_rows_batched_over_a_prefix_equal_mlx(arch, tmp_path):
    """Scoring's batched rows where a prefix fills the window (and wrapped it: 40 > 8): the
    rotating layers' broadcast rings are read as each row's prefix, and appended by MLX."""
    from runner.cache.batch import broadcast, forward_suffixes
    from runner.cache.kinds import kind_of

    native, plain = windowed_pair(arch, tmp_path, 16)
    prefix = list(range(20, 60))
    suffixes = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15, 16, 17], [13], [14, 15, 16, 17]]
    results = []
    for model in (native, plain):
        caches = model.make_caches()
        for at in range(0, 40, 8):
            forward(model, caches, prefix[at : at + 8])
        kinds = [kind_of(c) for c in caches]
        batch = broadcast(kinds, caches, len(suffixes))
        hidden = forward_suffixes(model, batch, suffixes)
        mx.eval(hidden)
        results.append([np.array(hidden[i, : len(s)]) for i, s in enumerate(suffixes)])
    for got, want in zip(*results, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
    assert native._native.taken == 6  # the prefix's five chunks and the batch


@pytest.mark.parametrize(
    "norm_topk, top_k, dense",
    [(False, 3, []), (True, 1, [1]), (False, 8, [0, 2])],
    ids=["not-renormalised", "one-expert", "every-expert"],
)
def test_experts_equal_mlx_however_they_route(norm_topk, top_k, dense, tmp_path):
    """A Qwen3-MoE's experts in the step (runner/native/decoder_step.c: `experts_mlp`)
    whether its probabilities are renormalised or not, a token takes one expert or all of
    them, and whichever layers are dense: prompts in chunks, decode steps and rows batched
    over a prefix equal MLX's path."""
    from runner.models import build_model
    from runner.sources.loader import load_local_dir

    dims = MOE_DIMS | {"norm_topk_prob": norm_topk, "num_experts_per_tok": top_k}
    checkpoint = moe_checkpoint(tmp_path / "hf", dims | {"mlp_only_layers": dense})
    on = Backend.cpu().replace(native_step_max_tokens=MAX_TOKENS)
    native = build_model(load_local_dir(checkpoint), on)
    plain = build_model(load_local_dir(checkpoint), on.replace(native_step_max_tokens=None))
    assert native._native is not None
    assert [e is not None for e in native._native._experts] == [i not in dense for i in range(3)]
    native._native = Counting(native._native)
    prompt = np.random.default_rng(3).integers(3, 300, size=40).tolist()
    cuts = [0, 7, 30, 31, 32, 33, 34]
    a, b = chunks_equal(native, plain, prompt, cuts)
    assert_caches_equal(a, b)
    assert native._native.taken == len(cuts) - 2  # all but the 23-token chunk
    suffixes = [prompt[34:37], prompt[37:38], prompt[38:40]]
    assert_rows_over_caches_equal((native, a), (plain, b), suffixes)
    assert native._native.taken == len(cuts) - 1


GPT_OSS = "GptOssForCausalLM"


def gpt_oss_pair(tmp_path: Any, source: str) -> tuple[Any, Any]:
    """A tiny gpt-oss (a sliding layer of window 8, then a full one; 4 experts, 2 a token;
    its clamped SwiGLU's limit 0.05, so that clamps bite) loaded with the step and without:
    its float32 checkpoint, or the GGUF llama.cpp's quantizer would write (experts MXFP4,
    attention Q4_0 / Q5_0 / Q4_1, norms, biases and sinks F32), in llama.cpp's layout or as
    Ollama's converter publishes it (`gptoss`, its own tensor names), the same with every
    other matrix in half precision as Ollama's gpt-oss:20b (`ollama-halves`: BF16, the head
    F16), or as mlx-community's gpt-oss conversions hold it (`mlx_mxfp4_q8`)."""
    from runner.models import build_model
    from runner.sources.gguf.model import load_gguf
    from runner.sources.loader import load_local_dir
    from tests.gguf_models import halves, mixed, tiny_checkpoint, write_gguf

    on = Backend.cpu().replace(native_step_max_tokens=MAX_TOKENS)
    off = on.replace(native_step_max_tokens=None)
    checkpoint = tiny_checkpoint(GPT_OSS, tmp_path / "hf")
    if source in ("gguf", "ollama-gguf", "ollama-halves"):
        rule = halves if source == "ollama-halves" else mixed
        path = write_gguf(checkpoint, tmp_path / "model.gguf", rule, ollama=source != "gguf")
        native, plain = build_model(load_gguf(path), on), build_model(load_gguf(path), off)
    elif source == "mlx":
        path = mlx_mxfp4_q8(checkpoint, tmp_path / "mlx")
        native = build_model(load_local_dir(path), on)
        plain = build_model(load_local_dir(path), off)
    else:
        native = build_model(load_local_dir(checkpoint), on)
        plain = build_model(load_local_dir(checkpoint), off)
    step = native._native
    assert step is not None and step.activation == "swiglu_oai"
    assert all(e is not None and e.router_bias and e.down_bias for e in step._experts)
    assert all(s.sinks for s in step._structs)
    # quantized: every attention product, and each layer's three expert stacks, from codes
    assert step.quantized == (0 if source == "float32" else 7 * step.layers)
    native._native = Counting(step)
    return native, plain


def mlx_mxfp4_q8(checkpoint: Path, out: Path) -> Path:
    """`checkpoint` (a tiny gpt-oss) as mlx-community's gpt-oss-*-MXFP4-Q8 conversions store
    it: the experts in MLX's mxfp4 mode (biases beside them in float32), the other linear
    layers affine 8-bit in groups of 64, the router, embedding and head float32."""
    from mlx.utils import tree_flatten

    from runner.models import build_model
    from runner.sources.loader import load_local_dir

    module = build_model(load_local_dir(checkpoint), Backend.cpu()).module
    quantization: dict[str, Any] = {"group_size": 64, "bits": 8, "mode": "affine"}

    def chosen(path: str, layer: nn.Module) -> dict[str, Any] | bool:
        if not hasattr(layer, "to_quantized") or "router" in path or "embed" in path:
            return False
        if path == "lm_head":
            return False
        spec = {"group_size": 32, "bits": 4, "mode": "mxfp4"} if ".experts." in path else None
        quantization[path] = spec or {"group_size": 64, "bits": 8, "mode": "affine"}
        return quantization[path]

    nn.quantize(module, class_predicate=chosen)
    out.mkdir(parents=True)
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(module.parameters())))
    config = json.loads((checkpoint / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(config | {"quantization": quantization}))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(checkpoint / name, out / name)
    return out


@pytest.mark.parametrize("source", ["float32", "gguf", "ollama-gguf", "ollama-halves", "mlx"])
def test_gpt_oss_equals_mlx(source, tmp_path):
    """gpt-oss in the step (Ollama's gpt-oss:20b: its decode ran MLX's graph a layer at a
    time): attention with sinks and biases over a sliding ring and a full cache, the router's
    bias and top-k softmax, the experts' biases and clamped SwiGLU, MXFP4 experts read in
    place. Prompts in chunks, decode steps past the window, and rows batched over a prefix
    equal MLX's path."""
    from runner.cache.batch import broadcast, forward_suffixes
    from runner.cache.kinds import kind_of

    native, plain = gpt_oss_pair(tmp_path, source)
    prompt = np.random.default_rng(5).integers(3, 300, size=60).tolist()
    cuts = [0, 5, 30, 36, *range(37, 50)]
    assert_chunks_equal(native, plain, prompt, cuts, rings=True)
    assert native._native.taken == len(cuts) - 2  # all but the 25-token chunk
    rows = []
    suffixes = [prompt[50:53], prompt[53:54], prompt[54:60]]
    for model in (native, plain):
        caches = model.make_caches()
        forward(model, caches, prompt[:8])
        forward(model, caches, prompt[8:16])
        batch = broadcast([kind_of(c) for c in caches], caches, len(suffixes))
        hidden = forward_suffixes(model, batch, suffixes)
        mx.eval(hidden)
        rows.append([np.array(hidden[i, : len(s)]) for i, s in enumerate(suffixes)])
    for got, want in zip(*rows, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
    assert native._native.taken == len(cuts) - 2 + 3


def test_half_precision_ggufs_are_held_at_their_own_size(tmp_path):
    """A GGUF's BF16 and F16 matrices (Ollama's gpt-oss:20b: 1.8B of its weights, 3.6 of its
    14 GB) are read by the step as stored: before, they became float32 for MLX's path with
    exact half copies beside them for the step, 3x their bytes (the 20b: ~21 GB resident
    against the file's 14). Every matrix is the file's own bytes, the whole model's
    parameters no larger than the file; without the step (MLX's path) they are the plain
    arrays they always were, widened."""
    from mlx.utils import tree_flatten

    from runner.models.quantized import GGMLEmbedding, GGMLLinear

    native, plain = gpt_oss_pair(tmp_path, "ollama-halves")
    file_bytes = (tmp_path / "model.gguf").stat().st_size
    kept = GGMLLinear | GGMLEmbedding
    layers = dict(native.module.named_modules())
    halves = {p: m.ggml_type for p, m in layers.items() if isinstance(m, kept)}
    attention = [p for p in halves if p.endswith(("q_proj", "k_proj", "v_proj", "o_proj"))]
    assert len(attention) == 4 * native._native.step.layers
    assert set(halves.values()) == {"BF16", "F16"}  # the head F16, the rest BF16
    assert native._native.step._head_rows == 1 << 30  # the head from its halves, any rows

    def parameter_bytes(model: Any) -> int:
        return sum(v.nbytes for _, v in tree_flatten(model.module.parameters()))

    assert parameter_bytes(native) <= file_bytes
    assert not any(isinstance(m, kept) for _, m in plain.module.named_modules())
    assert parameter_bytes(plain) > 1.5 * file_bytes  # float32 on MLX's path
    step = native._native.step
    prompt = np.random.default_rng(7).integers(3, 300, size=6).tolist()
    want = forward(plain, plain.make_caches(), prompt)
    np.testing.assert_allclose(forward(native, native.make_caches(), prompt), want, atol=1e-4)
    assert native._native.taken >= 1 and step.quantized == 7 * step.layers


def test_gpt_oss_sinks_and_clamps_change_what_the_step_computes(tmp_path):
    """The step's sinks and its clamped SwiGLU matter on the tiny gpt-oss (so the test above
    would see them dropped): without its sinks, or with SiLU's gate for the clamped one, a
    step's logits move far past that test's tolerance."""
    native, plain = gpt_oss_pair(tmp_path, "float32")
    prompt = np.random.default_rng(6).integers(3, 300, size=6).tolist()
    want = forward(plain, plain.make_caches(), prompt)
    np.testing.assert_allclose(forward(native, native.make_caches(), prompt), want, atol=1e-4)
    step = native._native.step
    kept = [s.sinks for s in step._structs]
    for s in step._structs:
        s.sinks = None
    assert np.abs(forward(native, native.make_caches(), prompt) - want).max() > 1e-2
    for s, sinks in zip(step._structs, kept, strict=True):
        s.sinks = sinks
    step._args.activation = abi.ACTIVATIONS["silu"]
    assert np.abs(forward(native, native.make_caches(), prompt) - want).max() > 1e-2


def test_only_float32_llama_shapes_get_a_step(tmp_path):
    """Families without the step keep MLX's path, as does a Llama with the step turned off."""
    other = load_tiny_model("Cohere2MoeForCausalLM", tmp_path / "g")  # no step for its family
    assert other._native is None
    without = Backend.cpu().replace(native_step_max_tokens=None)
    off = load_tiny_model("LlamaForCausalLM", tmp_path / "l", backend=without)
    assert off._native is None
    llama = load_tiny_model("LlamaForCausalLM", tmp_path / "q")
    assert llama._native is not None  # the CPU default with the dispatch preloaded


def test_rows_batched_over_a_shared_prefix_equal_mlx(pair):
    """Scoring's batched rows (runner/cache/batch.py): each row attends to the shared prefix
    and to its own suffix; the suffixes' keys and values land in the batch's caches."""
    from runner.cache.batch import broadcast, forward_suffixes
    from runner.cache.kinds import kind_of

    native, plain = pair
    prefix = list(range(20, 60))
    suffixes = [[5, 6, 7], [8, 9, 10, 11, 12], [13], [14, 15, 16, 17]]
    results = []
    for model in (native, plain):
        caches = model.make_caches()
        forward(model, caches, prefix)  # 40 tokens: MLX's path in both (limit 8)
        kinds = [kind_of(c) for c in caches]
        batch = broadcast(kinds, caches, len(suffixes))
        hidden = forward_suffixes(model, batch, suffixes)
        mx.eval(hidden)
        rows = [np.array(hidden[i, len(s) - 1]) for i, s in enumerate(suffixes)]
        keys = [np.array(c.segment(1, 40, 45)[0]) for c in batch]
        results.append((rows, keys))
    for got, want in zip(results[0][0], results[1][0], strict=True):
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
    for got, want in zip(results[0][1], results[1][1], strict=True):
        np.testing.assert_allclose(got, want, atol=2e-5)
    assert native._native.taken == 1  # the batch (the prefix was MLX's)


def test_one_row_over_a_shared_prefix_takes_the_step(pair):
    """A batch of one row over a shared prefix (SharedPrefixKV caches, batch 1) is the
    step's, as any batch is, and equals MLX's path."""
    from runner.cache.batch import broadcast, forward_suffixes
    from runner.cache.kinds import kind_of
    from runner.cache.shared_prefix import SharedPrefixKV

    native, plain = pair
    results = []
    for model in (native, plain):
        caches = model.make_caches()
        forward(model, caches, [9, 8, 7, 6, 5])
        batch = broadcast([kind_of(c) for c in caches], caches, 1)
        assert all(type(c) is SharedPrefixKV for c in batch)
        results.append(np.array(forward_suffixes(model, batch, [[1, 2, 3]])))
    np.testing.assert_allclose(results[0], results[1], atol=1e-4, rtol=1e-4)
    assert native._native.taken == 2  # the prefix and the row


def test_batched_rows_equal_each_row_alone(pair):
    """The same rows, batched through the step and one by one through it."""
    from runner.cache.batch import broadcast, forward_suffixes
    from runner.cache.kinds import kind_of

    native, _ = pair
    prefix, suffixes = [9, 8, 7, 6, 5], [[1, 2, 3], [4, 5, 6, 7]]
    caches = native.make_caches()
    forward(native, caches, prefix)
    batch = broadcast([kind_of(c) for c in caches], caches, len(suffixes))
    hidden = np.array(forward_suffixes(native, batch, suffixes))
    for i, suffix in enumerate(suffixes):
        alone = native.make_caches()
        forward(native, alone, prefix)
        row = np.array(native.hidden(mx.array([suffix], dtype=mx.int32), alone))
        np.testing.assert_allclose(hidden[i, : len(suffix)], row[0], atol=1e-4, rtol=1e-4)


@needs_half
@pytest.mark.parametrize("arch, dtype", CHECKPOINTS[2:])
def test_half_copies_compute_what_float32_weights_compute(arch, dtype, tmp_path):
    """A half-precision checkpoint's weights read from their exact half copies (half the
    bytes, as panels summed in order of k) give the float32 step's numbers up to float32
    rounding: prompt chunks (one of more rows than BLAS_ROWS: the tiles' where there are
    wide ones, else the BLAS's), decode steps with the head, batched rows. The copies' own
    sums are checked exactly in test_half_panels_products_sum_in_order."""
    from runner.cache.batch import broadcast, forward_suffixes
    from runner.cache.kinds import kind_of

    backend = Backend.cpu().replace(native_step_max_tokens=160)
    half = load_tiny_model(arch, tmp_path / "a", backend=backend, dtype=dtype)
    full = load_tiny_model(
        arch, tmp_path / "b", backend=backend.replace(native_half_formats=()), dtype=dtype
    )
    assert half._native.half_format == dtype and full._native.half_format is None
    half._native, full._native = Counting(half._native), Counting(full._native)
    prompt = np.random.default_rng(2).integers(3, 300, size=180).tolist()
    results = []
    for model in (half, full):
        caches = model.make_caches()
        logits = [forward(model, caches, prompt[a:b]) for a, b in ((0, 150), (150, 170))]
        assert model._native.taken == 2 and not model._native.declined
        logits += [forward(model, caches, [t]) for t in prompt[170:180]]  # decode steps
        batch = broadcast([kind_of(c) for c in caches], caches, 3)
        rows = np.array(forward_suffixes(model, batch, [[4, 5], [6], [7, 8, 9]]))
        keys = [np.array(c.keys[..., :180, :]) for c in caches]
        results.append((logits, rows, keys))
    (got_logits, got_rows, got_keys), (want_logits, want_rows, want_keys) = results
    close = {"rtol": 1e-4, "atol": 1e-5}  # float32 sums in another order, ~30 products deep
    for got, want in zip(got_logits, want_logits, strict=True):
        np.testing.assert_allclose(got, want, **close)
    np.testing.assert_allclose(got_rows, want_rows, **close)
    for got, want in zip(got_keys, want_keys, strict=True):
        np.testing.assert_allclose(got, want, **close)

    # and it is the copies that short forwards and the head read: changed, they change them
    def hidden() -> np.ndarray:
        return np.array(half.hidden(mx.array([prompt[:5]], dtype=mx.int32), half.make_caches()))

    before = hidden()
    *layers, head = half._native.half_copies
    for copy in layers:
        copy[...] = copy[::-1]  # another matrix of the same values
    assert not np.array_equal(hidden(), before)
    head[...] = 0
    assert not forward(half, half.make_caches(), prompt[:5]).any()


@needs_half
def test_no_half_copies_where_memory_is_short(tmp_path, monkeypatch):
    """The copies add half again the weights' size: not made when that is more than half of
    the memory still available (the float32 step runs instead; a checkpoint whose matrices
    the halves' layout chooses to store has no float32 weights to copy, tests/
    test_half_layouts.py)."""
    from runner.backend import native_step

    backend = Backend.cpu().replace(native_step_max_tokens=8)
    monkeypatch.setattr(native_step, "available_memory", lambda: 10_000)  # bytes
    monkeypatch.setenv("OLLAMA_MLX_RUNNER_HALF_WEIGHTS", "widened")
    short = load_tiny_model("Qwen3ForCausalLM", tmp_path / "a", backend=backend, dtype="float16")
    assert short._native is not None and short._native.half_format is None
    assert short._native.half_copies == []
    assert short._native.quantized == 0  # float32 weights, not the stored halves
    monkeypatch.setattr(native_step, "available_memory", lambda: 1 << 40)
    ample = load_tiny_model("Qwen3ForCausalLM", tmp_path / "b", backend=backend, dtype="float16")
    assert ample._native.half_format == "float16"
    monkeypatch.undo()
    room = native_step.available_memory()  # Linux's MemAvailable; None elsewhere
    assert room > 0 if sys.platform == "linux" else room is None


@needs_half
def test_half_copies_only_where_every_value_is_exact():
    """runner_narrow_panels: a copy in a half format only when it holds every value bit for
    bit (at any position of a panel, in the last, partly filled panel too)."""
    from runner.backend import native_step

    functions = abi.load()
    assert functions is not None

    def narrow(values: list[float], fmt: str, n: int = 1) -> bool:
        src = np.array(values, np.float32).reshape(n, -1)
        out = np.empty(functions.panel_halves(*src.shape), np.uint16)
        code = functions.narrow_panels(
            native_step._pointer(src), *src.shape, out.ctypes.data, abi.HALF_FORMATS[fmt]
        )
        return bool(code)

    def replaced(values: list[float], at: int, value: float) -> list[float]:
        return [*values[:at], value, *values[at + 1 :]]

    exact16 = [0.5, -0.0, 65504.0, 2.0**-24, float("inf"), 1 + 2.0**-10, -3.0, 7.0, 0.25, 1.5, 2.0]
    assert narrow(exact16, "float16")
    for at in (3, 10):
        for bad in (1 + 2.0**-11, 70000.0, 2.0**-25):
            assert not narrow(replaced(exact16, at, bad), "float16")
    exact_bf16 = [1.0, -(2.0**100), 65536.0, 1 + 2.0**-7, 3.0, 0.0, 5.0, 6.0, 7.0, 8.0, 9.0]
    assert narrow(exact_bf16, "bfloat16")
    assert not narrow(exact_bf16, "float16")  # 2^100 is past float16's range
    for at in (3, 10):
        assert not narrow(replaced(exact_bf16, at, 1 + 2.0**-8), "bfloat16")
    # 17 rows: the second panel holds one row; an inexact value there counts too
    rows = [float(v) for v in range(17 * 3)]
    assert narrow(rows, "float16", n=17)
    assert not narrow(replaced(rows, 16 * 3 + 1, 1 + 2.0**-11), "float16", n=17)


def _panel_product(functions, a: np.ndarray, w: np.ndarray, fmt: str) -> np.ndarray:
    """A W^T through W's panels in `fmt` (runner_weight_product)."""
    from runner.backend import native_step

    (n, k), m = w.shape, a.shape[0]
    panels = np.empty(functions.panel_halves(n, k), np.uint16)
    code = functions.narrow_panels(
        native_step._pointer(w), n, k, panels.ctypes.data, abi.HALF_FORMATS[fmt]
    )
    assert code == 1
    c = np.empty((m, n), np.float32)
    weight = abi.Weight(format=abi.HALF_FORMATS[fmt], data=panels.ctypes.data)
    code = functions.weight_product(
        m, n, k, native_step._pointer(a), ctypes.byref(weight), native_step._pointer(c), 0
    )
    assert code == 0
    return c


@needs_half
def test_half_panels_products_sum_in_order():
    """Products on the panels: every value is the sum over k in order, one fused
    multiply-add a step, whatever the rows: any row alone (a decode step's one-row tiles),
    any number of rows (row groups of 1-6), columns past the last whole panel (n % 16) and
    past the one-row tiles' four panels (n % 64)."""

    functions = abi.load()
    assert functions is not None
    rng = np.random.default_rng(3)

    def fma_in_order(a: np.ndarray, w: np.ndarray) -> np.ndarray:
        # float64 holds a product of two float32s exactly, so each step is rounded once to
        # float64 and once to float32: a fused multiply-add's result except in ties past
        # float32's precision, which these random values do not meet
        acc = np.zeros((a.shape[0], w.shape[0]), np.float32)
        for t in range(a.shape[1]):
            step = np.outer(a[:, t].astype(np.float64), w[:, t].astype(np.float64))
            acc = (acc.astype(np.float64) + step).astype(np.float32)
        return acc

    shapes = ((1, 19, 13), (3, 17, 29), (2, 64, 64), (15, 80, 40), (1, 130, 24), (23, 33, 7))
    for fmt, dtype in (("float16", mx.float16), ("bfloat16", mx.bfloat16)):
        for m, n, k in shapes:
            w = np.array(
                mx.array(rng.normal(size=(n, k)).astype(np.float32))
                .astype(dtype)
                .astype(mx.float32)
            )
            a = rng.normal(size=(m, k)).astype(np.float32)
            c = _panel_product(functions, a, w, fmt)
            np.testing.assert_array_equal(c, fma_in_order(a, w))
            for i in range(m):  # each row alone: the same bits
                alone = _panel_product(functions, a[i : i + 1], w, fmt)
                np.testing.assert_array_equal(alone, c[i : i + 1])


# --- MLX's affine quantization -----------------------------------------------------------------


def test_affine_products_equal_float64_and_every_row_count():
    """runner_weight_product on MLX's affine quantization (every bits, group and scale
    format): within 1e-4 (relative to the largest value) of the float64 product of
    mx.dequantize's values, and the same bits whatever the number of rows (the stream tiles of
    one or two rows, the block tiles of more, in row groups of 1-4 and chunks) and the columns
    (n not a whole number of blocks); on x86, exactly the sums the tiles define."""
    functions = abi.load()
    assert functions is not None
    lanes = AFFINE_LANES.get(abi.level() or "")
    rng = np.random.default_rng(11)
    for bits, group, scales in itertools.product((2, 3, 4, 5, 6, 8), (32, 64, 128), SCALE_DTYPES):
        n, k = 37, 256
        w = Affine(rng.normal(size=(n, k)).astype(np.float32), bits, group, scales)
        a = rng.normal(size=(133, k)).astype(np.float32)
        with amx_turned_off(functions):  # the float tiles (AMX's: tests/test_native_abi.py)
            c = w.times(functions, a)
            want = a.astype(np.float64) @ w.values.astype(np.float64).T
            assert np.abs(c - want).max() <= 1e-4 * np.abs(want).max(), (bits, group, scales)
            if lanes is not None:
                np.testing.assert_array_equal(c, affine_in_order(a, w.values, bits, *lanes))
            for m in (1, 2, 3, 4, 5, 8, 15, 40):
                got = w.times(functions, a[:m])
                np.testing.assert_array_equal(got, c[:m], err_msg=f"{m} rows")
            for i in (0, 17, 132):
                np.testing.assert_array_equal(w.times(functions, a[i : i + 1]), c[i : i + 1])


def test_affine_logits_equal_float64():
    """A head's worth of logits (SmolLM2's: 49152 x 576, 4 bits, groups of 64, float16
    scales, as mlx-lm converts it) for a decode step and 15 rows: within 1e-4 of the
    float64 product of mx.dequantize's values (relative to the largest logit), every row the
    same bits alone."""
    functions = abi.load()
    assert functions is not None
    rng = np.random.default_rng(12)
    w = Affine((rng.normal(size=(49152, 576)) * 0.05).astype(np.float32), 4, 64, "float16")
    a = rng.normal(size=(15, 576)).astype(np.float32)
    c = w.times(functions, a)
    want = a.astype(np.float64) @ w.values.astype(np.float64).T
    assert np.abs(c - want).max() <= 1e-4 * np.abs(want).max()
    np.testing.assert_array_equal(w.times(functions, a[3:4]), c[3:4])


@pytest.mark.parametrize("arch", ARCHES)
def test_quantized_weights_are_read_where_mlx_keeps_them(arch, tmp_path):
    """No copy of a quantized weight, float or not: every product of the step, and the head
    (Llama's lm_head, Qwen3's tied embedding), points into the arrays of MLX's quantized
    layers; the step makes no half copies."""
    model = load_quantized_model(
        arch, tmp_path / "m", 4, 64, "float16",
        backend=Backend.cpu().replace(native_step_max_tokens=MAX_TOKENS),
    )  # fmt: skip
    step = model._native
    assert step is not None and step.half_copies == [] and step.half_format is None

    def addresses(layer: Any) -> tuple[int, int, int]:
        return tuple(  # type: ignore[return-value]
            np.asarray(
                layer[name].view(mx.uint16) if layer[name].dtype == mx.bfloat16 else layer[name]
            ).ctypes.data
            for name in ("weight", "scales", "biases")
        )

    for struct, layer in zip(step._structs, model.module.model.layers, strict=True):
        for name in abi.PRODUCTS:
            owner = layer.mlp if name in ("gate", "up", "down") else layer.self_attn
            weight = getattr(struct, name)
            assert weight.format == abi.AFFINE and (weight.bits, weight.group) == (4, 64)
            assert weight.scale_format == abi.SCALE_FORMATS["float16"]
            got = (weight.data, weight.scales, weight.biases)
            assert got == addresses(getattr(owner, f"{name}_proj"))
    assert step._embed_rows is not None  # its rows float32 values, dequantized by the step
    head = step._head
    owner = model.module.model.embed_tokens if arch == "Qwen3ForCausalLM" else model.module.lm_head
    assert (head.data, head.scales, head.biases) == addresses(owner)


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("scales", ["float32", "float16", "bfloat16"])
def test_quantized_embedding_rows_are_mlx_dequantized_values(bits, scales):
    """A quantized embedding's rows, dequantized in numpy for the step (`_Matrix.values`):
    exactly mx.dequantize's float32 values (from float32 scales and biases), any row, a row
    twice."""
    from runner.backend.native_step import _Matrix

    rng = np.random.default_rng(bits)
    w = Affine(rng.normal(size=(40, 256)).astype(np.float32), bits, 64, scales)
    codes, s, b = w.arrays
    matrix = _Matrix(
        40, 256, codes=codes, scales=s, biases=b, bits=bits, group=64,
        scale_format=abi.SCALE_FORMATS[scales],
    )  # fmt: skip
    ids = np.array([0, 39, 7, 7, 20])
    np.testing.assert_array_equal(matrix.values(ids), w.values[ids])


def test_mxfp4_embedding_rows_are_mlx_dequantized_values():
    """An mxfp4 embedding's rows (mlx-lm's `--q-mode mxfp4` quantizes it) in numpy: exactly
    mx.dequantize's values, scales from subnormal powers of two to large ones."""
    from runner.backend.native_step import _Matrix

    rng = np.random.default_rng(4)
    shift = rng.integers(-126, 120, size=40)
    w = Mxfp4(rng.normal(size=(40, 256)).astype(np.float32), shift)
    codes, scales = w.arrays
    matrix = _Matrix(40, 256, codes=codes, scales=scales, bits=4, group=32, scale_format=abi.E8M0)
    ids = np.array([0, 39, 7, 7, 20])
    np.testing.assert_array_equal(matrix.values(ids), w.values[ids])


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen3ForCausalLM"])
def test_mxfp4_conversions_take_the_step(arch, tmp_path):
    """mlx-lm's mxfp4 conversions (`mlx_lm.convert --q-mode mxfp4`: every linear layer and
    the embedding MLX's mxfp4 mode) are read in place by the step, head included (Llama's
    lm_head, Qwen3's tied embedding), where it declined them and MLX's graph ran each layer:
    chunks, decode steps and rows batched over a prefix equal MLX's path."""

    on = Backend.cpu().replace(native_step_max_tokens=MAX_TOKENS)
    native = load_quantized_model(arch, tmp_path / "a", 4, 32, "float32", backend=on, mode="mxfp4")
    plain = load_quantized_model(
        arch, tmp_path / "b", 4, 32, "float32", backend=on.replace(native_step_max_tokens=None),
        mode="mxfp4",
    )  # fmt: skip
    step = native._native
    assert step is not None and step.quantized == 7 * step.layers
    assert step._head is not None and step._head.scale_format == abi.E8M0
    native._native = Counting(step)
    prompt = np.random.default_rng(7).integers(3, 300, size=40).tolist()
    cuts = [0, 5, 25, 29, 30, 31, 32]
    a, b = chunks_equal(native, plain, prompt, cuts)
    assert native._native.taken == len(cuts) - 2  # all but the 20-token chunk
    suffixes = [prompt[32:35], prompt[35:36], prompt[36:40]]
    assert_rows_over_caches_equal((native, a), (plain, b), suffixes)


@pytest.mark.parametrize(
    ("arch", "dtype", "bits", "group", "recipe"),
    [
        ("LlamaForCausalLM", "bfloat16", 3, 64, None),
        ("Qwen3ForCausalLM", "float16", 6, 32, None),
        ("LlamaForCausalLM", "float32", 2, 128, None),
        ("Qwen3ForCausalLM", "bfloat16", 3, 64, "mixed_3_6"),
        ("LlamaForCausalLM", "float16", 2, 32, "mixed_2_6"),
    ],
)
def test_low_and_mixed_bit_conversions_take_the_step(arch, dtype, bits, group, recipe, tmp_path):
    """mlx-lm's 2-, 3- and 6-bit conversions (mlx-community's `-3bit`, `-6bit`) and its mixed
    recipes (`--quant-predicate mixed_3_6`: 3-bit layers, 6-bit heads and some layers' v and
    down projections) are read in place by the step, head included, where it declined them
    and MLX's CPU quantized_matmul ran every layer (a Qwen3-0.6B shape's 32-token forward
    ~45x the time: bench/RESULTS.md, "2-, 3- and 6-bit affine codes; affine codes on AMX's
    tiles"): every product points at its layer's codes, with its layer's bits; chunks,
    decode steps and rows batched over a prefix equal MLX's path."""
    on = Backend.cpu().replace(native_step_max_tokens=MAX_TOKENS)
    models = [
        load_quantized_model(
            arch, tmp_path / name, bits, group, dtype, backend=backend, recipe=recipe
        )
        for name, backend in (("a", on), ("b", on.replace(native_step_max_tokens=None)))
    ]
    native, plain = models
    step = native._native
    assert step is not None and step.quantized == 7 * step.layers and step._head is not None
    read = set()
    for struct, layer in zip(step._structs, native.module.model.layers, strict=True):
        for name in abi.PRODUCTS:
            block = layer.mlp if name in ("gate", "up", "down") else layer.self_attn
            owner, weight = getattr(block, f"{name}_proj"), getattr(struct, name)
            assert weight.format == abi.AFFINE
            assert weight.data == np.asarray(owner.weight).ctypes.data
            assert (weight.bits, weight.group) == (owner.bits, group)
            read.add(weight.bits)
    head = step._head
    read.add(head.bits)
    assert read == ({bits, 6} if recipe else {bits})
    native._native = Counting(step)
    prompt = np.random.default_rng(8).integers(3, 300, size=40).tolist()
    cuts = [0, 5, 25, 29, 30, 31, 32]
    a, b = chunks_equal(native, plain, prompt, cuts)
    assert native._native.taken == len(cuts) - 2  # all but the 20-token chunk
    with native.decode_steps(), plain.decode_steps():
        a_, b_ = forward(native, a, prompt[32:33]), forward(plain, b, prompt[32:33])
    np.testing.assert_allclose(a_, b_, atol=1e-4, rtol=1e-4)
    suffixes = [prompt[33:36], prompt[36:37], prompt[37:40]]
    assert_rows_over_caches_equal((native, a), (plain, b), suffixes)


@pytest.mark.parametrize("ggml_type", ["Q6_K", "Q4_K", "Q5_K", "Q3_K", "Q2_K", "IQ4_XS", "IQ4_NL"])
def test_ggml_embedding_rows_are_llama_cpp_values(ggml_type):
    """GGML blocks' rows dequantized in numpy for the step: exactly the values of MLX's path
    (runner/models/quantized.py's dequantization of the blocks, llama.cpp's bit for bit)."""
    from runner.backend.native_step import GGML_FORMATS, _Matrix
    from runner.models.quantized import DEQUANTIZE
    from tests.gguf_models import QUANTIZERS, T

    quantize = QUANTIZERS[getattr(T, ggml_type)]
    rng = np.random.default_rng(3)
    blocks = np.ascontiguousarray(quantize(rng.normal(size=(24, 512)).astype(np.float32)))
    matrix = _Matrix(24, 512, codes=blocks, block_format=GGML_FORMATS[ggml_type][0])
    ids = np.array([23, 0, 5, 5])
    want = np.array(DEQUANTIZE[ggml_type](mx.array(blocks[ids])))
    np.testing.assert_array_equal(matrix.values(ids), want)


def test_quantizations_it_cannot_read_stay_on_mlx(tmp_path):
    """nvfp4 and mxfp8 layers leave the whole model on MLX's path (mxfp4 ones the step reads:
    test_mxfp4_conversions_take_the_step; affine ones of any width:
    test_low_and_mixed_bit_conversions_take_the_step); a head of such codes over layers it
    reads leaves only the head on MLX's, which then computes the same logits."""
    from mlx_lm.utils import quantize_model

    backend = Backend.cpu().replace(native_step_max_tokens=MAX_TOKENS)
    for i, (bits, group, mode) in enumerate([(4, 16, "nvfp4"), (8, 32, "mxfp8")]):
        model = load_tiny_model(
            "LlamaForCausalLM",
            tmp_path / f"f{i}",
            backend=backend,
            config=tiny_config("LlamaForCausalLM") | QUANTIZED_DIMS,
        )
        quantize_model(model.module, {}, group, bits, mode=mode)
        assert native_step_of(model) is None, (bits, mode)

    def head_in_mxfp8(path: str, module: Any) -> bool | dict:
        return {"group_size": 32, "bits": 8, "mode": "mxfp8"} if path == "lm_head" else True

    def quantized(backend: Backend) -> Any:
        model = load_tiny_model(
            "LlamaForCausalLM",
            tmp_path / "h",
            backend=backend,
            config=tiny_config("LlamaForCausalLM") | QUANTIZED_DIMS,
        )
        quantize_model(model.module, {}, 64, 4, quant_predicate=head_in_mxfp8)
        model._native = native_step_of(model)
        return model

    native, plain = quantized(backend), quantized(backend.replace(native_step_max_tokens=None))
    assert native._native is not None and native._native._head is None
    assert native._native.quantized == 7 * native._native.layers
    got = forward(native, native.make_caches(), [5, 6, 7])
    want = forward(plain, plain.make_caches(), [5, 6, 7])
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)


def native_step_of(model: Any) -> Any:
    """The native step `model`'s module gets now (after its layers were changed)."""
    from runner.backend import native_step

    return native_step.build(model.module, model.KERNELS, MAX_TOKENS)


def test_trie_restores_write_into_the_steps_own_buffers(pair):
    """A prefix paged in from the trie (the live state holds another prompt) is copied into
    the buffers the native step already owns for each live cache (`restore_kv`), not
    installed as new arrays: the caches keep their buffers, and what the forwards after it
    compute equals MLX's path over the same requests. Without owned buffers (a model with no
    native step, or a fresh cache) the install runs as before."""

    native, plain = pair
    rng = np.random.default_rng(7)
    shared = rng.integers(3, 300, size=20).tolist()
    a, b = [*shared, 5, 6, 7], [*shared, 8, 9]
    results = []
    restored = []
    real = native.restore_kv
    native.restore_kv = lambda *args: restored.append(real(*args)) or restored[-1]
    for model in (native, plain):
        cache = prefix_cache(model, name="t")
        rows = []
        for prompt in (a, b, [*a, 10], [*b, 11, 12]):  # each after the other: restores
            with cache.begin(prompt) as session:
                if prompt == [*a, 10]:  # the live caches hold b: [0, 23) comes from the trie
                    assert session.offset == len(a)
                rows.append(np.array(session.last_hidden(lambda: None)))
            if model is native and prompt == b:  # a short forward: the step's own buffers
                buffers = [c.keys for c in cache.live.caches]
        results.append(rows)
        if model is native:  # the step's buffers survived every restore
            assert all(c.keys is k for c, k in zip(cache.live.caches, buffers, strict=True))
    # every layer's cache restored in place, twice (a + [10], then b + [11, 12])
    assert restored.count(True) == 2 * len(buffers)
    for got, want in zip(*results, strict=True):  # assert_caches_equal's grade
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=2e-5)

    # a cache the step holds no buffers for is left to the install
    caches = native.make_caches()
    assert not real(caches[0], [], 3)


def test_a_restore_copies_only_what_the_live_state_lacks(pair):
    """The live state holds b = shared + [8, 9]; a + [10] restores [0, 23) from the trie
    (a = shared + [5, 6, 7]), of which the live caches already hold [0, 20): only [20, 23)
    is copied. The trie's copy of the shared positions is spoiled (NaN) before the switch,
    so reading it would spoil the answer; what is computed still equals MLX's path with an
    intact trie."""
    from runner.cache.kinds import Snap

    native, plain = pair
    rng = np.random.default_rng(9)
    shared = rng.integers(3, 300, size=20).tolist()
    a, b, c = [*shared, 5, 6, 7], [*shared, 8, 9], [*shared, 5, 6, 7, 10]
    rows = []
    for model in (native, plain):
        cache = prefix_cache(model, name="t")
        for prompt in (a, b):
            with cache.begin(prompt) as session:
                session.last_hidden(lambda: None)
        if model is native:
            node = cache.root.children[shared[0]]  # the shared prefix, split off by b
            assert (node.start, node.end) == (0, len(shared))
            for slot, snap in enumerate(node.snapshots):
                if snap is not None and len(snap.arrays) == 2:
                    spoiled = tuple(mx.full(x.shape, float("nan"), x.dtype) for x in snap.arrays)
                    node.snapshots[slot] = Snap(snap.start, snap.end, spoiled)
        with cache.begin(c) as session:
            assert session.offset == len(a)
            rows.append(np.array(session.last_hidden(lambda: None)))
    assert np.isfinite(rows[0]).all()
    np.testing.assert_allclose(rows[0], rows[1], rtol=1e-4, atol=1e-5)


def test_a_restore_that_fails_halfway_leaves_nothing_half_switched(pair):
    """A restore from the trie that fails after some layers were switched (here the second
    layer's copy raises) resets the live state: the request fails, and the next ones compute
    what a fresh cache computes."""

    native, _ = pair
    rng = np.random.default_rng(8)
    shared = rng.integers(3, 300, size=20).tolist()
    a, b = [*shared, 5, 6, 7], [*shared, 8, 9]
    cache = prefix_cache(native, name="t")
    for prompt in (a, b):
        with cache.begin(prompt) as session:
            session.last_hidden(lambda: None)
    real, calls = native.restore_kv, []

    def failing(*args: Any) -> bool:
        calls.append(args)
        if len(calls) == 2:
            raise MemoryError("no room")
        return real(*args)

    native.restore_kv = failing
    with pytest.raises(MemoryError):
        cache.begin([*a, 10])  # [0, 23) from the trie: the live state holds b
    native.restore_kv = real
    assert cache.live.tokens == []
    for prompt in ([*a, 10], [*b, 11]):
        with cache.begin(prompt) as session:
            got = np.array(session.last_hidden(lambda: None))
        with prefix_cache(native, name="fresh").begin(prompt) as session:
            want = np.array(session.last_hidden(lambda: None))
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)  # chunked otherwise
