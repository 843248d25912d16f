"""Images on the request side: tags, expansions, folds, chunk planning and the caches.

Over `TinyImageModel` (tests/image_model.py: the tiny Llama with a toy image expansion and
features; atomic images attend to each other). What is proven here holds for any
`ImageModel`: the prompt's tags expand as the Go runner's `PrepareMedia` does, with its error
texts; a chunked forward never ends inside an atomic image and equals the one-shot forward;
the prefix cache restores past an image it has seen and diverges at one it has not; rows that
share an image compute it once; generation after an image equals the uncached computation.
"""

from __future__ import annotations

import base64
import json

import mlx.core as mx
import numpy as np
import pytest

from runner.media.prepare import FOLD_BIT, Item, PreparedPrompt, fold_value, prepare_prompt
from runner.media.request import RequestMedia
from runner.protocol.errors import BadRequest
from runner.protocol.wire import decode_completion_request, decode_score_request
from runner.server.endpoints import CompletionEndpoint, ScoreEndpoint
from runner.service import Runner
from tests.image_model import BOI, EOI, IMG, TinyImageModel
from tests.tiny import prefix_cache

TOLERANCE = 1e-4
RED = b"\x89PNG red pixels"  # 15 bytes: k = 2 + 15 % 4 = 5 image tokens
BLUE = b"\x89PNG blue pixels!"  # 17 bytes: k = 3


def media(*items: tuple[int, bytes]) -> list[dict]:
    return [{"data": base64.b64encode(b).decode(), "id": i, "Kind": "image"} for i, b in items]


@pytest.fixture
def image_runner(engine, llama_loaded):
    """A fresh runner around the tiny Llama with atomic images."""

    def make(causal: bool = False, **kwargs) -> Runner:
        def build(job) -> Runner:  # on the MLX thread: the model makes arrays
            model = TinyImageModel(llama_loaded.model, causal=causal)
            return Runner(engine, model, llama_loaded.tokenizer, "tiny-image", **kwargs)

        return engine.call(build)

    return make


def prepared(runner: Runner, prompt: str, *items: tuple[int, bytes]) -> PreparedPrompt:
    request = decode_completion_request(
        json.dumps({"Prompt": prompt, "Media": media(*items)}).encode()
    )
    return prepare_prompt(prompt, request.media, runner.tokenizer, runner.model, False)


def item(start: int, end: int, causal: bool) -> Item:
    return Item(start, end, np.zeros((end - start, 1), np.float32), causal, FOLD_BIT | 1, 0)


# --- folds and preparation ------------------------------------------------------------------


def test_fold_depends_on_bytes_and_geometry_and_never_looks_like_a_token():
    fold = fold_value(b"abc", (3, 4))
    assert fold == fold_value(b"abc", (3, 4))  # deterministic
    assert fold & FOLD_BIT
    assert fold != fold_value(b"abc", (4, 3))  # the same bytes in another geometry
    assert fold != fold_value(b"abd", (3, 4))
    # Go's FNV-1a 64 of no bytes is its offset basis, folded to 32 bits with bit 31 set
    assert fold_value(b"", ()) == (0xCBF29CE4 ^ 0x84222325) | FOLD_BIT


def test_the_native_fold_equals_the_definition():
    """FNV-1a through the dispatch library (when preloaded) equals the byte-by-byte loop on
    lengths around the Python cut-off (64 bytes) and up to a megabyte, and a known value:
    FNV-1a 64 of "a" is 0xAF63DC4C8601EC8C; a fold over it equals the definition."""
    from runner.media import prepare

    if prepare._NATIVE_FNV is None:
        pytest.skip("the dispatch library is not preloaded")
    rng = np.random.default_rng(0)
    for n in (0, 1, 63, 64, 65, 1000, 1 << 20):
        data = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        native = int(prepare._NATIVE_FNV(data, len(data), prepare._FNV_OFFSET))
        assert native == prepare._fnv1a64_python(data, prepare._FNV_OFFSET), n
    assert int(prepare._NATIVE_FNV(b"a", 1, prepare._FNV_OFFSET)) == 0xAF63DC4C8601EC8C
    big = rng.integers(0, 256, 5000, dtype=np.uint8).tobytes()
    dims = (2).to_bytes(8, "little") + (3).to_bytes(8, "little")
    h = prepare._fnv1a64_python(big + dims, prepare._FNV_OFFSET)
    assert fold_value(big, (2, 3)) == ((h >> 32) ^ (h & 0xFFFFFFFF)) | FOLD_BIT


