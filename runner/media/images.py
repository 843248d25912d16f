"""Image bytes to a Pillow image, as the Go runner accepts them: PNG, JPEG, GIF, WebP.

Pillow is what transformers' image processors read, so a family's preprocessing can follow
its reference processor step by step on the same decoded pixels. Two steps, both raising
ValueError("invalid image data: ...") (the request side's 400) with a stable text that holds
no object address:

- `read_header(data)`: the format, size and mode from the header alone, nothing decoded (a
  few milliseconds at most), so a request's token count and its decoding budget are known
  before any pixel is (runner/media/prepare.py). It refuses what Go's decoders refuse and
  Pillow's would decode: a size over `MAX_IMAGE_PIXELS`; a JPEG coding Go does not decode
  (lossless, hierarchical, arithmetic, other than 8 bits); a JPEG or PNG whose data is too
  short to hold the image it declares (`check_jpeg`, `check_png`: libjpeg fills the missing
  blocks with grey and zlib's early end leaves rows unwritten, where Go's decoders fail).
- `decode_image(data)`: the header read again, then the pixels decoded (Pillow releases the
  GIL while it decodes; runner/media/pool.py runs it on the image pool).

Pillow's own decompression-bomb check is replaced by ours (`MAX_IMAGE_PIXELS`, the same
89,478,485 pixels): its warning is process-global state (a filter that cannot be set per
thread), and its error cited twice the limit applied.
"""

from __future__ import annotations

import io
import math
import re
import struct
from dataclasses import dataclass

from PIL import Image, UnidentifiedImageError

# The formats the Go runner decodes (docs/PROTOCOL.md); Pillow would open many more.
FORMATS = ("PNG", "JPEG", "GIF", "WEBP")
# The most pixels one image may declare: Pillow's default limit (a quarter of 1 GiB of
# RGB bytes: 1024 * 1024 * 1024 // 4 // 3).
MAX_IMAGE_PIXELS = 89_478_485

Image.MAX_IMAGE_PIXELS = None  # ours applies, in `read_header`, before anything is decoded


@dataclass(frozen=True)
class ImageHeader:
    """What an image's header declares: Pillow's format name, width, height and mode."""

    format: str
    width: int
    height: int
    mode: str

    @property
    def pixels(self) -> int:
        return self.width * self.height


def read_header(data: bytes) -> ImageHeader:
    """The header of the image in `data`, checked; nothing is decoded."""
    return ImageHeader(*_open(data)[1:])


def decode_image(data: bytes) -> Image.Image:
    """The image in `data`, fully decoded (a GIF's first frame), in its own mode: RGB
    conversion is the preprocessor's (transformers composites transparency onto white first).
    Raises ValueError("invalid image data: ...") for bytes that are not one whole image of a
    supported format."""
    image = _open(data)[0]
    try:
        image.seek(0)  # the first frame of an animation
        image.load()  # decode now: a truncated file fails here, not in the preprocessor
    except (OSError, SyntaxError, ValueError, EOFError, struct.error, IndexError) as e:
        raise ValueError(f"invalid image data: {_text(e)}") from None
    return image


def _open(data: bytes) -> tuple[Image.Image, str, int, int, str]:
    if not data:
        raise ValueError("invalid image data: empty")
    try:
        image = Image.open(io.BytesIO(data), formats=FORMATS)
    except UnidentifiedImageError:
        raise ValueError(
            "invalid image data: not a PNG, JPEG, GIF or WebP image (unsupported format)"
        ) from None
    except (OSError, SyntaxError, ValueError, EOFError, struct.error, IndexError) as e:
        raise ValueError(f"invalid image data: {_text(e)}") from None
    width, height = image.size
    if width < 1 or height < 1:
        raise ValueError("invalid image data: no pixels")
    if width * height > MAX_IMAGE_PIXELS:
        raise ValueError(
            f"invalid image data: {width} x {height} is {width * height} pixels, over the "
            f"limit of {MAX_IMAGE_PIXELS} pixels per image"
        )
    fmt = image.format or ""
    if fmt == "JPEG":
        check_jpeg(data)
    elif fmt == "PNG":
        check_png(data)
    return image, fmt, width, height, image.mode


_ADDRESS = re.compile(r"<[^<>]* at 0x[0-9a-fA-F]+>")


def _text(error: BaseException) -> str:
    """An exception's text without object reprs (`<_io.BytesIO object at 0x...>`)."""
    text = _ADDRESS.sub("the image", str(error)).strip()
    return text or type(error).__name__


