"""A stand-in for ``nvidia-cuda-mps-control``, so the check's MPS phase runs without a GPU (its own test).

    fake_mps_control.py -d      start the "daemon": detached, listening on $CUDA_MPS_PIPE_DIRECTORY/control
    echo quit | fake_mps_control.py     send the commands on stdin to it; "quit" stops it

What the supervisor's MPS detection (``supervisor.host.mps.detect_mps``) looks for is
a control socket in the pipe directory that accepts connections; this gives
it one. It proves the phase's flow (the daemon started with private
directories, the supervisor and its MPS tenant given them, the daemon
stopped whatever happens), never anything about MPS itself. The daemon also
ends by itself after ``IDLE_S`` without a connection, so a test that dies
midway leaves nothing behind for long.
"""

from __future__ import annotations

import os
import socket
import sys

IDLE_S = 60.0


def _control_path() -> str:
    pipe = os.environ.get("CUDA_MPS_PIPE_DIRECTORY") or "/tmp/nvidia-mps"
    return os.path.join(pipe, "control")


def _listen(path: str) -> socket.socket:
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(16)
    srv.settimeout(IDLE_S)
    return srv


def _serve(srv: socket.socket, path: str) -> None:
    """Accept connections until one says "quit" (or none comes for IDLE_S); then remove the socket."""
    try:
        while True:
            try:
                conn, _ = srv.accept()
            except TimeoutError:
                return
            with conn:
                conn.settimeout(2.0)
                try:
                    data = conn.recv(4096)
                except OSError:
                    continue
                if b"quit" in data:
                    return
    finally:
        srv.close()
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def _daemon(path: str) -> int:
    """``-d``: returns once the detached daemon listens (like the real one)."""
    if os.path.exists(path):
        print("An instance of this daemon is already running", file=sys.stderr)
        return 1
    os.makedirs(os.path.dirname(path), exist_ok=True)
    ready_r, ready_w = os.pipe()
    if os.fork():
        os.close(ready_w)
        ok = os.read(ready_r, 1) == b"1"
        os.close(ready_r)
        return 0 if ok else 1
    os.close(ready_r)
    os.setsid()
    if os.fork():
        os._exit(0)
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    try:
        srv = _listen(path)
    except OSError:
        os._exit(1)
    os.write(ready_w, b"1")
    os.close(ready_w)
    try:
        _serve(srv, path)
    finally:
        os._exit(0)


def main(argv: list[str]) -> int:
    path = _control_path()
    if argv[:1] == ["-d"]:
        return _daemon(path)
    commands = sys.stdin.read()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(path)
        s.sendall(commands.encode())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
