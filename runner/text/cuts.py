"""Exact tokenization of texts that begin alike, their common beginning tokenized once.

A *cut* of a text X is a position m with encode(X) == encode(X[:m]) + encode(X[m:]). For the
tokenizer pipelines `CutRule.of` recognises, 0 < m < len(X) is a cut whenever
  (1) X[m] is a space (U+0020) and X[m-1] is not whitespace, and
  (2) no added token's text occurs in X across m (starting before m and ending after it).
Why, step by step (each step must split X at m as it splits X[:m] and X[m:] alone):
- added tokens are found first, as literal strings (none with lstrip, rstrip or single_word;
  under NFC none matched on normalized text): with none across m, those before m are found
  in X[:m] alone and those from m on in X[m:] alone;
- the normalizer is none or NFC. NFC reorders and composes only between starters, and a
  space is a starter that composes with nothing, so nothing moves across m;
- the pre-tokenizers split around digits, or with the GPT-2 pattern (ByteLevel's regex) or
  Llama 3's, Qwen2's or Qwen3.5's (Split, isolated), at least one of those patterns. In
  each (and in their llama.cpp spellings, contractions case by case), a space is either the
  optional first character of a match (` ?\\p{L}+`,
  `[^\\r\\n\\p{L}\\p{N}]?\\p{L}+`, ` ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*`, ...) or part of a run of
  whitespace, so no match holds X[m-1] (not whitespace) together with X[m]: a match ends
  at m. A match attempt that starts before m reads at most X[m] (every alternative reads a
  run of one class and stops at the first character outside it; the one lookahead,
  `(?!\\S)`, follows a run of whitespace that ends before m - 1), and a space there stops
  each run as the end of the text does. With no anchors and no lookbehind, matching X[m:]
  alone finds what matching X finds from m on;
- a Split that isolates the characters of one bracketed class of single characters (what
  a GGUF tokenizer is rebuilt with to split off bytes its vocabulary lacks) matches one
  character at a time, wherever it stands: it splits X where it splits X[:m] and X[m:];
- BPE without dropout encodes each piece on its own; with special tokens off, no
  post-processor adds a token.
So X's pieces are X[:m]'s followed by X[m:]'s, and its ids theirs.

(1) and (2) read only X[m - L + 1 : m + L - 1] (L: the longest added token, at least 2), so
a cut of P at least L - 1 characters before its end is a cut of P + c for any c, and a cut of
any later text that begins with the same characters up to L - 1 past it.

`Heads` keeps the ids of a few beginnings that recent prompts shared, each ending at a cut:
a decision request over a system prompt sent before tokenizes only what follows it.
"""

from __future__ import annotations

import re
import threading
from array import array
from collections.abc import Sequence
from typing import Any

# The pre-tokenizer patterns whose matches a cut cannot cross (the module docstring).
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN3_5_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# llama.cpp spells the contractions case by case (`'[sS]`, not `(?i:'s)`, which also takes
# `'ſ`): the same patterns as a GGUF's tokenizer is rebuilt with them
# (runner/sources/gguf/tokenizer.py); literal apostrophes and letters, so the argument holds.
HF_CONTRACTIONS = "(?i:'s|'t|'re|'ve|'m|'ll|'d)"
LLAMA_CPP_CONTRACTIONS = "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
SPLIT_PATTERNS = frozenset(
    pattern.replace(HF_CONTRACTIONS, contractions)
    for pattern in (LLAMA3_PATTERN, QWEN2_PATTERN, QWEN3_5_PATTERN)
    for contractions in (HF_CONTRACTIONS, LLAMA_CPP_CONTRACTIONS)
)
# A Split pattern that is one class of single characters written as `\x{hex}` escapes (and
# ranges of them): each match is one character, found wherever it stands.
SINGLE_CHARACTERS = re.compile(r"\[(?:\\x\{[0-9a-fA-F]+\}(?:-\\x\{[0-9a-fA-F]+\})?)+\]")
# Characters treated as whitespace besides what str.isspace says: format characters that
# some Unicode versions or regex engines count as spaces. Calling a character whitespace
# only loses a cut.
_ALSO_SPACE = frozenset("\u180e\u200b\u2060\ufeff")
HEADS = 8  # prompt beginnings kept
SEARCH_LIMIT = 4096  # characters searched back for a cut
# Characters of a prompt kept to find what later prompts share (and so the longest kept
# beginning): 8 recent prompts of a 64 MiB body would otherwise hold up to 2 GiB.
KEEP_CHARS = 1 << 20


def _splits_at_cuts(step: Any) -> bool | None:
    """For one pre-tokenizer: True when it splits at every cut, False when it keeps cuts
    without splitting there, None when it may move one (the rule does not apply)."""
    if not isinstance(step, dict):
        return None
    kind = step.get("type")
    if kind == "Digits":
        return False
    if kind == "ByteLevel":
        if step.get("add_prefix_space") is not False:
            return None
        return step.get("use_regex", True) is True
    if kind == "Split":
        pattern = step.get("pattern") or {}
        if step.get("behavior") != "Isolated" or step.get("invert") is not False:
            return None
        regex = pattern.get("Regex")
        if regex in SPLIT_PATTERNS:
            return True
        if isinstance(regex, str) and SINGLE_CHARACTERS.fullmatch(regex):
            return False
    return None


