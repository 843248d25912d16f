"""A GGUF file (versions 2 and 3, little-endian): its metadata, its tensors' infos, and their
bytes as read-only memory maps. Needs numpy only.

The header is parsed from a memory map of the file with `struct`, every offset and count
checked against the file's size before it is used, so a corrupt or truncated file is a
`ModelLoadError` that says what is wrong and where, never a traceback or an allocation sized
by a bad count. Strings are UTF-8; metadata string values that are not decode with
"surrogateescape" (lossless: `.encode("utf-8", "surrogateescape")` gives the bytes back),
while keys and tensor names must be valid.

Metadata values are plain Python, as gguf.GGUFReader's `contents()` gives them: bool / int /
float / str for scalars (a FLOAT32 widened exactly), lists of them for arrays (numbers read
with one numpy call, then `tolist`), lists of lists for arrays of arrays. `value_types` keeps
each key's GGUF type chain (e.g. `(ARRAY, STRING)`, `(ARRAY, ARRAY, INT32)`).

Tensors: `dims` as GGUF stores them (ne[0], the row length, first), `shape` the numpy order
(reversed); `raw(name)` the tensor's bytes, a read-only np.memmap of shape
[*shape[:-1], bytes per row], which `runner.sources.gguf.quants` turns into arrays.
"""

from __future__ import annotations

import itertools
import math
import mmap
import os
import struct
from dataclasses import dataclass, field
from enum import IntEnum
from pathlib import Path
from typing import Any, cast

import numpy as np

from runner.sources.gguf.quants import TYPES, type_name
from runner.sources.source import ModelLoadError, show

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_ARRAY_DEPTH = 32  # arrays of arrays; GGUF sets no limit, a corrupt file could recurse


class ValueType(IntEnum):
    UINT8 = 0
    INT8 = 1
    UINT16 = 2
    INT16 = 3
    UINT32 = 4
    INT32 = 5
    FLOAT32 = 6
    BOOL = 7
    STRING = 8
    ARRAY = 9
    UINT64 = 10
    INT64 = 11
    FLOAT64 = 12


_SCALARS: dict[int, struct.Struct] = {
    ValueType.UINT8: struct.Struct("<B"),
    ValueType.INT8: struct.Struct("<b"),
    ValueType.UINT16: struct.Struct("<H"),
    ValueType.INT16: struct.Struct("<h"),
    ValueType.UINT32: struct.Struct("<I"),
    ValueType.INT32: struct.Struct("<i"),
    ValueType.FLOAT32: struct.Struct("<f"),
    ValueType.BOOL: struct.Struct("<B"),
    ValueType.UINT64: struct.Struct("<Q"),
    ValueType.INT64: struct.Struct("<q"),
    ValueType.FLOAT64: struct.Struct("<d"),
}
_DTYPES: dict[int, np.dtype[Any]] = {
    ValueType.UINT8: np.dtype("u1"),
    ValueType.INT8: np.dtype("i1"),
    ValueType.UINT16: np.dtype("<u2"),
    ValueType.INT16: np.dtype("<i2"),
    ValueType.UINT32: np.dtype("<u4"),
    ValueType.INT32: np.dtype("<i4"),
    ValueType.FLOAT32: np.dtype("<f4"),
    ValueType.BOOL: np.dtype("u1"),
    ValueType.UINT64: np.dtype("<u8"),
    ValueType.INT64: np.dtype("<i8"),
    ValueType.FLOAT64: np.dtype("<f8"),
}
# The fewest bytes an array item of each type takes (a string: its length; an array: its
# item type and count), to refuse counts the rest of the file cannot hold before reading.
_MIN_ITEM = {**{t: s.size for t, s in _SCALARS.items()}, ValueType.STRING: 8, ValueType.ARRAY: 12}
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


