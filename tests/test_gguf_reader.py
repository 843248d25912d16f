"""runner/sources/gguf/reader.py: GGUF files written by the gguf package's GGUFWriter (and by
hand, tests/gguf_files.py) read back equal to gguf.GGUFReader's view; every corruption a
ModelLoadError that names it, found by truncating and flipping bytes too; a Llama 3 sized
vocabulary parsed in well under a second."""

from __future__ import annotations

import contextlib
import struct
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from runner.sources.gguf import quants
from runner.sources.gguf.quants import Repacked
from runner.sources.gguf.reader import GGUFFile, ValueType, read_gguf
from runner.sources.source import ModelLoadError
from tests import gguf_files as G
from tests.gguf_files import (
    SIGNED_ZERO_DIFFERS,
    assert_bits_equal,
    make_blocks,
    mlx_values,
    reference,
)

gguf = pytest.importorskip("gguf")
QT = gguf.GGMLQuantizationType


def write_with_gguf(path: Path, build: Any, alignment: int | None = None) -> Path:
    writer = gguf.GGUFWriter(path, "llama")
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    build(writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


NESTED = [[1, 2], [3, 4, 5]]
NESTED_STRINGS = [["a", "bc"], ["", "ü", "漢字"]]


def every_metadata_type(w: Any) -> None:
    w.add_uint8("v.u8", 255)
    w.add_int8("v.i8", -128)
    w.add_uint16("v.u16", 65535)
    w.add_int16("v.i16", -32768)
    w.add_uint32("v.u32", 4294967295)
    w.add_int32("v.i32", -2147483648)
    w.add_float32("v.f32", 0.1)
    w.add_uint64("v.u64", 2**64 - 1)
    w.add_int64("v.i64", -(2**63))
    w.add_float64("v.f64", -1e300)
    w.add_bool("v.true", True)
    w.add_bool("v.false", False)
    w.add_string("v.str", "héllo\n\x00 wörld ✓")
    for name, vtype, items in [
        ("u8", gguf.GGUFValueType.UINT8, [0, 7, 255]),
        ("i8", gguf.GGUFValueType.INT8, [-128, 0, 127]),
        ("u16", gguf.GGUFValueType.UINT16, [0, 65535]),
        ("i16", gguf.GGUFValueType.INT16, [-32768, 32767]),
        ("u32", gguf.GGUFValueType.UINT32, [0, 4294967295]),
        ("i32", gguf.GGUFValueType.INT32, [-1, 2**31 - 1]),
        ("f32", gguf.GGUFValueType.FLOAT32, [0.5, -1e30, 3.25]),
        ("u64", gguf.GGUFValueType.UINT64, [2**64 - 1, 0]),
        ("i64", gguf.GGUFValueType.INT64, [-(2**63), 5]),
        ("f64", gguf.GGUFValueType.FLOAT64, [0.1, 1e-300]),
        ("bool", gguf.GGUFValueType.BOOL, [True, False, True]),
        ("str", gguf.GGUFValueType.STRING, ["a", "", "ü", "ĠThe", "漢字"]),
    ]:
        w.add_key_value(f"a.{name}", items, gguf.GGUFValueType.ARRAY, sub_type=vtype)
    w.add_array("a.nested", NESTED)
    w.add_array("a.nested_str", NESTED_STRINGS)


def test_every_metadata_type_reads_as_gguf_reader_does(tmp_path):
    path = write_with_gguf(tmp_path / "m.gguf", every_metadata_type)
    ours = read_gguf(path)
    theirs = gguf.GGUFReader(path)
    fields = {k: f for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert list(ours.metadata) == list(fields)
    assert ours.version == 3
    for key, field in fields.items():
        value = ours.metadata[key]
        assert ours.value_types[key][0] == field.types[0], key
        if key in ("a.nested", "a.nested_str"):
            continue  # gguf.GGUFReader flattens arrays of arrays
        assert ours.value_types[key] == tuple(field.types), key
        assert value == field.contents(), key
        assert type(value) is type(field.contents()), key
    assert ours.metadata["v.f32"] == np.float32(0.1)
    assert ours.metadata["v.true"] is True and ours.metadata["v.false"] is False
    assert ours.metadata["a.bool"] == [True, False, True]
    assert ours.metadata["a.f32"] == [0.5, float(np.float32(-1e30)), 3.25]
    assert ours.metadata["a.u64"] == [2**64 - 1, 0]
    assert ours.metadata["a.nested"] == NESTED
    assert ours.metadata["a.nested_str"] == NESTED_STRINGS
    assert ours.value_types["a.nested"] == (ValueType.ARRAY, ValueType.ARRAY, ValueType.INT32)
    assert ours.value_types["a.nested_str"] == (
        ValueType.ARRAY,
        ValueType.ARRAY,
        ValueType.STRING,
    )
    assert ours.tensors == {}


def tensor_cases(rng: np.random.Generator) -> list[tuple[str, int, tuple[int, ...], np.ndarray]]:
    """(name, type, numpy shape, raw bytes [*shape[:-1], row bytes]) for every type."""
    cases = []
    for t, info in quants.TYPES.items():
        if t in quants.NOT_STORED:
            continue
        row = info.block_size * 2
        for shape in [(row,), (3, row), (2, 3, row)]:
            raw = rng.integers(0, 256, size=quants.tensor_nbytes(t, shape), dtype=np.uint8)
            row_bytes = row // info.block_size * info.type_size
            name = f"{info.name.lower()}.{len(shape)}d"
            cases.append((name, t, shape, raw.reshape(*shape[:-1], row_bytes)))
    return cases


@pytest.mark.parametrize("alignment", [None, 64])
def test_tensors_read_as_gguf_reader_does(tmp_path, alignment):
    cases = tensor_cases(np.random.default_rng(0))

    # GGUFWriter wants typed arrays for the plain types and byte arrays for the others
    def build_tensors(w: Any) -> None:
        w.add_uint32("some.key", 7)
        for name, t, shape, raw in cases:
            if t in (0, 1, 24, 25, 26, 27, 28):
                w.add_tensor(name, quants.plain(raw, t, shape))
            else:
                w.add_tensor(name, raw, raw_shape=None, raw_dtype=QT(t))

    path = write_with_gguf(tmp_path / "t.gguf", build_tensors, alignment)
    ours = read_gguf(path)
    theirs = gguf.GGUFReader(path)
    assert ours.alignment == (alignment or 32)
    assert ours.data_offset == theirs.data_offset
    assert list(ours.tensors) == [t.name for t in theirs.tensors]
    for (name, t, shape, raw), tensor in zip(cases, theirs.tensors, strict=True):
        info = ours.tensors[name]
        assert info.ggml_type == t == int(tensor.tensor_type)
        assert info.dims == tuple(int(d) for d in tensor.shape)
        assert info.shape == shape
        assert info.nbytes == tensor.n_bytes == raw.nbytes
        assert ours.data_offset + info.offset == tensor.data_offset
        data = ours.raw(name)
        assert isinstance(data, np.memmap) and not data.flags.writeable
        assert data.dtype == np.uint8 and data.shape == raw.shape
        assert data.tobytes() == raw.tobytes() == tensor.data.tobytes()


def test_bf16_tensor_written_by_gguf(tmp_path):
    values = np.array([[1.0, -2.5e30, 3.1e-30, np.inf], [0.0, -0.0, 65504.0, 1e5]], np.float32)
    bits = gguf.quants.quantize(values, QT.BF16)
    path = write_with_gguf(
        tmp_path / "b.gguf", lambda w: w.add_tensor("w", bits, raw_dtype=QT.BF16)
    )
    f = read_gguf(path)
    assert f.tensors["w"].type_name == "BF16" and f.tensors["w"].shape == (2, 4)
    got = quants.dequantize(f.raw("w"), 30, (2, 4))
    expected = gguf.quants.dequantize(bits, QT.BF16)
    assert got.tobytes() == expected.tobytes()


def test_hand_written_file_version_2_empty_arrays_and_raw_bytes(tmp_path):
    data = G.gguf_bytes(
        [
            ("empty.u32", G.ARRAY, G.value(G.ARRAY, [], G.UINT32)),
            ("empty.str", G.ARRAY, G.value(G.ARRAY, [], G.STRING)),
            ("empty.nested", G.ARRAY, G.value(G.ARRAY, [], G.ARRAY)),
            ("bad.utf8", G.STRING, G.string(b"\xff\xfeok")),
            ("bool.two", G.BOOL, b"\x02"),
            ("general.alignment", G.UINT32, G.value(G.UINT32, 16)),
        ],
        [("t", [16, 2], 0, np.arange(32, dtype="<f4").tobytes())],
        version=2,
        alignment=16,
    )
    f = read_gguf(G.write(tmp_path / "v2.gguf", data))
    assert f.version == 2 and f.alignment == 16
    assert f.metadata["empty.u32"] == [] and f.value_types["empty.u32"][1] == ValueType.UINT32
    assert f.metadata["empty.str"] == [] and f.metadata["empty.nested"] == []
    assert f.metadata["bad.utf8"].encode("utf-8", "surrogateescape") == b"\xff\xfeok"
    assert f.metadata["bool.two"] is True
    values = quants.plain(f.raw("t"), 0, f.tensors["t"].shape)
    assert values.tolist() == np.arange(32, dtype=np.float32).reshape(2, 16).tolist()


def big_vocabulary() -> tuple[list[str], list[str]]:
    rng = np.random.default_rng(0)
    alphabet = np.array(list("abcdefghijklmnopqrstuvwxyzĠé漢"))
    picks = rng.choice(alphabet, size=(150_000, 9))
    vocab = ["".join(picks[i, : 1 + i % 9]) + str(i) for i in range(150_000)]
    merges = [f"{vocab[i % 150_000]} {vocab[(i * 7) % 150_000]}" for i in range(280_000)]
    return vocab, merges


def test_a_llama3_sized_vocabulary_parses_in_well_under_a_second(tmp_path):
    vocab, merges = big_vocabulary()
    data = G.gguf_bytes(
        [
            ("tokenizer.ggml.tokens", G.ARRAY, G.strings_array(vocab)),
            ("tokenizer.ggml.merges", G.ARRAY, G.strings_array(merges)),
            (
                "tokenizer.ggml.scores",
                G.ARRAY,
                struct.pack("<IQ", G.FLOAT32, 150_000) + np.arange(150_000, dtype="<f4").tobytes(),
            ),
            (
                "tokenizer.ggml.token_type",
                G.ARRAY,
                struct.pack("<IQ", G.INT32, 150_000) + np.ones(150_000, "<i4").tobytes(),
            ),
        ]
    )
    path = G.write(tmp_path / "vocab.gguf", data)
    best = min(_timed(read_gguf, path)[1] for _ in range(3))
    f = read_gguf(path)
    assert f.metadata["tokenizer.ggml.tokens"] == vocab
    assert f.metadata["tokenizer.ggml.merges"] == merges
    assert f.metadata["tokenizer.ggml.scores"][-1] == 149_999.0
    print(f"150k tokens + 280k merges parsed in {best * 1e3:.0f} ms")
    assert best < 1.0  # ~0.16 s on a 2-core VM; gguf.GGUFReader takes ~13 s


def _timed(fn: Any, *args: Any) -> tuple[Any, float]:
    start = time.perf_counter()
    result = fn(*args)
    return result, time.perf_counter() - start


# --- corrupt files ---------------------------------------------------------------------------


def small_file() -> bytes:
    rng = np.random.default_rng(3)
    return G.gguf_bytes(
        [
            ("general.architecture", G.STRING, G.value(G.STRING, "llama")),
            ("n", G.UINT32, G.value(G.UINT32, 12)),
            ("toks", G.ARRAY, G.strings_array(["a", "bb", "ccc", "Ġx"])),
            ("scores", G.ARRAY, G.value(G.ARRAY, [0.5, 1.5], G.FLOAT32)),
            ("nested", G.ARRAY, G.value(G.ARRAY, [[1, 2], [3]], (G.ARRAY, G.INT64))),
        ],
        [
            ("norm", [32], 0, np.ones(32, "<f4").tobytes()),
            ("w4", [64, 2], 2, make_blocks(rng, 2, 4).tobytes()),
            ("wk", [256, 1], 12, make_blocks(rng, 12, 1).tobytes()),
        ],
    )


def expect_error(data: bytes, tmp_path: Path, *fragments: str) -> str:
    path = G.write(tmp_path / "bad.gguf", data)
    with pytest.raises(ModelLoadError) as caught:
        read_gguf(path)
    message = str(caught.value)
    assert str(path) in message
    for fragment in fragments:
        assert fragment in message, message
    return message


def test_the_small_file_is_valid(tmp_path):
    f = read_gguf(G.write(tmp_path / "ok.gguf", small_file()))
    assert list(f.tensors) == ["norm", "w4", "wk"]
    assert f.metadata["nested"] == [[1, 2], [3]]


def kv(key: str, vtype: int, data: bytes) -> list[tuple[str, int, bytes]]:
    return [(key, vtype, data)]


CORRUPT: list[tuple[bytes, list[str]]] = [
    (b"GGML" + bytes(40), ["not a GGUF file", "b'GGML'"]),
    (b"GG", ["not a GGUF file"]),
    (b"", ["not a GGUF file"]),
    (G.gguf_bytes([], version=1), ["unsupported GGUF version 1"]),
    (G.gguf_bytes([], version=7), ["unsupported GGUF version 7"]),
    (
        b"GGUF" + struct.pack(">IQQ", 3, 0, 0),
        ["big-endian GGUF files are not supported"],
    ),
    (G.gguf_bytes(kv("k", 13, b"")), ["metadata key 'k' has unknown value type 13"]),
    (
        G.gguf_bytes(kv("k", G.ARRAY, struct.pack("<IQ", 99, 0))),
        ["array of unknown value type 99"],
    ),
    (
        G.gguf_bytes(kv("k", G.ARRAY, struct.pack("<IQ", G.UINT64, 2**60))),
        ["claims 1152921504606846976 items of type UINT64"],
    ),
    (
        G.gguf_bytes(kv("k", G.ARRAY, struct.pack("<IQ", G.STRING, 2**62))),
        ["claims", "items of type STRING"],
    ),
    (
        G.gguf_bytes(kv("k", G.STRING, struct.pack("<Q", 2**63))),
        ["truncated", "metadata key 'k' needs 9223372036854775808 bytes"],
    ),
    (
        b"GGUF" + struct.pack("<IQQ", 3, 0, 2**40),
        ["claims 1099511627776 metadata keys"],
    ),
    (
        b"GGUF" + struct.pack("<IQQ", 3, 2**50, 0),
        ["1125899906842624 tensors"],
    ),
    (
        b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + G.string("k") + struct.pack("<IB", 4, 1),
        ["truncated GGUF file: metadata key 'k' needs 4 bytes at offset 37"],
    ),
    (
        G.gguf_bytes(kv("k", G.UINT8, b"\x01") + kv("k", G.UINT8, b"\x02")),
        ["duplicate metadata key 'k'"],
    ),
    (
        b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + G.string(b"\xff\xff") + bytes(8),
        ["metadata key 0 is not UTF-8: b'\\xff\\xff'"],
    ),
    (
        G.gguf_bytes(kv("general.alignment", G.UINT64, struct.pack("<Q", 32))),
        ["general.alignment must be a UINT32, not UINT64"],
    ),
    (
        G.gguf_bytes(kv("general.alignment", G.UINT32, struct.pack("<I", 24))),
        ["general.alignment 24 is not a power of two"],
    ),
    (
        G.gguf_bytes(kv("general.alignment", G.UINT32, struct.pack("<I", 0))),
        ["general.alignment 0 is not a power of two"],
    ),
    (
        G.gguf_bytes(kv("deep", G.ARRAY, struct.pack("<IQ", G.ARRAY, 1) * 40)),
        ["arrays nested deeper than 32"],
    ),
    (
        G.gguf_bytes([], [("t", [32], 42, bytes(32))]),
        ["tensor 't' has unknown GGML type 42"],
    ),
    (
        G.gguf_bytes([], [("t", [1, 1, 1, 1, 1], 0, bytes(4))]),
        ["tensor 't' has 5 dimensions, more than ggml's 4"],
    ),
    (
        G.gguf_bytes([], [("t", [48], 2, bytes(27))]),
        ["tensor 't' (Q4_0, dims [48]): its rows of 48 are not whole blocks of 32"],
    ),
    (
        G.gguf_bytes([], [("t", [2**40, 2**40], 0, bytes(4))]),
        ["truncated", "tensor 't' (F32, dims [1099511627776, 1099511627776]) needs"],
    ),
    (
        G.gguf_bytes([], [("t", [8], 0, bytes(32)), ("t", [8], 0, bytes(32))]),
        ["duplicate tensor name 't'"],
    ),
    (
        G.gguf_bytes([], [("a", [64], 0, bytes(256)), ("b", [8], 0, bytes(32))], offsets=[0, 32]),
        [
            "tensor 'a' (F32, dims [64]) needs 256 bytes from offset 0, but tensor 'b' "
            "starts at 32: the space for it does not match its type and shape"
        ],
    ),
    (
        G.gguf_bytes([], [("a", [8], 0, bytes(32))], offsets=[8]),
        ["tensor 'a': data offset 8 is not a multiple of the alignment 32"],
    ),
]


@pytest.mark.parametrize(
    ("data", "fragments"), [pytest.param(d, f, id=f[0][:48]) for d, f in CORRUPT]
)
def test_corrupt_files_name_what_is_wrong(tmp_path, data, fragments):
    expect_error(data, tmp_path, *fragments)


def test_a_tensor_larger_than_its_data_is_truncation(tmp_path):
    # dims say 64 floats (256 bytes), the file holds 32 (128 bytes): the last tensor
    data = G.gguf_bytes([], [("t", [64], 0, bytes(128))])
    expect_error(
        data,
        tmp_path,
        "truncated GGUF file: tensor 't' (F32, dims [64]) needs 256 bytes at offset 0 of the "
        "data section, which holds 128",
    )


def test_unreadable_paths(tmp_path):
    with pytest.raises(ModelLoadError, match="cannot read"):
        read_gguf(tmp_path / "missing.gguf")
    with pytest.raises(ModelLoadError, match="cannot read"):
        read_gguf(tmp_path)


def _read_or_refuse(path: Path) -> GGUFFile | None:
    """A parse that must end in a GGUFFile or a ModelLoadError; a parsed file's tensors must
    then convert (or be refused) cleanly too."""
    try:
        f = read_gguf(path)
    except ModelLoadError:
        return None
    for name, info in f.tensors.items():
        with contextlib.suppress(ModelLoadError):
            quants.convert(f.raw(name), info.ggml_type, info.shape)
    return f


def test_fuzz_truncated_at_every_byte(tmp_path):
    data = small_file()
    whole = read_gguf(G.write(tmp_path / "whole.gguf", data))
    last = max(whole.data_offset + t.offset + t.nbytes for t in whole.tensors.values())
    path = tmp_path / "cut.gguf"
    for n in range(len(data)):
        path.write_bytes(data[:n])
        f = _read_or_refuse(path)
        # only the padding after the last tensor's bytes may go
        assert (f is not None) == (n >= last), n


def test_fuzz_flipped_header_bytes(tmp_path):
    data = small_file()
    header_end = read_gguf(G.write(tmp_path / "whole.gguf", data)).data_offset
    path = tmp_path / "flip.gguf"
    tracemalloc.start()
    try:
        refused = 0
        for at in range(header_end):
            for new in {0x00, 0xFF, 0x7F, data[at] ^ 0x80, (data[at] + 1) & 0xFF} - {data[at]}:
                path.write_bytes(data[:at] + bytes([new]) + data[at + 1 :])
                tracemalloc.reset_peak()
                refused += _read_or_refuse(path) is None
                peak = tracemalloc.get_traced_memory()[1]
                assert peak < 4 << 20, (at, new, peak)  # never an allocation sized by a bad count
    finally:
        tracemalloc.stop()
    assert refused > header_end  # most flips are refused, with a message


def test_raw_is_a_read_only_map_of_the_file(tmp_path):
    path = G.write(tmp_path / "ok.gguf", small_file())
    with read_gguf(path) as f:
        data = f.raw("w4")
        assert data.shape == (2, 36)
        with pytest.raises(ValueError, match="read-only"):
            data[0, 0] = 1
        assert data.filename is not None and Path(data.filename) == path.resolve()
    assert data.sum() >= 0  # still mapped after close


def test_convert_every_type_from_a_gguf_written_file(tmp_path):
    rng = np.random.default_rng(12)
    cases: list[tuple[str, int, np.ndarray]] = []
    for t, info in quants.TYPES.items():
        if t in quants.NOT_STORED or quants.kind(t) == "plain":
            continue
        cols = max(256, info.block_size * 2)
        blocks = make_blocks(rng, t, 6 * cols // info.block_size)
        cases.append((info.name, t, blocks.reshape(6, -1)))
    path = tmp_path / "all.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    for name, t, raw in cases:
        writer.add_tensor(name, raw, raw_dtype=QT(t))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    f = read_gguf(path)
    theirs = {t.name: t for t in gguf.GGUFReader(path).tensors}
    for name, t, raw in cases:
        info = f.tensors[name]
        out = quants.convert(f.raw(name), info.ggml_type, info.shape)
        values = mlx_values(out) if isinstance(out, Repacked) else out
        assert isinstance(out, Repacked) == (quants.kind(t) == "repack"), name
        with np.errstate(all="ignore"):
            expected = gguf.quants.dequantize(theirs[name].data, QT(t)) if t != 41 else None
        if expected is None:
            expected = reference(raw.reshape(-1, quants.TYPES[t].type_size), t, 6)
        assert_bits_equal(values, expected, zero_sign=t not in SIGNED_ZERO_DIFFERS)


def test_reading_gguf_imports_no_mlx():
    """runner/sources stays importable before MLX (runner/sources/source.py)."""
    code = (
        "import sys, runner.sources.gguf.reader, runner.sources.gguf.quants;"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'mlx'))"
    )
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True
    )
    assert done.stdout.strip() == "[]"
