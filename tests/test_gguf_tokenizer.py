"""runner/sources/gguf/tokenizer.py: a tokenizer.json and its configs from a GGUF's
`tokenizer.ggml.*` metadata, held to llama.cpp.

- Small GGUFs written here (gguf.GGUFWriter) check the errors, the special and added tokens,
  BOS/EOS/EOG, and SentencePiece against a port of llama.cpp's SPM loop. They run everywhere.
- llama.cpp's own test vectors (models/ggml-vocab-*.gguf with .inp/.out, as its
  tests/test-tokenizer-0.cpp reads them) ship in the llama-cpp-python sdist. They are read from
  `$OLLAMA_MLX_RUNNER_LLAMA_SDIST` (an unpacked sdist), else from the bench's sdist cache
  (bench/llamacpp.py `sdist_cache`: `<cache root>/llama-cpp-src/<version>/models/`), unpacked
  there from `<cache root>/llama-cpp-src/llama_cpp_python-<version>.tar.gz` when only the
  tarball is there; skipped when neither is. Every input goes through the runner's own
  `Tokenizer.encode`.
- With llama-cpp-python installed (marker `llama`), llama.cpp itself tokenizes generated texts
  for every pre-tokenizer the module knows, and says its end-of-generation set and token
  attributes for every vocabulary file.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import re
import unicodedata
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from bench.llamacpp import SDIST_ROOT, sdist_cache, unpacked_sdist
from runner.sources.gguf.tokenizer import (
    _PRE_TOKENIZERS,
    CONTROL,
    NORMAL,
    UNKNOWN,
    UNUSED,
    USER_DEFINED,
    generation_config,
    load_vocab,
    tokenizer_config,
    tokenizer_files,
    tokenizer_json,
)
from runner.sources.source import ModelLoadError
from runner.text.cuts import CutRule
from runner.text.tokenizer import Tokenizer

gguf = pytest.importorskip("gguf")

LLAMA_CPP_PYTHON = "0.3.36"  # the sdist whose vocabularies and vectors are read
SDIST_ENV = "OLLAMA_MLX_RUNNER_LLAMA_SDIST"
SEPARATOR = "\n__ggml_vocab_test__\n"  # tests/test-tokenizer-0.cpp's
# every vocabulary with vectors in the sdist, and what it checks (the pre-tokenizer)
VECTORS = {
    "llama-bpe": "gpt2 / llama-bpe (Llama 3)",
    "qwen2": "gpt2 / qwen2",
    "qwen35": "gpt2 / qwen35",
    "gpt-2": "gpt2 / gpt-2",
    "mpt": "gpt2 / mpt (GPT-2's regex)",
    "starcoder": "gpt2 / starcoder (smollm's regexes)",
    "refact": "gpt2 / refact (smollm's regexes)",
    "command-r": "gpt2 / command-r (smollm's regexes)",
    "deepseek-llm": "gpt2 / deepseek-llm",
    "deepseek-coder": "gpt2 / deepseek-coder",
    "falcon": "gpt2 / falcon",
    "llama-spm": "llama (SentencePiece, a space prefix)",
    "phi-3": "llama (SentencePiece, rstrip special tokens)",
    "gemma-4": "gemma4 (BPE over raw UTF-8)",
}
NOT_CLAIMED = {"bert-bge": "WordPiece (`bert`), an embedding model's vocabulary"}


# ---- GGUF files ----


def read_metadata(path: Path) -> dict[str, Any]:
    """A GGUF's metadata as plain values: the runner's reader where it exists, else
    gguf.GGUFReader (slower: ~10 s for a 128k vocabulary)."""
    try:
        from runner.sources.gguf.reader import read_gguf
    except ImportError:
        reader = gguf.GGUFReader(path)
        return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    return dict(read_gguf(path).metadata)


def _value_type(value: Any) -> Any:
    T = gguf.GGUFValueType
    if isinstance(value, bool):
        return T.BOOL
    if isinstance(value, int):
        return T.UINT32
    if isinstance(value, float):
        return T.FLOAT32
    return T.STRING


def write_gguf(path: Path, metadata: Mapping[str, Any], arch: str = "llama") -> Path:
    """A GGUF holding only `metadata` (arrays typed by their first item; token types INT32)."""
    writer = gguf.GGUFWriter(str(path), arch=arch)
    for key, value in metadata.items():
        if isinstance(value, list):
            sub = gguf.GGUFValueType.INT32 if key.endswith("token_type") else None
            writer.add_key_value(key, value, gguf.GGUFValueType.ARRAY, sub or _value_type(value[0]))
        else:
            writer.add_key_value(key, value, _value_type(value))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return path


def gguf_metadata(tmp_path: Path, metadata: Mapping[str, Any], arch: str = "llama") -> dict:
    """`metadata` written to a GGUF and read back, as a model's would be."""
    return read_metadata(write_gguf(tmp_path / "vocab.gguf", metadata, arch))


