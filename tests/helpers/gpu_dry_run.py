"""One ``check_gpu.py --dry-run-fake --quick`` per test run, for every test that reads it.

The hardware check's dry run on the fake driver, its processes forked from one preloaded
interpreter (:func:`run_check`'s ``forked``), takes about 12 s of CPU and 11 s of wall time on a
quiet 2-core machine (started fresh, as on the device: 26 s and 24 s). Five test modules read one:
tests/gpu/test_check_script.py (the phases, the JSON, the figures the docs name),
tests/gpu/test_phase_share.py, test_phase_mix.py and test_phases_tenancy.py (their phases' results)
and tests/worker/backends/test_replay_bindings.py (every driver, NVRTC and cuBLAS call the check
makes, recorded through ``FAKE_CUDA_RECORD_CALLS`` and replayed into the real bindings). Each used
to run its own. :func:`dry_run` runs it once, with the calls recorded, and hands every caller the
same result:

* in one process, from memory;
* across pytest-xdist workers (loadscope puts the three modules on different workers), through a
  directory shared by the run's workers (the parent of the worker's pytest base temp, named after
  xdist's run id): the first worker to take its lock runs the check and writes the result; the
  others wait on the lock (a blocked ``flock``: no CPU) and read it. A worker that died halfway
  leaves no result, so the next one runs the check itself.

Every caller gets the record directory read-only by convention: a test that adds calls of its own
copies the records first (see test_replay_bindings).
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers import timeouts, zygote

__all__ = ["DryRun", "dry_run", "run_check", "why_failed"]

ROOT = Path(__file__).resolve().parents[2]
CHECK = ROOT / "tests" / "gpu" / "check_gpu.py"
#: the check's own timeout inside a test: a hang guard, scaled as every test timeout is (the check
#: runs first, beside the run's heaviest modules: on a busy machine its ~35 s took over 220 s);
#: the reading tests' pytest timeouts are larger
TIMEOUT_S = timeouts.scaled(200)
#: how long a timed-out check's process group gets to stop after SIGTERM (its supervisor's graceful
#: stop unlinks its segments) before SIGKILL; a hang guard too, so scaled
STOP_GRACE_S = timeouts.scaled(10)


@dataclass(frozen=True)
class DryRun:
    """What one dry run left: its exit, output, JSON file and the calls it made through the fakes, and
    whether its processes were forked (:func:`_forked`) or started as on the device."""

    proc: subprocess.CompletedProcess[str]
    json_out: Path
    record_dir: Path
    forked: bool = False


_memo: list[DryRun] = []


def _shared_dir(factory: pytest.TempPathFactory) -> Path:
    base = factory.getbasetemp()
    run_id = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if run_id and base.name.startswith("popen-gw"):  # an xdist worker: its siblings share the parent
        path = base.parent / f"gpu-dry-run-{run_id[:16]}"
    else:
        path = base / "gpu-dry-run"
    path.mkdir(exist_ok=True)
    return path


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # a member we cannot signal is still a member
        return True
    return True


def _stop_group(leader: subprocess.Popen[str]) -> None:
    """Stop a timed-out check and everything it started (its supervisor, their workers): SIGTERM to
    the whole group - the supervisor stops gracefully and unlinks its segments - then SIGKILL to
    whatever is left after :data:`STOP_GRACE_S`. Killing the check alone would leave its supervisor
    running, and the next test's hygiene check would report it. ``leader``: the check, or the zygote
    it was forked from (:func:`_forked`), started in a session of its own: it leads the group."""
    pgid = leader.pid
    for sig, grace in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, STOP_GRACE_S)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        until = time.monotonic() + grace
        while time.monotonic() < until:
            leader.poll()  # reap the leader: a zombie still counts as a member of its group
            if not _group_alive(pgid):
                return
            time.sleep(0.05)


def _rest(proc: subprocess.Popen[str]) -> tuple[str, str]:
    """What a stopped check wrote still (nothing, if a member that left its group holds the pipes)."""
    try:
        return proc.communicate(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        return "", ""


#: what the forked check's processes import before they are forked (tests/helpers/zygote.py's
#: script_server, beside the supervisor's and the workers' modules): the orchestrator and its
#: phase helpers, the fake driver and cuBLAS, numpy (one BLAS thread: the check's own setting on the
#: fake) and what the phases' tenants import
FORK_PRELOAD = ("numpy", "tests.helpers.fake_cuda", "tests.helpers.fake_cublas", "tests.gpu.check_gpu",
                "tests.gpu.phase_kit", "tests.gpu.phase_child", "shared.gpu_time", "worker.device_time",
                "worker.backends.cuda")
_ONE_BLAS_THREAD = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def run_check(argv: list[str], *, timeout_s: float, env: dict[str, str] | None = None,
              forked: bool = False) -> subprocess.CompletedProcess[str]:
    """``check_gpu.py`` with ``argv`` (output captured, text), in a session of its own so that a
    timeout stops the whole tree it started (:func:`_stop_group`) before ``TimeoutExpired`` is raised.

    ``forked``: the check and every process it starts that can be are forks of one preloaded
    interpreter (:func:`_forked`) rather than fresh ones; otherwise each is started as on the device."""
    if forked and zygote.enabled():
        return _forked(argv, timeout_s=timeout_s, env=dict(os.environ if env is None else env))[0]
    proc = subprocess.Popen([sys.executable, str(CHECK), *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=ROOT, env=env, start_new_session=True)
    return _communicate(proc, proc, timeout_s)


def _communicate(proc: subprocess.Popen[str], leader: subprocess.Popen[str],
                 timeout_s: float) -> subprocess.CompletedProcess[str]:
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _stop_group(leader)
        out, err = _rest(proc)
        raise subprocess.TimeoutExpired(proc.args, timeout_s, out, err) from None
    except BaseException:  # an interrupt (pytest-timeout's signal): the tree goes with the test
        _stop_group(leader)
        _rest(proc)
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _forked(argv: list[str], *, timeout_s: float,
            env: dict[str, str]) -> tuple[subprocess.CompletedProcess[str], bool]:
    """The check as :func:`run_check` runs it, its processes forked: the orchestrator from a zygote
    of its own (:func:`tests.helpers.zygote.script_server`: the check's modules, numpy and the fake
    preloaded), and through a copy of that zygote every ``--child`` step, phase script and
    supervisor it starts (each phase script through a copy of its own); the supervisors' workers come
    from a fork server forked from them (``--start-method forkserver``, as the suite's other forked
    supervisors). The device's path - each process a fresh interpreter, the workers spawned - is
    what the suite's other runs of the check take (tests/gpu/test_check_script.py). The zygote leads
    the tree's process group, so a timeout stops all of it. Returns the check's result and whether
    the orchestrator was forked (a zygote that cannot start or fork: a plain start)."""
    env = {**env, **{k: env.get(k, v) for k, v in _ONE_BLAS_THREAD.items()}}  # as the dry run sets them
    try:
        server = zygote.script_server(env, scripts=str(CHECK.parent), preload=FORK_PRELOAD)
    except OSError:
        proc = subprocess.Popen([sys.executable, str(CHECK), *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, cwd=ROOT, env=env, start_new_session=True)
        return _communicate(proc, proc, timeout_s), False
    try:
        proc = zygote.start_script(server, [sys.executable, str(CHECK), *argv], stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
        return _communicate(proc, server.proc, timeout_s), isinstance(proc, zygote.ZygoteProcess)
    finally:
        server.close()


def _run(where: Path) -> DryRun:
    out, records = where / "check.json", where / "calls"
    records.mkdir(exist_ok=True)
    env = {**os.environ, "FAKE_CUDA_RECORD_CALLS": str(records), "PYTHONPATH": str(ROOT)}
    argv = ["--dry-run-fake", "--quick", "--json-out", str(out)]
    if not zygote.enabled():  # PYTEST_TWT_ZYGOTE=0: every process as on the device
        return DryRun(run_check(argv, timeout_s=TIMEOUT_S, env=env), out, records)
    proc, forked = _forked(argv, timeout_s=TIMEOUT_S, env=env)
    return DryRun(proc, out, records, forked)


def dry_run(factory: pytest.TempPathFactory) -> DryRun:
    """The run's one dry run of the hardware check (with its calls recorded); see the module docstring."""
    if _memo:
        return _memo[0]
    where = _shared_dir(factory)
    done = where / "done.json"
    with open(where / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # held while the check runs; a waiting worker blocks here
        try:
            if done.exists():
                doc = json.loads(done.read_text())
                result = DryRun(subprocess.CompletedProcess(doc["args"], doc["returncode"], doc["stdout"], doc["stderr"]),
                                where / "check.json", where / "calls", doc["forked"])
            else:
                result = _run(where)
                p = result.proc
                tmp = where / "done.json.tmp"
                tmp.write_text(json.dumps({"args": p.args, "returncode": p.returncode, "stdout": p.stdout,
                                           "stderr": p.stderr, "forked": result.forked}))
                tmp.rename(done)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    _memo.append(result)
    return result


def why_failed(proc: subprocess.CompletedProcess[str]) -> str:
    """What a failed dry run says: its FAIL rows first (a check that failed may be far from the
    end of a long table), then the ends of its output."""
    fails = [line for line in proc.stdout.splitlines() if line.startswith("FAIL") or " FAIL " in line[:20]]
    return "\n".join(["failed checks:", *fails, "--- stdout (end):", proc.stdout[-2000:],
                      "--- stderr (end):", proc.stderr[-2000:]])
