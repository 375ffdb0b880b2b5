"""The suite's own cost machinery: the shared ``process`` scan, the dry run's place in the order, and
the per-test CPU record (tests/conftest.py, tests/helpers/cpu_profile.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest

import tests.conftest as suite
from tests.helpers import cpu_profile, gpu_dry_run


class _Item:
    """What the collection hooks read of a pytest item: its node id, module and markers."""

    def __init__(self, nodeid: str, module: types.ModuleType | None = None, *markers: str) -> None:
        self.nodeid = nodeid
        self.module = module
        self._markers = set(markers)

    def get_closest_marker(self, name: str) -> object | None:
        return name if name in self._markers else None


def _counting_scan(monkeypatch: pytest.MonkeyPatch, verdict: dict[str, bool]) -> list[str]:
    scanned: list[str] = []

    def scan(item: Any) -> bool:
        scanned.append(item.nodeid)
        return verdict[item.nodeid]

    monkeypatch.setattr(suite, "_item_starts_processes", scan)
    return scanned


def test_the_process_scan_runs_once_per_run_and_the_other_workers_read_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    verdict = {"a.py::t1": True, "a.py::t2": False, "b.py::t3": False}
    items: Any = [_Item(n) for n in verdict] + [_Item("c.py::marked", None, "process")]
    monkeypatch.setenv("PYTEST_XDIST_TESTRUNUID", "0123456789abcdef0123")
    monkeypatch.setenv("PYTEST_TWT_ROOT", str(tmp_path))
    scanned = _counting_scan(monkeypatch, verdict)
    first = suite._process_verdicts(items)  # the first worker: scans every unmarked test
    assert sorted(scanned) == sorted(verdict) and first == verdict
    scanned.clear()
    again = suite._process_verdicts(items)  # another worker of the same run: reads, scans nothing
    assert scanned == [] and again == verdict
    more: Any = [*items, _Item("d.py::t4")]  # a test the file lacks is scanned, and kept
    verdict["d.py::t4"] = True
    assert suite._process_verdicts(more)["d.py::t4"] is True and scanned == ["d.py::t4"]
    monkeypatch.setenv("PYTEST_XDIST_TESTRUNUID", "ffffffffffffffff0123")  # another run: its own scan
    scanned.clear()
    assert suite._process_verdicts(items) == {k: verdict[k] for k in ("a.py::t1", "a.py::t2", "b.py::t3")}
    assert len(scanned) == 3


def test_without_xdist_every_test_is_scanned_and_nothing_is_written(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTEST_XDIST_TESTRUNUID", raising=False)
    monkeypatch.setenv("PYTEST_TWT_ROOT", str(tmp_path))
    scanned = _counting_scan(monkeypatch, {"a.py::t": False})
    assert suite._process_verdicts([_Item("a.py::t")]) == {"a.py::t": False}  # type: ignore[list-item]
    assert scanned == ["a.py::t"] and list(tmp_path.iterdir()) == []


def test_the_dry_run_goes_first_and_its_other_readers_after_the_process_tests() -> None:
    def module(name: str, reads: bool) -> types.ModuleType:
        m = types.ModuleType(name)
        if reads:
            m.gpu_dry_run = gpu_dry_run  # type: ignore[attr-defined]
        return m

    producer, reader, plain = module("p", True), module("r", True), module("x", False)
    items: Any = [_Item("r::read", reader, "process"), _Item("p::check", producer, "process"), _Item("x::quick", plain),
                  _Item("x::proc", plain, "process"), _Item("x::slow", plain, "slow"),
                  _Item("x::ray", plain, "longest", "slow")]
    assert suite._dry_run_producer(items) is reader  # the first reader collected runs the check
    items[0], items[1] = items[1], items[0]
    assert suite._dry_run_producer(items) is producer
    assert suite._dry_run_producer([i for i in items if i.module is plain]) is None
    order = sorted(items, key=lambda i: suite._run_order(i, producer))
    assert [i.nodeid for i in order] == ["p::check", "x::ray", "x::slow", "x::proc", "r::read", "x::quick"]


def test_the_cpu_record_counts_a_childs_cpu_and_sums_per_module(tmp_path: Path) -> None:
    prefix = str(tmp_path / "cpu")
    recorder = cpu_profile.Recorder(prefix + ".gw0", lambda: ())
    recorder.start()
    subprocess.run([sys.executable, "-c", "import time\nt = time.process_time()\n"
                    "while time.process_time() - t < 0.3: pass"], check=True, timeout=60)
    recorder.stop("tests/x.py::t1")
    with open(prefix + ".gw1", "w", encoding="utf-8") as f:
        f.write(json.dumps({"id": "tests/x.py::t2", "t0": 0.0, "t1": 1.0, "cpu": 1.5}) + "\n")
        f.write(json.dumps({"id": "tests/y.py::t3", "t0": 1.0, "t1": 3.0, "cpu": 0.25}) + "\n")
    (line,) = [json.loads(x) for x in Path(prefix + ".gw0").read_text(encoding="utf-8").splitlines()]
    assert line["id"] == "tests/x.py::t1" and line["cpu"] >= 0.3  # the reaped child's CPU is the test's
    report = cpu_profile.summarize(prefix)
    module_rows = {r.split()[-1]: r.split() for r in report.splitlines() if r.split()[-1].startswith("tests/")
                   and "::" not in r}
    assert float(module_rows["tests/x.py"][0]) == pytest.approx(1.5 + line["cpu"], abs=0.06)
    assert module_rows["tests/x.py"][2] == "2" and module_rows["tests/y.py"][2] == "1"
    assert "gw0" in report and "gw1" in report


def test_a_zygotes_children_count_once_reaped() -> None:
    """The zygotes' forks are reaped by the zygote, not by the test process: read from /proc."""
    assert cpu_profile._tree_cpu(os.getpid()) > 0
    assert cpu_profile._tree_cpu(2 ** 22 + 1) == 0.0  # no such process


