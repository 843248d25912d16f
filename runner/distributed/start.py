"""A rank's start: join the group, open the control channel, load this rank's share.

`start(...)` runs on the process's load thread (runner/__main__.py). On rank 0 it returns
the `Runner` the HTTP side serves: the runner's own, over a sharded model, with
`LeaderPrefixCache`s and a `GroupBudget`. On every other rank it loads the model's share
and serves rank 0's commands on this thread until `stop` (returns 0) or until rank 0 is
gone (1); the process then ends with that code.

Options (flags, or the environment for a supervisor that passes only its own flags):
`--distributed tensor|pipeline` (`OLLAMA_MLX_RUNNER_DISTRIBUTED`), `--pipeline-split
N,N,...` (`OLLAMA_MLX_RUNNER_PIPELINE_SPLIT`, layers per rank from rank 0);
`OLLAMA_MLX_RUNNER_RANK_TIMEOUT` (the watchdog, seconds, default 60),
`OLLAMA_MLX_RUNNER_GROUP_SECONDS` (forming the group, default 120),
`OLLAMA_MLX_RUNNER_CHECK_RANKS=1` (compare every rank's cache-index digest after every job).

The native decoder step (runner/backend/native_step.py) steps aside in distributed runs:
it runs every decoder layer of a forward in one native call, where tensor parallelism needs
an `all_sum` inside each block and pipeline parallelism a hand-over between two ranks'
layers; MLX's path has both. The runner's other CPU kernels (attention, activations, the
sgemm dispatch) stay.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
from collections.abc import Callable
from typing import Any

from runner.backend import Backend
from runner.cache.kinds import kind_of
from runner.distributed import group as grp
from runner.distributed import wire
from runner.distributed.follower import Follower, LoadPonger, serve
from runner.distributed.leader import GroupBudget, Leader, LeaderPrefixCache, SocketLink
from runner.distributed.shard import Mode, check_supported, distributor, parse_split
from runner.engine import Engine
from runner.service import Runner

log = logging.getLogger(__name__)

MODE_ENV = "OLLAMA_MLX_RUNNER_DISTRIBUTED"
SPLIT_ENV = "OLLAMA_MLX_RUNNER_PIPELINE_SPLIT"
TIMEOUT_ENV = "OLLAMA_MLX_RUNNER_RANK_TIMEOUT"
CHECK_ENV = "OLLAMA_MLX_RUNNER_CHECK_RANKS"
DEFAULT_TIMEOUT = 60.0

_leader: Leader | None = None


def requested_mode(flag: str) -> str:
    """The distributed mode asked for (the flag, else the environment); '' for none."""
    return flag or os.environ.get(MODE_ENV, "").strip()


def stop_group() -> None:
    """Rank 0 stops: tell every other rank to exit."""
    if _leader is not None:
        _leader.stop()


def backend_for_group() -> Backend:
    """MLX's path for the decoder layers (see the module docstring)."""
    return Backend.for_device().replace(native_step_max_tokens=None, native_half_formats=())


def start(
    mode_text: str,
    split_text: str,
    model: str,
    cache_limit: int,
    fail: Callable[[str], None],
) -> dict[str, Any]:
    """{"runner": Runner} on rank 0, {"exit": code} on the others once they are done."""
    try:
        mode = Mode.parse(mode_text)
        split = parse_split(split_text or os.environ.get(SPLIT_ENV, ""))
        if split is not None and mode is not Mode.PIPELINE:
            raise ValueError("--pipeline-split is for --distributed pipeline")
    except ValueError as e:
        fail(str(e))
        raise
    timeout = float(os.environ.get(TIMEOUT_ENV, "") or DEFAULT_TIMEOUT)
    seconds = grp.group_seconds()
    key = grp.group_key(f"{mode.value}|{split}")
    backend = backend_for_group()
    log.info(
        "distributed %s: the native decoder step steps aside (MLX's path runs the layers: "
        "the step has no place for a collective inside a forward)",
        mode.value,
    )
    if os.environ.get("MLX_RANK", "0").strip() in ("", "0"):
        return {
            "runner": _start_rank0(
                mode, split, model, cache_limit, fail, timeout, seconds, key, backend
            )
        }
    return {"exit": _start_follower(mode, split, model, fail, seconds, key, backend)}


