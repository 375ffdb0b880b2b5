"""The fork server's child path (worker.fork_child): a worker's start runs without multiprocessing's
preparation, with the fork server's signals and fds undone as before; a multiprocessing process
started through the same fork server is still prepared and run as multiprocessing does."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import timeouts

pytestmark = pytest.mark.timeout(180)

REPO = Path(__file__).resolve().parents[2]

_PROBE_MODULE = r'''
import json, os, signal, sys

def report(path, name):
    from multiprocessing import forkserver, parent_process, process, resource_tracker
    frames, f = [], sys._getframe()
    while f is not None:
        frames.append(f.f_code.co_filename.rsplit("/", 2)[-1] + ":" + f.f_code.co_name)
        f = f.f_back
    wakeup = signal.set_wakeup_fd(-1)
    parent = parent_process()
    fds = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds[int(fd)] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the listing's own fd, closed by now
            pass
    with open(path, "w") as out:
        json.dump({
            "frames": frames, "wakeup_fd": wakeup,
            "sigchld_default": signal.getsignal(signal.SIGCHLD) == signal.SIG_DFL,
            "sigint_default": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
            "fds": fds, "alive_fd": forkserver._forkserver._forkserver_alive_fd,
            "tracker_fd": resource_tracker._resource_tracker._fd,
            "name": process.current_process().name, "parent_sentinel": parent.sentinel if parent else None,
            "cwd": os.getcwd(), "on_path": os.path.dirname(os.path.abspath(__file__)) in sys.path,
        }, out)
'''

_SCRIPT = r'''
import json, multiprocessing, os, sys
from multiprocessing import forkserver
from supervisor.runtime.entry import EntryPoint
from supervisor.runtime.workers import FORKSERVER_PRELOAD, fork_start

if __name__ == "__main__":
    mods, out = sys.argv[1], sys.argv[2]
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(FORKSERVER_PRELOAD)   # the supervisor's: worker.preload installs the child path
    forkserver.ensure_running()
    # the fork server's listening socket, by its inode: no child may hold it
    address = forkserver._forkserver._forkserver_address
    with open("/proc/net/unix") as table:
        listener = [line.split()[6] for line in table if line.rstrip().endswith(address)]
    with open(os.path.join(out, "listener.json"), "w") as f:
        json.dump(["socket:[%s]" % inode for inode in listener], f)
    sys.path.insert(0, mods)                         # after the fork server started: the start carries it
    os.chdir(mods)
    import forked_report
    worker = fork_start(EntryPoint("forked_report:report"), (os.path.join(out, "worker.json"), "worker"))
    worker.join(float(sys.argv[3]))
    assert worker.exitcode == 0, worker.exitcode
    proc = ctx.Process(target=forked_report.report, args=(os.path.join(out, "mp.json"), "mp"), name="mp-probe")
    proc.start()
    proc.join(float(sys.argv[3]))
    assert proc.exitcode == 0, proc.exitcode
    print("ok")
'''


def test_the_child_path_is_installed_only_over_the_fork_server_it_mirrors(monkeypatch: pytest.MonkeyPatch) -> None:
    """Another ``_serve_one`` (a Python whose fork server changed) keeps multiprocessing's own child path."""
    from multiprocessing import forkserver

    from worker import fork_child

    def changed(child_r: int, fds: list[int], unused_fds: list[int], handlers: dict[int, object],
                authkey: bytes) -> int:
        return 0

    monkeypatch.setattr(forkserver, "_serve_one", changed)
    assert not fork_child.installable() and not fork_child.install()
    assert forkserver._serve_one is changed  # type: ignore[attr-defined]
    monkeypatch.setattr(forkserver, "_serve_one", fork_child.serve_one)
    assert fork_child.installable()  # the parameters it mirrors
    monkeypatch.setattr(fork_child, "_KNOWN_VERSIONS", ((3, 0), (3, 1)))  # a Python outside them
    assert not fork_child.installable()


@pytest.mark.skipif(not __import__("worker.fork_child").fork_child.installable(),
                    reason="this Python's fork server is not the one worker.fork_child mirrors: its own path stays")
def test_a_forked_worker_start_skips_multiprocessings_preparation_and_a_process_keeps_it(tmp_path: Path) -> None:
    """A worker's start (``fork_start``: the mark as preparation data, a ForkedStart) is unpickled
    and run by the fork server's child path at once - no ``spawn._main``, no preparation, no
    parent sentinel - with the fork server's wake-up fd and SIGCHLD/SIGINT handlers undone, its
    fds closed but for the two it hands every child (the alive pipe, the resource tracker), and
    the starter's sys.path and working directory. A ``multiprocessing`` process through the same
    fork server is prepared (its name) and gets its parent sentinel, as multiprocessing does. In a
    child interpreter: a fork server of this test process would be every later test's."""
    mods = tmp_path / "mods"
    mods.mkdir()
    (mods / "forked_report.py").write_text(_PROBE_MODULE)
    script = tmp_path / "fork_child.py"
    script.write_text(_SCRIPT)
    run = subprocess.run([sys.executable, str(script), str(mods), str(tmp_path), str(timeouts.scaled(60))], cwd=REPO,
                         capture_output=True, text=True, timeout=timeouts.scaled(150))
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-3000:]
    worker = json.loads((tmp_path / "worker.json").read_text())
    mp = json.loads((tmp_path / "mp.json").read_text())

    assert "fork_child.py:serve_one" in worker["frames"]
    assert not any(f.startswith("spawn.py:") for f in worker["frames"])  # no spawn._main, no prepare
    assert worker["parent_sentinel"] is None
    assert worker["wakeup_fd"] == -1 and worker["sigchld_default"] and worker["sigint_default"]
    # the fork server's own fds closed (its listener among them), the two it hands every child kept
    listener = json.loads((tmp_path / "listener.json").read_text())
    assert len(listener) == 1
    for child in (worker, mp):
        links = child["fds"].values()
        assert not set(listener) & set(links)
        assert str(child["alive_fd"]) in child["fds"] and str(child["tracker_fd"]) in child["fds"]
    assert len(worker["fds"]) < len(mp["fds"])  # no parent sentinel
    assert worker["cwd"] == str(mods) and worker["on_path"]

    assert "spawn.py:_main" not in mp["frames"] and "fork_child.py:serve_one" in mp["frames"]
    assert mp["name"] == "mp-probe"  # prepared from its preparation data
    assert mp["parent_sentinel"] is not None and str(mp["parent_sentinel"]) in mp["fds"]
    assert mp["wakeup_fd"] == -1 and mp["sigchld_default"] and mp["sigint_default"]