def runner_tokenizer(metadata: Mapping[str, Any]) -> Tokenizer:
    text, config, generation = tokenizer_files(metadata)
    return Tokenizer(text, tokenizer_config=config, generation_config=generation)


# ---- a small byte-level BPE vocabulary ----


def gpt2_chars() -> list[str]:
    """GPT-2's byte -> character table, by byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = {b: chr(b) for b in printable}
    chars.update((b, chr(256 + n)) for n, b in enumerate(b for b in range(256) if b not in chars))
    return [chars[b] for b in range(256)]


BYTES = gpt2_chars()
MERGES = ["Ġ t", "h e", "Ġt he", "Ġ a", "a b", "1 2", "12 3"]


def bpe_metadata(
    pre: str | None = "gpt-2", specials: Mapping[str, int] | None = None, **extra: Any
) -> dict[str, Any]:
    """256 byte tokens, the merges' tokens, then `specials` (text -> token type)."""
    tokens = [*BYTES, "Ġt", "he", "Ġthe", "Ġa", "ab", "12", "123"]
    types = [NORMAL] * len(tokens)
    for text, kind in (specials or {}).items():
        tokens.append(text)
        types.append(kind)
    metadata: dict[str, Any] = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": MERGES,
        **extra,
    }
    if pre is not None:
        metadata["tokenizer.ggml.pre"] = pre
    return metadata


def ids_of(metadata: Mapping[str, Any], *texts: str) -> list[int]:
    tokens = metadata["tokenizer.ggml.tokens"]
    return [tokens.index(t) for t in texts]


# ---- errors ----


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"tokenizer.ggml.model": "bert"}, "unsupported GGUF tokenizer model: 'bert'"),
        ({"tokenizer.ggml.model": "t5"}, "unsupported GGUF tokenizer model: 't5'"),
        ({"tokenizer.ggml.pre": "no-such-pre"}, "unsupported GGUF pre-tokenizer: 'no-such-pre'"),
        # known to llama.cpp, but split by its own code, not a regex: refused too
        ({"tokenizer.ggml.pre": "kimi-k2"}, "unsupported GGUF pre-tokenizer: 'kimi-k2'"),
        ({"tokenizer.ggml.pre": "superbpe"}, "unsupported GGUF pre-tokenizer: 'superbpe'"),
    ],
)
def test_an_unknown_or_unsupported_vocabulary_is_named(tmp_path, change, message):
    metadata = gguf_metadata(tmp_path, {**bpe_metadata(), **change})
    for build in (tokenizer_json, tokenizer_config, generation_config):
        with pytest.raises(ModelLoadError) as caught:
            build(metadata)
        assert str(caught.value) == message


def test_a_missing_or_short_vocabulary_is_an_error(tmp_path):
    metadata = bpe_metadata()
    with pytest.raises(ModelLoadError, match=re.escape("no tokenizer.ggml.model")):
        tokenizer_json({k: v for k, v in metadata.items() if k != "tokenizer.ggml.model"})
    with pytest.raises(ModelLoadError, match=re.escape("no tokenizer.ggml.tokens")):
        tokenizer_json({k: v for k, v in metadata.items() if k != "tokenizer.ggml.tokens"})
    with pytest.raises(ModelLoadError, match=re.escape("no tokenizer.ggml.merges")):
        tokenizer_json({k: v for k, v in metadata.items() if k != "tokenizer.ggml.merges"})
    short = {**metadata, "tokenizer.ggml.token_type": [NORMAL] * 3}
    with pytest.raises(ModelLoadError, match="3 token types for 263 tokens"):
        tokenizer_json(short)
    with pytest.raises(ModelLoadError, match=re.escape("tokenizer.ggml.pre holds a non-string: 7")):
        tokenizer_json({**metadata, "tokenizer.ggml.pre": 7})
    with pytest.raises(ModelLoadError, match="is not an array"):
        tokenizer_json({**metadata, "tokenizer.ggml.tokens": "abc"})


