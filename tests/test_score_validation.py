"""/v1/score validation: every rule of docs/PROTOCOL.md §4.3, in order, with its exact text.

Each failing request is followed by a good one, to show a bad request changes nothing.
"""

from __future__ import annotations

import pytest

from runner.protocol.wire import ScoreRequest, ScoreRow
from runner.score.validate import prepare_rows
from tests.candidates import single_token_candidates

GOOD = {"rows": [{"prompt": "Is the sky blue?", "candidates": [" Yes", " No"]}], "max_tokens": 64}


async def expect_400(client, body, message: str) -> None:
    response = await client.post("/v1/score", json=body)
    assert response.status == 400, await response.text()
    assert response.headers["Content-Type"].startswith("text/plain")
    assert await response.text() == message + "\n"
    # ...and the runner still serves.
    good = await client.post("/v1/score", json=GOOD)
    assert good.status == 200
    assert len((await good.json())["logits"][0]) == 2


@pytest.mark.parametrize("count", [0, 65])
async def test_rule1_row_count(client, count):
    rows = [{"prompt": "Is the sky blue?", "candidates": [" Yes"]}] * count
    await expect_400(client, {"rows": rows, "max_tokens": 64}, "scoring requires 1–64 prompts")


@pytest.mark.parametrize("max_tokens", [0, -1, None, "ctx+1"])
async def test_rule2_max_tokens(client, llama_runner, max_tokens):
    n = llama_runner.context_length
    body = {"rows": GOOD["rows"]}
    if max_tokens is not None:
        body["max_tokens"] = n + 1 if max_tokens == "ctx+1" else max_tokens
    await expect_400(client, body, f"max_tokens must be between 1 and {n}")


async def test_rule3_empty_prompt(client):
    body = {"rows": [{"prompt": "", "candidates": [" Yes"]}], "max_tokens": 64}
    await expect_400(
        client, body, "prompt 0 has 0 tokens; expected 1–64 (input is never truncated)"
    )


async def test_rule3_prompt_longer_than_max_tokens_is_never_truncated(client, llama_runner):
    long_prompt = "Is the sky blue? " * 20
    k = len(llama_runner.tokenizer.encode(long_prompt))
    body = {
        "rows": [GOOD["rows"][0], {"prompt": long_prompt, "candidates": [" Yes"]}],
        "max_tokens": k - 1,
    }
    await expect_400(
        client, body, f"prompt 1 has {k} tokens; expected 1–{k - 1} (input is never truncated)"
    )


@pytest.mark.parametrize("count", [0, 27])
async def test_rule4_candidate_count(client, count):
    body = {
        "rows": [{"prompt": "Is the sky blue?", "candidates": [" Yes"] * count}],
        "max_tokens": 64,
    }
    await expect_400(client, body, "prompt 0 requires 1–26 candidates")


@pytest.mark.parametrize(
    ("candidate", "quoted"),
    [
        (" zqxv jkwp", '" zqxv jkwp"'),  # several tokens
        ("", '""'),  # no token at all
        ("<|im_end|>", '"<|im_end|>"'),  # an added (special) token
        ('"\n', '"\\"\\n"'),  # quoted as Go's %q
    ],
)
async def test_rule5_candidate_must_append_one_ordinary_token(client, candidate, quoted):
    body = {
        "rows": [{"prompt": "Is the sky blue?", "candidates": [" Yes", candidate]}],
        "max_tokens": 64,
    }
    await expect_400(
        client, body, f"candidate {quoted} must append exactly one ordinary token to prompt 0"
    )


async def test_rule5_candidate_that_merges_with_the_prompt(client, llama_runner):
    tokenizer = llama_runner.tokenizer
    # Find a split of a word that the tokenizer writes as one token: prompt + tail re-merges.
    for word in ["blue", "sky", "the", "Answer", "Yes"]:
        ids = tokenizer.encode(" " + word)
        if len(ids) == 1:
            prompt, tail = "Is the " + word[:-1], word[-1]
            break
    else:
        pytest.fail("tiny tokenizer merges none of the probe words")
    body = {"rows": [{"prompt": prompt, "candidates": [tail]}], "max_tokens": 64}
    await expect_400(
        client, body, f'candidate "{tail}" must append exactly one ordinary token to prompt 0'
    )


