"""One model over a process group: rank 0 decides, every other rank replays (docs/DESIGN.md §6).

- `shard`: the loaded module split over MLX's group, tensor (mlx-lm's `shard`) or pipeline
  (the runner's staging of a plain layer loop, or mlx-lm's `pipeline`), and what is refused;
- `group`: joining MLX's group, rank 0's control channel beside it, deadlines;
- `wire`: the control channel's frames (a JSON header and int32 token lists);
- `leader`: rank 0's prefix caches that send every action before it happens, the budget over
  every rank's bytes, the phantom point slot, the monitor and watchdog;
- `follower`: another rank's replicas of rank 0's caches and its command loop;
- `digest`: a digest of a cache index, equal on every rank of a group in step;
- `start`: a rank's start from runner/__main__.py.
"""