def test_no_pre_tokenizer_is_llama_cpps_default(tmp_path):
    """A gpt2 vocabulary without tokenizer.ggml.pre: llama.cpp warns and uses "default"."""
    without = tokenizer_json(gguf_metadata(tmp_path, bpe_metadata(pre=None)))
    assert without == tokenizer_json(bpe_metadata(pre="default"))


# ---- special and added tokens, BOS, EOS, end of generation ----


def test_control_user_defined_and_unknown_tokens_are_added_and_parsed(tmp_path):
    specials = {
        "<|begin_of_text|>": CONTROL,
        "<|user_tag|>": USER_DEFINED,
        "<oov>": UNKNOWN,
        "<plain>": NORMAL,
        "<unused0>": UNUSED,
    }
    metadata = gguf_metadata(tmp_path, bpe_metadata(specials=specials))
    spec = json.loads(tokenizer_json(metadata))
    added = {t["content"]: t for t in spec["added_tokens"]}
    assert set(added) == {"<|begin_of_text|>", "<|user_tag|>", "<oov>"}
    assert added["<|begin_of_text|>"]["special"] and added["<oov>"]["special"]
    assert not added["<|user_tag|>"]["special"]
    assert all(not t["normalized"] and not t["lstrip"] and not t["rstrip"] for t in added.values())

    tok = runner_tokenizer(metadata)
    bot, user, oov = ids_of(metadata, "<|begin_of_text|>", "<|user_tag|>", "<oov>")
    the, a = ids_of(metadata, "Ġthe", "Ġa")
    assert tok.encode("<|begin_of_text|> the<|user_tag|> a<oov>") == [bot, the, user, a, oov]
    assert tok.is_special("<|user_tag|>") and not tok.is_special("<plain>")
    # a NORMAL or UNUSED token's text is text
    assert len(tok.encode("<plain>")) > 1 and len(tok.encode("<unused0>")) > 1


def test_bpe_merges_ranks_and_byte_level(tmp_path):
    metadata = gguf_metadata(tmp_path, bpe_metadata())
    tok = runner_tokenizer(metadata)
    assert tok.encode(" the") == ids_of(metadata, "Ġthe")
    assert tok.encode("the") == ids_of(metadata, "t", "he")
    assert tok.encode("1234") == ids_of(metadata, "123", "4")
    assert tok.encode(" ab") == ids_of(metadata, "Ġa", "b")  # "Ġ a" ranks before "a b"
    assert tok.encode("é") == [BYTES.index("Ã"), BYTES.index("©")]
    assert tok.token_bytes(ids_of(metadata, "Ġthe")[0]) == b" the"


def test_llama3_ignores_merges_for_a_word_that_is_a_token(tmp_path):
    """ "Ġab" is a token but no merge makes it: llama.cpp's llama3 pre-tokenizer takes the
    word whole (ignore_merges), gpt-2's merges it from its pieces."""
    base = bpe_metadata()
    base["tokenizer.ggml.tokens"] = [*base["tokenizer.ggml.tokens"], "Ġab"]
    base["tokenizer.ggml.token_type"] = [*base["tokenizer.ggml.token_type"], NORMAL]
    llama3 = runner_tokenizer(gguf_metadata(tmp_path, {**base, "tokenizer.ggml.pre": "llama3"}))
    gpt2 = runner_tokenizer(base)
    assert llama3.encode(" ab") == ids_of(base, "Ġab")
    assert gpt2.encode(" ab") == ids_of(base, "Ġa", "b")


@pytest.mark.parametrize(
    ("pre", "given", "add_bos"),
    [
        ("gpt-2", None, False),
        ("llama-bpe", None, True),  # llama.cpp's default for llama3 and tekken
        ("tekken", None, True),
        ("llama-bpe", False, False),  # tokenizer.ggml.add_bos_token wins
        ("qwen2", True, True),
    ],
)
def test_add_bos_follows_llama_cpp(tmp_path, pre, given, add_bos):
    extra = {"tokenizer.ggml.bos_token_id": 256}
    if given is not None:
        extra["tokenizer.ggml.add_bos_token"] = given
    metadata = gguf_metadata(tmp_path, bpe_metadata(pre=pre, **extra))
    config = tokenizer_config(metadata)
    assert config["add_bos_token"] is add_bos and config["add_eos_token"] is False
    tok = runner_tokenizer(metadata)
    assert tok.add_bos is add_bos
    assert tok.encode(" the", tok.add_bos)[:1] == ([256] if add_bos else ids_of(metadata, "Ġthe"))


