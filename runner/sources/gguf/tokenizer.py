"""A `tokenizers` tokenizer.json, and the configs that go with it, from a GGUF file's
`tokenizer.ggml.*` metadata, with llama.cpp's semantics (its src/llama-vocab.cpp and
src/unicode.cpp, as vendored by llama-cpp-python 0.3.36).

`tokenizer_json(metadata)`, `tokenizer_config(metadata)` and `generation_config(metadata)` take
the GGUF's metadata as plain Python values (key -> str, int, float, bool or a sequence of
them) and give what runner/text/tokenizer.py's `Tokenizer` takes; `tokenizer_files` gives the
three at once. Vocabularies (`tokenizer.ggml.model`):

- `gpt2`: byte-level BPE with the GGUF's merges. Text is split by the regular expressions
  llama.cpp picks for `tokenizer.ggml.pre` (`_PRE_TOKENIZERS`), each a `Split` (isolated) in
  order, then mapped to GPT-2's byte characters. llama.cpp runs its expressions with its own
  Unicode tables, through std::regex on a text whose non-ASCII characters are collapsed to
  one byte per category (so `\\p{Lu}` there means any letter: written `\\p{L}` here) or
  through hand-written equivalents; Oniguruma runs them here. `ignore_merges` (a word that
  is a token is that token) where llama.cpp sets it (llama3, tekken, ...).
- `llama`: SentencePiece. llama.cpp merges, again and again, the adjacent pair whose
  concatenation is the vocabulary's highest-scoring token (the leftmost among equals); here
  that is a BPE whose merges are every split of every token into two tokens, ranked by the
  token's score. Spaces become "▁"; text gets a "▁" in front (each piece between special
  tokens: llama.cpp's "prefix with space if previous is special") unless
  `tokenizer.ggml.add_space_prefix` is false (Gemma); characters without a token become
  their `<0xXX>` byte tokens.
- `gemma4`: BPE with the GGUF's merges over raw UTF-8 with spaces as "▁", split at runs of
  newlines, byte tokens `<0xXX>` for what has no token.

Special tokens: llama.cpp's special-token cache (CONTROL, USER_DEFINED and UNKNOWN tokens,
after it promotes tokens by their text: `<|eot_id|>`, `<|im_end|>`, FIM tokens, ...) becomes
the added tokens, matched in raw text before anything else; Phi-3's get `rstrip` as llama.cpp
gives them. The runner parses special tokens in every text (Go's semantics), which is
llama.cpp's `parse_special = true`.

`generation_config` says llama.cpp's end-of-generation set (`special_eog_ids`): the GGUF's
EOS, EOT and EOM ids, FIM pad/repo/separator tokens, and the tokens it recognises by text
(`<|eot_id|>`, `<|im_end|>`, `<end_of_turn>`, `<|return|>`, ...), less `<|end|>` where
`<|return|>` and `<|call|>` both exist (gpt-oss) and a normal `</s>` (Gemma 4).

Where a vocabulary holds several tokens of one kind (two EOT texts, two FIM prefixes) llama.cpp
takes the first it meets in a hash map; here the highest id, which is what it takes in every
vocabulary checked. An unknown or unsupported `tokenizer.ggml.model` or
`tokenizer.ggml.pre` raises ModelLoadError naming it.

Held to llama.cpp by tests/test_gguf_tokenizer.py: its test vectors, and llama.cpp itself on
generated texts for every pre-tokenizer here. Where they still part:
- characters whose Unicode category differs between llama.cpp's tables (Unicode 15) and
  Oniguruma's (16): the characters new in Unicode 16 are letters here, unassigned there;
- after an `rstrip` special token (Phi-3) llama.cpp strips ASCII whitespace, `tokenizers` any
  (a U+00A0 or U+3000 right after `<|end|>`);
- special tokens whose texts overlap: llama.cpp matches the longest token everywhere first,
  `tokenizers` the leftmost match (the longest there);
- SentencePiece: two different tokens of equal score competing for a character: llama.cpp
  merges the leftmost pair, here the one listed first.
The llama3, qwen2 and qwen35 regexes are llama.cpp's (`'[sS]`, not `(?i:'s)`, which also takes
"'ſ"), which runner/text/cuts.py does not list, so their texts are tokenized whole.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from runner.sources.source import ModelLoadError, show

# tokenizer.ggml.token_type values (llama.cpp's llama_token_type)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# llama.cpp's llama_token_attr bits
_A_UNKNOWN, _A_UNUSED, _A_NORMAL, _A_CONTROL = 1 << 0, 1 << 1, 1 << 2, 1 << 3
_A_USER_DEFINED, _A_BYTE, _A_RSTRIP = 1 << 4, 1 << 5, 1 << 8
_TYPE_ATTR = {
    UNKNOWN: _A_UNKNOWN,
    UNUSED: _A_UNUSED,
    NORMAL: _A_NORMAL,
    CONTROL: _A_CONTROL,
    USER_DEFINED: _A_USER_DEFINED,
    BYTE: _A_BYTE,
}
_SPECIAL = _A_CONTROL | _A_USER_DEFINED | _A_UNKNOWN  # llama.cpp's cache_special_tokens

SPACE = "▁"  # SentencePiece's space

# ---- pre-tokenizers: llama.cpp's regular expressions, verbatim ----

_CONTRACTIONS = "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
GPT2 = "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)"
LLAMA3 = (
    _CONTRACTIONS + "|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*"
    "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
)
QWEN2 = (
    _CONTRACTIONS + "|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*"
    "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
)
QWEN35 = (
    _CONTRACTIONS + "|[^\\r\\n\\p{L}\\p{N}]?[\\p{L}\\p{M}]+|\\p{N}"
    "| ?[^\\s\\p{L}\\p{M}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
)
_CJK = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
# non-ASCII characters escaped: an editor's Unicode normalization would change them
DEEPSEEK_LLM = (
    "[\r\n]",
    "\\s?[A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293"
    "\u0295-\u02af\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c"
    "\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5"
    "\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77"
    "\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59"
    "\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc"
    "\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107"
    "\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139"
    "\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee"
    "\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e"
    "\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a"
    "\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2"
    "\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943]+",
    "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
    "\\s+$",
    _CJK,
    "\\p{N}+",
)
DEEPSEEK_CODER = ("[\r\n]", "\\s?\\p{L}+", "\\s?\\p{P}+", _CJK, "\\p{N}")
DEEPSEEK3 = (
    "\\p{N}{1,3}",
    "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+"
    "| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+",
)
FALCON = ("[\\p{P}\\$\\+<=>\\^~\\|`]+", GPT2, "[0-9][0-9][0-9]")
DEFAULT = ("[\\p{P}\\$\\+<=>\\^~\\|]+", GPT2, "\\p{N}+", "[0-9][0-9][0-9]")
BLOOM = " ?[^(\\s|.,!?\u2026\u3002\uff0c\u3001\u0964\u06d4\u060c)]+"
# the letters' cases in llama.cpp: its collapsed text has one byte for every non-ASCII letter,
# so "[^a-z]" after a letter look-ahead is an upper-case ASCII letter or any other letter
_UPPER, _LOWER = "((?=[\\p{L}])([^a-z]))", "((?=[\\p{L}])([^A-Z]))"
TEKKEN = (
    f"[^\\r\\n\\p{{L}}\\p{{N}}]?{_UPPER}*{_LOWER}+|[^\\r\\n\\p{{L}}\\p{{N}}]?{_UPPER}+{_LOWER}*"
    "|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
)
GPT4O = (
    f"[^\\r\\n\\p{{L}}\\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTIONS}?"
    f"|[^\\r\\n\\p{{L}}\\p{{N}}]?{_UPPER}+{_LOWER}*{_CONTRACTIONS}?"
    "|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
)
SEED_CODER = (
    _CONTRACTIONS + "|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1}| ?[^\\s\\p{L}\\p{N}\\r\\n]+"
    "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
)
BAILINGMOE = (
    "'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}"
    "| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]|\\s+(?!\\S)|\\s+"
)
EXAONE_MOE = (
    _CONTRACTIONS + "|[^\\r\\n\\p{L}\\p{N}]?(?:\\p{L}\\p{M}*(?: \\p{L}\\p{M}*)*)+|\\p{N}"
    "| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]?|\\s*[\\r\\n]|\\s+(?!\\S)|\\s+"
)
MINICPM5 = (
    "\\p{N}{1,3}",
    _CONTRACTIONS + "|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}+| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*"
    "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
)
NEWLINES = "[^\\n]+|[\\n]+"


@dataclass(frozen=True)
class _Pre:
    """What llama.cpp sets for one kind of pre-tokenizer (`llm_tokenizer_bpe`, `load`)."""

    regexes: tuple[str, ...]
    ignore_merges: bool = False
    add_bos: bool = False
    bos: bool = True  # False: no default BOS token (ChatGLM)
    clean_spaces: bool = True
    byte_level: bool = True  # False: "▁" for spaces, raw UTF-8 (Gemma 4)


_LLAMA3 = _Pre((LLAMA3,), ignore_merges=True, add_bos=True)
_GPT2 = _Pre((GPT2,))
_DIGITS_GPT2 = _Pre(("\\p{N}", GPT2))
_QWEN2 = _Pre((QWEN2,), clean_spaces=False)
_DEEPSEEK3 = _Pre(DEEPSEEK3, clean_spaces=False)
_GPT4O = _Pre((GPT4O,), clean_spaces=False)
_GEMMA4 = _Pre((NEWLINES,), add_bos=True, byte_level=False)
# tokenizer.ggml.pre -> what llama.cpp does with it; names it knows but whose splitting needs
# its own code (kimi-k2, afmoe, superbpe, tiny_aya, ...) are left out, and so refused.
_PRE_TOKENIZERS: dict[str, _Pre] = {
    "default": _Pre(DEFAULT),
    **dict.fromkeys(
        (
            "llama3",
            "llama-v3",
            "llama-bpe",
            "falcon3",
            "falcon-h1",
            "pixtral",
            "midm-2.0",
            "lfm2",
            "jina-v5-nano",
        ),
        _LLAMA3,
    ),
    "dbrx": _Pre((LLAMA3,)),
    "smaug-bpe": _Pre((LLAMA3,)),
    "deepseek-llm": _Pre(DEEPSEEK_LLM, clean_spaces=False),
    "deepseek-coder": _Pre(DEEPSEEK_CODER, clean_spaces=False),
    **dict.fromkeys(("deepseek-v3", "hunyuan-dense", "joyai-llm", "hy_v4"), _DEEPSEEK3),
    "falcon": _Pre(FALCON),
    **dict.fromkeys(
        ("starcoder", "refact", "codeshell", "exaone", "minerva-7b", "mellum2"), _DIGITS_GPT2
    ),
    **dict.fromkeys(("command-r", "smollm"), _Pre(("\\p{N}", GPT2), clean_spaces=False)),
    **dict.fromkeys(
        ("gpt-2", "phi-2", "gigachat", "a.x-4.0", "mellum", "exaone4", "mpt", "olmo", "jais"),
        _GPT2,
    ),
    **dict.fromkeys(("trillion", "granite-docling"), _Pre((GPT2,), clean_spaces=False)),
    **dict.fromkeys(
        ("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "hunyuan", "solar-open"), _QWEN2
    ),
    **dict.fromkeys(("stablelm2", "megrez"), _Pre((QWEN2,))),
    "grok-2": _Pre((QWEN2,), clean_spaces=False),
    "qwen35": _Pre((QWEN35,), clean_spaces=False),
    "poro-chat": _Pre((BLOOM,), clean_spaces=False),
    **dict.fromkeys(("bloom", "gpt3-finnish"), _Pre((BLOOM,))),
    "viking": _Pre((BLOOM, "\\p{N}"), clean_spaces=False),
    "chatglm-bpe": _Pre((LLAMA3,), bos=False),
    **dict.fromkeys(("glm4", "glm5"), _Pre((LLAMA3,), ignore_merges=True, bos=False)),
    "tekken": _Pre((TEKKEN,), ignore_merges=True, add_bos=True, clean_spaces=False),
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _GPT4O),
    "seed-coder": _Pre((SEED_CODER,), clean_spaces=False),
    **dict.fromkeys(
        ("bailingmoe", "bailingmoe2", "llada-moe"), _Pre((BAILINGMOE,), clean_spaces=False)
    ),
    "laguna": _Pre((NEWLINES, QWEN2), clean_spaces=False),
    "exaone-moe": _Pre((EXAONE_MOE,)),
    "minicpm5": _Pre(MINICPM5, ignore_merges=True),
    **dict.fromkeys(("gemma4", "granite-embed-multi-311m"), _GEMMA4),
}

# ---- special tokens llama.cpp recognises by their text ----

_EOT_TEXTS = (
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "<｜end▁of▁sentence｜>",
    "<end_of_utterance>",
)
_EOM_TEXTS = ("<|eom_id|>",)
_FIM_TEXTS = {
    "fim_pre": (
        "<|fim_prefix|>",
        "<fim-prefix>",
        "<fim_prefix>",
        "<｜fim▁begin｜>",
        "<PRE>",
        "▁<PRE>",
        "<|code_prefix|>",
        "<|prefix|>",
    ),
    "fim_suf": (
        "<|fim_suffix|>",
        "<fim-suffix>",
        "<fim_suffix>",
        "<｜fim▁hole｜>",
        "<SUF>",
        "▁<SUF>",
        "<|code_suffix|>",
        "<|suffix|>",
    ),
    "fim_mid": (
        "<|fim_middle|>",
        "<fim-middle>",
        "<fim_middle>",
        "<｜fim▁end｜>",
        "<MID>",
        "▁<MID>",
        "<|code_middle|>",
        "<|middle|>",
    ),
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}
_EOG_TEXTS = frozenset(
    (
        "<|eot_id|>",
        "<|im_end|>",
        "<|end|>",
        "<|return|>",
        "<|call|>",
        "<|flush|>",
        "<|calls|>",
        "<end_of_turn>",
        "<|endoftext|>",
        "</s>",
        "<|eom_id|>",
        "<EOT>",
        "_<EOT>",
        "[EOT]",
        "[EOS]",
        "<|end_of_text|>",
        "<end_of_utterance>",
        "<eos>",
        "<turn|>",
        "<|tool_response>",
        "<｜end▁of▁sentence｜>",
        "[e~[",
    )
)
_ALWAYS_RENDERED = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")  # gpt-oss
# the special token ids llama.cpp reads: its name here -> the GGUF key's middle
_ID_KEYS = {
    "bos": "bos",
    "eos": "eos",
    "eot": "eot",
    "eom": "eom",
    "unk": "unknown",
    "sep": "seperator",  # sic, llama.cpp's key
    "pad": "padding",
    "mask": "mask",
    "fim_pre": "fim_pre",
    "fim_suf": "fim_suf",
    "fim_mid": "fim_mid",
    "fim_pad": "fim_pad",
    "fim_rep": "fim_rep",
    "fim_sep": "fim_sep",
}
_DEPRECATED_FIM = {"fim_pre": "prefix", "fim_suf": "suffix", "fim_mid": "middle"}


# ---- the vocabulary, as llama.cpp loads it ----


@dataclass
class Vocab:
    """A GGUF vocabulary after llama.cpp's `llama_vocab::impl::load`."""

    model: str  # "gpt2", "llama" or "gemma4"
    pre: _Pre | None  # None for SentencePiece
    tokens: list[str]
    token_to_id: dict[str, int]  # the last id of each text, as llama.cpp's map keeps
    scores: list[float] | None
    attrs: list[int]
    merges: list[tuple[str, str]]
    ids: dict[str, int | None]  # "bos", "eos", "eot", ... -> id
    add_bos: bool
    add_eos: bool
    add_space_prefix: bool
    eog: set[int]
    metadata: Mapping[str, Any]

    def special_ids(self) -> list[int]:
        """The ids of llama.cpp's special-token cache (what it matches in raw text)."""
        return [
            i
            for i, attr in enumerate(self.attrs)
            if attr & _SPECIAL and self.token_to_id.get(self.tokens[i]) == i
        ]

    def text(self, key: str) -> str | None:
        token = self.ids.get(key)
        return None if token is None else self.tokens[token]


