"""Prompt logprobs on the MLX thread, computed the way `/v1/score` computes candidates.

What an evaluation harness asks of a completion with `echo` and `logprobs` (lm-eval's
`local-completions`: every prompt position's logprob and top-k, one prompt per context +
continuation) is a decision over many positions. `Loglikelihoods.compute` answers it:

- **Every prefix once.** The hidden rows come from the scoring prefix cache: positions it
  holds are read from its stored final hidden rows (`PrefixCache.stored_rows`), never
  recomputed; the rest are computed through its sessions, and stored there for later calls
  and for `/v1/score`. Prompts of one call are grouped by what they share beyond what all
  of them share (a question's choices after a few-shot block); a group's prompts run as
  batches over its own prefix (`PrefixSession.forward_rows`, as the scorer batches rows),
  computed once or restored, and a prompt alone restores its longest stored prefix.
- **The head only where asked.** The output projection runs on the positions whose logprob
  is asked for (from `start` on; the last position's row only when the next token is
  wanted), in blocks of `HEAD_ROWS`.
- **Positions already seen are not recomputed.** Each position's result (its token's logprob
  and the top-k, computed at least with k = 1) is kept in an LRU keyed by a digest of the
  tokens up to and including it (`PositionCache`): a multiple-choice context scored for its
  second choice costs only the choice's own positions.
- **Exact.** float32: each row is the model's `unembed` (its own post-processing included)
  in float32, through a log-softmax: the token's logprob is its logit minus the row's
  log-sum-exp, the same numbers as `/v1/score`'s logits through a log-softmax up to float32
  rounding (tests/test_loglikelihood.py holds them equal, and cached = uncached, batched =
  one by one). Top-k entries are the k best of the full row, best first (ties by id).
"""

from __future__ import annotations

import hashlib
import logging
import struct
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from runner.cache.batch import unbatched_kinds
from runner.cache.prefix_cache import PrefixCache
from runner.models import Model

log = logging.getLogger(__name__)

HEAD_ROWS = 128  # positions per head product (128 x a 49,152-token vocabulary: 25 MB)
BATCH_MAX_SUFFIX = 256  # as the scorer: longer unshared parts are computed one by one
POSITION_CAPACITY = 1 << 18  # positions the LRU keeps (~60 MB at k = 1)


@dataclass(frozen=True)
class Position:
    """One prompt position: its token's logprob given the tokens before it, and the `top`
    best tokens there (id, logprob), best first."""

    logprob: float
    top: tuple[tuple[int, float], ...]


@dataclass
class PromptLogprobs:
    """One prompt's answer: `positions[j]` for each position asked (None before `start`),
    and, when asked, the raw float32 logits [V] after the last token (`next_logits`, on the
    MLX thread's side: sample from it there)."""

    positions: list[Position | None]
    next_logits: mx.array | None = None


class PositionCache:
    """An LRU of `Position`s keyed by the digest of the tokens up to and including each."""

    def __init__(self, capacity: int = POSITION_CAPACITY):
        self.capacity = capacity
        self._entries: OrderedDict[bytes, Position] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: bytes, top: int) -> Position | None:
        """The entry when it lists at least `top` alternatives."""
        entry = self._entries.get(key)
        if entry is None or len(entry.top) < top:
            return None
        self._entries.move_to_end(key)
        return entry

    def put(self, key: bytes, entry: Position) -> None:
        self._entries[key] = entry
        self._entries.move_to_end(key)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def clear(self) -> None:
        self._entries.clear()


def digests(tokens: Sequence[int]) -> list[bytes]:
    """d[j] identifies tokens[: j + 1]: a chained BLAKE2b, so a position's key costs one
    hash whatever the prompt's length (a collision would need 2^64 work)."""
    out: list[bytes] = []
    previous = b""
    pack = struct.Struct("<Q").pack
    for token in tokens:
        data = previous + pack(token & 0xFFFFFFFFFFFFFFFF)
        previous = hashlib.blake2b(data, digest_size=16).digest()
        out.append(previous)
    return out


def shared_prefix(prompts: Sequence[Sequence[int]]) -> int:
    """Tokens every prompt starts with (0 for fewer than two)."""
    if len(prompts) < 2:
        return 0
    n = min(len(p) for p in prompts)
    first = prompts[0]
    for other in prompts[1:]:
        for j in range(n):
            if other[j] != first[j]:
                n = j
                break
    return n