async def test_rule6_duplicate_candidate_tokens(client):
    body = {
        "rows": [GOOD["rows"][0], {"prompt": "Is it?", "candidates": [" Yes", " No", " Yes"]}],
        "max_tokens": 64,
    }
    await expect_400(client, body, "prompt 1 has invalid or duplicate candidate tokens")


def test_rule6_candidate_outside_the_model_vocabulary(llama_runner):
    tokenizer = llama_runner.tokenizer
    (word,) = single_token_candidates(tokenizer, "Is it", 1)
    token = tokenizer.encode("Is it" + word)[-1]
    request = ScoreRequest(rows=[ScoreRow("Is it", [word])], maxtokens=64)
    from runner.protocol.errors import BadRequest

    with pytest.raises(BadRequest, match="prompt 0 has invalid or duplicate candidate tokens"):
        prepare_rows(request, tokenizer, 128, vocab_size=token)
    assert prepare_rows(request, tokenizer, 128, vocab_size=token + 1)[0].candidates == [token]


async def test_rules_apply_in_order(client, llama_runner):
    n = llama_runner.context_length
    # Bad max_tokens and a bad row: max_tokens is checked first.
    body = {"rows": [{"prompt": "", "candidates": []}], "max_tokens": 0}
    await expect_400(client, body, f"max_tokens must be between 1 and {n}")
    # Bad token count and bad candidates in row 0: the token count is checked first.
    body = {"rows": [{"prompt": "", "candidates": []}], "max_tokens": 5}
    await expect_400(client, body, "prompt 0 has 0 tokens; expected 1–5 (input is never truncated)")
    # Row 0 bad candidates, row 1 bad prompt: row 0 first.
    body = {
        "rows": [{"prompt": "Is it", "candidates": []}, {"prompt": "", "candidates": [" a"]}],
        "max_tokens": 5,
    }
    await expect_400(client, body, "prompt 0 requires 1–26 candidates")


async def test_a_candidate_before_an_overlong_prompt_is_still_checked_first(client, llama_runner):
    long_prompt = "Is the sky blue? " * 20
    k = len(llama_runner.tokenizer.encode(long_prompt))
    body = {
        "rows": [
            {"prompt": "Is the sky blue?", "candidates": [" Yes", " zqxv jkwp"]},
            {"prompt": long_prompt, "candidates": [" Yes"]},
        ],
        "max_tokens": k - 1,
    }
    await expect_400(
        client, body, 'candidate " zqxv jkwp" must append exactly one ordinary token to prompt 0'
    )


