"""The leak fixture itself (tests/conftest.py, tests/helpers/hygiene.py): strict for this run's
segments, blind to another run's.

The ``selftest_*`` tests leak on purpose and run only inside the child pytest
started by the tests below (``PYTEST_TWT_HYGIENE_SELFTEST`` set), so the real
autouse fixture judges them.
"""

from __future__ import annotations

import importlib
import os
import struct
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from xml.etree import ElementTree

import pytest

from shared import _shm, quota
from shared.quota import QuotaBlock, namespace_of, segment_namespace
from tests.helpers import hygiene
from tests.helpers.cluster import wait_for
from tests.helpers import segments as fab

SELFTEST = "PYTEST_TWT_HYGIENE_SELFTEST"
ROOT = Path(__file__).resolve().parent.parent
selftest = pytest.mark.skipif(not os.environ.get(SELFTEST), reason="leaks on purpose; run by test_hygiene only")

_kept: list[QuotaBlock] = []  # a leaked block must not be unlinked by the garbage collector


@selftest
def test_selftest_leaks_a_live_segment() -> None:
    _kept.append(QuotaBlock.create("leaky", name=f"twt-hyg{os.getpid()}-live"))


@selftest
def test_selftest_leaks_a_dead_supervisors_segment(tmp_path: Path) -> None:
    """What a SIGKILLed supervisor of this run leaves on its run dir (made by this process)."""
    run_dir = tmp_path / "rd"
    run_dir.mkdir()
    fab.write_stale(fab.namespaced_name(segment_namespace(str(run_dir))), fab.dead_owner())


@selftest
def test_selftest_sees_another_runs_dead_segment() -> None:
    """Another test run on the host leaves its dead supervisor's segment meanwhile: not ours."""
    another_run = os.path.join(os.environ[SELFTEST], "another-run")  # a run dir this run never made
    name = fab.write_stale(fab.namespaced_name(segment_namespace(another_run)), fab.dead_owner())
    (Path(os.environ["TMPDIR"]) / "foreign").write_text(name)


@selftest
def test_selftest_writes_outside_its_temp_root() -> None:
    """Writes next to its run's temp root (the child runs with a root of its own below it)."""
    outside = Path(os.environ[SELFTEST]) / "outside"
    outside.mkdir()
    (outside / "left.txt").write_text("a leftover")


@selftest
def test_selftest_writes_inside_its_temp_root(tmp_path: Path) -> None:
    (tmp_path / "fine.txt").write_text("inside")
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "also-fine").mkdir()


@selftest
def test_selftest_starts_a_process_unmarked() -> None:
    hidden = importlib.import_module("sub" + "process")  # hidden from the collection-time scan on purpose
    hidden.run([sys.executable, "-c", "pass"], check=True, timeout=60)


#: the leaky tests above, each with what the fixture must make of it (the tests below check it)
LEAKS_OWN_SEGMENT = ("test_selftest_leaks_a_live_segment", "test_selftest_leaks_a_dead_supervisors_segment")
SELFTESTS = (*LEAKS_OWN_SEGMENT, "test_selftest_sees_another_runs_dead_segment",
             "test_selftest_writes_outside_its_temp_root", "test_selftest_writes_inside_its_temp_root",
             "test_selftest_starts_a_process_unmarked")


@dataclass(frozen=True)
class Verdict:
    """One self-test's result in the child run: its outcome (``passed``, ``failed``: a failure or an
    error, the fixture's verdict being a tear-down error) and every message and report text it got."""

    outcome: str
    text: str


def _selftest(tmp_path: Path, names: tuple[str, ...]) -> tuple[subprocess.CompletedProcess[str], dict[str, Verdict]]:
    """Run ``names`` in one child pytest (its own temp root, as make test gives one to each run): its
    exit and each test's :class:`Verdict`, read from its JUnit XML report. One child for all of them,
    not one each: a pytest start (interpreter, plugins, this suite's conftest) is ~1 s of CPU, and the
    fixture judges each test of a run by itself, as it does in every run."""
    tmp_path.mkdir(exist_ok=True)
    root = tmp_path / "root"
    root.mkdir(exist_ok=True)
    report = tmp_path / "report.xml"
    env = {**os.environ, SELFTEST: str(tmp_path), "TMPDIR": str(root), hygiene.ROOT_ENV: str(root)}
    env.pop("PYTEST_XDIST_WORKER", None)
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", "-p", "no:xdist",
                          f"--basetemp={root / 'pt'}", f"--junitxml={report}",
                          *(f"tests/test_hygiene.py::{name}" for name in names)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    verdicts: dict[str, Verdict] = {}
    if report.exists():
        for case in ElementTree.parse(report).iter("testcase"):
            bad = [e for e in case if e.tag in ("failure", "error")]
            text = "\n".join(f"{e.get('message', '')}\n{e.text or ''}" for e in bad)
            verdicts[case.get("name", "")] = Verdict("failed" if bad else "passed", text)
    return out, verdicts