def test_tags_expand_to_the_models_tokens_with_items_keyed_by_fold(image_runner):
    runner = image_runner()
    tok = runner.tokenizer
    p = prepared(runner, "Is it[img-7] blue?[img-3]", (3, BLUE), (7, RED))
    head, tail = tok.encode("Is it"), tok.encode(" blue?")
    red = [BOI, *[IMG] * 5, EOI]
    blue = [BOI, *[IMG] * 3, EOI]
    assert p.tokens == [*head, *red, *tail, *blue, *tok.encode("")]
    first, second = p.items
    assert (first.start, first.end) == (len(head) + 1, len(head) + 6)  # the IMG tokens
    assert (second.start, second.end) == (len(head) + 7 + len(tail) + 1, len(p.tokens) - 1)
    assert first.fold == fold_value(RED, first.pixels.shape) != second.fold
    keys = p.keys
    assert keys[first.start : first.end] == [first.fold] * 5  # every position keyed by the fold
    assert [k for k in keys if k & FOLD_BIT] == [first.fold] * 5 + [second.fold] * 3
    assert keys[: first.start] == p.tokens[: first.start]
    assert p.tail_start == len(p.tokens)  # the text after the last tag is empty


def test_same_image_twice_gives_two_items_with_one_fold_and_unused_media_is_ignored(image_runner):
    runner = image_runner()
    p = prepared(runner, "[img-1] and [img-1]", (1, RED), (2, BLUE))
    assert len(p.items) == 2 and p.items[0].fold == p.items[1].fold
    assert p.items[0].source == 0 and p.items[1].source == 1


def test_without_media_tags_are_text(image_runner):
    runner = image_runner()
    endpoint = CompletionEndpoint(runner)
    plan = endpoint.prepare(decode_completion_request(b'{"Prompt":"Is it[img-0]"}'))
    assert plan.prompt.tokens == runner.tokenizer.encode("Is it[img-0]") and not plan.prompt.items


@pytest.mark.parametrize(
    ("prompt", "items", "message"),
    [
        ("Is it[img-3]", [(0, RED)], "invalid image index: 3"),
        ("Is it[img-0]", [(0, b"")], "invalid image data: no bytes"),
    ],
)
def test_bad_images_are_400s_for_both_endpoints(image_runner, prompt, items, message):
    runner = image_runner()
    body = {"Prompt": prompt, "Media": media(*items)}
    with pytest.raises(BadRequest, match=f"^{message}$"):
        CompletionEndpoint(runner).prepare(decode_completion_request(json.dumps(body).encode()))
    score = {"rows": [{"prompt": prompt, "candidates": [" Yes"]}], "max_tokens": 64}
    score["media"] = body["Media"]
    with pytest.raises(BadRequest, match=f"^{message}$"):
        ScoreEndpoint(runner).prepare(decode_score_request(json.dumps(score).encode()))


def test_a_text_only_model_refuses_media_on_both_endpoints(llama_runner):
    body = {"Prompt": "Is it[img-0]", "Media": media((0, RED))}
    with pytest.raises(BadRequest, match=r"^this model does not support image input$"):
        CompletionEndpoint(llama_runner).prepare(
            decode_completion_request(json.dumps(body).encode())
        )
    score = {"rows": [{"prompt": "Is it", "candidates": [" Yes"]}], "media": body["Media"]}
    with pytest.raises(BadRequest, match=r"^this model does not support image input$"):
        ScoreEndpoint(llama_runner).prepare(decode_score_request(json.dumps(score).encode()))


def test_score_candidates_are_checked_against_the_text_after_the_last_tag(image_runner):
    runner = image_runner()
    body = {
        "rows": [{"prompt": "[img-0] Is it", "candidates": [" Yes", " the"]}],
        "max_tokens": 64,
        "media": media((0, RED)),
    }
    plan = ScoreEndpoint(runner).prepare(decode_score_request(json.dumps(body).encode()))
    (row,) = plan.rows
    tok = runner.tokenizer
    assert row.candidates == [tok.encode(" Is it Yes")[-1], tok.encode(" Is it the")[-1]]
    body["rows"][0]["candidates"] = [" Yesterday and"]
    with pytest.raises(BadRequest, match="must append exactly one ordinary token to prompt 0"):
        ScoreEndpoint(runner).prepare(decode_score_request(json.dumps(body).encode()))
    body["rows"][0]["candidates"] = [" Yes"]
    body["max_tokens"] = 5  # the expanded prompt has 9 tokens
    with pytest.raises(BadRequest, match=r"^prompt 0 has 9 tokens; expected 1–5"):
        ScoreEndpoint(runner).prepare(decode_score_request(json.dumps(body).encode()))


