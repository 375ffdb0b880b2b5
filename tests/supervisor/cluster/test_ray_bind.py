"""Ray on the named address only: a real ``ray start --head`` (the recipe of docs/CLUSTER.md) and the
benches' local Ray open no listening socket beyond 127.0.0.1, and keep their directories 0700.

Each Ray runs in a session of its own (``start_new_session``) and is stopped by signalling that
process group - never ``ray stop``, which would stop every Ray of this user on the machine.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil
import pytest

from supervisor.cluster.ray_bind import (
    LOOPBACK_RAY_ENV,
    Listener,
    exposed,
    listeners_of,
    private_ray_temp_dir,
    tighten,
)
from tests.helpers import timeouts
from tests.helpers.tmp import short_temp_dir

# never ``pytest.importorskip("ray")``: that imports Ray at collection in every xdist worker, and
# Ray reads its RAY_* constants (the cluster module's token authentication) at import
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300),
              pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="Ray is not installed")]

ROOT = Path(__file__).resolve().parents[3]
#: the recipe's flags (docs/CLUSTER.md, "Securing a real cluster"), on loopback
RECIPE = ["--head", "--node-ip-address=127.0.0.1", "--port=0", "--include-dashboard=false",
          "--num-cpus=1", "--num-gpus=0", "--disable-usage-stats"]


def _session(leader: int) -> set[int]:
    """The live processes of ``leader``'s session (every Ray process ``ray start`` made)."""
    out = set()
    for proc in psutil.process_iter(["pid"]):
        try:
            if os.getsid(proc.pid) == leader and proc.status() != psutil.STATUS_ZOMBIE:
                out.add(proc.pid)
        except (ProcessLookupError, psutil.Error):
            continue
    return out


@contextmanager
def _ray_start(extra_env: dict[str, str]) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """``ray start ... --block`` in a session of its own; yields it and its temp dir; stops it after."""
    temp_dir = private_ray_temp_dir(short_temp_dir())
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update({"RAY_USAGE_STATS_ENABLED": "0", **extra_env})
    ray = shutil.which("ray", path=str(Path(sys.executable).parent)) or "ray"
    proc = subprocess.Popen([ray, "start", *RECIPE, "--block", f"--temp-dir={temp_dir}"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        yield proc, temp_dir
    finally:
        # SIGKILL at once: a SIGTERM to the group stops none of it in time - ``ray start --block``
        # catches it, the raylet takes ~10 s to go, and the GCS, the ``ray`` CLI and a Python helper
        # were still running 20 s later (a SIGTERM phase here only ever waited out its 15 s before
        # the SIGKILL that stopped them). Nothing is checked after the stop but that every process
        # of the session is gone and the temp dir removed.
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + timeouts.scaled(30)
        while True:
            proc.poll()  # reap the leader: a zombie is still a member of its session
            if not _session(proc.pid) or time.monotonic() >= deadline:
                break
            time.sleep(0.1)
        proc.wait(timeouts.scaled(30))
        assert not _session(proc.pid), "a Ray process outlived its stop"
        shutil.rmtree(os.path.dirname(temp_dir), ignore_errors=True)


def _listening(leader: int, timeout_s: float = 120.0) -> list[Listener]:
    """The session's listeners once its GCS and raylet listen (Ray's start-up is the slow part);
    ``timeout_s``: a quiet machine's hang guard, scaled."""
    timeout_s = timeouts.scaled(timeout_s)
    deadline = time.monotonic() + timeout_s
    while True:
        found = listeners_of(_session(leader))
        if {"gcs_server", "raylet"} <= {lst.name for lst in found}:
            time.sleep(2.0)  # the agents bind right after the raylet: take them in too
            return listeners_of(_session(leader))
        assert time.monotonic() < deadline, f"Ray did not come up within {timeout_s} s: {found}"
        time.sleep(0.5)


def _modes(temp_dir: str) -> dict[str, int]:
    return {str(p): stat.S_IMODE(p.lstat().st_mode) for p in [Path(temp_dir), *Path(temp_dir).rglob("*")]
            if p.is_dir() and not p.is_symlink()}


def test_ray_start_per_the_recipe_listens_on_loopback_only_and_its_dirs_are_private() -> None:
    with _ray_start(dict(LOOPBACK_RAY_ENV)) as (proc, temp_dir):
        found = _listening(proc.pid)
        names = {lst.name for lst in found}
        assert {"gcs_server", "raylet"} <= names and len(found) >= 3, found
        assert not exposed(found, "127.0.0.1"), found
        assert not [lst for lst in found if lst.wildcard]
        # Ray made its directories 0777; the recipe's chmod (tighten) makes them the operator's
        assert any(mode & 0o077 for mode in _modes(temp_dir).values())
        tighten(temp_dir)
        assert set(_modes(temp_dir).values()) == {0o700}
        assert stat.S_IMODE(os.stat(os.path.dirname(temp_dir)).st_mode) == 0o700


def test_without_the_loopback_variable_ray_binds_the_wildcard() -> None:
    """Why the recipe sets RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0: without it this Ray replaces
    --node-ip-address=127.0.0.1 by the host's address and its GCS and raylet bind every interface
    (the check above can fail)."""
    with _ray_start({}) as (proc, _):
        found = _listening(proc.pid)
        wild = {lst.name for lst in found if lst.wildcard}
        assert {"gcs_server", "raylet"} <= wild, found


_BENCH_RAY = r"""
import json, os, sys
import psutil
from supervisor.cluster.ray_bind import init_loopback_ray, listeners_of, private_ray_temp_dir
temp_dir = private_ray_temp_dir(sys.argv[1])
ray = init_loopback_ray(temp_dir, num_cpus=1, num_gpus=0, object_store_memory=80 << 20, log_to_driver=False)
@ray.remote
def pid():
    return os.getpid()
worker = ray.get(pid.remote())  # a worker too: core workers listen as well
me = psutil.Process()
pids = {me.pid} | {c.pid for c in me.children(recursive=True)}
found = [[l.pid, l.name, l.ip, l.port] for l in listeners_of(pids)]
modes = {}
for top, dirs, files in os.walk(temp_dir):
    modes[top] = os.lstat(top).st_mode & 0o777
print(json.dumps({"listeners": found, "modes": modes, "worker": worker,
                  "parent_mode": os.stat(os.path.dirname(temp_dir)).st_mode & 0o777}))
ray.shutdown()
import shutil
shutil.rmtree(os.path.dirname(temp_dir), ignore_errors=True)
"""


def test_the_benches_local_ray_listens_on_loopback_only() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update({"RAY_USAGE_STATS_ENABLED": "0", "PYTHONPATH": str(ROOT)})
    proc = subprocess.run([sys.executable, "-c", _BENCH_RAY, short_temp_dir()], capture_output=True, text=True,
                          env=env, timeout=timeouts.scaled(240), cwd=str(ROOT), start_new_session=True, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    found = [Listener(*row) for row in report["listeners"]]
    assert {"gcs_server", "raylet"} <= {lst.name for lst in found}, found
    assert report["worker"] in {lst.pid for lst in found} or len(found) >= 4, found
    assert not exposed(found, "127.0.0.1"), found
    assert set(report["modes"].values()) == {0o700} and report["parent_mode"] == 0o700, report["modes"]