def test_a_zygotes_live_descendants_count_while_they_run(tmp_path: Path) -> None:
    """A zygote's fork that works during a test and is reaped only later (a module fixture's
    supervisor and its workers) counts on the test it worked in, not on the one it is reaped in."""
    script = ("import os, sys, time\n"
              "pid = os.fork()\n"
              "if pid == 0:\n"
              "    sys.stdin.readline()\n"
              "    t = time.process_time()\n"
              "    while time.process_time() - t < 0.3: pass\n"
              "    print('burned', flush=True)\n"
              "    sys.stdin.readline()\n"  # held, unreaped, until the test closes its stdin
              "    os._exit(0)\n"
              "os.waitpid(pid, 0)\n")
    server = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    assert server.stdin is not None and server.stdout is not None
    try:
        recorder = cpu_profile.Recorder(str(tmp_path / "cpu.gw0"), lambda: (server.pid,))
        recorder.start()
        server.stdin.write("go\n")
        server.stdin.flush()
        assert server.stdout.readline().strip() == "burned"
        recorder.stop("tests/x.py::t1")
    finally:
        server.stdin.close()  # the grandchild exits, its parent reaps it and exits
        server.wait(timeout=60)
        server.stdout.close()
    (line,) = [json.loads(x) for x in (tmp_path / "cpu.gw0").read_text(encoding="utf-8").splitlines()]
    assert line["cpu"] >= 0.25, line  # /proc's 10 ms ticks, sampled: 0.29 once (the old record: 0.01)


def test_tree_cpu_counts_what_outlives_its_parent() -> None:
    """tests.helpers.tree_cpu is the tree's subreaper: a grandchild that burns CPU after its parent
    exited (as a supervisor's fork server or tracker does) is reaped, and counted, there."""
    orphan = ("import os, time\n"
              "if os.fork() == 0:\n"
              "    time.sleep(0.2)\n"  # its parent is gone by now: reparented
              "    t = time.process_time()\n"
              "    while time.process_time() - t < 0.4: pass\n"
              "os._exit(0)\n")
    done = subprocess.run([sys.executable, "-m", "tests.helpers.tree_cpu", "--linger", "60", "--",
                           sys.executable, "-c", orphan], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[1], check=False)
    assert done.returncode == 0, done.stderr
    line = done.stderr.strip().splitlines()[-1]
    cpu = float(line.split("CPU ", 1)[1].split(" s", 1)[0])
    assert cpu >= 0.4 and "0 descendant(s) still running" in line, line


def test_the_controller_writes_the_bytecode_each_worker_would_compile(
        tmp_path: Path, pytestconfig: pytest.Config) -> None:
    """warm_bytecode.warm leaves, for a test module, the rewritten pyc pytest's import hook accepts
    (asserts rewritten, keyed on the source's hash) and, for a helper, the interpreter's own pyc;
    valid caches are left alone, a changed source is compiled again."""
    if sys.dont_write_bytecode:  # PYTHONDONTWRITEBYTECODE: warm() writes nothing, by design
        pytest.skip("this interpreter writes no bytecode (PYTHONDONTWRITEBYTECODE); make test lifts it")
    import importlib.util

    from _pytest.assertion import rewrite

    from tests.helpers import warm_bytecode

    top = tmp_path / "suite"
    top.mkdir()
    (top / "__init__.py").write_text("")
    test_file, helper = top / "test_sample.py", top / "helper.py"
    test_file.write_text("def test_it() -> None:\n    value = 1\n    assert value == 1\n")
    helper.write_text("VALUE = 2\n")
    assert warm_bytecode.warm(pytestconfig, top) == (1, 2)  # the test module; the helper and __init__
    pyc = rewrite.get_cache_dir(test_file) / (test_file.name[:-3] + rewrite.PYC_TAIL)
    code = rewrite._read_pyc(test_file, pyc)
    assert code is not None, "no rewritten pyc the import hook would read"
    test_code = next(c for c in code.co_consts if getattr(c, "co_name", "") == "test_it")
    assert any(n.startswith("@py_assert") for n in test_code.co_varnames), "the asserts are not rewritten"
    plain = Path(importlib.util.cache_from_source(str(helper)))
    assert plain.read_bytes()[:4] == importlib.util.MAGIC_NUMBER
    assert not Path(importlib.util.cache_from_source(str(test_file))).exists()  # no unused plain pyc
    assert warm_bytecode.warm(pytestconfig, top) == (0, 0)  # valid caches: nothing written
    test_file.write_text("def test_it() -> None:\n    assert 2 == 2\n")
    os.utime(helper, ns=(1, 1))  # an older mtime than the cache recorded: stale
    assert warm_bytecode.warm(pytestconfig, top) == (1, 1)
    assert rewrite._read_pyc(test_file, pyc) is not None