def test_configs_name_the_special_tokens_and_carry_the_template(tmp_path):
    specials = {"<s>": CONTROL, "</s>": CONTROL, "<pad>": CONTROL}
    metadata = bpe_metadata(specials=specials)
    bos, eos, pad = ids_of(metadata, "<s>", "</s>", "<pad>")
    metadata = gguf_metadata(
        tmp_path,
        {
            **metadata,
            "tokenizer.ggml.bos_token_id": bos,
            "tokenizer.ggml.eos_token_id": eos,
            "tokenizer.ggml.padding_token_id": pad,
            "tokenizer.chat_template": "{{ messages }}",
        },
    )
    config = tokenizer_config(metadata)
    assert config["bos_token"] == "<s>" and config["eos_token"] == "</s>"
    assert config["pad_token"] == "<pad>" and config["unk_token"] is None
    assert config["chat_template"] == "{{ messages }}"
    assert generation_config(metadata) == {
        "bos_token_id": bos,
        "pad_token_id": pad,
        "eos_token_id": [eos],
    }


def test_an_id_out_of_range_keeps_the_default(tmp_path):
    """llama.cpp: "bad special token ... using default id"; gpt2's default 11 is in range."""
    metadata = gguf_metadata(tmp_path, bpe_metadata(**{"tokenizer.ggml.eos_token_id": 99999}))
    assert generation_config(metadata)["eos_token_id"] == [11]


def test_end_of_generation_by_text(tmp_path):
    """Tokens llama.cpp ends a generation at by their text, made special (CONTROL) even when
    the GGUF says NORMAL; the EOS id joins them."""
    specials = {
        "<|end_of_text|>": CONTROL,
        "<|eot_id|>": NORMAL,
        "<|im_end|>": NORMAL,
        "<|eom_id|>": CONTROL,
        "<|fim_pad|>": NORMAL,
        "<|start_header_id|>": CONTROL,
    }
    metadata = bpe_metadata(specials=specials)
    end, eot, im_end, eom, fim_pad = ids_of(
        metadata, "<|end_of_text|>", "<|eot_id|>", "<|im_end|>", "<|eom_id|>", "<|fim_pad|>"
    )
    metadata = gguf_metadata(tmp_path, {**metadata, "tokenizer.ggml.eos_token_id": end})
    assert generation_config(metadata)["eos_token_id"] == sorted([end, eot, im_end, eom, fim_pad])
    tok = runner_tokenizer(metadata)
    assert tok.eos_ids == sorted([end, eot, im_end, eom, fim_pad])
    assert tok.encode("<|eot_id|><|im_end|>") == [eot, im_end]  # promoted: parsed as special
    assert not tok.is_eos(ids_of(metadata, "<|start_header_id|>")[0])


def test_gpt_oss_end_is_not_end_of_generation(tmp_path):
    """With <|return|> and <|call|> (o200k_harmony), llama.cpp takes <|end|> out of the
    end-of-generation set and makes it, and the channel tokens, USER_DEFINED."""
    names = ["<|return|>", "<|call|>", "<|end|>", "<|channel|>", "<|message|>", "<|start|>"]
    metadata = gguf_metadata(
        tmp_path, bpe_metadata(pre="gpt-4o", specials=dict.fromkeys(names, CONTROL))
    )
    ret, call = ids_of(metadata, "<|return|>", "<|call|>")
    assert generation_config(metadata)["eos_token_id"] == sorted([11, ret, call])
    added = {t["content"]: t for t in json.loads(tokenizer_json(metadata))["added_tokens"]}
    assert not added["<|end|>"]["special"] and not added["<|channel|>"]["special"]
    assert added["<|return|>"]["special"]
    without_call = bpe_metadata(pre="gpt-4o", specials=dict.fromkeys(["<|end|>"], CONTROL))
    assert ids_of(without_call, "<|end|>")[0] in generation_config(without_call)["eos_token_id"]


def test_gemma4_normal_s_is_not_end_of_generation():
    """A </s> beside <|tool_response> (Gemma 4) is a normal token, not an end."""
    tokens = ["<pad>", "<eos>", "<bos>", "</s>", "<|tool_response>", "▁", "a", "<0x61>"]
    metadata = {
        "tokenizer.ggml.model": "gemma4",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [CONTROL] * 5 + [NORMAL] * 3,
        "tokenizer.ggml.merges": [],
        "tokenizer.ggml.eos_token_id": 1,
        "tokenizer.ggml.bos_token_id": 2,
    }
    assert generation_config(metadata) == {"bos_token_id": 2, "eos_token_id": [1, 4]}
    assert tokenizer_config(metadata)["add_bos_token"] is True  # llama.cpp forces it
    added = [t["content"] for t in json.loads(tokenizer_json(metadata))["added_tokens"]]
    assert "</s>" not in added


