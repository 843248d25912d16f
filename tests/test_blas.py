"""The re-exec environment: OpenBLAS preloaded, its idle threads told to sleep at once."""

from __future__ import annotations

import pytest

from runner import blas

LIBRARY = "/opt/lib/libblas.so.3"


@pytest.fixture(autouse=True)
def present(monkeypatch):
    monkeypatch.setattr(blas, "optimised_blas", lambda: LIBRARY)


def test_fresh_environment_gets_the_library_and_the_thread_timeout():
    env = blas.preload_env({"PATH": "/bin", "LD_PRELOAD": "/x.so"})
    assert env == {
        "PATH": "/bin",
        "LD_PRELOAD": f"{LIBRARY}:/x.so",
        "OPENBLAS_THREAD_TIMEOUT": "4",
        blas.MARKER: LIBRARY,
    }


def test_preloaded_by_the_caller_still_gets_the_thread_timeout():
    env = blas.preload_env({"LD_PRELOAD": LIBRARY})
    assert env is not None
    assert env["LD_PRELOAD"] == LIBRARY and env["OPENBLAS_THREAD_TIMEOUT"] == "4"


def test_nothing_to_change_or_already_re_executed_means_no_re_exec():
    assert blas.preload_env({"LD_PRELOAD": LIBRARY, "OPENBLAS_THREAD_TIMEOUT": "9"}) is None
    assert blas.preload_env({blas.MARKER: LIBRARY}) is None


def test_a_user_thread_timeout_is_kept():
    env = blas.preload_env({"OPENBLAS_THREAD_TIMEOUT": "20"})
    assert env is not None and env["OPENBLAS_THREAD_TIMEOUT"] == "20"


def test_reference_blas_asked_for_changes_nothing(monkeypatch):
    monkeypatch.undo()
    assert blas.preload_env({blas.MARKER: "reference"}) is None
