"""The BLAS under MLX's CPU backend: the re-exec environment (the runner's sgemm dispatch and
OpenBLAS preloaded, OpenBLAS's idle threads told to sleep at once), and the dispatch itself
computing what OpenBLAS computes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from runner.native import build, preload

LIBRARY = "/opt/lib/libblas.so.3"
DISPATCH = "/cache/native/runner_native-0.so"


@pytest.fixture(autouse=True)
def present(monkeypatch):
    monkeypatch.setattr(preload, "optimised_blas", lambda: LIBRARY)
    monkeypatch.setattr(build, "library", lambda cache_dir=None: DISPATCH)


def test_fresh_environment_gets_the_dispatch_the_library_and_the_thread_timeout():
    env = preload.preload_env({"PATH": "/bin", "LD_PRELOAD": "/x.so"})
    assert env == {
        "PATH": "/bin",
        "LD_PRELOAD": f"{DISPATCH}:{LIBRARY}:/x.so",
        "OPENBLAS_THREAD_TIMEOUT": "4",
        preload.MARKER: LIBRARY,
    }


def test_without_the_dispatch_openblas_alone(monkeypatch):
    monkeypatch.setattr(build, "library", lambda cache_dir=None: None)
    env = preload.preload_env({})
    assert env is not None and env["LD_PRELOAD"] == LIBRARY


def test_preloaded_by_the_caller_still_gets_the_thread_timeout():
    env = preload.preload_env({"LD_PRELOAD": f"{DISPATCH}:{LIBRARY}"})
    assert env is not None
    assert env["LD_PRELOAD"] == f"{DISPATCH}:{LIBRARY}" and env["OPENBLAS_THREAD_TIMEOUT"] == "4"


def test_nothing_to_change_or_already_re_executed_means_no_re_exec():
    preloaded = {"LD_PRELOAD": f"{DISPATCH}:{LIBRARY}", "OPENBLAS_THREAD_TIMEOUT": "9"}
    assert preload.preload_env(preloaded) is None
    assert preload.preload_env({preload.MARKER: LIBRARY}) is None


def test_a_user_thread_timeout_is_kept():
    env = preload.preload_env({"OPENBLAS_THREAD_TIMEOUT": "20"})
    assert env is not None and env["OPENBLAS_THREAD_TIMEOUT"] == "20"


def test_reference_blas_asked_for_changes_nothing(monkeypatch):
    monkeypatch.undo()
    assert preload.preload_env({preload.MARKER: "reference"}) is None


def test_the_start_environment_is_computed_without_importing_mlx():
    """A libmlx that shadows the installed MLX on the library path breaks `import mlx.core`,
    so the environment the runner re-executes with (the preloads: building the dispatch in
    the cache directory) must be computed before anything imports it."""
    env = {k: v for k, v in os.environ.items() if k not in (preload.MARKER, "LD_PRELOAD")}
    script = (
        "import sys, runner.environment as e; e.start_env(dict(__import__('os').environ)); "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'mlx'))"
    )
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_no_compiler_means_no_dispatch(monkeypatch, tmp_path):
    monkeypatch.undo()
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert build.library(tmp_path) is None
    assert list(tmp_path.iterdir()) == []


def test_another_versions_build_stays_until_unused_for_two_weeks(monkeypatch, tmp_path):
    """Two runner versions sharing the cache directory do not delete each other's build (each
    would rebuild its own at every start); a build unused for two weeks goes."""
    monkeypatch.undo()
    target = tmp_path / "runner_native-new.so"
    recent, old = tmp_path / "runner_native-other.so", tmp_path / "runner_native-old.so"
    # an earlier version's build, under the library's earlier name
    earlier, earlier_old = tmp_path / "sgemm_dispatch-a.so", tmp_path / "sgemm_dispatch-b.so"
    for path in (target, recent, old, earlier, earlier_old):
        path.write_bytes(b"")
    weeks_ago = time.time() - build.STALE_AFTER_S - 60
    for path in (old, earlier_old):
        os.utime(path, (weeks_ago, weeks_ago))
    build._remove_stale(target)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "runner_native-new.so",
        "runner_native-other.so",
        "sgemm_dispatch-a.so",
    ]


# --- the dispatch computes what OpenBLAS computes ---------------------------------------

CHECK = """
import json, sys
import mlx.core as mx, numpy as np
from runner.native import build, preload
from runner.backend import Backend
rng = np.random.default_rng(0)
worst = 0.0
for m in (1, 2, 5, 20, 32, 33, 100):
    for k, n in ((300, 700), (1024, 96), (64, 9)):
        A = rng.standard_normal((m, k)).astype(np.float32)
        B = rng.standard_normal((k, n)).astype(np.float32)
        bias = rng.standard_normal(n).astype(np.float32)
        want = A.astype(np.float64) @ B.astype(np.float64)
        for ta in (False, True):
            for tb in (False, True):
                a = mx.array(A.T.copy()).T if ta else mx.array(A)
                b = mx.array(B.T.copy()).T if tb else mx.array(B)
                got = np.array(a @ b)
                with_bias = np.array(mx.addmm(mx.array(bias), a, b))  # beta = 1
                scale = np.abs(want).max()
                worst = max(worst, np.abs(got - want).max() / scale,
                            np.abs(with_bias - (want + bias)).max() / scale)
# A forked child (the pool's workers stay in the parent) still gets its products; called
# through the C interface, as MLX itself does not survive a fork.
import ctypes, os
def sgemm(A, W):
    C = np.zeros((A.shape[0], W.shape[0]), np.float32)
    f = ctypes.CDLL(None).cblas_sgemm
    p = lambda x: x.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
    f(101, 111, 112, A.shape[0], W.shape[0], A.shape[1], ctypes.c_float(1.0), p(A),
      A.shape[1], p(W), W.shape[1], ctypes.c_float(0.0), p(C), W.shape[0])
    return C
A = rng.standard_normal((20, 576)).astype(np.float32)
W = rng.standard_normal((1536, 576)).astype(np.float32)
assert np.abs(sgemm(A, W) - A @ W.T).max() < 1e-3
pid = os.fork()
if pid == 0:
    os._exit(0 if np.abs(sgemm(A, W) - A @ W.T).max() < 1e-3 else 1)
forked = os.waitpid(pid, 0)[1] == 0
print(json.dumps({"active": preload.dispatch_active(), "gemv": Backend.cpu().gemv, "worst": worst,
                  "forked": forked}))
"""


def test_the_dispatch_computes_what_the_blas_computes(monkeypatch, tmp_path):
    """Under MLX, with the dispatch and OpenBLAS preloaded: one row, few rows and many rows,
    every transposition, with and without a beta (addmm), equal float64 products; and the
    backend then leaves decode's one-row products to it."""
    monkeypatch.undo()
    library = preload.optimised_blas()
    if library is None or not (shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("needs Linux, OpenBLAS and a C compiler")
    dispatch = build.library(tmp_path)
    assert dispatch is not None and os.path.exists(dispatch)
    assert build.library(tmp_path) == dispatch  # built once
    env = {**os.environ, "LD_PRELOAD": f"{dispatch}:{library}", preload.MARKER: library}
    run = subprocess.run(
        [sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["active"] and not result["gemv"]
    assert result["worst"] < 1e-5
    assert result["forked"]