def test_phi3_special_tokens_strip_the_whitespace_after_them():
    specials = {"<|end|>": CONTROL, "<|endoftext|>": CONTROL, "<|user|>": CONTROL}
    metadata = {**spm_metadata(specials), "general.name": "Phi3"}
    added = {t["content"]: t for t in json.loads(tokenizer_json(metadata))["added_tokens"]}
    assert added["<|end|>"]["rstrip"] and added["<|user|>"]["rstrip"]
    assert not added["<|endoftext|>"]["rstrip"] and not added["<s>"]["rstrip"]
    assert added["</s>"]["rstrip"]
    plain = {
        t["content"]: t for t in json.loads(tokenizer_json(spm_metadata(specials)))["added_tokens"]
    }
    assert not any(t["rstrip"] for t in plain.values())
    tok = runner_tokenizer(metadata)
    end = ids_of(metadata, "<|end|>")[0]
    assert tok.encode("<|end|>\n a") == [end, *tok.encode("a")]


def test_tokens_that_are_not_utf8_or_empty_still_build(tmp_path):
    metadata = bpe_metadata()
    tokens = list(metadata["tokenizer.ggml.tokens"])
    tokens[-1] = "ab\udcff"  # a reader's "surrogateescape" for a stray byte
    tokens[-2] = ""
    metadata["tokenizer.ggml.tokens"] = tokens
    vocab = json.loads(tokenizer_json(metadata))["model"]["vocab"]
    assert vocab["ab\ufffd"] == len(tokens) - 1 and vocab[f"[EMPTY_{len(tokens) - 2}]"]


def test_cut_rule_holds_for_gpt2_regex_vocabularies(tmp_path):
    """GPT-2's and smollm's pipelines are written as runner/text/cuts.py recognises them."""
    for pre in ("gpt-2", "smollm", "starcoder"):
        spec = json.loads(tokenizer_json(bpe_metadata(pre=pre)))
        assert CutRule.of(spec) is not None, pre


def test_a_byte_without_a_token_splits_its_word():
    """A byte the vocabulary lacks ("h" here): llama.cpp drops it and never merges across it
    ("t e" is a merge), `tokenizers` alone would merge its neighbours."""
    metadata = bpe_metadata()
    tokens = [*metadata["tokenizer.ggml.tokens"], "te"]
    tokens[ord("h")] = "[no h]"
    metadata["tokenizer.ggml.tokens"] = tokens
    metadata["tokenizer.ggml.token_type"] = [*metadata["tokenizer.ggml.token_type"], NORMAL]
    metadata["tokenizer.ggml.merges"] = [*MERGES, "t e"]
    tok = runner_tokenizer(metadata)
    assert tok.encode("the") == [BYTES.index("t"), BYTES.index("e")]
    assert tok.encode("te") == [len(tokens) - 1]


# ---- SentencePiece, against a port of llama.cpp's llm_tokenizer_spm_session ----


def spm_metadata(
    specials: Mapping[str, int] | None = None, seed: int = 0, **extra: Any
) -> dict[str, Any]:
    """<unk>, <s>, </s>, 256 byte tokens, every string of 1-3 characters over "▁abc" with
    distinct random scores, then `specials`."""
    rng = random.Random(seed)
    pieces = ["".join(p) for n in (1, 2, 3) for p in itertools.product("▁abc", repeat=n)]
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *pieces]
    types = [UNKNOWN, CONTROL, CONTROL, *[6] * 256, *[NORMAL] * len(pieces)]
    scores = [0.0, 0.0, 0.0, *[0.0] * 256, *rng.sample(range(-10_000, 0), len(pieces))]
    for text, kind in (specials or {}).items():
        tokens.append(text)
        types.append(kind)
        scores.append(0.0)
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": [float(s) for s in scores],
        "tokenizer.ggml.token_type": types,
        **extra,
    }


