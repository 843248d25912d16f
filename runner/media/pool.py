"""The image pool: where images are decoded and preprocessed (docs/DESIGN.md §1).

A request's preparation (tokenizing, validation) runs in the server's CPU executor; each
image it decodes is handed to this pool of `IMAGE_WORKERS` threads and awaited, one image at
a time per request. So however many requests arrive, at most `IMAGE_WORKERS` images are being
decoded at once, each at most `MAX_IMAGE_PIXELS` (runner/media/images.py): the bound on the
memory that decoding adds to the process (docs/PROTOCOL.md §7). The GIL is free meanwhile:
Pillow releases it while it decodes, converts, composites (`paste`) and resizes, and numpy
while it normalises.

- `decode_on_pool(work, check)`: `check()` when the image's turn comes (a request cancelled
  while it waited decodes nothing), then `work()`; an exception is the caller's.
- After an image of more than `TRIM_PIXELS` pixels, `release_memory()` hands the heap's free
  pages back to the system (glibc's `malloc_trim`): Pillow allocates a large image in 16 MiB
  blocks, which glibc serves from its heaps once its mmap threshold has risen past them,
  so without it the process kept the peak of a burst of large images (gigabytes) long after
  their requests ended.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import ctypes.util
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

IMAGE_WORKERS = 2
TRIM_PIXELS = 4 << 20  # images smaller than this leave little to give back

_lock = threading.Lock()
_pool: concurrent.futures.ThreadPoolExecutor | None = None


def image_pool() -> concurrent.futures.ThreadPoolExecutor:
    global _pool
    with _lock:
        if _pool is None:
            _pool = concurrent.futures.ThreadPoolExecutor(IMAGE_WORKERS, thread_name_prefix="image")
        return _pool


def decode_on_pool(work: Callable[[], T], check: Callable[[], None], pixels: int = 0) -> T:
    """`work()` on the image pool, after `check()` there; waits for it. `pixels`: how many the
    image declares (a large one gives its memory back afterwards)."""

    def task() -> T:
        check()
        try:
            return work()
        finally:
            if pixels > TRIM_PIXELS:
                release_memory()

    return image_pool().submit(task).result()


def _malloc_trim() -> Any:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        function = libc.malloc_trim
    except (OSError, AttributeError):  # not glibc (macOS, musl)
        return None
    function.argtypes = [ctypes.c_size_t]
    function.restype = ctypes.c_int
    return function


_TRIM = _malloc_trim()


def release_memory() -> None:
    """Give the C heap's free pages back to the system (nothing where it cannot)."""
    if _TRIM is not None:
        _TRIM(0)
