"""Run a scenario in a private mount namespace, with small tmpfs file systems mounted only there.

A full ``/dev/shm`` or a full state file system is real only on a real small
file system, and mounting one on the host would touch every other process.
``unshare --mount --propagation private`` gives the scenario (a script run
with this interpreter, the supervisor it launches and its workers) its own
mount table: what it mounts there vanishes with it and is never seen by
anything else on the host. Needs root (or CAP_SYS_ADMIN) and ``unshare``;
:func:`available` says whether this host allows it, so a test can skip
where it cannot run (never on the project's root sandbox).
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]

__all__ = ["available", "run_scenario"]


@functools.cache
def available() -> str | None:
    """None when a private mount namespace with a tmpfs works here, else why not."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return "no unshare(1) on this host"
    try:
        out = subprocess.run(
            [unshare, "--mount", "--propagation", "private", "sh", "-c",
             "mount -t tmpfs -o size=64k tmpfs /mnt && umount /mnt"],
            capture_output=True, text=True, timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unshare failed: {exc}"
    if out.returncode != 0:
        return f"no private mount namespace here (not root?): {out.stderr.strip()[:200]}"
    return None


def run_scenario(code: str, *, timeout_s: float = 240.0) -> dict[str, Any]:
    """Run ``code`` (a Python script body) in a private mount namespace; it prints one JSON line
    last, which is returned. Its stderr is kept for the failure message."""
    unshare = shutil.which("unshare")
    assert unshare is not None
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    out = subprocess.run(
        [unshare, "--mount", "--propagation", "private", sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True, text=True, timeout=timeout_s, cwd=REPO, env=env,
    )
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    assert out.returncode == 0 and lines, f"scenario failed (rc {out.returncode}):\n{out.stdout}\n{out.stderr[-4000:]}"
    result: dict[str, Any] = json.loads(lines[-1])
    return result