def spm_reference(metadata: Mapping[str, Any], text: str, add_space_prefix: bool) -> list[int]:
    """llama.cpp's SentencePiece on one text without special tokens: "▁" for spaces (one in
    front with add_space_prefix), then again and again the adjacent pair whose concatenation
    is the highest-scoring token, the leftmost among equals; what is no token, bytes."""
    tokens, scores = metadata["tokenizer.ggml.tokens"], metadata["tokenizer.ggml.scores"]
    ids = {t: i for i, t in enumerate(tokens)}
    symbols = list(((" " if add_space_prefix else "") + text).replace(" ", "▁"))
    while True:
        best = None
        for i in range(len(symbols) - 1):
            token = ids.get(symbols[i] + symbols[i + 1])
            if token is not None and (best is None or scores[token] > best[0]):
                best = (scores[token], i)
        if best is None:
            break
        i = best[1]
        symbols[i : i + 2] = [symbols[i] + symbols[i + 1]]
    out = []
    for symbol in symbols:
        if symbol in ids:
            out.append(ids[symbol])
        else:
            out.extend(ids[f"<0x{b:02X}>"] for b in symbol.encode())
    return out


@pytest.mark.parametrize("add_space_prefix", [True, False])
def test_sentencepiece_merges_by_score_like_llama_cpp(tmp_path, add_space_prefix):
    metadata = gguf_metadata(
        tmp_path, spm_metadata(**{"tokenizer.ggml.add_space_prefix": add_space_prefix})
    )
    tok = runner_tokenizer(metadata)
    rng = random.Random(1)
    for _ in range(300):
        text = "".join(rng.choice("abc  d") for _ in range(rng.randint(1, 12)))
        assert tok.encode(text) == spm_reference(metadata, text, add_space_prefix), text


def test_sentencepiece_prefixes_each_piece_after_a_special_token(tmp_path):
    """llama.cpp: "prefix with space if previous is special"."""
    metadata = gguf_metadata(tmp_path, spm_metadata())
    tok = runner_tokenizer(metadata)
    bos, eos = 1, 2
    expected = [bos, *spm_reference(metadata, "ab", True), eos, *spm_reference(metadata, "c", True)]
    assert tok.encode("<s>ab</s>c") == expected
    config = tokenizer_config(metadata)
    assert config["add_bos_token"] is True and config["bos_token"] == "<s>"
    assert config["unk_token"] == "<unk>"
    assert generation_config(metadata) == {"bos_token_id": 1, "eos_token_id": [2]}
    assert tok.token_bytes(ids_of(metadata, "▁ab")[0]) == b" ab"
    assert tok.token_bytes(ids_of(metadata, "<0x0A>")[0]) == b"\n"


def test_sentencepiece_defaults_without_ids(tmp_path):
    """llama.cpp's SPM defaults: BOS 1, EOS 2, UNK 0, BOS added."""
    metadata = spm_metadata()
    assert generation_config(metadata) == {"bos_token_id": 1, "eos_token_id": [2]}
    assert tokenizer_config(metadata)["add_bos_token"] is True


# ---- llama.cpp's vocabularies and test vectors, from the llama-cpp-python sdist ----


def vocab_dir() -> Path | None:
    """Where the sdist's ggml-vocab-* files are, unpacking the cached tarball if need be."""
    given = os.environ.get(SDIST_ENV, "").strip()
    if given:
        root = Path(given)
        for found in (root / SDIST_ROOT / "models", root / "models"):
            if any(found.glob("ggml-vocab-*.gguf")):
                return found
        pytest.fail(f"${SDIST_ENV}={given} holds no vendor/llama.cpp/models/ggml-vocab-*.gguf")
    target = unpacked_sdist(LLAMA_CPP_PYTHON)
    if target is None or not any((target / "models").glob("ggml-vocab-*.gguf.inp")):
        return None
    return target / "models"


@pytest.fixture(scope="module")
def vocabs() -> Path:
    found = vocab_dir()
    if found is None:
        pytest.skip(
            f"no llama-cpp-python {LLAMA_CPP_PYTHON} sdist: set ${SDIST_ENV}, or put "
            f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz in {sdist_cache(LLAMA_CPP_PYTHON).parent}"
        )
    return found


def vectors(path: Path) -> list[tuple[str, list[int]]]:
    """A vocabulary's inputs and llama.cpp's ids for them (add_special false: no BOS), as
    tests/test-tokenizer-0.cpp reads them."""
    raw = path.with_name(path.name + ".inp").read_bytes().decode()
    inputs = raw.split(SEPARATOR)
    lines = path.with_name(path.name + ".out").read_text().split("\n")
    outputs = [[int(t) for t in line.split()] for line in lines[: len(inputs)]]
    assert len(outputs) == len(inputs), path
    return list(zip(inputs, outputs, strict=True))


