"""Tokenizer with the Go runner's semantics (docs/PROTOCOL.md §4-5), on top of `tokenizers`.

- Text is encoded without the tokenizer's post-processor; BOS is prepended by us, and only
  when tokenizer_config.json says `add_bos_token: true` (absent means false).
- Every added token counts as special, whatever its `special` flag: `is_special(s)` is an
  exact lookup among all added-token strings (the Go `GetSpecialToken`).
- EOS ids come from generation_config.json, then config.json, then tokenizer_config.json's
  `eos_token` looked up among the added tokens; BOS the same way.
- `vocab_size` is max(vocab entries, highest id over vocab and added tokens + 1).
- `token_bytes(id)` gives a token's raw bytes (byte-level BPE or SentencePiece rules), so a
  stream can hold back incomplete UTF-8; special tokens give their literal text.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from typing import Any, cast

from tokenizers import Tokenizer as HFTokenizer

from runner.text.cuts import CutRule, Heads


def _byte_decoder() -> dict[str, int]:
    """GPT-2's printable-rune -> byte table, inverted."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1))
    bs += list(range(0xAE, 0xFF + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


_BYTE_DECODER = _byte_decoder()


def token_text(value: Any) -> str | None:
    """tokenizer_config token fields are a string or an AddedToken object."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _ids(value: Any) -> list[int]:
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


class Tokenizer:
    def __init__(
        self,
        tokenizer_json: str,
        *,
        config: dict[str, Any] | None = None,
        tokenizer_config: dict[str, Any] | None = None,
        generation_config: dict[str, Any] | None = None,
    ):
        spec = json.loads(tokenizer_json)
        model_type = (spec.get("model") or {}).get("type")
        if model_type != "BPE":
            raise ValueError(f"unsupported tokenizer type: {model_type}")
        self._tok = HFTokenizer.from_str(tokenizer_json)
        rule = CutRule.of(spec)
        # where texts can be cut (None: always tokenized whole), and prompts' beginnings
        self._heads = Heads(rule) if rule is not None else None
        config = config or {}
        tokenizer_config = tokenizer_config or {}
        generation_config = generation_config or {}

        self.added: dict[str, int] = {
            t["content"]: t["id"] for t in spec.get("added_tokens", []) if "content" in t
        }
        vocab = spec["model"].get("vocab") or {}
        highest = max([*vocab.values(), *self.added.values(), -1])
        self.vocab_size = max(len(vocab), highest + 1)
        self._sentencepiece = _is_sentencepiece(spec.get("decoder"))
        self._pieces: dict[int, str] = {i: s for s, i in vocab.items()}
        self._pieces.update({i: s for s, i in self.added.items()})
        self._added_ids = frozenset(self.added.values())
        # The most bytes one token stands for (a byte-level piece's characters are one byte
        # each; a SentencePiece character at most four), or None when normalization may
        # shorten a text, so that a text's length says nothing of its tokens.
        self.max_token_bytes: int | None = None
        if _never_shortens(spec.get("normalizer")):
            per_char = 4 if self._sentencepiece else 1
            longest = max((len(piece) for piece in vocab), default=0) * per_char
            self.max_token_bytes = max([longest, *(len(t.encode()) for t in self.added)])

        def special(key: str) -> list[int]:
            for source in (generation_config, config):
                found = _ids(source.get(f"{key}_token_id"))
                if found:
                    return found
            text = token_text(tokenizer_config.get(f"{key}_token"))
            return [self.added[text]] if text in self.added else []

        self.eos_ids: list[int] = special("eos")
        bos = special("bos")
        self.bos_id: int | None = bos[0] if bos else None
        self.add_bos: bool = tokenizer_config.get("add_bos_token") is True

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        return [*self.bos(add_bos), *self.encode_batch([text])[0]]

    def bos(self, add_bos: bool) -> list[int]:
        """The tokens a text starts with: BOS when asked for and the tokenizer has one."""
        return [self.bos_id] if add_bos and self.bos_id is not None else []

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """`encode` of each text (no BOS), in parallel across the machine's cores."""
        return cast(list[list[int]], self.encode_within(texts, None))  # no limit: all lists

    def encode_within(self, texts: list[str], limit: int | None) -> list[list[int] | int]:
        """`encode_batch`, except that a text of more than `limit` tokens comes back as its
        count alone (what a length check needs).

        `encode_batch_fast` (the same ids without character offsets: 3.3x faster on a
        1,000,000-character text, ~25% on a decision's five ~120-word texts) releases the
        GIL while it works, as `encode` does not (a 1,000,000-character prompt held it 2.3 s,
        so the event loop could not answer /v1/status). What holds the GIL is listing an
        encoding's ids and freeing it: 33-96 ms and ~50 ms for 4,000,000 tokens. So ids past
        the limit are never listed, and each encoding is freed as soon as it is read, never
        a whole batch's at once."""
        encodings: list[Any] = self._tok.encode_batch_fast(texts, add_special_tokens=False)
        out: list[list[int] | int] = []
        for i in range(len(encodings)):
            n = len(encodings[i])
            out.append(n if limit is not None and n > limit else encodings[i].ids)
            encodings[i] = None
        return out

    def encode_extended(
        self, items: list[tuple[str, list[str | None]]], limit: int | None
    ) -> list[tuple[list[int] | int, list[list[int] | int | None]]]:
        """For each (text, appended): `encode_within` of text, and of text + a for each a in
        appended (None for None), all in one parallel batch.

        Where the tokenizer allows cuts (runner/text/cuts.py), text and each text + a are
        tokenized from the last cut of text that holds for all of them (the same ids: that
        is what a cut is), and text from the longest beginning kept from earlier prompts:
        a decision request's prompt + " Yes" and + " No" cost a few words each, not the
        whole prompt again, and a system prompt seen before is not tokenized again."""
        plans = [self._plan(text, appended) for text, appended in items]
        encodings: list[Any] = self._tok.encode_batch_fast(
            [piece for plan in plans for piece in plan.pieces], add_special_tokens=False
        )
        out = []
        at = 0
        for plan in plans:
            out.append(plan.assemble(encodings, at, limit, self._heads))
            at += len(plan.pieces)
        return out

    def _plan(self, text: str, appended: list[str | None]) -> _Plan:
        heads = self._heads
        if heads is None:
            return _Plan(text, appended, [], 0, [], None)
        rule, given = heads.rule, [a for a in appended if a is not None]
        start, head = heads.longest(text, given)
        shared = heads.shared_with_recent(text)
        tail = rule.last_cut(text, start, len(text), given)
        # a beginning later prompts may share: a cut whose conditions read only shared text
        # (and so a cut of text + a too), at most `tail`
        hi = min(shared - rule.reach + 2, (len(text) if tail is None else tail) + 1)
        kept = rule.last_cut(text, start, hi)
        cuts = sorted({c for c in (kept, tail) if c is not None})
        return _Plan(text, appended, head, start, cuts, kept)

    def may_be_one_token(self, text: str) -> bool:
        """False when `text` is longer than any token (a candidate of a megabyte need not be
        tokenized to know it does not append one token)."""
        limit = self.max_token_bytes
        return limit is None or len(text) <= limit or len(text.encode()) <= limit

    def is_special(self, text: str) -> bool:
        return text in self.added

    def is_eos(self, token: int) -> bool:
        return token in self.eos_ids

    def token_bytes(self, token: int) -> bytes:
        piece = self._pieces.get(token)
        if piece is None:
            return b""
        if token in self._added_ids and self.added.get(piece) == token:
            return piece.encode()
        if self._sentencepiece:
            if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                return bytes([int(piece[3:5], 16)])
            return piece.replace("▁", " ").encode()
        return bytes(_BYTE_DECODER.get(c, ord(c) & 0xFF) for c in piece)


def _never_shortens(normalizer: Any) -> bool:
    """Whether a tokenizer.json normalizer never makes a text shorter in bytes: none, or
    only prepending and replacing a string by one at least as long (SentencePiece's "▁")."""
    if normalizer is None:
        return True
    if not isinstance(normalizer, dict):
        return False
    kind = normalizer.get("type")
    if kind == "Sequence":
        return all(_never_shortens(n) for n in normalizer.get("normalizers", []))
    if kind == "Prepend":
        return True
    if kind == "Replace":
        pattern, content = normalizer.get("pattern") or {}, normalizer.get("content")
        return (
            isinstance(pattern.get("String"), str)
            and isinstance(content, str)
            and len(content.encode()) >= len(pattern["String"].encode())
        )
    return False


def _is_sentencepiece(decoder: Any) -> bool:
    """The Go rule: a Sequence decoder holding a Replace of "▁" means SentencePiece."""
    if not isinstance(decoder, dict) or decoder.get("type") != "Sequence":
        return False
    for step in decoder.get("decoders", []):
        pattern = step.get("pattern") or {}
        if step.get("type") == "Replace" and pattern.get("String") == "▁":
            return True
    return False


class _Plan:
    """How one text and its extensions are tokenized: `head` (the ids of text[:start], kept
    from an earlier prompt), the text's pieces between `cuts` (after `start`), then from the
    last cut on the text's rest and the rest + each appended string. Without cuts: the text
    and each text + appended string whole. `kept`: a cut whose beginning is worth keeping."""

    def __init__(
        self,
        text: str,
        appended: list[str | None],
        head: Sequence[int],
        start: int,
        cuts: list[int],
        kept: int | None,
    ):
        edges = [start, *cuts]
        middle = [text[a:b] for a, b in itertools.pairwise(edges)]
        rest = text[edges[-1] :]
        self.pieces = [*middle, rest, *(rest + a for a in appended if a is not None)]
        self.middle = len(middle)
        self.text, self.head, self.appended = text, head, appended
        # the beginning to keep, text[:kept]: the head and the middle pieces up to `kept`
        self.kept = (kept, edges.index(kept)) if kept is not None else None

    def assemble(
        self, encodings: list[Any], at: int, limit: int | None, heads: Heads | None
    ) -> tuple[list[int] | int, list[list[int] | int | None]]:
        """The text's and each extension's ids (a count past `limit`) from the pieces'
        encodings at `at`, each freed once read (a batch freed at once held the GIL ~50 ms
        for 4,000,000 tokens); keeps the ids of text[:kept] in `heads` when the text fits."""
        n = len(self.pieces)
        lengths = [len(encodings[i]) for i in range(at, at + n)]
        before = len(self.head) + sum(lengths[: self.middle])
        totals = [before + length for length in lengths[self.middle :]]
        fits = [limit is None or total <= limit for total in totals]
        listed = any(fits)
        ids: list[list[int]] = []  # the middle pieces' ids, when any text is listed
        for i in range(at, at + self.middle):
            if listed:
                ids.append(encodings[i].ids)
            encodings[i] = None
        prefix = [*self.head, *(t for piece in ids for t in piece)]
        results: list[list[int] | int] = []
        for i, total, fit in zip(range(at + self.middle, at + n), totals, fits, strict=True):
            results.append([*prefix, *encodings[i].ids] if fit else total)
            encodings[i] = None
        if heads is not None and self.kept is not None and fits[0]:
            end, pieces = self.kept
            heads.add(self.text[:end], [*self.head, *(t for piece in ids[:pieces] for t in piece)])
        extended = iter(results[1:])
        return results[0], [None if a is None else next(extended) for a in self.appended]