@dataclass(frozen=True)
class SelfTests:
    """The child run's verdicts by test name, its ``PYTEST_TWT_HYGIENE_SELFTEST`` folder and the
    name of the other run's segment that one self-test left."""

    verdicts: dict[str, Verdict]
    folder: Path
    foreign: str


@pytest.fixture(scope="module")
def selftests(tmp_path_factory: pytest.TempPathFactory) -> SelfTests:
    """Every self-test's verdict, from one child run (a leak test the fixture let pass is tried again,
    at most twice: a parallel test run of an older build, before namespaces, removes every dead
    owner's segment at its supervisors' starts, maybe within the fixture's grace period; a fixture
    that never reports the leak fails all three)."""
    where = tmp_path_factory.mktemp("selftests")
    out, verdicts = _selftest(where / "0", SELFTESTS)
    assert set(verdicts) == set(SELFTESTS), out.stdout + out.stderr
    foreign = (where / "0" / "root" / "foreign").read_text()
    fab.remove(foreign)  # the other run's segment, which the fixture left alone
    for attempt in (1, 2):
        again = tuple(name for name in LEAKS_OWN_SEGMENT if verdicts[name].outcome == "passed")
        if again:
            out, retried = _selftest(where / str(attempt), again)
            assert set(retried) == set(again), out.stdout + out.stderr
            verdicts.update(retried)
    return SelfTests(verdicts, where / "0", foreign)


@pytest.mark.timeout(330)
@pytest.mark.parametrize("name", LEAKS_OWN_SEGMENT)
def test_a_test_that_leaks_its_own_segment_fails(selftests: SelfTests, name: str) -> None:
    verdict = selftests.verdicts[name]
    assert verdict.outcome == "failed", verdict
    assert f"{name} leaked segments=['twt-" in verdict.text, verdict.text
    leaked = verdict.text.split("leaked segments=[", 1)[1].split("]", 1)[0]
    assert not any(fab.exists(n.strip(" '")) for n in leaked.split(","))  # and the fixture removed them


@pytest.mark.timeout(330)
def test_another_runs_dead_segment_is_not_blamed(selftests: SelfTests) -> None:
    verdict = selftests.verdicts["test_selftest_sees_another_runs_dead_segment"]
    assert verdict.outcome == "passed" and "leaked" not in verdict.text, verdict
    # neither reported nor ours (the selftests fixture removed it after the run)
    assert namespace_of(selftests.foreign) not in hygiene.session_namespaces()


@pytest.mark.parametrize("size", [0, 4096])
def test_a_segment_another_process_is_still_creating_is_never_ours(monkeypatch: pytest.MonkeyPatch,
                                                                   size: int) -> None:
    """A segment with no header yet (empty, or sized with no magic: its creator writes the magic
    last) made by another process is not judged ours even by a serial run - the self-tests' child
    run is one, beside the parallel run that started it, and took another worker's new quota block
    between its create and its attach."""
    name = f"twt-{os.urandom(6).hex()}-0"
    code = f"import os; fd = os.open('/dev/shm/{name}', os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600); " \
           f"os.ftruncate(fd, {size}); os.close(fd)"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    try:
        monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)  # a serial run's judgement
        assert not hygiene._segment_is_ours(name)
    finally:
        fab.remove(name)


