"""The xdist workers forked from one preloading interpreter (tests/helpers/xdist_fork.py)."""

from __future__ import annotations

import os
import sys

import pytest

from tests.helpers import xdist_fork, zygote


def _cmdline(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().replace(b"\0", b" ").decode(errors="replace")


@pytest.mark.skipif(not os.environ.get("PYTEST_XDIST_WORKER") or not zygote.enabled(),
                    reason="a forked xdist worker only under xdist with the zygotes on")
def test_this_worker_was_forked_and_runs_as_python_c_would() -> None:
    if os.environ.get("OPENBLAS_NUM_THREADS") != "1":
        # numpy's OpenBLAS starts a thread per core at import, and the preload forks only with one
        # thread: the workers then start as before. tests/run-suite.sh (make test) sets it to 1
        pytest.skip("OPENBLAS_NUM_THREADS is not 1: numpy's BLAS threads keep the preload from forking")
    assert "tests.helpers.xdist_fork" in _cmdline(os.getppid())
    main = sys.modules["__main__"]
    assert getattr(main, "__file__", None) is None and main.__spec__ is None  # python -c's __main__
    assert sys.argv == ["-c"]
    # the preload imported nothing pytest rewrites: its plugins' modules came through its importer
    for name in xdist_fork.marked_for_rewrite():
        module = sys.modules.get(name)
        if module is not None and module.__doc__ and "PYTEST_DONT_REWRITE" in module.__doc__:
            continue
        assert module is None or type(module.__loader__).__name__ == "AssertionRewritingHook", name


def test_the_preload_holds_no_module_of_the_suite_and_none_pytest_rewrites() -> None:
    marked = xdist_fork.marked_for_rewrite()
    assert {"xdist", "hypothesis", "pytest_timeout"} <= marked
    modules = xdist_fork.preload_modules(marked=marked)
    assert "numpy" in modules and "supervisor.client.launch" in modules and "pytest" in modules
    assert not [m for m in modules if m.split(".", 1)[0] in ("tests", "conftest", *marked)]
    assert "worker.preload" not in modules  # its wasmtime engine's fault handlers: see xdist_fork