# --- JPEG ---------------------------------------------------------------------------------------

_JPEG_CODINGS = {
    0xC3: "lossless",
    0xC5: "hierarchical",
    0xC6: "hierarchical",
    0xC7: "hierarchical",
    0xC9: "arithmetic",
    0xCA: "arithmetic",
    0xCB: "arithmetic",
    0xCD: "arithmetic",
    0xCE: "arithmetic",
    0xCF: "arithmetic",
}
# Where a scan's entropy-coded data ends: a marker (0xFF, then neither a stuffed zero, a
# restart marker nor another fill byte).
_END_OF_SCAN = re.compile(rb"\xff+[^\x00\xd0-\xd7\xff]")
MAX_EOB_RUN = 32767  # a progressive AC scan codes up to this many empty blocks in one symbol
# The walks below stop (leaving the file to Pillow's decoder) past this many segments or
# chunks: a real image has a few dozen to a few thousand; a file of millions of tiny ones
# would make the walk itself the cost.
MAX_SEGMENTS = 1 << 18


@dataclass(frozen=True)
class _Frame:
    progressive: bool
    width: int
    height: int
    sampling: dict[int, tuple[int, int]]  # component id -> (h, v)


def check_jpeg(data: bytes) -> None:
    """Refuse, from its markers alone, a JPEG that Go's decoder refuses and libjpeg would
    decode: a coding other than baseline, extended sequential or progressive Huffman, a
    precision other than 8 bits or a component count other than 1, 3 or 4, and a scan whose
    data is too short for its blocks. Every block of a sequential scan takes one DC and at
    least one AC code, each at least as long as its table's shortest code; of a progressive
    first DC scan, one DC code; of a DC refinement, one bit (AC scans may code thousands of
    empty blocks in one symbol, and count nothing). A scan with fewer bits than that ends
    before its blocks do: libjpeg fills the rest with grey, Go's decoder fails.

    Anything this walk cannot parse is left to Pillow's decoder, which refuses it."""
    frame: _Frame | None = None
    shortest: dict[tuple[int, int], int] = {}  # (class, table) -> shortest code length
    pos, scan = 2, 0
    size = len(data)
    for _ in range(MAX_SEGMENTS):
        if pos + 4 > size:
            return
        if data[pos] != 0xFF:  # stray bytes between segments: both decoders skip them
            pos = data.find(b"\xff", pos)
            if pos < 0:
                return
            continue
        marker = data[pos + 1]
        if marker == 0xFF:
            pos += 1
            continue
        if marker == 0xD9:
            return
        if 0xD0 <= marker <= 0xD7 or marker in (0x00, 0x01, 0xD8):
            pos += 2
            continue
        (length,) = struct.unpack_from(">H", data, pos + 2)
        segment = data[pos + 4 : pos + 2 + length]
        if length < 2 or len(segment) != length - 2:
            return
        pos += 2 + length
        if marker in _JPEG_CODINGS:
            raise ValueError(
                f"invalid image data: unsupported JPEG coding ({_JPEG_CODINGS[marker]}; "
                "baseline, extended and progressive Huffman JPEGs are decoded)"
            )
        if marker in (0xC0, 0xC1, 0xC2):
            frame = _read_frame(marker == 0xC2, segment)
            if frame is None:
                return
        elif marker == 0xC4:
            _read_tables(segment, shortest)
        elif marker == 0xDA:
            end = _END_OF_SCAN.search(data, pos)
            stop = end.start() if end else size
            scan += 1
            if frame is not None:
                needed = _scan_bits(frame, segment, shortest)
                if needed is not None and needed > 8 * (stop - pos):
                    raise ValueError(
                        f"invalid image data: JPEG data too short: scan {scan} of the "
                        f"{frame.width} x {frame.height} image holds {stop - pos} bytes, "
                        f"its blocks need at least {math.ceil(needed / 8)}"
                    )
            pos = stop


def _read_frame(progressive: bool, segment: bytes) -> _Frame | None:
    if len(segment) < 6:
        return None
    precision, height, width, count = struct.unpack_from(">BHHB", segment)
    if precision != 8:
        raise ValueError(f"invalid image data: unsupported JPEG precision ({precision} bits)")
    if count not in (1, 3, 4):
        raise ValueError(f"invalid image data: unsupported JPEG component count ({count})")
    if len(segment) < 6 + 3 * count:
        return None
    sampling = {}
    for i in range(count):
        ident, factors = segment[6 + 3 * i], segment[7 + 3 * i]
        h, v = factors >> 4, factors & 15
        if not (1 <= h <= 4 and 1 <= v <= 4):
            return None
        sampling[ident] = (h, v)
    return _Frame(progressive, width, height, sampling)


