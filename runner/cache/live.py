"""The live state of one prefix cache: the model's caches, what they hold, and the forward.

Every token a request computes goes through `LiveState`: `feed` (a prefill chunk, evaluated)
and `step` (a decode step, built lazily so the pipeline can overlap it with host work).
This is the only place that calls `model.hidden` on live caches.

Invariants:
- `tokens` lists exactly what the caches hold, once `settle()` has run: a decode step's
  token is recorded at `settle()` (its forward may still be in flight before that), which
  the prefix cache calls before it reads `tokens` for anything but a prefix test.
- A forward that raises leaves caches some layers wrote and others did not: `feed` and
  `step` then `reset()` (empty caches, no tokens) before re-raising, so nothing half-written
  is ever stored or restored.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from runner.cache.batch import forward_suffixes
from runner.cache.kinds import HiddenRows, Kind, kind_of

if TYPE_CHECKING:
    from runner.media.request import RequestMedia


class LiveState:
    def __init__(self, model: Any, keep_hidden: bool):
        self.model = model
        self.hidden = HiddenRows() if keep_hidden else None
        self.tokens: list[int] = []
        self._pending: list[mx.array] = []  # decode tokens whose forwards may be in flight
        self.caches: list[Any] = []
        self.slots: list[Any] = []
        self.kinds: list[Kind] = []
        self.reset()

    def reset(self) -> None:
        """Empty caches holding nothing (after a failed forward, or to start over)."""
        self.caches = self.model.make_caches()
        self.slots = [*self.caches, *([self.hidden] if self.hidden is not None else [])]
        self.kinds = [kind_of(c) for c in self.slots]
        if self.hidden is not None:
            self.hidden.reset(0)
        self.tokens = []
        self._pending = []

    def arrays(self) -> list[mx.array]:
        """Every array the live caches (and kept hidden rows) hold, to evaluate them."""
        out = live_arrays(self.caches)
        if self.hidden is not None and self.hidden.rows is not None:
            out.append(self.hidden.rows)
        return out

    def feed(self, tokens: list[int], media: RequestMedia | None = None) -> mx.array:
        """Compute `tokens` after what the caches hold and evaluate; returns their final
        hidden states [1, n, H]. With `media`, `tokens` are its keys (runner/media) and the
        model gets the real ids and the features of the images they cover."""
        assert not self._pending, "settle decode steps before feeding"
        try:
            if media is None:
                hidden = self._forward(mx.array([tokens], dtype=mx.int32))
            else:
                start = len(self.tokens)
                ids, blocks = media.inputs(start, start + len(tokens))
                hidden = self._forward(ids, blocks, media.layout)
            mx.eval(hidden, *self.arrays())
        except BaseException:
            self.reset()
            raise
        self.tokens.extend(tokens)
        return hidden

    def step(self, token: int | mx.array, layout: Any = None) -> mx.array:
        """Build (lazily) the forward of one decode token; returns its hidden row [1, H].
        `layout`: the request's position layout (runner/media/prepare.py), if any."""
        if isinstance(token, int):  # [[token]] made whole: no reshape for the step to evaluate
            ids, token = mx.array([[token]], dtype=mx.int32), mx.array([token], dtype=mx.int32)
        else:
            ids = token.reshape(1, 1)
        try:
            hidden = self._forward(ids, None, layout)
        except BaseException:
            self.reset()
            raise
        self._pending.append(token)
        return hidden[0]

    def forward_rows(self, batch: list[Any], rows: list[list[int]], layout: Any = None) -> mx.array:
        """Build (lazily) the forward of `rows`, right-padded, over `batch` (caches broadcast
        from these: runner/cache/batch.py); their final hidden states [B, W, H]. `layout`: the
        prefix's position layout, if its prompt has one."""
        if layout is None:
            return forward_suffixes(self.model, batch, rows)
        return forward_suffixes(self.model, batch, rows, layout)

    def settle(self) -> None:
        """Wait for decode steps still in flight and record their tokens."""
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        try:
            mx.eval(*pending, *self.arrays())
        except BaseException:
            self.reset()
            raise
        self.tokens.extend(int(t.reshape(-1)[0].item()) for t in pending)  # type: ignore[arg-type]

    def _forward(self, tokens: mx.array, media: list | None = None, layout: Any = None) -> mx.array:
        if layout is not None:  # only models that make layouts take one
            hidden = self.model.hidden(tokens, self.caches, media or None, layout=layout)
        elif media:
            hidden = self.model.hidden(tokens, self.caches, media)
        else:
            hidden = self.model.hidden(tokens, self.caches)
        if self.hidden is not None:
            self.hidden.append(hidden)
        return hidden


def live_arrays(caches: list[Any]) -> list[mx.array]:
    """Every array the caches hold, to evaluate them after a chunk."""
    out: list[mx.array] = []

    def collect(value: Any) -> None:
        if isinstance(value, mx.array):
            out.append(value)
        elif isinstance(value, list | tuple):
            for v in value:
                collect(v)

    for cache in caches:
        if type(cache) is KVCache:  # its buffers: `state` would slice them (a new array each)
            if cache.keys is not None:
                out += (cache.keys, cache.values)
        elif cache is not None:
            collect(cache.state)
    return out