class _CountingTokenizer:
    """The tokenizer, counting the texts it is asked to encode (a text and each text +
    appended string of `encode_extended`)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.texts = tokenizer, []

    def encode_within(self, texts, limit):
        self.texts += texts
        return self.tokenizer.encode_within(texts, limit)

    def encode_extended(self, items, limit):
        for text, appended in items:
            self.texts += [text, *(text + a for a in appended if a is not None)]
        return self.tokenizer.encode_extended(items, limit)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


def test_candidates_of_a_long_prompt_are_not_tokenized_when_it_is_refused(
    llama_runner, monkeypatch
):
    """A prompt of more than LONG_PROMPT_CHARS_PER_TOKEN characters a token of max_tokens is
    tokenized before its candidates, which are never tokenized when a row up to it is refused:
    a prompt of a million tokens is tokenized once, not once more per candidate. Whichever
    batch a row's candidates go in, the rows are the same."""
    from runner.protocol.errors import BadRequest
    from runner.score import validate as score

    long_prompt = "Is the sky blue? " * 60
    k = len(llama_runner.tokenizer.encode(long_prompt))
    rows = [
        ScoreRow("Is it", [" Yes", " No"]),
        ScoreRow(long_prompt, [" Yes", " No", " A"]),
        ScoreRow("Is that", [" Yes"]),
    ]
    counting = _CountingTokenizer(llama_runner.tokenizer)
    with pytest.raises(BadRequest, match=f"prompt 1 has {k} tokens; expected 1–16"):
        prepare_rows(ScoreRequest(rows=rows, maxtokens=16), counting, 4096, 1 << 20)
    short = ["Is it", "Is it Yes", "Is it No", "Is that", "Is that Yes"]
    assert sorted(counting.texts) == sorted([*short, long_prompt])
    # Within the limit: one batch for all; as a long prompt, its candidates in a second
    # batch, with the prompt again.
    request = ScoreRequest(rows=rows, maxtokens=k)
    counting.texts.clear()
    together = prepare_rows(request, counting, 4096, 1 << 20)
    assert len(counting.texts) == 9
    monkeypatch.setattr(score, "LONG_PROMPT_CHARS_PER_TOKEN", 1)
    counting.texts.clear()
    apart = prepare_rows(request, counting, 4096, 1 << 20)
    assert len(counting.texts) == 9 + 1
    assert [(r.tokens, r.candidates) for r in apart] == [(r.tokens, r.candidates) for r in together]
    assert [len(r.candidates) for r in apart] == [2, 3, 1]


def test_a_candidate_longer_than_any_token_is_refused_without_tokenizing_it(llama_runner):
    from runner.protocol.errors import BadRequest

    huge = " the" * 250_000
    rows = [ScoreRow("Is it", [" Yes", huge])]
    counting = _CountingTokenizer(llama_runner.tokenizer)
    with pytest.raises(BadRequest, match="must append exactly one ordinary token to prompt 0"):
        prepare_rows(ScoreRequest(rows=rows, maxtokens=64), counting, 4096, 1 << 20)
    assert sorted(counting.texts) == ["Is it", "Is it Yes"]


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        (b"", "EOF"),
        (b"{not json", "malformed"),
        (b'{"rows": 5}', "Expected `array`"),
        (b'{"rows": [{"prompt": ["x"]}]}', "Expected `str`"),
        (b'"just a string"', "cannot unmarshal string into Go value of type ScoreRequest"),
        (b"[1, 2]", "cannot unmarshal array"),
        (b'{"rows": [', "unexpected EOF"),
    ],
)
async def test_bad_bodies_are_400_with_the_decoder_message(client, body, fragment):
    response = await client.post("/v1/score", data=body)
    assert response.status == 400
    assert fragment in await response.text()
    assert (await client.post("/v1/score", json=GOOD)).status == 200


async def test_huge_body_is_400_and_runner_keeps_serving(make_client, llama_runner):
    client = await make_client(llama_runner, max_body_bytes=4096)
    response = await client.post("/v1/score", data=b"{" + b" " * 10_000 + b"}")
    assert response.status == 400
    assert "request body too large" in await response.text()
    assert (await client.post("/v1/score", json=GOOD)).status == 200


def test_a_prompt_past_the_limit_is_counted_not_listed(llama_runner):
    """What the length check needs of a prompt past max_tokens is its count: the message
    says it exactly (as Go's does), though its ids are never listed."""
    from runner.protocol.errors import BadRequest

    prompt = "Is the sky blue? " * 50
    k = len(llama_runner.tokenizer.encode(prompt))
    (within,) = llama_runner.tokenizer.encode_within([prompt], k)
    (past,) = llama_runner.tokenizer.encode_within([prompt], k - 1)
    assert within == llama_runner.tokenizer.encode(prompt) and past == k
    rows = [ScoreRow(prompt, [" Yes"])]
    with pytest.raises(BadRequest, match=f"prompt 0 has {k} tokens; expected 1–8 "):
        prepare_rows(ScoreRequest(rows=rows, maxtokens=8), llama_runner.tokenizer, 4096, 1 << 20)