@dataclass(frozen=True)
class TensorInfo:
    name: str
    ggml_type: int
    dims: tuple[int, ...]  # as stored: ne[0] (the row length) first
    offset: int  # from the start of the data section
    nbytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        """numpy's order: the last axis is the row."""
        return self.dims[::-1]

    @property
    def type_name(self) -> str:
        return type_name(self.ggml_type)

    @property
    def n_elements(self) -> int:
        return math.prod(self.dims)


@dataclass
class GGUFFile:
    path: Path
    version: int
    file_size: int
    metadata: dict[str, Any]
    value_types: dict[str, tuple[ValueType, ...]]
    tensors: dict[str, TensorInfo]  # in the file's order
    alignment: int
    data_offset: int  # where the data section starts in the file
    _data: np.memmap | None = field(default=None, repr=False)

    def raw(self, name: str) -> np.memmap:
        """The tensor's bytes, read-only and mapped (nothing is read until used):
        uint8 [*shape[:-1], bytes per row]."""
        info = self.tensors[name]
        if self._data is None:
            self._data = np.memmap(self.path, dtype=np.uint8, mode="r")
        start = self.data_offset + info.offset
        flat = self._data[start : start + info.nbytes]
        shape = info.shape
        block = TYPES[info.ggml_type]
        row_bytes = (shape[-1] if shape else 1) // block.block_size * block.type_size
        return cast(np.memmap, flat.reshape(*shape[:-1], row_bytes))

    def close(self) -> None:
        """Drop this file's mapping (arrays from `raw` keep theirs while they live)."""
        self._data = None

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_gguf(path: str | os.PathLike[str]) -> GGUFFile:
    """Parse a GGUF file's header, metadata and tensor infos, and check that every tensor's
    bytes lie in the file; a ModelLoadError naming the problem otherwise."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 24:
                raise ModelLoadError(
                    f"{path}: not a GGUF file: {size} bytes, less than a GGUF header"
                    if size < 4 or _peek(f) != MAGIC
                    else f"{path}: truncated GGUF file: {size} bytes, less than its header"
                )
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                return _Parser(path, mm, size).parse()
    except OSError as e:
        raise ModelLoadError(f"cannot read {path}: {e.strerror or e}") from None


def _peek(f: Any) -> bytes:
    f.seek(0)
    return bytes(f.read(4))


class _Parser:
    def __init__(self, path: Path, mm: mmap.mmap, size: int):
        self.path = path
        self.mm = mm
        self.size = size
        self.pos = 0

    def fail(self, message: str) -> ModelLoadError:
        return ModelLoadError(f"{self.path}: {message}")

    def need(self, n: int, what: str) -> None:
        if self.pos + n > self.size:
            raise self.fail(
                f"truncated GGUF file: {what} needs {n} bytes at offset {self.pos}, "
                f"but the file ends at {self.size}"
            )

    def u32(self, what: str) -> int:
        self.need(4, what)
        (value,) = _U32.unpack_from(self.mm, self.pos)
        self.pos += 4
        return int(value)

    def u64(self, what: str) -> int:
        self.need(8, what)
        (value,) = _U64.unpack_from(self.mm, self.pos)
        self.pos += 8
        return int(value)

    def string_bytes(self, what: str) -> bytes:
        n = self.u64(f"the length of {what}")
        self.need(n, what)
        start = self.pos
        self.pos += n
        return self.mm[start : self.pos]

    def name(self, what: str) -> str:
        data = self.string_bytes(what)
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} is not UTF-8: {show(data)}") from None

    # --- the file ----------------------------------------------------------------------

    def parse(self) -> GGUFFile:
        magic = self.mm[0:4]
        if magic != MAGIC:
            raise self.fail(f"not a GGUF file (magic {show(magic)}, expected b'GGUF')")
        self.pos = 4
        version = self.u32("the version")
        if version not in VERSIONS:
            swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
            if swapped in VERSIONS:
                raise self.fail("big-endian GGUF files are not supported")
            raise self.fail(f"unsupported GGUF version {version} (versions 2 and 3 are read)")
        n_tensors = self.u64("the tensor count")
        n_kv = self.u64("the metadata count")
        # each key/value takes at least 13 bytes (key length, type, one byte), each tensor
        # info 24 (name length, dimension count, type, offset)
        if n_kv * 13 + n_tensors * 24 > self.size - self.pos:
            raise self.fail(
                f"the header claims {n_kv} metadata keys and {n_tensors} tensors, more than "
                f"the file's {self.size} bytes can hold"
            )
        metadata: dict[str, Any] = {}
        value_types: dict[str, tuple[ValueType, ...]] = {}
        for index in range(n_kv):
            key = self.name(f"metadata key {index}")
            if key in metadata:
                raise self.fail(f"duplicate metadata key {key!r}")
            value_type = self.u32(f"the type of metadata key {key!r}")
            value, types = self.value(value_type, f"metadata key {key!r}", 0)
            metadata[key] = value
            value_types[key] = types
        alignment = self.alignment(metadata, value_types)
        infos = [self.tensor_info(index) for index in range(n_tensors)]
        data_offset = -(-self.pos // alignment) * alignment
        tensors = self.check_tensors(infos, alignment, data_offset)
        return GGUFFile(
            path=self.path,
            version=version,
            file_size=self.size,
            metadata=metadata,
            value_types=value_types,
            tensors=tensors,
            alignment=alignment,
            data_offset=data_offset,
        )

    def alignment(self, metadata: dict[str, Any], types: dict[str, tuple[ValueType, ...]]) -> int:
        if "general.alignment" not in metadata:
            return DEFAULT_ALIGNMENT
        value = metadata["general.alignment"]
        if types["general.alignment"] != (ValueType.UINT32,):
            kind = "/".join(t.name for t in types["general.alignment"])
            raise self.fail(f"general.alignment must be a UINT32, not {kind}")
        if value == 0 or value & (value - 1):
            raise self.fail(f"general.alignment {value} is not a power of two")
        return int(value)

    # --- metadata values ---------------------------------------------------------------

    def value(self, value_type: int, what: str, depth: int) -> tuple[Any, tuple[ValueType, ...]]:
        scalar = _SCALARS.get(value_type)
        if scalar is not None:
            self.need(scalar.size, what)
            (value,) = scalar.unpack_from(self.mm, self.pos)
            self.pos += scalar.size
            if value_type == ValueType.BOOL:
                value = value != 0
            return value, (ValueType(value_type),)
        if value_type == ValueType.STRING:
            data = self.string_bytes(what)
            return data.decode("utf-8", "surrogateescape"), (ValueType.STRING,)
        if value_type == ValueType.ARRAY:
            return self.array(what, depth)
        raise self.fail(f"{what} has unknown value type {value_type}")

    def array(self, what: str, depth: int) -> tuple[Any, tuple[ValueType, ...]]:
        if depth >= MAX_ARRAY_DEPTH:
            raise self.fail(f"{what}: arrays nested deeper than {MAX_ARRAY_DEPTH}")
        item_type = self.u32(f"the item type of {what}")
        count = self.u64(f"the item count of {what}")
        least = _MIN_ITEM.get(item_type)
        if least is None:
            raise self.fail(f"{what} is an array of unknown value type {item_type}")
        if count * least > self.size - self.pos:
            raise self.fail(
                f"{what} claims {count} items of type {ValueType(item_type).name}, more than "
                f"the {self.size - self.pos} bytes left in the file can hold"
            )
        dtype = _DTYPES.get(item_type)
        if dtype is not None:
            values = np.frombuffer(self.mm, dtype, count, self.pos)
            self.pos += count * dtype.itemsize
            if item_type == ValueType.BOOL:
                values = values != 0
            return values.tolist(), (ValueType.ARRAY, ValueType(item_type))
        if item_type == ValueType.STRING:
            return self.strings(count, what), (ValueType.ARRAY, ValueType.STRING)
        items: list[Any] = []
        inner: tuple[ValueType, ...] = (ValueType.ARRAY,)
        for index in range(count):
            item, types = self.array(f"{what} item {index}", depth + 1)
            items.append(item)
            inner = types if index == 0 else inner
        return items, (ValueType.ARRAY, *inner)

    def strings(self, count: int, what: str) -> list[str]:
        """`count` strings, in one tight loop (a vocabulary has 150k, its merges 280k)."""
        mm, size, pos = self.mm, self.size, self.pos
        unpack = _U64.unpack_from
        out: list[str] = []
        append = out.append
        for index in range(count):
            if pos + 8 > size:
                self.pos = pos
                self.need(8, f"the length of {what} item {index}")
            (n,) = unpack(mm, pos)
            pos += 8
            end = pos + n
            if end > size:
                self.pos = pos
                self.need(n, f"{what} item {index}")
            append(mm[pos:end].decode("utf-8", "surrogateescape"))
            pos = end
        self.pos = pos
        return out

    # --- tensors -----------------------------------------------------------------------

    def tensor_info(self, index: int) -> tuple[str, int, tuple[int, ...], int]:
        name = self.name(f"the name of tensor {index}")
        what = f"tensor {name!r}"
        n_dims = self.u32(f"the dimension count of {what}")
        if n_dims > MAX_DIMS:
            raise self.fail(f"{what} has {n_dims} dimensions, more than ggml's {MAX_DIMS}")
        self.need(8 * n_dims, f"the dimensions of {what}")
        dims = struct.unpack_from(f"<{n_dims}Q", self.mm, self.pos)
        self.pos += 8 * n_dims
        ggml_type = self.u32(f"the type of {what}")
        offset = self.u64(f"the data offset of {what}")
        return name, ggml_type, tuple(int(d) for d in dims), offset

    def check_tensors(
        self,
        infos: list[tuple[str, int, tuple[int, ...], int]],
        alignment: int,
        data_offset: int,
    ) -> dict[str, TensorInfo]:
        tensors: dict[str, TensorInfo] = {}
        data_size = self.size - data_offset
        for name, ggml_type, dims, offset in infos:
            what = f"tensor {name!r}"
            if name in tensors:
                raise self.fail(f"duplicate tensor name {name!r}")
            info = TYPES.get(ggml_type)
            if info is None:
                raise self.fail(f"{what} has unknown GGML type {ggml_type}")
            row = dims[0] if dims else 1
            if row % info.block_size:
                raise self.fail(
                    f"{what} ({info.name}, dims {list(dims)}): its rows of {row} are not whole "
                    f"blocks of {info.block_size}"
                )
            nbytes = math.prod(dims) // info.block_size * info.type_size
            if offset % alignment:
                raise self.fail(
                    f"{what}: data offset {offset} is not a multiple of the alignment {alignment}"
                )
            if offset + nbytes > data_size:
                raise self.fail(
                    f"truncated GGUF file: {what} ({info.name}, dims {list(dims)}) needs "
                    f"{nbytes} bytes at offset {offset} of the data section, which holds "
                    f"{max(data_size, 0)}"
                )
            tensors[name] = TensorInfo(name, ggml_type, dims, offset, nbytes)
        ordered = sorted((t for t in tensors.values() if t.nbytes), key=lambda t: t.offset)
        for this, following in itertools.pairwise(ordered):
            if this.offset + this.nbytes > following.offset:
                raise self.fail(
                    f"tensor {this.name!r} ({this.type_name}, dims {list(this.dims)}) needs "
                    f"{this.nbytes} bytes from offset {this.offset}, but tensor "
                    f"{following.name!r} starts at {following.offset}: the space for it does "
                    f"not match its type and shape"
                )
        return tensors
