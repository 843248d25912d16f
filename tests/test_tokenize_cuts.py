"""Cuts (runner/text/cuts.py): positions where a text's ids are its two parts' ids, and
`Tokenizer.encode_extended`, which tokenizes prompts and prompt + candidate texts from them.

The property behind everything: wherever `CutRule.is_cut(X, m)` says yes, encode(X) ==
encode(X[:m]) + encode(X[m:]), checked on random texts made to stress the pre-tokenizers'
patterns (spaces, newlines, digits, punctuation runs, contractions, combining marks, other
scripts, added tokens), for every pipeline the rule recognises, and on the default model's
real tokenizer."""

from __future__ import annotations

import json
import random
from types import SimpleNamespace
from typing import Any

import pytest
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer

from runner.text.cuts import (
    HF_CONTRACTIONS,
    LLAMA3_PATTERN,
    LLAMA_CPP_CONTRACTIONS,
    QWEN2_PATTERN,
    QWEN3_5_PATTERN,
    CutRule,
)
from runner.text.tokenizer import Tokenizer

FRAGMENTS = [
    "the",
    "The",
    "sky",
    "blue",
    "is",
    "Yes",
    "No",
    "A",
    "b",
    "don't",
    "we're",
    "I'll",
    "she'S",
    "it'd",
    "'",
    "''",
    "42",
    "2024",
    "7",
    "3.14",
    "x1",
    "?",
    "!",
    "...",
    "?!",
    ",",
    ":",
    ")",
    "(",
    "--",
    "—",
    "é",
    "e\u0301",
    "o\u0308\u0301",
    "\u0301",
    "日本語",
    "ß",
    "Ωμέγα",
    "😀",
    "\u00a0",
    "\u3000",
    "\u2028",
    "\t",
    "\r\n",
    "\n",
    "\n\n",
    "  ",
    "   ",
    " ",
    " ",
    " ",
    " ",
    " ",
    "<|im_start|>",
    "<|im_end|>",
    "<tag>",
    "hello world",
    "x",
]
CORPUS = ["".join(random.Random(i).choices(FRAGMENTS, k=40)) for i in range(200)]
ADDED = [("<|im_start|>", True), ("<|im_end|>", True), ("hello world", False), ("<tag>", False)]


def _train(pre: Any, normalizer: Any = None, *, use_regex_level: bool = True) -> str:
    tok = HFTokenizer(models.BPE())
    if normalizer is not None:
        tok.normalizer = normalizer
    tok.pre_tokenizer = pre
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=500, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer)
    for content, special in ADDED:
        tok.add_tokens([AddedToken(content, special=special, normalized=False)])
    return tok.to_str()


def _split(pattern: str) -> Any:
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


PIPELINES = {
    "gpt2": lambda: _train(pre_tokenizers.ByteLevel(add_prefix_space=False)),
    "digits+gpt2": lambda: _train(
        pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False),
            ]
        )
    ),
    "llama3": lambda: _train(_split(LLAMA3_PATTERN)),
    "qwen2+nfc": lambda: _train(_split(QWEN2_PATTERN), normalizers.NFC()),
    "qwen3.5+nfc": lambda: _train(_split(QWEN3_5_PATTERN), normalizers.NFC()),
    # a GGUF's GPT-2 pipeline as rebuilt where its vocabulary lacks bytes: those split off
    # after the byte mapping (here 'e', 'Ġ' for a space and 'Ċ' for a newline: often)
    "digits+gpt2+bytes": lambda: _train(
        pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False),
                pre_tokenizers.Split(
                    Regex("[\\x{65}\\x{120}-\\x{121}\\x{10a}]"), behavior="isolated", invert=False
                ),
            ]
        )
    ),
    # llama.cpp's spelling, which GGUF tokenizers are rebuilt with
    "llama3-llama.cpp": lambda: _train(
        _split(LLAMA3_PATTERN.replace(HF_CONTRACTIONS, LLAMA_CPP_CONTRACTIONS))
    ),
}


