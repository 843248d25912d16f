"""MLX memory as requests see it: read for `/v1/status` without waiting behind inference,
and released after a request (docs/PROTOCOL.md §6).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator

import mlx.core as mx

from runner.engine import Engine, Job

log = logging.getLogger(__name__)

# Keep small reusable buffers, but release a large working set once a request is done.
SCRATCH_LIMIT_BYTES = 512 << 20
STATUS_MEMORY_WAIT_SECONDS = 0.05


@contextlib.contextmanager
def scratch_released() -> Iterator[None]:
    """After a request: release MLX scratch memory above the limit, or all of it when the
    request failed (its working set is no use to the next one)."""
    try:
        yield
    except BaseException:
        mx.clear_cache()
        raise
    if mx.get_cache_memory() > SCRATCH_LIMIT_BYTES:
        mx.clear_cache()


class StatusMemory:
    """MLX memory for /v1/status without waiting behind inference (docs/PROTOCOL.md §6).

    At most one refresh is queued on the engine at a time; a reader waits up to 50 ms for
    it and otherwise gets the last value read.
    """

    def __init__(self, engine: Engine):
        self.engine = engine
        self.value = 0
        self._refresh: asyncio.Future[int] | None = None

    async def read(self, wait: float = STATUS_MEMORY_WAIT_SECONDS) -> int:
        if self._refresh is None or self._refresh.done():
            job = self.engine.submit(_memory_bytes, asyncio.get_running_loop())
            assert job.future is not None
            self._refresh = job.future
            self._refresh.add_done_callback(self._store)
        try:
            await asyncio.wait_for(asyncio.shield(self._refresh), wait)
        except TimeoutError:
            pass
        except Exception:  # a failed read keeps the old value
            log.debug("memory refresh failed", exc_info=True)
        return self.value

    def _store(self, future: asyncio.Future[int]) -> None:
        if not future.cancelled() and future.exception() is None:
            self.value = future.result()


def _memory_bytes(_: Job) -> int:
    return int(mx.get_active_memory() + mx.get_cache_memory())