def test_every_vocabulary_with_vectors_is_claimed_or_named(vocabs):
    found = {p.name[len("ggml-vocab-") : -len(".gguf.inp")] for p in vocabs.glob("*.gguf.inp")}
    assert found == set(VECTORS) | set(NOT_CLAIMED)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(VECTORS))
def test_llama_cpp_vectors(vocabs, name):
    path = vocabs / f"ggml-vocab-{name}.gguf"
    spec, config, generation = tokenizer_files(read_metadata(path))
    tok = Tokenizer(spec, tokenizer_config=config, generation_config=generation)
    cases = vectors(path)
    # llama.cpp's vectors are tokenized without parsing CONTROL and UNKNOWN tokens (USER_DEFINED
    # ones it always parses), the runner parses every one: the same while no input holds one
    special = [t["content"] for t in json.loads(spec)["added_tokens"] if t["special"]]
    assert not [s for s, _ in cases if any(t in s for t in special)]
    failed = [(text, want, got) for text, want in cases if (got := tok.encode(text)) != want]
    assert not failed, f"{len(failed)}/{len(cases)} differ, first: {failed[0]}"


# ---- llama.cpp itself (llama-cpp-python), where installed ----

PIECES = [
    *("Hello", " world", "HELLO", "camelCase", "XMLHttp", " the", "a", "'s", "'S", "'ll"),
    *("'LL", "'re", "'ve", "'m", "'D", "'\u017f", "\u2019s", "1", "12", "123", "12345678"),
    *(" 42", "\u0663\u0664", "\u216b", "\u00bd", " ", "  ", "   ", "\t", "\n", "\n\n", "\r\n"),
    *(" \n ", "\u00a0", "\u3000", "\u2009", "\u0085", "\x0b", ".", ",", "!?", "...", "->"),
    *("$", "+", "<", ">", "^", "~", "|", "`", "#", "@", "(", "]", "{", "/", "\\", '"', "-"),
    *("_", "e\u0301", "na\u00efve", "\u00d6l\u00e7\u00fc", "\u0391\u0392\u0393", "\u03b1"),
    *("\u041f\u0440\u0438", " \u043c\u0438\u0440", "\u4e2d\u6587", "\u3072\u3089", "\u30ab\u30bf"),
    *("\ud55c\uad6d", "\u0627\u0644\u0639", "\u0939\u093f\u0928\u094d\u0926\u0940", "\u0e44\u0e17"),
    *("\U0001f999", "\U0001f636\u200d\U0001f32b\ufe0f", "\u2705", "\ue000", "\u0378", "\u200b"),
    *("\ufeff", "\x00", "\x7f", "\u01c5", "\ufb01", "\uff21", "\u210c", "\u212a", "\u2126"),
    *("<s>", "</s>", "<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|end|>", "\u2581", "<PAD>"),
]
# blocks whose characters were all assigned long before any Unicode version in play here
# (llama.cpp's tables, Oniguruma's, Python's): newer characters' categories differ
BLOCKS = [(0xA0, 0x24F), (0x400, 0x4FF), (0x900, 0x97F), (0x2000, 0x206F), (0x2190, 0x22FF)]
BLOCKS += [(0x3040, 0x30FF), (0x4E00, 0x9FA5), (0xAC00, 0xD7A3), (0xFF01, 0xFF5E)]
BLOCKS += [(0x1F600, 0x1F64F)]


def generated_texts(seed: int, count: int) -> list[str]:
    rng = random.Random(seed)
    texts = []
    for _ in range(count):
        parts = []
        for _ in range(rng.randint(1, 14)):
            roll = rng.random()
            if roll < 0.65:
                parts.append(rng.choice(PIECES))
            elif roll < 0.85:
                low, high = rng.choice(BLOCKS)
                char = chr(rng.randint(low, high))
                parts.append(char if unicodedata.category(char) != "Cn" else "x")
            else:
                parts.append(" " * rng.randint(1, 5) + rng.choice(["", "\n", "\t"]))
        texts.append("".join(parts))
    return texts


def llama_cpp_vocab(path: Path) -> Any:
    llama_cpp = pytest.importorskip("llama_cpp")
    return llama_cpp.Llama(str(path), vocab_only=True, verbose=False)


def _disagreements(
    path: Path, metadata: Mapping[str, Any], texts: list[str]
) -> list[tuple[str, list[int], list[int]]]:
    """The texts llama.cpp (loading `path`) and the runner (from `metadata`) tokenize apart,
    special tokens parsed (llama.cpp's parse_special, the runner's way)."""
    reference = llama_cpp_vocab(path)
    tok = runner_tokenizer(metadata)
    out = []
    for text in texts:
        want = reference.tokenize(text.encode(), add_bos=False, special=True)
        if (got := tok.encode(text)) != want:
            out.append((text, want, got))
    return out


