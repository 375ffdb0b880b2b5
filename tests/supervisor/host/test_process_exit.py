"""A ``twt`` process ends as the interpreter's exit would, less the teardown (supervisor.host.process_exit).

Each case runs a fresh interpreter: what is checked is how that process ends.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from shared.exitcodes import EXIT_CHECK
from tests.helpers.timeouts import scaled

pytestmark = pytest.mark.timeout(60)

CHECKOUT = Path(__file__).resolve().parents[3]

#: an object that says when the interpreter's teardown destroys it: builtins outlive every module,
#: and only the teardown clears them (``os.write`` bound early: the os module is gone by then)
PROBE = textwrap.dedent("""
    import builtins, os

    class Probe:
        def __del__(self, write=os.write):
            write(2, b"torn down\\n")

    builtins._twt_teardown_probe = Probe()
""")


def _env() -> dict[str, str]:
    """This checkout first on the path; stdout buffered (as it is unless PYTHONUNBUFFERED says otherwise)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(CHECKOUT), os.environ.get("PYTHONPATH")) if p)
    return env


def _python(code: str, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=_env(),
                          cwd=cwd, timeout=scaled(30), check=False)


def test_the_probe_sees_an_ordinary_exit_tear_down() -> None:
    """The check below means something: at ``sys.exit`` the teardown destroys the probe."""
    done = _python(PROBE + "import sys; sys.exit(0)")
    assert done.returncode == 0
    assert "torn down" in done.stderr


def test_exit_process_runs_what_an_exit_runs_and_skips_the_teardown() -> None:
    """Threads joined, then atexit callbacks, then the streams flushed; the status kept; no teardown."""
    code = PROBE + textwrap.dedent("""
        import atexit, sys, threading
        from supervisor.host.process_exit import exit_process

        gate = threading.Event()
        def late() -> None:
            gate.wait(5)
            print("thread done", flush=True)
        threading.Thread(target=late).start()          # not a daemon: the exit waits for it
        atexit.register(print, "atexit ran")            # after the join: prints after 'thread done'
        sys.stdout.write("buffered, never flushed by hand\\n")
        gate.set()
        exit_process(3)
    """)
    done = _python(code)
    assert done.returncode == 3, done.stderr
    assert done.stdout.splitlines() == ["buffered, never flushed by hand", "thread done", "atexit ran"], done.stdout
    assert "torn down" not in done.stderr


@pytest.mark.parametrize("ending", ["exit_process(0)", "sys.exit(0)"])
def test_a_failed_flush_is_status_120(ending: str) -> None:
    """stdout's reader gone before the exit's flush: status 120, the interpreter's own for it."""
    code = textwrap.dedent(f"""
        import os, sys
        from supervisor.host.process_exit import exit_process

        sys.stdout.write("lost")  # buffered: a pipe
        os.read(0, 1)             # until the test has closed the pipe's other end (EOF)
        {ending}
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, env=_env())
    assert proc.stdout is not None and proc.stdin is not None
    proc.stdout.close()
    proc.stdin.close()
    assert proc.wait(scaled(30)) == 120


def test_twt_commands_end_without_the_teardown(tmp_path: Path) -> None:
    """``python -m supervisor CMD`` (and so ``twt``, the same :func:`supervisor.cli.console`) ends
    with the command's status and output, without tearing its objects down."""
    config = tmp_path / "twt.toml"
    config.write_text("[supervisor]\npool_size = 0\n")
    run_as_m = "import runpy, sys; sys.argv = ['-m', *sys.argv[1:]]; " \
               "runpy.run_module('supervisor', run_name='__main__', alter_sys=True)"
    done = _python(PROBE + run_as_m, "check-config", str(config), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "ok (0 tenants" in done.stdout, done.stdout  # stdout is a pipe: flushed at the exit
    assert "torn down" not in done.stderr
    bad = _python(PROBE + run_as_m, "check-config", str(tmp_path / "missing.toml"), cwd=tmp_path)
    assert bad.returncode == EXIT_CHECK, bad.stderr  # the command's own status, kept
    assert "torn down" not in bad.stderr