class _Metadata:
    """Typed reads of GGUF metadata given as plain Python values (numpy scalars and arrays
    accepted too); a value of the wrong type is a ModelLoadError naming its key."""

    def __init__(self, metadata: Mapping[str, Any]):
        self.metadata = metadata

    def _scalar(self, key: str) -> Any:
        value = self.metadata.get(key)
        item = getattr(value, "item", None) if hasattr(value, "dtype") else None
        return value if item is None else item()

    def string(self, key: str) -> str | None:
        value = self._scalar(key)
        return None if value is None else _string(value, key)

    def integer(self, key: str) -> int | None:
        value = self._scalar(key)
        return None if value is None else _integer(value, key)

    def flag(self, key: str) -> bool | None:
        value = self._scalar(key)
        if value is None:
            return None
        if not isinstance(value, (bool, int)):
            raise ModelLoadError(f"GGUF metadata {key} is not a boolean: {show(value)}")
        return bool(value)

    def array(self, key: str) -> list[Any] | None:
        value = self.metadata.get(key)
        if value is None:
            return None
        if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
            raise ModelLoadError(f"GGUF metadata {key} is not an array: {show(value)}")
        return list(value.tolist() if hasattr(value, "tolist") else value)


def _string(value: Any, key: str) -> str:
    """A metadata string. One that was not UTF-8 (read with "surrogateescape", or given as
    bytes) gets U+FFFD for its bad bytes: tokenizer.json is UTF-8."""
    if isinstance(value, str):
        if value.isascii():
            return value
        try:
            value.encode()
            return value
        except UnicodeEncodeError:
            try:
                value = value.encode("utf-8", "surrogateescape")
            except UnicodeEncodeError:
                value = value.encode("utf-8", "replace")
    if isinstance(value, (bytes, bytearray)):
        return bytes(value).decode("utf-8", "replace")
    raise ModelLoadError(f"GGUF metadata {key} holds a non-string: {show(value)}")