@pytest.mark.parametrize("look", [1, 2, 3, 4])
def test_a_segment_whose_creator_finishes_while_it_is_judged_is_never_ours(monkeypatch: pytest.MonkeyPatch,
                                                                           look: int) -> None:
    """Another run's creator writes its header (magic last) between two of the judge's looks at
    the segment - a loaded host preempts the judge anywhere. Whichever look saw which state, the
    segment of a live owner that is not ours is never ours: a verdict must not combine "no owner"
    from one read with "written" from a later one (a serial run's leak fixture would unlink a
    worker's live region between its create and its first attach). The creator here finishes
    just before the judge's ``look``-th look (its reads of the file, and of the header)."""
    name = f"twt-test{os.getpid()}-r{os.urandom(16).hex()}"  # a region name as the worker tests make it
    size = 2 * 4096
    code = f"import os; fd = os.open('/dev/shm/{name}', os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600); " \
           f"os.ftruncate(fd, {size}); os.close(fd)"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)  # made by another process
    try:
        assert name not in hygiene._created_segments
        seg = _shm.attach(name)
        looks = 0

        def finish_creating() -> None:
            nonlocal looks
            looks += 1
            if looks == look:  # a live owner of another run (pid 1: never ours), the magic last
                struct.pack_into("<7Q", seg.buf, 8, quota.LAYOUT_VERSION, quota.KIND_REGION, 1,
                                 quota.process_start_ms(1), 0, size, quota.MAX_INSTANCES)
                struct.pack_into("<Q", seg.buf, 0, quota.MAGIC)

        real_open, real_read_header = open, quota.read_header  # what hygiene imported

        def looking_open(file: Any, *args: Any, **kwargs: Any) -> Any:
            if os.fsdecode(file).endswith("/" + name):
                finish_creating()
            return real_open(file, *args, **kwargs)

        def looking_read_header(seg_name: str) -> Any:
            if seg_name == name:
                finish_creating()
            return real_read_header(seg_name)

        monkeypatch.setattr(hygiene, "open", looking_open, raising=False)
        monkeypatch.setattr(hygiene, "read_header", looking_read_header)
        monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)  # a serial run's judgement
        try:
            assert not hygiene._segment_is_ours(name), f"judged ours after {looks} looks"
        finally:
            seg.close()
    finally:
        fab.remove(name)


def test_this_sessions_run_dirs_are_recorded(tmp_path: Path) -> None:
    made = tmp_path / "made-here"
    made.mkdir()
    named = tmp_path / "named-to-a-child"  # created by the child, named on its command line
    subprocess.run([sys.executable, "-c", "import os, sys; os.mkdir(sys.argv[2])", "--run-dir", str(named)],
                   check=True, timeout=60)
    ours = hygiene.session_namespaces()
    assert segment_namespace(str(made)) in ours and segment_namespace(str(named)) in ours
    assert segment_namespace(str(tmp_path / "never-seen")) not in ours


@pytest.mark.timeout(330)
def test_a_write_outside_the_temp_root_fails_the_test_that_made_it(selftests: SelfTests) -> None:
    verdict = selftests.verdicts["test_selftest_writes_outside_its_temp_root"]
    assert verdict.outcome == "failed", verdict
    assert "wrote outside its temp root" in verdict.text and str(selftests.folder / "outside") in verdict.text, \
        verdict.text


@pytest.mark.timeout(330)
def test_writes_inside_the_temp_root_pass(selftests: SelfTests) -> None:
    verdict = selftests.verdicts["test_selftest_writes_inside_its_temp_root"]
    assert verdict.outcome == "passed", verdict


@pytest.mark.timeout(330)
def test_an_unmarked_test_that_starts_a_process_fails(selftests: SelfTests) -> None:
    verdict = selftests.verdicts["test_selftest_starts_a_process_unmarked"]
    assert verdict.outcome == "failed", verdict
    assert "is not marked `process`" in verdict.text, verdict.text


def test_the_process_marker_is_applied_at_collection(request: pytest.FixtureRequest) -> None:
    """Tests that start supervisors, subprocesses or Ray carry it; pure ones do not. (The scan errs
    on the safe side: naming a function that starts processes counts as calling it, so this test
    is marked too.)"""
    from tests import conftest
    from tests.supervisor.client import test_client_replies, test_supervisor

    def scan(func: object) -> bool:
        return conftest._starts_processes(func, set())  # type: ignore[arg-type]

    assert request.node.get_closest_marker("process") is not None
    assert scan(test_this_sessions_run_dirs_are_recorded)  # subprocess.run
    assert scan(test_client_replies.test_buffers_with_more_than_4096_buffers_works_end_to_end)  # a helper, imported inside
    assert scan(test_supervisor.test_sigkill_worker_with_requests_in_flight)  # tests.helpers.cluster.supervisor -> launch
    assert scan(_selftest)
    assert not scan(test_suite_sources_name_no_fixed_temp_directory)
    assert not scan(test_client_replies.test_large_replies_the_supervisor_produces_decode)