@pytest.fixture(scope="module", params=sorted(PIPELINES))
def spec_json(request: pytest.FixtureRequest) -> str:
    return PIPELINES[request.param]()


def _texts(seed: int, n: int) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choices(FRAGMENTS, k=rng.randint(1, 30))) for _ in range(n)]


def test_every_cut_the_rule_allows_splits_the_ids(spec_json: str) -> None:
    rule = CutRule.of(json.loads(spec_json))
    assert rule is not None
    hf = HFTokenizer.from_str(spec_json)

    def encode(text: str) -> list[int]:
        return hf.encode(text, add_special_tokens=False).ids

    cuts = 0
    for text in _texts(1, 800):
        whole = encode(text)
        for m in range(1, len(text)):
            if rule.is_cut(text, m):
                cuts += 1
                assert encode(text[:m]) + encode(text[m:]) == whole, (text, m)
    assert cuts > 800  # the texts have cuts to check


def test_a_cut_ends_no_added_token_and_needs_a_space_after_a_non_space(spec_json: str) -> None:
    rule = CutRule.of(json.loads(spec_json))
    assert rule is not None
    assert rule.is_cut("say hello world now", 3)
    assert not rule.is_cut("say hello world now", 9)  # inside the added token "hello world"
    assert not rule.is_cut("say  hi", 4)  # a space before it
    assert not rule.is_cut("say\thi", 3)  # not a space
    assert not rule.is_cut("say hi", 0) and not rule.is_cut("say ", 4)  # not inside the text
    # the token " world" reaches past the end of "say hello": known only once appended to
    assert rule.is_cut("say hello", 9 - 6) and not rule.is_cut("say hello", 9, " world")
    assert rule.is_cut("hi hello", 2, " world")  # "hello world" starts after the cut


