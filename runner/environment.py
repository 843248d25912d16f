"""The process environment the runner re-executes itself with, before MLX is imported.

Two things can only be set at process start, so the runner's entry point computes them here
and re-executes itself once when anything changes (`RESTARTED` in the new environment says
it already did):
- the BLAS under MLX's CPU backend (runner/native/preload.py);
- a library path that loads the MLX this runner was installed with. Ollama's supervisor puts
  its own `lib/ollama` and `lib/ollama/mlx_*` folders first on `LD_LIBRARY_PATH` (Windows:
  `PATH`); `LD_LIBRARY_PATH` wins over the wheel's RUNPATH, so a `libmlx.so` there is loaded
  instead of the wheel's and `import mlx.core` fails on an undefined symbol before anything
  is logged. Every folder holding a library of the installed MLX's name is left out, and the
  re-executed runner logs what was removed (`REMOVED_ENV`).
"""

from __future__ import annotations

import importlib.util
import logging
import os
from pathlib import Path

from runner.native import preload

REMOVED_ENV = "OLLAMA_MLX_RUNNER_REMOVED_LIBRARY_PATH"
RESTARTED = "OLLAMA_MLX_RUNNER_RESTARTED"
LIBRARY_PATH = "LD_LIBRARY_PATH"

log = logging.getLogger(__name__)


def mlx_library_names() -> set[str]:
    """File names of the shared libraries the installed MLX ships (found without importing
    it: an import is what a shadowing library breaks)."""
    spec = importlib.util.find_spec("mlx")
    names: set[str] = set()
    for location in (spec.submodule_search_locations or []) if spec else []:
        lib = Path(location) / "lib"
        if lib.is_dir():
            names.update(p.name for p in lib.iterdir() if ".so" in p.name or p.suffix == ".dylib")
    return names


def without_shadowing(path: str, names: set[str]) -> tuple[str, list[str]]:
    """`path` (a `:` list of folders) without the folders that hold any of `names`."""
    kept, removed = [], []
    for folder in path.split(os.pathsep):
        if folder and names and any((Path(folder) / n).exists() for n in names):
            removed.append(folder)
        else:
            kept.append(folder)
    return os.pathsep.join(kept), removed


def start_env(env: dict[str, str]) -> dict[str, str] | None:
    """The environment to re-execute with, or None when this one is right."""
    if env.get(RESTARTED):
        return None
    changes: dict[str, str] = {}
    path, removed = without_shadowing(env.get(LIBRARY_PATH, ""), mlx_library_names())
    if removed:
        changes[LIBRARY_PATH] = path
        changes[REMOVED_ENV] = os.pathsep.join(removed)
    new = preload.preload_env({**env, **changes})
    if new is None and not changes:
        return None
    return {**(new if new is not None else {**env, **changes}), RESTARTED: "1"}


def log_removed() -> None:
    """In the re-executed runner: say which library folders were left out, and why."""
    removed = os.environ.get(REMOVED_ENV)
    if removed:
        log.warning(
            "removed from %s (they hold a libmlx that would shadow this runner's MLX): %s",
            LIBRARY_PATH,
            removed,
        )
