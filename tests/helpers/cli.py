"""Run the ``twt`` command line as a real process, the way an operator does."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.helpers import zygote

#: the repository root: the command runs from here, with it first on PYTHONPATH
ROOT = Path(__file__).resolve().parents[2]


def twt(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """``python -m supervisor ARGS``, its stdout and stderr captured as text; a non-zero exit is the
    caller's to check (nothing raised for it)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    # forked from the suite's preloaded zygote (tests/helpers/zygote.py) where it can be
    return zygote.run([sys.executable, "-m", "supervisor", *args], timeout=timeout, env=env, cwd=str(ROOT))