def _integer(value: Any, key: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise ModelLoadError(f"GGUF metadata {key} holds a non-integer: {show(value)}")


def _pre_tokenizer(model: str, name: str | None) -> _Pre | None:
    """What llama.cpp does for `tokenizer.ggml.model` and `tokenizer.ggml.pre` (None for
    SentencePiece, which has no pre-tokenizer)."""
    if model == "llama":
        return None
    if model == "gemma4":
        return _GEMMA4  # llama.cpp sets tokenizer_pre = "gemma4" whatever the file says
    if model != "gpt2":
        raise ModelLoadError(f"unsupported GGUF tokenizer model: {show(model)}")
    pre = _PRE_TOKENIZERS.get(name or "default")  # none: llama.cpp's warning and "default"
    if pre is None:
        raise ModelLoadError(f"unsupported GGUF pre-tokenizer: {show(name)}")
    return pre


def load_vocab(metadata: Mapping[str, Any]) -> Vocab:
    """The vocabulary llama.cpp loads from `metadata`; ModelLoadError when it cannot be
    rebuilt (a missing vocabulary, an unknown or unsupported model or pre-tokenizer)."""
    meta = _Metadata(metadata)
    model = meta.string("tokenizer.ggml.model")
    if model is None:
        raise ModelLoadError("GGUF metadata has no tokenizer.ggml.model")
    pre = _pre_tokenizer(model, meta.string("tokenizer.ggml.pre"))

    raw_tokens = meta.array("tokenizer.ggml.tokens")
    if not raw_tokens:
        raise ModelLoadError("GGUF metadata has no tokenizer.ggml.tokens")
    n = len(raw_tokens)
    # an empty token gets the name llama.cpp gives it
    tokens = [
        _string(t, "tokenizer.ggml.tokens") or f"[EMPTY_{i}]" for i, t in enumerate(raw_tokens)
    ]
    token_to_id = {text: i for i, text in enumerate(tokens)}

    scores = meta.array("tokenizer.ggml.scores")
    if scores is not None:
        if len(scores) < n:
            raise ModelLoadError(f"GGUF has {len(scores)} token scores for {n} tokens")
        scores = [float(s) for s in scores[:n]]
    types = meta.array("tokenizer.ggml.token_type")
    if types is None:
        attrs = [_A_NORMAL] * n
    else:
        if len(types) < n:
            raise ModelLoadError(f"GGUF has {len(types)} token types for {n} tokens")
        attrs = [_TYPE_ATTR.get(_integer(t, "tokenizer.ggml.token_type"), 0) for t in types[:n]]

    merges: list[tuple[str, str]] = []
    if model != "llama":
        raw_merges = meta.array("tokenizer.ggml.merges")
        if raw_merges is None:
            raise ModelLoadError("GGUF metadata has no tokenizer.ggml.merges")
        for raw in raw_merges:
            merge = _string(raw, "tokenizer.ggml.merges")
            at = merge.find(" ", 1)  # llama.cpp: the first space after the first character
            merges.append((merge[:at], merge[at + 1 :]) if at >= 0 else ("", ""))

    # llama.cpp's defaults for the vocabulary's type, then the file's ids where in range
    defaults: dict[str, int | None] = {}
    if model == "llama":
        defaults = {"bos": 1, "eos": 2, "unk": 0}
    elif model == "gpt2":
        defaults = {"bos": 11 if pre is not None and pre.bos else None, "eos": 11}
    ids: dict[str, int | None] = {}
    for key, name in _ID_KEYS.items():
        token = defaults.get(key)
        ids[key] = token if token is not None and token < n else None
        for name_ in (name, _DEPRECATED_FIM.get(key)):
            given = meta.integer(f"tokenizer.ggml.{name_}_token_id") if name_ else None
            if given is not None and 0 <= given < n:
                ids[key] = given

    add_space_prefix = model == "llama"
    given_prefix = meta.flag("tokenizer.ggml.add_space_prefix")
    if model == "llama" and given_prefix is not None:
        add_space_prefix = given_prefix
    add_bos = model == "llama" or (pre is not None and pre.add_bos)
    add_bos = _either(meta.flag("tokenizer.ggml.add_bos_token"), add_bos)
    add_eos = _either(meta.flag("tokenizer.ggml.add_eos_token"), False)
    if pre is _GEMMA4:
        add_bos = True  # llama.cpp's workaround for Gemma 4

    vocab = Vocab(
        model=model,
        pre=pre,
        tokens=tokens,
        token_to_id=token_to_id,
        scores=scores,
        attrs=attrs,
        merges=merges,
        ids=ids,
        add_bos=add_bos,
        add_eos=add_eos,
        add_space_prefix=add_space_prefix,
        eog=set(),
        metadata=metadata,
    )
    _recognise_by_text(vocab)
    return vocab


def _either(given: bool | None, default: bool) -> bool:
    return default if given is None else given


def _recognise_by_text(vocab: Vocab) -> None:
    """llama.cpp's "auto-detect special tokens by text", its end-of-generation set and the
    per-model token attributes, in its order."""
    attrs, ids, eog = vocab.attrs, vocab.ids, vocab.eog
    # llama.cpp walks an unordered_map, which meets later tokens first in every vocabulary
    # checked (<|eot_id|> before <|end_of_text|>, <|im_end|> before <|endoftext|>)
    by_text = sorted(vocab.token_to_id.items(), key=lambda item: -item[1])

    kinds = {"eot": _EOT_TEXTS, "eom": _EOM_TEXTS, **_FIM_TEXTS}
    for text, token in by_text:
        for key, texts in kinds.items():
            if ids[key] is None and text in texts:
                ids[key] = token
                attrs[token] |= _A_CONTROL  # "control-looking token ... will be overridden"

    eog.update(t for key in ("fim_pad", "fim_rep", "fim_sep") if (t := ids[key]) is not None)
    for text, token in by_text:
        if text in _EOG_TEXTS:
            eog.add(token)
            attrs[token] |= _A_CONTROL
    for text in _ALWAYS_RENDERED:
        if text in vocab.token_to_id:
            attrs[vocab.token_to_id[text]] = _A_USER_DEFINED
    eog.update(t for key in ("eos", "eot", "eom") if (t := ids[key]) is not None)

    ends = {vocab.tokens[t]: t for t in sorted(eog)}
    calls = "<|call|>" in ends or "<|calls|>" in ends
    if "<|end|>" in ends and calls and ("<|return|>" in ends or "<|flush|>" in ends):
        eog.discard(ends["<|end|>"])  # gpt-oss, solar-open: it ends a message, not the turn
        attrs[ends["<|end|>"]] = _A_USER_DEFINED
    if "</s>" in ends and ("<|tool_response>" in ends or "<|plamo:eos|>" in ends):
        eog.discard(ends["</s>"])  # Gemma 4, PLaMo 2: a normal </s>
        attrs[ends["</s>"]] = _A_NORMAL

    name = str(vocab.metadata.get("general.name") or "").lower()
    if "phi-3" in name or "phi3" in name:  # llama.cpp's per-model attributes
        for token in vocab.special_ids():
            attrs[token] |= _A_RSTRIP
        for text, strip in (
            ("</s>", True),
            ("<unk>", False),
            ("<s>", False),
            ("<|endoftext|>", False),
        ):
            found = vocab.token_to_id.get(text)
            if found is not None:
                attrs[found] = attrs[found] | _A_RSTRIP if strip else attrs[found] & ~_A_RSTRIP


# ---- tokenizer.json ----


# llama.cpp's whitespace beyond ASCII, which it turns into U+000B before running a regex
_WIDE_SPACES = (
    "\\x{85}\\x{a0}\\x{1680}\\x{2000}-\\x{200a}\\x{2028}\\x{2029}\\x{202f}\\x{205f}\\x{3000}"
)


def as_oniguruma(regex: str) -> str:
    """One of llama.cpp's regexes, to run with Oniguruma as llama.cpp runs it.

    With a Unicode category (`\\p{...}`) llama.cpp matches on a text collapsed to one byte
    per category, where `\\p{Lu}`, `\\p{Ll}`, ... are all one letter byte: `\\p{L}` here.
    Without, it runs std::wregex on a text whose non-ASCII whitespace is U+000B, so that a
    class's literal U+3000 (or a range over it) never matches it: such classes here exclude
    that whitespace (negated classes are left alone: those in the table exclude `\\s`)."""
    if "\\p{" in regex:
        return re.sub(r"\\p\{L[ultmo]\}", r"\\p{L}", regex)
    out, i = [], 0
    while i < len(regex):
        char = regex[i]
        if char == "\\":
            out.append(regex[i : i + 2])
            i += 2
        elif char == "[":
            end = i + 1
            while regex[end] != "]":
                end += 2 if regex[end] == "\\" else 1
            body = regex[i + 1 : end]
            if body.startswith("^") or body.isascii():
                out.append(regex[i : end + 1])
            else:
                out.append(f"[{body}&&[^{_WIDE_SPACES}]]")
            i = end + 1
        else:
            out.append(char)
            i += 1
    return "".join(out)


def _split(regex: str) -> dict[str, Any]:
    pattern = {"Regex": as_oniguruma(regex)}
    return {"type": "Split", "pattern": pattern, "behavior": "Isolated", "invert": False}


def _gpt2_bytes() -> list[str]:
    """GPT-2's byte -> printable character table, by byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = {b: chr(b) for b in printable}
    others = (b for b in range(256) if b not in chars)
    chars.update((b, chr(256 + n)) for n, b in enumerate(others))
    return [chars[b] for b in range(256)]


def _byte_level_pre_tokenizer(vocab: Vocab, regexes: Sequence[str]) -> dict[str, Any]:
    """The regexes in order, then GPT-2's byte mapping. GPT-2's regex last is ByteLevel's
    own (its extra `|\\s+` is what llama.cpp's hand-written GPT-2 splitter does too) and a
    lone `\\p{N}` before it is Digits (Rust's `is_numeric`: the same categories): the
    pipeline runner/text/cuts.py knows how to cut.

    A byte without a token (Falcon has none for U+000B) is dropped by both, but `tokenizers`
    would then merge its neighbours, which llama.cpp never does: such bytes are split off."""
    steps: list[dict[str, Any]] = []
    last_is_gpt2 = regexes[-1] == GPT2
    for regex in regexes[:-1] if last_is_gpt2 else regexes:
        if regex == "\\p{N}" and last_is_gpt2:
            steps.append({"type": "Digits", "individual_digits": True})
        else:
            steps.append(_split(regex))
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True}
    steps.append({**byte_level, "use_regex": last_is_gpt2})
    missing = [c for c in _gpt2_bytes() if c not in vocab.token_to_id]
    if missing:
        pattern = "[" + "".join(f"\\x{{{ord(c):x}}}" for c in missing) + "]"
        steps.append(
            {
                "type": "Split",
                "pattern": {"Regex": pattern},
                "behavior": "Isolated",
                "invert": False,
            }
        )
    return steps[0] if len(steps) == 1 else {"type": "Sequence", "pretokenizers": steps}


def _score_merges(vocab: Vocab) -> list[tuple[str, str]]:
    """SentencePiece's merges as BPE: every split of a token into two tokens, the highest
    scoring token's splits first (llama.cpp merges the best-scoring pair first)."""
    token_to_id, scores = vocab.token_to_id, vocab.scores
    ranked = []
    for text, token in token_to_id.items():
        score = scores[token] if scores is not None else 0.0
        for at in range(1, len(text)):
            left, right = text[:at], text[at:]
            if left in token_to_id and right in token_to_id:
                ranked.append((-score, token, token_to_id[left], token_to_id[right], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _bpe_merges(vocab: Vocab) -> list[tuple[str, str]]:
    """The GGUF's merges that `tokenizers` can hold: both parts and their concatenation
    tokens, each pair once at its first rank (llama.cpp keeps the first too)."""
    seen: set[tuple[str, str]] = set()
    out = []
    for pair in vocab.merges:
        left, right = pair
        if pair in seen or not left or not right:
            continue
        if (
            left in vocab.token_to_id
            and right in vocab.token_to_id
            and left + right in vocab.token_to_id
        ):
            seen.add(pair)
            out.append(pair)
    return out


def _sentencepiece_decoder(strip_prefix: bool) -> dict[str, Any]:
    """Hugging Face's Llama decoder ("▁" as a space, byte tokens fused into text); its
    Replace of "▁" is how runner/text/tokenizer.py tells SentencePiece pieces apart."""
    steps: list[dict[str, Any]] = [
        {"type": "Replace", "pattern": {"String": SPACE}, "content": " "},
        {"type": "ByteFallback"},
        {"type": "Fuse"},
    ]
    if strip_prefix:
        steps.append({"type": "Strip", "content": " ", "start": 1, "stop": 0})
    return {"type": "Sequence", "decoders": steps}


_ESCAPE_SPACES = {"type": "Replace", "pattern": {"String": " "}, "content": SPACE}


def tokenizer_spec(vocab: Vocab) -> dict[str, Any]:
    """tokenizer.json's content for `vocab`, as a dict."""
    added = [
        {
            "id": token,
            "content": vocab.tokens[token],
            "single_word": False,
            "lstrip": False,
            "rstrip": bool(vocab.attrs[token] & _A_RSTRIP),
            "normalized": False,
            "special": not vocab.attrs[token] & _A_USER_DEFINED,
        }
        for token in vocab.special_ids()
    ]
    model: dict[str, Any] = {
        "type": "BPE",
        "dropout": None,
        "unk_token": None,
        "continuing_subword_prefix": None,
        "end_of_word_suffix": None,
        "fuse_unk": False,
        "byte_fallback": False,
        "ignore_merges": False,
        "vocab": vocab.token_to_id,
    }
    normalizer: dict[str, Any] | None = None
    pre_tokenizer: dict[str, Any] | None = None
    post_processor: dict[str, Any] | None = None
    if vocab.pre is None:  # SentencePiece
        model.update(unk_token=vocab.text("unk"), fuse_unk=True, byte_fallback=True)
        model["merges"] = _score_merges(vocab)
        normalizer = _ESCAPE_SPACES
        if vocab.add_space_prefix:
            prepend = {"type": "Prepend", "prepend": SPACE}
            normalizer = {"type": "Sequence", "normalizers": [prepend, _ESCAPE_SPACES]}
        decoder = _sentencepiece_decoder(strip_prefix=vocab.add_space_prefix)
    elif not vocab.pre.byte_level:  # Gemma 4: "▁" BPE over raw UTF-8
        model.update(byte_fallback=True, merges=_bpe_merges(vocab))
        normalizer = _ESCAPE_SPACES
        pre_tokenizer = _split(NEWLINES)
        decoder = _sentencepiece_decoder(strip_prefix=False)
    else:
        model.update(ignore_merges=vocab.pre.ignore_merges, merges=_bpe_merges(vocab))
        pre_tokenizer = _byte_level_pre_tokenizer(vocab, vocab.pre.regexes)
        byte_level = {"type": "ByteLevel", "add_prefix_space": False}
        post_processor = {**byte_level, "trim_offsets": False, "use_regex": False}
        decoder = {**byte_level, "trim_offsets": True, "use_regex": True}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": normalizer,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": post_processor,
        "decoder": decoder,
        "model": model,
    }


def config_of(vocab: Vocab) -> dict[str, Any]:
    """tokenizer_config.json's content for `vocab`."""
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": vocab.add_bos,
        "add_eos_token": vocab.add_eos,
        "bos_token": vocab.text("bos"),
        "eos_token": vocab.text("eos"),
        "unk_token": vocab.text("unk"),
        "pad_token": vocab.text("pad"),
        "clean_up_tokenization_spaces": vocab.pre.clean_spaces if vocab.pre else False,
    }
    template = vocab.metadata.get("tokenizer.chat_template")
    if template is not None:
        config["chat_template"] = _string(template, "tokenizer.chat_template")
    return config


def generation_config_of(vocab: Vocab) -> dict[str, Any]:
    """generation_config.json's content for `vocab`: `eos_token_id` is llama.cpp's
    end-of-generation set, lowest id first."""
    config: dict[str, Any] = {}
    for key in ("bos", "pad"):
        if vocab.ids[key] is not None:
            config[f"{key}_token_id"] = vocab.ids[key]
    if vocab.eog:
        config["eos_token_id"] = sorted(vocab.eog)
    return config


def tokenizer_json(metadata: Mapping[str, Any]) -> str:
    """The text of a tokenizer.json for the GGUF vocabulary in `metadata`."""
    return json.dumps(tokenizer_spec(load_vocab(metadata)), ensure_ascii=False)


def tokenizer_config(metadata: Mapping[str, Any]) -> dict[str, Any]:
    """A tokenizer_config.json for it: BOS, EOS, UNK and PAD texts, add_bos_token and
    add_eos_token as llama.cpp decides them, the chat template."""
    return config_of(load_vocab(metadata))


def generation_config(metadata: Mapping[str, Any]) -> dict[str, Any]:
    """A generation_config.json for it: BOS and PAD ids, and as `eos_token_id` every token
    llama.cpp ends a generation at."""
    return generation_config_of(load_vocab(metadata))


def tokenizer_files(metadata: Mapping[str, Any]) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """(tokenizer_json, tokenizer_config, generation_config), the vocabulary read once."""
    vocab = load_vocab(metadata)
    spec = json.dumps(tokenizer_spec(vocab), ensure_ascii=False)
    return spec, config_of(vocab), generation_config_of(vocab)