@pytest.mark.parametrize(
    "change",
    [
        {"normalizer": {"type": "NFKC"}},
        {"normalizer": {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}},
        {"pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "use_regex": False}},
        {"pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": True, "use_regex": True}},
        {"pre_tokenizer": {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first"}},
        {"pre_tokenizer": {"type": "Digits", "individual_digits": True}},
        {"pre_tokenizer": None},
        {
            "pre_tokenizer": {
                "type": "Split",
                "pattern": {"Regex": r"\w+|\s+"},
                "behavior": "Isolated",
                "invert": False,
            }
        },
        {"model": {"type": "BPE", "dropout": 0.1}},
        {"truncation": {"max_length": 8}},
    ],
)
def test_other_pipelines_are_always_tokenized_whole(change: dict[str, Any]) -> None:
    spec = json.loads(PIPELINES["gpt2"]())
    assert CutRule.of(spec) is not None
    assert CutRule.of({**spec, **change}) is None


def test_added_tokens_that_strip_spaces_or_need_word_boundaries_forbid_cuts() -> None:
    spec = json.loads(PIPELINES["gpt2"]())
    for flag in ("lstrip", "rstrip", "single_word"):
        added = [{**spec["added_tokens"][0], flag: True}, *spec["added_tokens"][1:]]
        assert CutRule.of({**spec, "added_tokens": added}) is None
    nfc = json.loads(PIPELINES["qwen2+nfc"]())
    added = [{**nfc["added_tokens"][0], "normalized": True}, *nfc["added_tokens"][1:]]
    assert CutRule.of({**nfc, "added_tokens": added}) is None


def _counting(tokenizer: Tokenizer) -> list[str]:
    """The texts `tokenizer` hands to `tokenizers` from now on."""
    seen: list[str] = []
    inner = tokenizer._tok

    class Counting:
        def encode_batch_fast(self, texts: list[str], **kwargs: Any) -> Any:
            seen.extend(texts)
            return inner.encode_batch_fast(texts, **kwargs)

    tokenizer._tok = Counting()
    return seen


def test_encode_extended_equals_encoding_each_text_whole(spec_json: str) -> None:
    """Prompts under a few shared beginnings, each with appended candidates (some of which
    would change the prompt's last tokens, some None), over many calls so that kept
    beginnings are found and used: the ids and counts equal `encode_within` of each text."""
    tokenizer, reference = Tokenizer(spec_json), Tokenizer(spec_json)
    rng = random.Random(3)
    systems = _texts(4, 3)
    appended = [" Yes", " No", " A", "?", "\n", "", " ", "<|im_end|>", " world", "s", "2", None]
    for _ in range(120):
        text = rng.choice(systems) + "".join(rng.choices(FRAGMENTS, k=rng.randint(0, 12)))
        extra = rng.sample(appended, rng.randint(0, 4))
        limit = rng.choice([None, None, 10_000, 40, 5])
        ((ids, extended),) = tokenizer.encode_extended([(text, extra)], limit)
        wants = reference.encode_within([text, *(text + a for a in extra if a is not None)], limit)
        assert ids == wants[0], (text, limit)
        wanted = iter(wants[1:])
        assert extended == [None if a is None else next(wanted) for a in extra], (text, extra)


def test_an_added_token_completed_by_a_candidate_moves_the_cut(spec_json: str) -> None:
    """ "say hello w" + "orld" holds the added token "hello world": the prompt's last cut (at
    " w") is not one of the extended text, so the candidate is tokenized from an earlier one."""
    tokenizer, reference = Tokenizer(spec_json), Tokenizer(spec_json)
    for prompt in ("say hello w", "so we say hello w"):
        ((ids, extended),) = tokenizer.encode_extended([(prompt, ["orld", "ax"])], None)
        assert ids == reference.encode(prompt)
        assert extended == [reference.encode(prompt + "orld"), reference.encode(prompt + "ax")]
        assert reference.encode(prompt + "orld")[-1] == reference.added["hello world"]


def test_a_beginning_shared_by_recent_prompts_is_not_tokenized_again() -> None:
    tokenizer = Tokenizer(PIPELINES["gpt2"]())
    system = "You are a careful judge of answers. " * 20
    questions = ["Is the sky blue? Answer:", "Is grass red? Answer:", "Is snow cold? Answer:"]
    seen = _counting(tokenizer)
    for question in questions[:2]:  # the second shares the system prompt with the first
        tokenizer.encode_extended([(system + question, [" Yes", " No"])], None)
    seen.clear()
    ((ids, extended),) = tokenizer.encode_extended([(system + questions[2], [" Yes", " No"])], None)
    assert sum(map(len, seen)) < len(questions[2]) * 4  # the question and its candidates only
    reference = Tokenizer(PIPELINES["gpt2"]())
    assert ids == reference.encode(system + questions[2])
    assert extended == [reference.encode(system + questions[2] + c) for c in (" Yes", " No")]


def test_a_kept_beginning_is_used_only_where_it_ends_at_a_cut() -> None:
    """Two prompts sharing "say hello qqq..." keep "say hello"; a later "say hello world"
    holds the added token "hello world" across its end, so it is tokenized whole there, and
    a later prompt that does continue it with a cut uses it."""
    tokenizer, reference = Tokenizer(PIPELINES["gpt2"]()), Tokenizer(PIPELINES["gpt2"]())
    rest = " " + "q" * 20
    for last in (" A", " B"):
        tokenizer.encode_extended([("say hello" + rest + last, [])], None)
    seen = _counting(tokenizer)
    for text in ("say hello world and more", "say hello" + rest + " C"):
        seen.clear()
        ((ids, _),) = tokenizer.encode_extended([(text, [])], None)
        assert ids == reference.encode(text)
        assert any(t.startswith("say hello") for t in seen) == ("world" in text)


def test_candidates_are_tokenized_from_the_prompts_last_cut() -> None:
    tokenizer = Tokenizer(PIPELINES["llama3"]())
    seen = _counting(tokenizer)
    prompt = "Question: is the sky blue on a clear day, seen from the ground? Answer:"
    tokenizer.encode_extended([(prompt, [" Yes", " No", " Maybe"])], None)
    # the prompt once, then " Answer:" and " Answer:" + each candidate
    assert sorted(seen) == sorted(
        [prompt[: -len(" Answer:")], " Answer:", " Answer: Yes", " Answer: No", " Answer: Maybe"]
    )


@pytest.mark.slow  # the real default model
def test_the_default_models_tokenizer_allows_cuts_and_they_hold(default_model_dir: Any) -> None:
    spec = (default_model_dir / "tokenizer.json").read_text()
    rule = CutRule.of(json.loads(spec))
    assert rule is not None
    hf = HFTokenizer.from_str(spec)
    for text in _texts(5, 150):
        whole = hf.encode(text, add_special_tokens=False).ids
        for m in range(1, len(text)):
            if rule.is_cut(text, m):
                parts = hf.encode_batch_fast([text[:m], text[m:]], add_special_tokens=False)
                assert parts[0].ids + parts[1].ids == whole, (text, m)


def test_what_is_kept_of_a_prompt_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the first KEEP_CHARS characters of a prompt are kept to find shared beginnings:
    a long shared beginning is kept up to there, and tokenizing still gives the same ids."""
    from runner.text import cuts as tokenize_cuts

    monkeypatch.setattr(tokenize_cuts, "KEEP_CHARS", 40)
    tokenizer, reference = Tokenizer(PIPELINES["gpt2"]()), Tokenizer(PIPELINES["gpt2"]())
    system = "one two three four five six seven eight nine ten eleven twelve "
    for question in ("Is it? Answer:", "Was it? Answer:", "Will it be? Answer:"):
        ((ids, _),) = tokenizer.encode_extended([(system + question, [])], None)
        assert ids == reference.encode(system + question)
    heads = tokenizer._heads
    assert heads is not None
    assert all(len(r) <= 40 for r in heads._recent) and len(heads._recent) == 3
    assert heads._heads and all(len(head) <= 40 for head, _ in heads._heads)


def test_gguf_tokenizers_are_rebuilt_with_patterns_that_allow_cuts() -> None:
    """A GGUF's llama3 / qwen2 / qwen35 tokenizer is rebuilt with llama.cpp's spelling of
    those patterns (runner/sources/gguf/tokenizer.py): prompts for those models get cuts."""
    from runner.sources.gguf import tokenizer as gguf_tokenizer
    from runner.text.cuts import SPLIT_PATTERNS

    assert {gguf_tokenizer.LLAMA3, gguf_tokenizer.QWEN2, gguf_tokenizer.QWEN35} <= SPLIT_PATTERNS


def test_a_gguf_gpt2_tokenizer_missing_bytes_still_allows_cuts() -> None:
    """A GGUF whose vocabulary lacks some bytes (SmolLM2's, the default model's) is rebuilt
    with a Split isolating them after the byte mapping (runner/sources/gguf/tokenizer.py):
    one character a match, so its prompts still get cuts; a class with a quantifier or
    anything past its characters does not."""
    from runner.sources.gguf import tokenizer as gguf_tokenizer

    # every GPT-2 byte character but two
    vocab = SimpleNamespace(token_to_id=dict.fromkeys(gguf_tokenizer._gpt2_bytes()[2:], 0))
    pre = gguf_tokenizer._byte_level_pre_tokenizer(vocab, [gguf_tokenizer.GPT2])
    assert pre["type"] == "Sequence" and pre["pretokenizers"][-1]["type"] == "Split"
    spec = {"model": {"type": "BPE"}, "pre_tokenizer": pre}
    assert CutRule.of(spec) is not None
    for regex in ("[\\x{100}\\x{101}]+", "[\\x{100}]x", "[ab]"):
        pre["pretokenizers"][-1]["pattern"] = {"Regex": regex}
        assert CutRule.of(spec) is None, regex
