"""Tokenizer semantics of the Go runner (docs/PROTOCOL.md §4.3, §5.1) over real tokenizer files."""

import json

import pytest
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer

from runner.text.tokenizer import Tokenizer

CORPUS = [
    "Is the sky blue? Yes. Is grass red? No. Answer: A, B, C or D.",
    "héllo wörld 日本語",
] * 20


def byte_level_json(added=()) -> str:
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
    )
    tok.train_from_iterator(CORPUS, trainer)
    for content, special in added:
        tok.add_tokens([AddedToken(content, special=special)])
    return tok.to_str()


def sentencepiece_json() -> str:
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for piece in ["▁", "a", "b", "▁a", "▁b", "ab", "▁ab"]:
        vocab[piece] = len(vocab)
    merges = [("▁", "a"), ("▁", "b"), ("a", "b"), ("▁a", "b")]
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    tok.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    return tok.to_str()


def test_bos_only_when_tokenizer_config_says_so():
    text = byte_level_json()
    plain = Tokenizer(text, tokenizer_config={"bos_token": "<|im_start|>"})
    assert plain.add_bos is False
    assert plain.bos_id == 1
    with_bos = Tokenizer(
        text, tokenizer_config={"bos_token": "<|im_start|>", "add_bos_token": True}
    )
    assert with_bos.add_bos is True
    ids = with_bos.encode("Yes", add_bos=True)
    assert ids[0] == 1 and ids[1:] == with_bos.encode("Yes")


def test_no_bos_token_means_none_added():
    tok = Tokenizer(byte_level_json(), tokenizer_config={"add_bos_token": True})
    assert tok.bos_id is None
    assert tok.encode("Yes", add_bos=True) == tok.encode("Yes")


def test_every_added_token_is_special_and_split_out():
    tok = Tokenizer(byte_level_json(added=[("<tool>", False)]))
    assert tok.is_special("<tool>")
    assert tok.is_special("<|im_end|>")
    assert not tok.is_special(" Yes")
    ids = tok.encode("Yes<tool>No<|im_end|>")
    assert tok.added["<tool>"] in ids and tok.added["<|im_end|>"] in ids


def test_eos_precedence_generation_then_config_then_tokenizer_config():
    text = byte_level_json()
    tc = {"eos_token": {"content": "<|im_end|>"}}
    assert Tokenizer(text, tokenizer_config=tc).eos_ids == [2]
    assert Tokenizer(text, config={"eos_token_id": 0}, tokenizer_config=tc).eos_ids == [0]
    assert Tokenizer(
        text,
        config={"eos_token_id": 0},
        generation_config={"eos_token_id": [2, 1]},
        tokenizer_config=tc,
    ).eos_ids == [2, 1]


def test_vocab_size_covers_highest_added_id():
    text = byte_level_json()
    spec = json.loads(text)
    spec["added_tokens"].append(
        {
            "id": 399,
            "content": "<far>",
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
    )
    tok = Tokenizer(json.dumps(spec))
    assert tok.vocab_size == 400


def text_of(tok: Tokenizer, ids: list[int]) -> str:
    return b"".join(tok.token_bytes(t) for t in ids).decode()


def test_byte_level_token_bytes_rebuild_text_including_split_characters():
    tok = Tokenizer(byte_level_json())
    for text in ["Is the sky blue? Yes.", "héllo wörld 日本語", " Answer: D"]:
        ids = tok.encode(text)
        assert b"".join(tok.token_bytes(t) for t in ids) == text.encode()


def test_sentencepiece_token_bytes_use_space_and_byte_fallback():
    tok = Tokenizer(sentencepiece_json())
    ids = tok.encode(" ab b日")
    assert text_of(tok, ids) == " ab b日"
    assert tok.token_bytes(tok.added["</s>"]) == b"</s>"


def test_non_bpe_tokenizer_is_refused():
    wordlevel = HFTokenizer(models.WordLevel(vocab={"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    with pytest.raises(ValueError, match="unsupported tokenizer type: WordLevel"):
        Tokenizer(wordlevel.to_str())


def test_regex_split_pretokenizer_round_trips():
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r"\p{N}|\s+|[^\s\p{N}]+"), "isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        CORPUS,
        trainers.BpeTrainer(vocab_size=280, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()),
    )
    ours = Tokenizer(tok.to_str())
    assert text_of(ours, ours.encode("A 12 B")) == "A 12 B"


@pytest.mark.parametrize("spec", [byte_level_json, sentencepiece_json], ids=["bytes", "pieces"])
def test_encode_gives_the_ids_of_the_tokenizers_own_encode(spec):
    """The runner encodes without character offsets (`encode_batch_fast`, faster, and the
    GIL is released): the ids are those of `tokenizers`' own `encode`, one text or many."""
    import random

    text = spec()
    hf, ours = HFTokenizer.from_str(text), Tokenizer(text)
    rng = random.Random(0)
    pieces = ["Is", " the", " sky", "?", " Yes", "\n", "  ", "日本", "é", "<s>", "ab", " a", "😀"]
    texts = ["".join(rng.choice(pieces) for _ in range(rng.randint(0, 30))) for _ in range(300)]
    expected = [hf.encode(t, add_special_tokens=False).ids for t in texts]
    assert ours.encode_batch(texts) == expected
    assert [ours.encode(t) for t in texts[:50]] == expected[:50]


@pytest.mark.parametrize("spec", [byte_level_json, sentencepiece_json], ids=["bytes", "pieces"])
def test_no_token_is_longer_than_max_token_bytes(spec):
    """`may_be_one_token` is False only for texts no token can stand for: every token's
    bytes fit `max_token_bytes`, and a text past it never appends exactly one token."""
    import random

    tok = Tokenizer(spec())
    assert tok.max_token_bytes is not None
    assert max(len(tok.token_bytes(i)) for i in range(tok.vocab_size)) <= tok.max_token_bytes
    rng = random.Random(1)
    pieces = ["a", "b", " ", "ab", "Is", " the", "é", "日本", "<s>", "😀", "sky"]
    prompt = tok.encode("Is the")
    for _ in range(400):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 12)))
        if not tok.may_be_one_token(text):
            joined = tok.encode("Is the" + text)
            assert not (len(joined) == len(prompt) + 1 and joined[:-1] == prompt), text
    assert not tok.may_be_one_token("x" * (tok.max_token_bytes + 1))
    assert tok.may_be_one_token("x" * tok.max_token_bytes)


def test_a_normalizer_that_may_shorten_text_disables_the_length_bound():
    spec = json.loads(byte_level_json())
    spec["normalizer"] = {"type": "NFKC"}
    tok = Tokenizer(json.dumps(spec))
    assert tok.max_token_bytes is None and tok.may_be_one_token("x" * 10_000)
    spec["normalizer"] = {
        "type": "Sequence",
        "normalizers": [
            {"type": "Prepend", "prepend": "▁"},
            {"type": "Replace", "pattern": {"String": " "}, "content": "▁"},
        ],
    }
    assert Tokenizer(json.dumps(spec)).max_token_bytes is not None
