"""Rank 0's cache decisions replayed on another rank, in one process (no MLX group).

The other rank here is a `Follower` fed through a direct link: every command rank 0's
`LeaderPrefixCache` sends is encoded, decoded and applied at once, and acknowledged with
the follower's bytes, exactly as over the control channel (tests/test_distributed.py runs
the real thing: processes, MLX's ring, sharded models). Its model may differ from rank 0's
(another family, other layers): the cache index must not, so after every request the
digest of every rank's index is compared, through hits, extensions, branch points,
evictions (on the follower's bytes when it holds more), cancellations and batched rows.
"""

from __future__ import annotations

import random

import pytest

from runner.cache.budget import ByteBudget
from runner.cache.kinds import kind_of
from runner.distributed import wire
from runner.distributed.follower import Follower
from runner.distributed.leader import PHANTOM, GroupBudget, Leader, LeaderPrefixCache
from runner.distributed.start import backend_for_group
from runner.generate.pipeline import GenerateOptions
from runner.protocol.errors import Cancelled
from runner.score.validate import Row
from runner.service import Runner
from runner.text.tokenizer import Tokenizer
from tests.tiny import load_tiny_model, tiny_config, tokenizer_json

pytestmark = pytest.mark.timeout(300)


class Failed(Exception):
    pass


def fail(message: str) -> None:
    raise Failed(message)


class DirectLink:
    """A follower on the other end, applied synchronously on the caller's (MLX) thread."""

    def __init__(self, rank: int, follower: Follower):
        self.rank, self.follower = rank, follower
        self.reader = wire.Reader()
        self.leader: Leader | None = None
        self.commands: list[str] = []

    def send(self, frame: bytes) -> None:
        assert self.leader is not None
        for message in self.reader.feed(frame):
            if message.op in ("stop", "ping"):
                continue
            self.commands.append(message.op)
            digest = self.follower.execute(message)
            ack = wire.Message(
                "ack",
                {"seq": message.get("seq"), "bytes": self.follower.nbytes, "digest": digest},
            )
            self.leader.on_message(self.rank, ack)

    def close(self) -> None:
        pass


class Group:
    """Rank 0's runner over `model` and followers over `others`, linked directly."""

    def __init__(self, engine, model, others, limit=1 << 40):
        backend = backend_for_group()
        self.followers = [
            Follower(m, backend.prefill_chunk_tokens, backend.batch_tokens) for m in others
        ]
        self.links = {r + 1: DirectLink(r + 1, f) for r, f in enumerate(self.followers)}
        self.leader = Leader(dict(self.links), timeout=30, fail=fail)  # type: ignore[arg-type]
        for link in self.links.values():
            link.leader = self.leader
        self.leader.ready = {
            r: {"point": any(kind_of(c).point for c in f.model.make_caches())}
            for r, f in zip(self.links, self.followers, strict=True)
        }
        points_here = any(kind_of(c).point for c in model.make_caches())
        phantom = not points_here and any(i["point"] for i in self.leader.ready.values())
        leader = self.leader

        def prefix_cache(m, **kwargs):
            return LeaderPrefixCache(m, leader=leader, phantom=phantom, **kwargs)

        tokenizer = Tokenizer(tokenizer_json())
        self.engine = engine
        self.runner = engine.call(
            lambda job: Runner(
                engine,
                model,
                tokenizer,
                "tiny",
                GroupBudget(limit, leader),
                backend,
                prefix_cache,
            )
        )
        self.limit = limit

    def check(self) -> str:
        """Every rank's cache index equal to rank 0's; the digest."""
        self.engine.call(lambda job: self.leader.check_digests())
        return str(self.leader.checks)

    def score(self, rows, cancel_after=None):
        def run(job):
            return self.runner.scorer.score(rows, counting(job.check, cancel_after))

        try:
            return self.engine.call(run).logits
        except (Cancelled, Broken):
            return None

    def generate(self, tokens, n, cancel_after=None):
        def run(job):
            check = counting(job.check, cancel_after)

            class Checked:
                def check(self):
                    check()

            return [
                s.token for s in self.runner.generator.steps(tokens, GenerateOptions(n), Checked())
            ]  # type: ignore[arg-type]

        try:
            return self.engine.call(run)
        except (Cancelled, Broken):
            return None

    def bytes(self) -> list[int]:
        return [self.runner.score_cache.nbytes + self.runner.generate_cache.nbytes] + [
            f.nbytes for f in self.followers
        ]


class Broken(Exception):
    """A failure between forwards (not a cancellation): the live state is discarded."""


def counting(check, limit):
    """`check`, then a cancellation after `limit` calls (a negative limit: a failure)."""
    calls = [0]

    def inner():
        check()
        calls[0] += 1
        if limit is not None and calls[0] > abs(limit):
            raise Cancelled() if limit >= 0 else Broken()

    return inner


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    backend = backend_for_group()
    out = {}
    for arch in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        path = tmp_path_factory.mktemp(arch)
        out[arch] = load_tiny_model(arch, path, backend=backend)
    # six layers, the first windowed: more bytes a token than Llama's two, and a point kind
    deep = {**tiny_config("Qwen3ForCausalLM"), "num_hidden_layers": 6, "sliding_window": 8}
    deep["layer_types"] = ["sliding_attention"] + ["full_attention"] * 5
    deep["use_sliding_window"] = True
    path = tmp_path_factory.mktemp("deep")
    out["deep"] = load_tiny_model("Qwen3ForCausalLM", path, backend=backend, config=deep)
    return out