class Loglikelihoods:
    """Prompt logprobs through the scoring prefix cache; call only on the MLX thread."""

    def __init__(self, model: Model, cache: PrefixCache, capacity: int = POSITION_CAPACITY):
        self.model = model
        self.cache = cache
        self.positions = PositionCache(capacity)
        self.batches = not unbatched_kinds(model)
        self.vocab = model.vocab_size

    def compute(
        self,
        prompts: Sequence[list[int]],
        starts: Sequence[int],
        top: int,
        want_next: bool,
        check: Callable[[], None],
    ) -> list[PromptLogprobs]:
        """For each prompt, the logprobs of its positions from `starts[i]` on (at least 1:
        position 0 has none) with `top` alternatives each, and with `want_next` the logits
        after its last token. `check` raises to cancel; it runs before every forward."""
        began = time.perf_counter()
        k = max(1, min(top, self.vocab))
        answers: list[PromptLogprobs] = []
        keys: list[list[bytes]] = []
        wanted: dict[int, list[int]] = {}  # prompt -> hidden-row indices to unembed
        claimed: dict[bytes, tuple[int, int]] = {}  # a position computed for another prompt
        shared: list[tuple[int, int, tuple[int, int]]] = []
        reused = 0
        for i, tokens in enumerate(prompts):
            assert tokens, "a prompt has at least one token"
            positions: list[Position | None] = [None] * len(tokens)
            keys.append(digests(tokens))
            rows: list[int] = []
            for j in range(max(1, starts[i]), len(tokens)):
                key = keys[i][j]
                hit = self.positions.get(key, k)
                if hit is not None:
                    positions[j] = hit
                    reused += 1
                elif key in claimed:  # the same tokens in an earlier prompt of the call
                    shared.append((i, j, claimed[key]))
                else:
                    claimed[key] = (i, j)
                    rows.append(j - 1)
            if want_next:
                rows.append(len(tokens) - 1)
            if rows:
                wanted[i] = rows
            answers.append(PromptLogprobs(positions))
        hidden = self._hidden(prompts, sorted(wanted), check)
        computed = self._unembed(prompts, wanted, hidden, keys, k, answers, check)
        for i, j, (first, at) in shared:
            answers[i].positions[j] = answers[first].positions[at]
        log.info(
            "logprobs prompts=%d positions=%d reused=%d seconds=%.3f",
            len(prompts),
            computed,
            reused,
            time.perf_counter() - began,
        )
        return answers

    # --- hidden rows ----------------------------------------------------------------------
    def _hidden(
        self, prompts: Sequence[list[int]], which: list[int], check: Callable[[], None]
    ) -> dict[int, mx.array]:
        """Every position's final hidden row ([n, H]) of the prompts `which`: stored ones read
        from the scoring cache, the rest computed through it (prompts sharing a prefix as
        batches over it)."""
        out: dict[int, mx.array] = {}
        todo = []
        for i in which:
            parts, covered = self.cache.stored_rows(prompts[i], len(prompts[i]))
            if covered == len(prompts[i]):
                out[i] = _joined(parts)
            else:
                todo.append(i)
        base = shared_prefix([prompts[i] for i in todo])
        for group in _groups(prompts, todo, base):
            prefix = shared_prefix([prompts[i] for i in group])
            if prefix and self.batches:
                batch = [i for i in group if 0 < len(prompts[i]) - prefix <= BATCH_MAX_SUFFIX]
                if len(batch) > 1:
                    out.update(self._batched(prompts, batch, prefix, check))
            for i in group:
                if i not in out:
                    check()
                    schedule = [p for p in {base, prefix} if p]
                    out[i] = self._alone(prompts[i], sorted(schedule), check)
        return out

    def _batched(
        self, prompts: Sequence[list[int]], which: list[int], prefix: int, check: Callable[[], None]
    ) -> dict[int, mx.array]:
        """The prompts `which` (each longer than `prefix`) as suffixes batched over their
        shared prefix, computed once (or restored)."""
        check()
        first = prompts[which[0]]
        rows: list[mx.array] | None = None
        with self.cache.begin(first[:prefix], need_state=True) as session:
            head = self._restored(first, session.offset)
            if head is not None:
                if session.offset < prefix:
                    session.prefill(prefix, check)
                    computed = session.computed_rows()
                    assert computed is not None
                    head.append(computed)
                prefix_rows = _joined(head)
                suffixes = [prompts[i][prefix:] for i in which]
                rows = session.forward_rows(suffixes, check, every_position=True)
        if rows is None:  # the trie lost rows it restored: compute each alone
            return {i: self._alone(prompts[i], [], check) for i in which}
        return {
            i: mx.concatenate([prefix_rows, r], axis=0) for i, r in zip(which, rows, strict=True)
        }

    def _alone(self, tokens: list[int], schedule: list[int], check: Callable[[], None]) -> mx.array:
        with self.cache.begin(tokens, schedule, need_state=True) as session:
            parts = self._restored(tokens, session.offset)
            if parts is not None:
                if session.offset < len(tokens):
                    session.prefill(len(tokens), check)
                    computed = session.computed_rows()
                    assert computed is not None
                    parts.append(computed)
                return _joined(parts)
        return self._uncached(tokens, check)

    def _restored(self, tokens: list[int], offset: int) -> list[mx.array] | None:
        """The stored rows of tokens[:offset] (what a session restored), or None when the
        trie does not hold them all (it always should: every scoring node keeps its rows)."""
        parts, covered = self.cache.stored_rows(tokens, offset)
        if covered < offset:
            log.warning("logprobs: the scoring cache restored %d positions without rows", offset)
            return None
        return parts

    def _uncached(self, tokens: list[int], check: Callable[[], None]) -> mx.array:
        """Every row of `tokens` through a throwaway cache (the fallback above)."""
        scratch = PrefixCache(
            self.model,
            name="scratch",
            keep_hidden=True,
            chunk_tokens=self.cache.chunk_tokens,
            batch_tokens=self.cache.batch_tokens,
        )
        with scratch.begin(tokens) as session:
            session.prefill(len(tokens), check)
            rows = session.computed_rows()
        assert rows is not None
        return rows[0]

    # --- the head -------------------------------------------------------------------------
    def _unembed(
        self,
        prompts: Sequence[list[int]],
        wanted: dict[int, list[int]],
        hidden: dict[int, mx.array],
        keys: list[list[bytes]],
        k: int,
        answers: list[PromptLogprobs],
        check: Callable[[], None],
    ) -> int:
        """Fill `answers` at the wanted rows: the head over blocks of `HEAD_ROWS` rows."""
        # (prompt, row index r): the row predicts token r + 1, or is the last one (next)
        items = [(i, r) for i in sorted(wanted) for r in wanted[i]]
        selected = [
            hidden[i][mx.array(wanted[i], dtype=mx.int32)] for i in sorted(wanted) if wanted[i]
        ]
        if not items:
            return 0
        rows = mx.concatenate(selected, axis=0) if len(selected) > 1 else selected[0]
        for begin in range(0, len(items), HEAD_ROWS):
            check()
            block = items[begin : begin + HEAD_ROWS]
            logits = self.model.unembed(rows[begin : begin + len(block)]).astype(mx.float32)
            lse = mx.logsumexp(logits, axis=-1, keepdims=True)
            logprobs = logits - lse
            best = mx.argpartition(-logprobs, kth=k - 1, axis=-1)[:, :k]
            best_values = mx.take_along_axis(logprobs, best, axis=-1)
            targets = [prompts[i][r + 1] if r + 1 < len(prompts[i]) else 0 for i, r in block]
            target_ids = mx.array(targets, dtype=mx.int32)[:, None]
            chosen = mx.take_along_axis(logprobs, target_ids, axis=-1)[:, 0]
            mx.eval(best, best_values, chosen, logits)
            ids_np = np.asarray(best)
            values_np = np.asarray(best_values)
            chosen_np = np.asarray(chosen)
            for row, (i, r) in enumerate(block):
                if r + 1 == len(prompts[i]):  # the row after the last token
                    answers[i].next_logits = mx.array(np.array(logits[row]))
                    continue
                order = np.lexsort((ids_np[row], -values_np[row]))
                top = tuple((int(ids_np[row][o]), float(values_np[row][o])) for o in order)
                entry = Position(float(chosen_np[row]), top)
                answers[i].positions[r + 1] = entry
                self.positions.put(keys[i][r + 1], entry)
        return len(items)


def _groups(prompts: Sequence[list[int]], which: list[int], base: int) -> list[list[int]]:
    """The prompts `which` in groups that share more than the `base` tokens they all share
    (a multiple-choice question's choices, after a few-shot block every question has): each
    group's own prefix is then computed once, not once per batch row. Neighbours in token
    order share the most, so a group is a run of them."""
    order = sorted(which, key=lambda i: prompts[i])
    groups: list[list[int]] = []
    for i in order:
        if groups and shared_prefix([prompts[groups[-1][-1]], prompts[i]]) > base:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def _joined(parts: list[mx.array]) -> mx.array:
    """[1, k, H] slices in order as one [n, H] array."""
    joined = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=1)
    return joined[0]