def _read_tables(segment: bytes, shortest: dict[tuple[int, int], int]) -> None:
    i = 0
    while i + 17 <= len(segment):
        kind, counts = segment[i], segment[i + 1 : i + 17]
        lengths = [n + 1 for n, count in enumerate(counts) if count]
        shortest[(kind >> 4, kind & 15)] = lengths[0] if lengths else 16
        i += 17 + sum(counts)


def _scan_bits(frame: _Frame, segment: bytes, shortest: dict[tuple[int, int], int]) -> int | None:
    """The fewest bits the scan's blocks can be coded in; None when the header is not one
    this walk understands."""
    if not segment:
        return None
    count = segment[0]
    if len(segment) < 1 + 2 * count + 3:
        return None
    start, _, approximation = segment[1 + 2 * count : 4 + 2 * count]
    members = [(segment[1 + 2 * i], segment[2 + 2 * i]) for i in range(count)]
    if any(ident not in frame.sampling for ident, _ in members):
        return None
    h_max = max(h for h, _ in frame.sampling.values())
    v_max = max(v for _, v in frame.sampling.values())
    mcus = math.ceil(frame.width / (8 * h_max)) * math.ceil(frame.height / (8 * v_max))
    bits = 0
    for ident, tables in members:
        h, v = frame.sampling[ident]
        if count == 1:  # one component: its own blocks, not whole MCUs
            across = math.ceil(math.ceil(frame.width * h / h_max) / 8)
            down = math.ceil(math.ceil(frame.height * v / v_max) / 8)
            blocks = across * down
        else:
            blocks = mcus * h * v
        dc = shortest.get((0, tables >> 4), 1)
        ac = shortest.get((1, tables & 15), 1)
        if not frame.progressive:
            bits += blocks * (dc + ac)
        elif start == 0:  # a DC scan: the first codes each block, a refinement one bit each
            bits += blocks * (dc if approximation >> 4 == 0 else 1)
        else:
            bits += math.ceil(blocks / MAX_EOB_RUN)
    return bits


# --- PNG ----------------------------------------------------------------------------------------

# Deflate's largest expansion: a 258-byte match in two bits (a one-bit length code and a
# one-bit distance code), so a byte of compressed data yields at most 1032 bytes.
MAX_DEFLATE_RATIO = 1032
_CHANNELS = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}  # PNG colour type -> samples a pixel
# Adam7's passes: (first column, first row, column step, row step)
_ADAM7 = (
    (0, 0, 8, 8),
    (4, 0, 8, 8),
    (0, 4, 4, 8),
    (2, 0, 4, 4),
    (0, 2, 2, 4),
    (1, 0, 2, 2),
    (0, 1, 1, 2),
)


def check_png(data: bytes) -> None:
    """Refuse a PNG whose compressed image data (its IDAT chunks) is too short to inflate to
    the rows its header declares: zlib ends early, Pillow keeps the rows it never wrote and
    Go's decoder fails. Anything this walk cannot parse is left to Pillow's decoder."""
    pos, header, compressed = 8, None, 0
    for _ in range(MAX_SEGMENTS):
        if pos + 8 > len(data):
            break
        length, kind = struct.unpack_from(">I4s", data, pos)
        if kind == b"IHDR" and length >= 13 and pos + 21 <= len(data):
            header = struct.unpack_from(">IIBBBBB", data, pos + 8)
        elif kind == b"IDAT":
            compressed += min(length, len(data) - pos - 8)
        elif kind == b"IEND":
            break
        pos += 12 + length
    else:
        return
    if header is None:
        return
    width, height, depth, colour, _, _, interlace = header
    if colour not in _CHANNELS:
        return
    bits = _CHANNELS[colour] * depth
    passes = _ADAM7 if interlace else ((0, 0, 1, 1),)
    needed = 0
    for x0, y0, dx, dy in passes:
        across = -(-(width - x0) // dx) if width > x0 else 0
        down = -(-(height - y0) // dy) if height > y0 else 0
        if across and down:
            needed += down * (1 + -(-across * bits // 8))
    if needed > 1 + MAX_DEFLATE_RATIO * compressed:
        raise ValueError(
            f"invalid image data: PNG data too short: {compressed} compressed bytes cannot "
            f"hold the {needed} bytes of its {width} x {height} rows"
        )
