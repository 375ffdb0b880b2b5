"""The leak fixture itself (tests/conftest.py, tests/helpers/hygiene.py): strict for this run's
segments, blind to another run's.

The ``selftest_*`` tests leak on purpose and run only inside the child pytest
started by the tests below (``PYTEST_TWT_HYGIENE_SELFTEST`` set), so the real
autouse fixture judges them.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from shared.quota import QuotaBlock, namespace_of, segment_namespace
from tests.helpers import hygiene
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
    (Path(os.environ[SELFTEST]) / "foreign").write_text(name)


def _selftest(tmp_path: Path, name: str) -> subprocess.CompletedProcess[str]:
    tmp_path.mkdir(exist_ok=True)
    env = {**os.environ, SELFTEST: str(tmp_path)}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", f"tests/test_hygiene.py::{name}"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=100, stdin=subprocess.DEVNULL)


@pytest.mark.timeout(330)
@pytest.mark.parametrize("name", ["test_selftest_leaks_a_live_segment", "test_selftest_leaks_a_dead_supervisors_segment"])
def test_a_test_that_leaks_its_own_segment_fails(tmp_path: Path, name: str) -> None:
    # Up to three tries: a parallel test run of an older build (before namespaces) removes every
    # dead owner's segment at its supervisors' starts, maybe within the fixture's grace period;
    # the child then passes. A fixture that never reports the leak fails all three.
    for attempt in range(3):
        out = _selftest(tmp_path / str(attempt), name)
        if out.returncode != 0:
            break
    assert out.returncode == 1, out.stdout + out.stderr
    assert f"{name} leaked segments=['twt-" in out.stdout, out.stdout
    leaked = out.stdout.split("leaked segments=[", 1)[1].split("]", 1)[0]
    assert not any(fab.exists(n.strip(" '")) for n in leaked.split(","))  # and the fixture removed them


@pytest.mark.timeout(110)
def test_another_runs_dead_segment_is_not_blamed(tmp_path: Path) -> None:
    foreign = ""
    try:
        out = _selftest(tmp_path, "test_selftest_sees_another_runs_dead_segment")
        foreign = (tmp_path / "foreign").read_text()
        assert out.returncode == 0, out.stdout + out.stderr
        assert "1 passed" in out.stdout and "leaked" not in out.stdout
        # left alone: neither reported nor unlinked (unless a parallel older build's start removed it)
        assert namespace_of(foreign) not in hygiene.session_namespaces()
    finally:
        fab.remove(foreign)


def test_this_sessions_run_dirs_are_recorded(tmp_path: Path) -> None:
    made = tmp_path / "made-here"
    made.mkdir()
    named = tmp_path / "named-to-a-child"  # created by the child, named on its command line
    subprocess.run([sys.executable, "-c", "import os, sys; os.mkdir(sys.argv[2])", "--run-dir", str(named)],
                   check=True, timeout=60)
    ours = hygiene.session_namespaces()
    assert segment_namespace(str(made)) in ours and segment_namespace(str(named)) in ours
    assert segment_namespace(str(tmp_path / "never-seen")) not in ours