# --- chunk planning ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("pos", "stop", "end", "expected"),
    [
        (0, 4, 20, 4),  # ends before the atomic item [5, 9)
        (0, 5, 20, 5),  # ends at its start
        (0, 7, 20, 5),  # would end inside, starts before it: cut at its start
        (5, 7, 20, 9),  # starts at it: extended to its end
        (6, 7, 20, 9),  # starts inside it (a restore never does; still whole from here)
        (5, 7, 8, 8),  # extended, but never past the end asked for
        (9, 12, 20, 12),  # past it
        (10, 13, 20, 13),  # the causal item [12, 15) may split
        (0, 20, 20, 20),  # covers everything
    ],
)
def test_extend_chunk(pos, stop, end, expected):
    plan = RequestMedia(
        None, PreparedPrompt(list(range(20)), [item(5, 9, False), item(12, 15, True)])
    )
    assert plan.extend_chunk(pos, stop, end) == expected


def test_restores_never_land_inside_an_atomic_item():
    plan = RequestMedia(
        None, PreparedPrompt(list(range(20)), [item(5, 9, False), item(12, 15, True)])
    )
    assert [plan.floor(o) for o in (4, 5, 6, 8, 9, 13)] == [4, 5, 5, 5, 9, 13]


# --- forwards and caches -----------------------------------------------------------------------


def logits_of(runner: Runner, prompt: PreparedPrompt, **cache_kwargs) -> tuple[np.ndarray, int]:
    """Last-position logits through a scoring prefix cache (fresh unless given)."""

    def run(job):
        cache = cache_kwargs.pop("cache", None) or prefix_cache(
            runner.model, name="t", keep_hidden=True, **cache_kwargs
        )
        media = RequestMedia(runner.model, prompt)
        row, restored = cache.last_hidden(prompt.keys, job.check, media=media)
        return np.array(runner.model.unembed(row).astype(mx.float32))[0], restored

    return runner.engine.call(run)


def test_chunked_equals_one_shot_and_never_splits_an_atomic_image(image_runner, monkeypatch):
    runner = image_runner()
    p = prepared(runner, "Is the sky[img-0] blue? Is grass[img-1] green?", (0, RED), (1, BLUE))
    one_shot, _ = logits_of(runner, p, chunk_tokens=4096)
    fed: list[tuple[int, int]] = []
    original = RequestMedia.inputs

    def spy(self, start, stop):
        fed.append((start, stop))
        return original(self, start, stop)

    monkeypatch.setattr(RequestMedia, "inputs", spy)
    chunked, _ = logits_of(runner, p, chunk_tokens=3)
    assert np.abs(chunked - one_shot).max() <= TOLERANCE
    assert len(fed) > 4  # really chunked
    for start, stop in fed:
        for it in p.items:
            assert not it.start < stop < it.end, f"chunk [{start}, {stop}) splits {it}"


def test_splitting_an_atomic_image_would_change_the_logits(image_runner, monkeypatch):
    """The planner is what keeps chunked = one-shot: without it a chunk of 3 cuts the image,
    and the logits move by more than the tolerance the equivalence tests above use."""
    runner = image_runner()
    p = prepared(runner, "Is the sky[img-0] blue?", (0, RED))
    one_shot, _ = logits_of(runner, p, chunk_tokens=4096)
    monkeypatch.setattr(RequestMedia, "extend_chunk", lambda self, pos, stop, end: stop)
    split, _ = logits_of(runner, p, chunk_tokens=3)
    assert np.abs(split - one_shot).max() > 3 * TOLERANCE


def test_a_causal_image_may_split(image_runner):
    runner = image_runner(causal=True)
    p = prepared(runner, "Is the sky[img-0] blue?", (0, RED))
    one_shot, _ = logits_of(runner, p, chunk_tokens=4096)
    chunked, _ = logits_of(runner, p, chunk_tokens=2)
    assert np.abs(chunked - one_shot).max() <= TOLERANCE


def test_the_same_image_restores_past_its_expansion_and_other_bytes_diverge_there(image_runner):
    runner = image_runner()
    cache = prefix_cache(runner.model, name="t", keep_hidden=True)
    first = prepared(runner, "Is the sky[img-0] blue?", (0, RED))
    logits_of(runner, first, cache=cache)
    again = prepared(runner, "Is the sky[img-0] red?", (0, RED))
    cold, _ = logits_of(runner, again)
    warm, restored = logits_of(runner, again, cache=cache)
    assert restored >= again.items[0].end  # the whole expansion came from the cache
    assert np.abs(warm - cold).max() <= TOLERANCE
    other = prepared(runner, "Is the sky[img-0] blue?", (0, RED[:-1] + b"?"))  # same length
    cold, _ = logits_of(runner, other)
    warm, restored = logits_of(runner, other, cache=cache)
    assert restored == other.items[0].start  # diverges at the image's first position
    assert np.abs(warm - cold).max() <= TOLERANCE


