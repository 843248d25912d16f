"""Every supported family and mode over one group: `python -m tests.distributed_families OUT
DIR:ARCH:MODE ...`, started on every rank (MLX_RANK, MLX_HOSTFILE), or with no group to
compute the one-process reference (`--alone`).

For each model directory: build it split over the group (runner/distributed/shard.py: the
build's batched-rows check runs over the group too), then a prompt in two chunks, a decode
step and rows batched over the shared prefix, each forward evaluated alone, as the runner
evaluates them; rank 0 writes the logits of the last positions to OUT/<ARCH>-<MODE>.npy.
One process pair serves every family (starting a pair costs seconds on two cores).
"""

from __future__ import annotations

import sys
from pathlib import Path

import mlx.core as mx
import numpy as np

from runner.cache.batch import broadcast, forward_suffixes
from runner.cache.kinds import kind_of
from runner.cache.live import live_arrays
from runner.distributed.shard import Mode, distributor
from runner.distributed.start import backend_for_group
from runner.models import build_model
from runner.sources.loader import load_local_dir


def logits(model) -> np.ndarray:
    caches = model.make_caches()
    tokens = [(5 * i + 7) % 300 for i in range(20)]
    outs = []
    for chunk in (tokens[:13], tokens[13:], [17]):
        h = model.hidden(mx.array([chunk], dtype=mx.int32), caches)
        mx.eval(h, *live_arrays(caches))
        outs.append(h[:, -1:])
    kinds = [kind_of(c) for c in caches]
    if all(k.batches for k in kinds):
        batch = broadcast(kinds, caches, 2)
        h = forward_suffixes(model, batch, [[30, 31, 32], [40]])
        mx.eval(h)
        outs += [h[0:1, 2:3], h[1:2, 0:1]]
    return np.array(model.unembed(mx.concatenate(outs, axis=1)).astype(mx.float32))


def main(argv: list[str]) -> None:
    out = Path(argv[0])
    backend = backend_for_group()
    group = None if "--alone" in argv else mx.distributed.init(strict=True)
    for spec in argv[1:]:
        if spec == "--alone":
            continue
        path, arch, mode = spec.rsplit(":", 2)
        distribute = None if group is None else distributor(Mode(mode), group, None)
        model = build_model(load_local_dir(Path(path)), backend, distribute)
        result = logits(model)
        rank = 0 if group is None else group.rank()
        if rank == 0:
            np.save(out / f"{arch}-{mode}.npy", result)
        layers = len(model.module.layers)  # the rank's own, in pipeline mode
        print(f"{arch} {mode} rank {rank} layers {layers}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