SHARED = [5 + (i * 7) % 300 for i in range(40)]


def test_hits_extensions_and_decode_keep_the_ranks_in_step(engine, models):
    group = Group(engine, models["LlamaForCausalLM"], [models["LlamaForCausalLM"]])
    plain = engine.call(
        lambda job: Runner(engine, models["LlamaForCausalLM"], Tokenizer(tokenizer_json()), "p")
    )
    rows = [Row([*SHARED, 11, 12, 13], [3, 7]), Row([*SHARED, 14], [3, 7])]
    first = group.score(rows)
    group.check()
    again = group.score(rows)  # full hits: nothing computed, nothing sent but touches
    group.check()
    assert first == again
    extended = [Row([*SHARED, 11, 12, 13, 20, 21], [3, 7])]
    group.score(extended)
    group.check()
    tokens = group.generate([*SHARED, 30, 31], 6)
    group.check()
    more = group.generate([*SHARED, 30, 31, *tokens, 40], 4)  # continues the chat
    group.check()
    assert more is not None
    # same numbers as the runner alone, on the same (MLX) path
    alone = engine.call(lambda job: plain.scorer.score(rows, job.check)).logits
    assert first == alone
    commands = set(group.links[1].commands)
    assert {"open", "switch", "feed", "step", "rows", "store", "store_rows"} <= commands


def test_evictions_follow_the_rank_with_the_most_bytes(engine, models):
    """The follower (Qwen3, six layers, one windowed) holds more bytes than rank 0 (Llama,
    two layers, and the hidden rows): the budget is over when it is, and rank 0 evicts for
    it (alone, under the same limit, rank 0 would evict nothing); rank 0 restores only where
    the follower's window states are stored (its phantom slot)."""
    llama, deep = models["LlamaForCausalLM"], models["deep"]
    limit = 120_000
    group = Group(engine, llama, [deep], limit=limit)
    assert PHANTOM in group.runner.score_cache.kinds  # rank 0 has no point kind; rank 1 has
    alone = engine.call(
        lambda job: Runner(engine, llama, Tokenizer(tokenizer_json()), "p", ByteBudget(limit))
    )
    rng = random.Random(3)
    group.generate([*SHARED[:10], 50], 3)
    for _ in range(14):
        prefix = SHARED[: rng.randint(5, 40)]
        rows = [
            Row(prefix + rng.choices(range(3, 300), k=rng.randint(1, 6)), [3]) for _ in range(3)
        ]
        expected = engine.call(lambda job, r=rows: alone.scorer.score(r, job.check).logits)
        # restored at other points (the follower's windows): float32 rounding apart
        assert group.score(rows) == [pytest.approx(e, abs=1e-5) for e in expected]
        group.check()
        mine, theirs = group.bytes()
        assert mine < theirs <= limit
    assert group.links[1].commands.count("evict") > 0
    assert alone.cache_budget.used < limit
    assert group.bytes()[0] < alone.cache_budget.used  # rank 0 evicted for rank 1's bytes


def test_cancellations_and_failures_mid_prefill_and_mid_decode_stay_in_step(engine, models):
    llama = models["LlamaForCausalLM"]
    group = Group(engine, llama, [llama, models["Qwen3ForCausalLM"]])
    for cache in (group.runner.score_cache, group.runner.generate_cache):
        cache.chunk_tokens = 8
    long = SHARED * 3
    assert group.score([Row([*long, 9], [3])], cancel_after=2) is None
    group.check()
    assert group.generate([*long, 10], 8, cancel_after=9) is None  # 6 chunks, then 3 steps
    group.check()
    assert group.score([Row([*long, 9], [3])]) is not None  # resumes where it stopped
    group.check()
    assert group.generate([*long, 10], 4) is not None
    group.check()
    assert group.generate([*long, 11, 12], 8, cancel_after=-2) is None  # fails mid-decode
    group.check()
    assert group.score([Row([*long, 13], [3])], cancel_after=-1) is None
    group.check()
    assert "reset" in group.links[1].commands and "reset" in group.links[2].commands
    assert group.generate([*long, 11, 12], 3) is not None
    group.check()


@pytest.mark.parametrize("seed", [0, 1])
def test_random_mixed_requests(engine, models, seed):
    """Scores (shared prefixes, batches, full hits), generations, cancellations, under a
    budget that evicts; three ranks of three different models."""
    group = Group(
        engine,
        models["Qwen3ForCausalLM"],
        [models["LlamaForCausalLM"], models["Qwen2ForCausalLM"]],
        limit=150_000,
    )
    rng = random.Random(seed)
    history: list[list[int]] = [SHARED]
    for _ in range(30):
        base = rng.choice(history)
        prompt = base[: rng.randint(1, len(base))] + rng.choices(range(3, 300), k=rng.randint(1, 8))
        cancel = rng.choice([None, None, None, 1, 2, 4])
        if rng.random() < 0.6:
            rows = [Row(prompt + rng.choices(range(3, 300), k=rng.randint(0, 4)), [3, 5])]
            rows += [Row([*prompt, rng.randint(3, 300)], [3]) for _ in range(rng.randint(0, 3))]
            group.score(rows, cancel)
        else:
            out = group.generate(prompt, rng.randint(1, 5), cancel)
            if out:
                history.append(prompt + out)
        history.append(prompt)
        group.check()
    assert {"evict", "rows", "step"} <= set(group.links[1].commands)