def test_a_restore_backs_off_to_the_start_of_an_atomic_image(image_runner):
    """A prompt stored up to the middle of an image (a text prompt whose tokens happen to be
    the keys) cannot be restored there: the image's states depend on all of it."""
    runner = image_runner()
    p = prepared(runner, "Is the sky[img-0] blue?", (0, RED))
    it = p.items[0]
    cache = prefix_cache(runner.model, name="t", keep_hidden=True)

    def store_text_prefix(job):
        keys = p.keys[: it.start + 2]
        cache.last_hidden([k if k < FOLD_BIT else 1 for k in keys], job.check)
        session = cache.begin(p.keys, media=RequestMedia(runner.model, p))
        session.close()
        return session.offset

    offset = runner.engine.call(store_text_prefix)
    assert offset <= it.start


def test_score_rows_sharing_an_image_compute_it_once_and_equal_rows_alone(image_runner):
    runner = image_runner()
    questions = [" blue?", " red?", " green? Is it", " the sky? Yes"]
    body = {
        "rows": [
            {"prompt": f"Is the sky[img-0]{q}", "candidates": [" Yes", " No"]} for q in questions
        ],
        "max_tokens": 64,
        "media": media((0, RED)),
    }
    endpoint = ScoreEndpoint(runner)
    together = endpoint(decode_score_request(json.dumps(body).encode()))
    assert runner.model.encoded == 1
    assert together.cached_tokens >= (len(questions) - 1) * 10  # the rows' shared prefix
    for i, row in enumerate(body["rows"]):
        alone = image_runner()
        one = {**body, "rows": [row]}
        answer = ScoreEndpoint(alone)(decode_score_request(json.dumps(one).encode()))
        assert np.abs(np.array(answer.logits[0]) - np.array(together.logits[i])).max() <= TOLERANCE


def test_score_rows_with_different_images_score_each(image_runner):
    runner = image_runner()
    body = {
        "rows": [
            {"prompt": "Is the sky[img-0] blue?", "candidates": [" Yes", " No"]},
            {"prompt": "Is the sky[img-1] blue?", "candidates": [" Yes", " No"]},
        ],
        "max_tokens": 64,
        "media": media((0, RED), (1, BLUE)),
    }
    together = ScoreEndpoint(runner)(decode_score_request(json.dumps(body).encode()))
    for i, row in enumerate(body["rows"]):
        one = {**body, "rows": [row]}
        answer = ScoreEndpoint(image_runner())(decode_score_request(json.dumps(one).encode()))
        assert np.abs(np.array(answer.logits[0]) - np.array(together.logits[i])).max() <= TOLERANCE
    assert together.logits[0] != together.logits[1]


def greedy_uncached(runner: Runner, p: PreparedPrompt, n: int) -> list[int]:
    """Greedy tokens from one forward over the whole prompt, then plain decode steps."""

    def run(job):
        model = runner.model
        caches = model.make_caches()
        plan = RequestMedia(model, p)
        ids, blocks = plan.inputs(0, len(p.tokens))
        h = model.hidden(ids, caches, blocks)[:, -1]
        out = []
        for _ in range(n):
            token = int(mx.argmax(model.unembed(h), axis=-1).item())
            out.append(token)
            h = model.hidden(mx.array([[token]], dtype=mx.int32), caches)[:, -1]
        return out

    return runner.engine.call(run)


def test_generation_after_an_image_equals_the_uncached_forward_and_restores_it(image_runner):
    runner = image_runner()
    endpoint = CompletionEndpoint(runner)
    body = {"Prompt": "Is the sky[img-0] blue?", "Media": media((0, RED))}
    body["Options"] = {"num_predict": 6}
    plan = endpoint.prepare(decode_completion_request(json.dumps(body).encode()))
    expected = greedy_uncached(runner, plan.prompt, 6)
    if 2 in expected:  # the tiny model's EOS ends generation, unstreamed
        expected = expected[: expected.index(2)]

    def generated(job) -> list[int]:
        return [step.token for step in runner.generator.steps(plan.prompt, plan.options, job)]

    assert runner.engine.call(generated) == expected
    encoded = runner.model.encoded
    assert runner.engine.call(generated) == expected
    assert runner.model.encoded == encoded  # restored: the image was not encoded again
    lines = endpoint(decode_completion_request(json.dumps(body).encode()))
    assert lines[-1].PromptEvalCount == len(plan.prompt.tokens)