def test_suite_sources_name_no_fixed_temp_directory() -> None:
    """Nothing the suite or the packages run writes to a hard-coded /tmp: temporary files go to
    tempfile's directory ($TMPDIR, one fresh directory per make test). Shown paths in messages and
    docs, and a name a test only reads, are listed here."""
    allowed = {
        "shared/config.py",  # the default run dir /tmp/twt-<uid> when XDG_RUNTIME_DIR is unset (documented)
        "supervisor/host/mps.py",  # NVIDIA's default MPS pipe directory: read, never written
        "shared/errors.py", "supervisor/client/api.py", "supervisor/routing/placement.py",
        "supervisor/cli/supervise.py",  # docs and help text
        "shared/rundir.py",  # temp_parent(): /tmp when $TMPDIR is too long for unix sockets
        "tests/shared/test_errors.py", "tests/supervisor/cli/test_operator.py",  # error texts naming a path
        "tests/supervisor/client/test_rundir_trust.py",  # its docstring
        "tests/supervisor/client/test_supervisor.py",  # a run dir that does not exist (a client's error)
        "tests/run-suite.sh",  # makes the root
        "tests/test_deploy.py",  # a mount in the k8s manifest
        "tests/worker/backends/test_cuda_backend.py",  # an MPS pipe directory named to a fake, never made
        "tests/gpu/fake_mps_control.py",  # NVIDIA's default, read
        "tests/gpu/check_gpu.py",  # the real-GPU MPS phase (a daemon's pipe dir: short); not in make test
        "tests/test_hygiene.py",  # this list
        "tests/sdk/test_hostile.py",  # a guest's fopen of a host path, which must fail inside the sandbox
    }
    found = []
    for top in ("shared", "supervisor", "worker", "tests"):
        for dirpath, dirnames, filenames in os.walk(ROOT / top):
            dirnames[:] = [d for d in dirnames if d != "__pycache__"]
            for name in filenames:
                path = Path(dirpath) / name
                rel = path.relative_to(ROOT).as_posix()
                if path.suffix in (".py", ".sh") and rel not in allowed and \
                        '"/tmp' in path.read_text(errors="replace").replace("'/tmp", '"/tmp'):
                    found.append(rel)
    assert not found, f"hard-coded /tmp in {found}: use tempfile (or tests.helpers.tmp.short_temp_dir)"


def test_the_fixtures_process_scans_see_what_psutil_sees() -> None:
    """The leak fixture's own scans (/proc reads, tests/helpers/hygiene.py) against psutil's: a child
    named ``twt-worker`` and its grandchild are our descendants; the child is a twt process, the
    grandchild is not; the command line reads back."""
    import psutil

    child = subprocess.Popen(
        [sys.executable, "-c", "import subprocess, time; from shared.prctl import set_process_name; "
         "set_process_name('twt-worker'); p = subprocess.Popen(['sleep', '60']); print(p.pid, flush=True); "
         "time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    grandchild = 0
    try:
        assert child.stdout is not None
        grandchild = int(child.stdout.readline())  # printed after the name was set
        mine = hygiene.descendants()
        assert {child.pid, grandchild} <= mine
        assert mine == {c.pid for c in psutil.Process().children(recursive=True)}
        named = {pid for pid, _ in hygiene.twt_processes()}
        assert child.pid in named and grandchild not in named
        # read once the kernel has set it: Popen returns when the exec has replaced the child's memory,
        # which is before the new program's argument area is recorded - until then /proc/PID/cmdline
        # reads empty (a fresh-clone run failed here once; read right after Popen returns, 212 of 300
        # were empty beside two CPU burners)
        wait_for(lambda: hygiene.cmdline(grandchild) == ["sleep", "60"], what="the grandchild's command line")
    finally:
        if grandchild:
            os.kill(grandchild, 9)
        child.kill()
        child.wait()
        if child.stdout is not None:
            child.stdout.close()
    assert child.pid not in {pid for pid, _ in hygiene.twt_processes()}  # a reaped child is gone