@pytest.fixture(scope="module")
def gpt2_fields(vocabs) -> list[tuple[str, Any, list[Any]]]:
    """GPT-2's vocabulary file as (key, value, GGUF types), read once."""
    pytest.importorskip("llama_cpp")
    reader = gguf.GGUFReader(vocabs / "ggml-vocab-gpt-2.gguf")
    return [
        (key, field.contents(), field.types)
        for key, field in reader.fields.items()
        if not key.startswith("GGUF.")
    ]


def _one_name_each() -> list[str]:
    """A name for each distinct byte-level pre-tokenizer (regexes and flags)."""
    names: dict[Any, str] = {}
    for name, pre in _PRE_TOKENIZERS.items():
        if pre.byte_level:
            names.setdefault(pre, name)
    return sorted(names.values())


@pytest.mark.llama
@pytest.mark.slow
@pytest.mark.parametrize("pre", _one_name_each())
def test_every_pre_tokenizer_splits_as_llama_cpp(gpt2_fields, tmp_path, pre):
    """GPT-2's vocabulary under each pre-tokenizer the module knows, on generated texts."""
    fields = [(k, pre if k == "tokenizer.ggml.pre" else v, t) for k, v, t in gpt2_fields]
    arch = next(v for k, v, _ in fields if k == "general.architecture")
    writer = gguf.GGUFWriter(str(tmp_path / "vocab.gguf"), arch=arch)
    for key, value, types in fields:
        if key != "general.architecture":
            writer.add_key_value(
                key, value, types[0], sub_type=types[1] if len(types) > 1 else None
            )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    metadata = {k: v for k, v, _ in fields}
    texts = generated_texts(seed=len(pre), count=150)
    failed = _disagreements(tmp_path / "vocab.gguf", metadata, texts)
    assert not failed, f"{len(failed)} differ, first: {failed[0]}"


@pytest.mark.llama
@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(set(VECTORS) - {"phi-3"}))
def test_vocabularies_tokenize_as_llama_cpp(vocabs, name):
    """Each vocabulary on generated texts. (Phi-3 is left out: after its special tokens
    llama.cpp strips ASCII whitespace only, `tokenizers` any whitespace.)"""
    path = vocabs / f"ggml-vocab-{name}.gguf"
    failed = _disagreements(path, read_metadata(path), generated_texts(0, 150))
    assert not failed, f"{len(failed)} differ, first: {failed[0]}"


@pytest.mark.llama
@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(set(VECTORS) | {"aquila", "baichuan", "gpt-neox"}))
def test_special_tokens_and_end_of_generation_as_llama_cpp(vocabs, name):
    """llama.cpp's end-of-generation set, special-token attributes, BOS/EOS and add_bos."""
    llama_cpp = pytest.importorskip("llama_cpp")
    path = vocabs / f"ggml-vocab-{name}.gguf"
    reference = llama_cpp_vocab(path)  # kept: the vocabulary is its memory
    vocab = llama_cpp.llama_model_get_vocab(reference.model)
    ours = load_vocab(read_metadata(path))
    n = llama_cpp.llama_vocab_n_tokens(vocab)
    assert n == len(ours.tokens)
    assert {i for i in range(n) if llama_cpp.llama_vocab_is_eog(vocab, i)} == ours.eog
    mask = 0b1_0001_1001  # UNKNOWN, CONTROL, USER_DEFINED, RSTRIP
    theirs = [llama_cpp.llama_vocab_get_attr(vocab, i) & mask for i in range(n)]
    assert theirs == [a & mask for a in ours.attrs]

    def null(token: int) -> int | None:
        return None if token < 0 else token

    assert null(llama_cpp.llama_vocab_bos(vocab)) == ours.ids["bos"]
    assert null(llama_cpp.llama_vocab_eos(vocab)) == ours.ids["eos"]
    assert null(llama_cpp.llama_vocab_eot(vocab)) == ours.ids["eot"]
    assert null(llama_cpp.llama_vocab_pad(vocab)) == ours.ids["pad"]
    assert llama_cpp.llama_vocab_get_add_bos(vocab) == ours.add_bos
    assert llama_cpp.llama_vocab_get_add_eos(vocab) == ours.add_eos