class CutRule:
    """Where a text can be cut (the module docstring); `of(spec)` is None for any other
    pipeline, whose texts are always tokenized whole."""

    def __init__(self, added: list[str]):
        self.added = [t for t in added if len(t) > 1]  # a one-character token crosses nothing
        self.reach = max([2, *(len(t) for t in self.added)])  # L
        self._starts = frozenset(t[0] for t in self.added)
        # the longest added token at a position first (a regex takes the first alternative
        # that matches): Llama 3 has 256, tried in C rather than one `find` each
        longest_first = sorted(self.added, key=len, reverse=True)
        self._added = re.compile("|".join(map(re.escape, longest_first))) if self.added else None

    @classmethod
    def of(cls, spec: dict[str, Any]) -> CutRule | None:
        normalizer = spec.get("normalizer")
        nfc = normalizer == {"type": "NFC"} or (
            isinstance(normalizer, dict)
            and normalizer.get("type") == "Sequence"
            and all(n == {"type": "NFC"} for n in normalizer.get("normalizers") or [None])
        )
        if normalizer is not None and not nfc:
            return None
        model = spec.get("model") or {}
        if model.get("type") != "BPE" or model.get("dropout") not in (None, 0, 0.0):
            return None
        if spec.get("truncation") is not None or spec.get("padding") is not None:
            return None
        pre = spec.get("pre_tokenizer")
        steps = (
            pre.get("pretokenizers")
            if isinstance(pre, dict) and pre.get("type") == "Sequence"
            else [pre]
        )
        kinds = [_splits_at_cuts(s) for s in steps or [None]]
        if None in kinds or True not in kinds:
            return None
        added = spec.get("added_tokens") or []
        for token in added:
            if token.get("lstrip") or token.get("rstrip") or token.get("single_word"):
                return None
            if nfc and token.get("normalized"):
                return None
        return cls([t["content"] for t in added if isinstance(t.get("content"), str)])

    def is_cut(self, text: str, m: int, appended: str = "") -> bool:
        """Whether m is a cut of text + appended (0 < m < len(text))."""
        if not 0 < m < len(text) or text[m] != " ":
            return False
        before = text[m - 1]
        if before.isspace() or before in _ALSO_SPACE:
            return False
        if self._added is None:
            return True
        lo = max(0, m - self.reach + 1)
        starts = [p for p in range(lo, m) if text[p] in self._starts]
        if not starts:
            return True
        window = text[lo : m + self.reach - 1]
        if m + self.reach - 1 > len(text):
            window = (window + appended)[: m + self.reach - 1 - lo]
        for p in starts:  # the longest added token starting at p must end by m
            found = self._added.match(window, p - lo)
            if found is not None and found.end() > m - lo:
                return False
        return True

    def last_cut(self, text: str, lo: int, hi: int, appended: Sequence[str] = ()) -> int | None:
        """The last m in (lo, hi) that is a cut of text and of text + each appended string,
        looking back at most `SEARCH_LIMIT` characters; None when there is none."""
        hi = min(hi, len(text))
        if hi <= lo + 1:
            return None
        floor = max(lo, hi - SEARCH_LIMIT)
        m = text.rfind(" ", floor + 1, hi)
        while m > floor:
            if self.is_cut(text, m) and all(self.is_cut(text, m, a) for a in appended):
                return m
            m = text.rfind(" ", floor + 1, m)
        return None


def common_prefix_length(a: str, b: str) -> int:
    """Characters `a` and `b` begin with alike (slices compared in C, halving the range)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class Heads:
    """The ids of a few beginnings recent prompts shared, each ending at a cut, and the last
    prompts seen (where a new prompt's shared beginning is looked for). Thread-safe."""

    def __init__(self, rule: CutRule, size: int = HEADS):
        self.rule = rule
        self.size = size
        # most recently used first; ids as 32-bit integers (a million-token beginning as a
        # list of ints would hold ~36 MB)
        self._heads: list[tuple[str, array[int]]] = []
        self._recent: list[str] = []  # the last prompts seen, newest first
        self._lock = threading.Lock()

    def longest(self, text: str, appended: Sequence[str]) -> tuple[int, Sequence[int]]:
        """(h, ids of text[:h]) for the longest kept beginning of `text` that ends at a cut of
        it and of text + each appended string; (0, []) when none does."""
        with self._lock:
            heads = list(self._heads)
        best: tuple[str, array[int]] | None = None
        for head, ids in heads:
            h = len(head)
            if (
                (best is None or h > len(best[0]))
                and h < len(text)
                and text.startswith(head)
                and self.rule.is_cut(text, h)
                and all(self.rule.is_cut(text, h, a) for a in appended)
            ):
                best = (head, ids)
        if best is None:
            return 0, []
        with self._lock:
            if best in self._heads:
                self._heads.remove(best)
                self._heads.insert(0, best)
        return len(best[0]), best[1]

    def shared_with_recent(self, text: str) -> int:
        """The most characters `text` begins with alike with one of the last prompts seen
        (prompts under several system prompts in turn each find theirs); `text` is the
        newest seen now."""
        kept = text[:KEEP_CHARS]
        with self._lock:
            recent = self._recent
            self._recent = [kept, *recent[: self.size - 1]]
        return max((common_prefix_length(kept, r) for r in recent), default=0)

    def add(self, head: str, ids: list[int]) -> None:
        with self._lock:
            kept = (head, array("i", ids))
            self._heads = [kept, *(e for e in self._heads if e[0] != head)][: self.size]
