"""Seeded English-like text of an exact token length, and the byte-level BPE that reads it.

The tokenizer is trained here (`tokenizers`, byte-level BPE, GPT-2 pre-tokenizer) on seeded
text drawn from `WORDS` plus the answer words the workloads score (" Yes", " No", " A" ..
" Z", ...), so those are single tokens. Byte-level pre-tokenization splits text at spaces,
newlines and punctuation, so the token count of `" w1 w2 ..."` is the sum of the counts of
each `" w"`; `exact_words` uses that to hit a token budget exactly.
"""

from __future__ import annotations

import random

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 0, 1, 2
DECISION_ANSWERS = (" Yes", " No", " Maybe", " Unsure")
LETTERS = tuple(f" {chr(c)}" for c in range(ord("A"), ord("Z") + 1))
CORPUS_WORDS = 200_000
# Few enough merges that words split into 1-5 tokens (~1.8 a word), as real text does; the
# model's own vocabulary (rows of the output head) stays the shape's.
TOKENIZER_VOCAB = 768

WORD_TEXT = """
the of and to in is was for on that with as by at from it his an were are which this be
or has had not first one their its new after who they have her she two been other when
there all during into school time may years more most only over city some world would
where later up such used many can state about national out known university united then
made age people small house river water light night family story road north south east
west game music field power party market season company public report voice window
garden morning evening letter number teacher doctor village forest mountain island bridge
station kitchen table chair paper money price question answer reason result system
history member course energy nature picture language animal summer winter spring autumn
street office paint stone glass metal cloth bread apple orange butter coffee sugar salt
quick brown lazy happy quiet bright early simple strong gentle careful honest clever
eager calm brave fair proud kind warm cold dark deep wide long short heavy empty full
open close begin carry change follow learn listen move play read remember run speak
start stop think travel try walk watch write build choose decide explain find give
grow help hold keep leave live look make meet need pay put send show sit stand take
tell turn understand use wait want wear work always often never sometimes usually again
almost already also perhaps quite rather really still together yet because before
between through under while without against among around behind beyond despite toward
within across along beside inside outside above below near since until upon whether
although however therefore meanwhile otherwise instead indeed certainly probably
"""
WORDS = WORD_TEXT.split()


def training_corpus(seed: int, words: int = CORPUS_WORDS) -> list[str]:
    """Seeded sentences over WORDS, with option and answer lines so answers are one token."""
    rng = random.Random(seed)
    options = "".join(DECISION_ANSWERS + LETTERS)
    lines = []
    for _ in range(words // 10):
        sentence = " ".join(rng.choice(WORDS) for _ in range(10))
        answer = rng.choice(DECISION_ANSWERS + LETTERS)
        lines.append(
            f"{sentence.capitalize()}.\nOptions:{options}\nQuestion: {sentence}?\nAnswer:{answer}\n"
        )
    return lines


def train_tokenizer(vocab_size: int = TOKENIZER_VOCAB, seed: int = 0) -> str:
    """tokenizer.json text of a byte-level BPE with at most `vocab_size` entries."""
    return train_byte_level_bpe(training_corpus(seed), vocab_size)


def train_byte_level_bpe(texts: list[str], vocab_size: int) -> str:
    """tokenizer.json text of a GPT-2 style byte-level BPE trained on `texts`, with
    SPECIAL_TOKENS first (ids 0, 1, 2). The tests' tiny tokenizer is trained here too."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=list(SPECIAL_TOKENS),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return tok.to_str()


def pad_vocabulary(tokenizer_json: str, size: int) -> str:
    """Add vocabulary entries up to `size` that no merge produces (so encoding is unchanged)
    but that decode to distinct text: random-weight models emit any id, and generated text
    can only be compared when every id has a piece."""
    import json

    spec = json.loads(tokenizer_json)
    vocab: dict[str, int] = spec["model"]["vocab"]
    taken = set(vocab.values()) | {t["id"] for t in spec.get("added_tokens", [])}
    for token_id in range(size):
        if token_id not in taken:
            vocab[f"\u0120<{token_id}>"] = token_id  # byte-level " <id>"
    return json.dumps(spec, ensure_ascii=False)


class TextMaker:
    """Seeded word sequences of exact token lengths for one tokenizer (`encode(str) -> ids`)."""

    def __init__(self, encode, seed: int):
        self.encode = encode
        self.rng = random.Random(seed)
        self.cost = {w: len(encode(" " + w)) for w in WORDS}
        self.short = [w for w, n in self.cost.items() if n == 1]
        if not self.short:
            raise ValueError("the tokenizer has no single-token words")

    def words(self, tokens: int) -> str:
        """`" w1 w2 ..."` that encodes to exactly `tokens` tokens."""
        out: list[str] = []
        left = tokens
        longest = max(self.cost.values())
        while left > longest:
            word = self.rng.choice(WORDS)
            out.append(word)
            left -= self.cost[word]
        out += [self.rng.choice(self.short) for _ in range(left)]
        text = "".join(" " + w for w in out)
        assert len(self.encode(text)) == tokens, (tokens, len(self.encode(text)))
        return text

    def single_tokens(self, texts: tuple[str, ...]) -> tuple[str, ...]:
        """The `texts` that are one token, as scoring candidates must be: a real model's
        tokenizer may split a few (SmolLM2 splits " Unsure")."""
        kept = tuple(t for t in texts if len(self.encode(t)) == 1)
        if not kept:
            raise ValueError(f"none of {texts} is a single token for this tokenizer")
        return kept

    def exact(self, tokens: int, head: str = "", tail: str = "") -> str:
        """`head + words + tail` of exactly `tokens` tokens (head/tail start at a pre-token
        boundary, e.g. a newline)."""
        fixed = len(self.encode(head)) + len(self.encode(tail)) if head or tail else 0
        if fixed >= tokens:
            raise ValueError(f"{tokens} tokens cannot hold {head!r} and {tail!r}")
        text = head + self.words(tokens - fixed) + tail
        got = len(self.encode(text))
        if got != tokens:
            raise AssertionError(f"text has {got} tokens, wanted {tokens}")
        return text