def _distribute(mode: Mode, group: Any, split: list[int] | None) -> Callable[[Any, str], None]:
    shard = distributor(mode, group, split)

    def distribute(module: Any, architecture: str) -> None:
        check_supported(architecture, mode)
        shard(module, architecture)

    return distribute


def _start_rank0(
    mode: Mode,
    split: list[int] | None,
    model: str,
    cache_limit: int,
    fail: Callable[[str], None],
    timeout: float,
    seconds: float,
    key: str,
    backend: Backend,
) -> Runner:
    global _leader
    engine = Engine()
    try:
        joined = engine.call(lambda job: grp.join(seconds))
        server = grp.listen(grp.rank0_host())
        port = server.getsockname()[1]
        engine.call(lambda job: grp.broadcast_port(joined, port))
        socks = grp.accept(server, joined.size, key, seconds)
    except grp.GroupError as e:
        fail(str(e))
        raise
    log.info("rank 0 of %d: the group formed; control channel on port %d", joined.size, port)
    leader = Leader({r: SocketLink(s) for r, s in socks.items()}, timeout=timeout, fail=fail)
    leader.start_monitor(socks)
    _leader = leader

    def prefix_cache(loaded: Any, **kwargs: Any) -> LeaderPrefixCache:
        ready = leader.wait_ready()
        mine = config_digest(loaded)
        for rank, info in sorted(ready.items()):
            if info.get("config") != mine:
                fail(f"rank {rank} loaded another model than rank 0 (config.json differs)")
        points_here = any(kind_of(c).point for c in loaded.make_caches())
        phantom = not points_here and any(info.get("point") for info in ready.values())
        if phantom:
            log.info(
                "prefix cache %s: another rank holds windows or recurrent states, rank 0 none: "
                "restores only where theirs are stored (a phantom point slot)",
                kwargs.get("name"),
            )
        return LeaderPrefixCache(loaded, leader=leader, phantom=phantom, **kwargs)

    runner = Runner.load(
        engine,
        model,
        cache_budget=GroupBudget(cache_limit, leader),
        backend=backend,
        distribute=_distribute(mode, joined.group, split),
        prefix_cache=prefix_cache,
    )
    if os.environ.get(CHECK_ENV, "") not in ("", "0"):
        engine.after_each_job(leader.check_digests)
        log.info("every rank's cache index is compared after every job (%s)", CHECK_ENV)
    return runner


def _start_follower(
    mode: Mode,
    split: list[int] | None,
    model: str,
    fail: Callable[[str], None],
    seconds: float,
    key: str,
    backend: Backend,
) -> int:
    from runner.models import build_model
    from runner.sources.loader import load_model_source

    try:
        joined = grp.join(seconds)
        port = grp.broadcast_port(joined, 0)
        sock = grp.connect(grp.rank0_host(), port, joined.rank, key, seconds)
    except grp.GroupError as e:
        fail(str(e))
        raise
    rank = joined.rank
    log.info("rank %d of %d: joined rank 0's control channel", rank, joined.size)
    ponger = LoadPonger(sock, rank, fail)  # rank 0 pings while this rank loads
    try:
        loaded = build_model(
            load_model_source(model), backend, _distribute(mode, joined.group, split)
        )
    except Exception as e:
        ponger.finish()
        with contextlib.suppress(OSError):
            sock.sendall(wire.encode("error", message=f"loading failed: {e}"))
        raise
    points = any(kind_of(c).point for c in loaded.make_caches())
    reader, early = ponger.finish()
    sock.sendall(wire.encode("ready", point=points, config=config_digest(loaded)))
    log.info("rank %d of %d: ready (%s)", rank, joined.size, mode.value)
    follower = Follower(loaded, backend.prefill_chunk_tokens, backend.batch_tokens)
    return serve(follower, sock, rank, fail, reader, early)


def config_digest(model: Any) -> str:
    config = getattr(model, "config", None)
    text = json.dumps(config, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]
