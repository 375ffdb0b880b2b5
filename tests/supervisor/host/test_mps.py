from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from supervisor.host.mps import DEFAULT_PIPE_DIR, Fallback, Mps, detect_mps


@pytest.fixture
def pipe_dir() -> Iterator[Path]:
    # unix socket paths are limited to ~107 bytes: keep the directory short
    import tempfile

    from tests.helpers.tmp import short_temp_dir

    with tempfile.TemporaryDirectory(prefix="mps", dir=short_temp_dir()) as d:
        yield Path(d)


def _listening_socket(path: Path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    sock.listen(1)
    return sock


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_listening_socket_is_mps(pipe_dir: Path) -> None:
    sock = _listening_socket(pipe_dir / "control")
    try:
        decision = detect_mps({"CUDA_MPS_PIPE_DIRECTORY": str(pipe_dir)})
    finally:
        sock.close()
    assert isinstance(decision, Mps)
    assert decision.pipe_dir == str(pipe_dir)
    assert decision.active


def test_stale_socket_with_live_pid_is_mps(pipe_dir: Path) -> None:
    sock = _listening_socket(pipe_dir / "control")
    sock.close()  # the file stays, nobody listens
    (pipe_dir / "nvidia-cuda-mps-control.pid").write_text(f"{os.getpid()}\n")
    decision = detect_mps({"CUDA_MPS_PIPE_DIRECTORY": str(pipe_dir)})
    assert isinstance(decision, Mps)
    assert str(os.getpid()) in decision.reason


def test_stale_socket_with_dead_pid_is_fallback(pipe_dir: Path) -> None:
    sock = _listening_socket(pipe_dir / "control")
    sock.close()
    (pipe_dir / "nvidia-cuda-mps-control.pid").write_text(f"{_dead_pid()}\n")
    decision = detect_mps({"CUDA_MPS_PIPE_DIRECTORY": str(pipe_dir)})
    assert isinstance(decision, Fallback)
    assert "stale" in decision.reason
    assert not decision.active


def test_missing_socket_is_fallback(pipe_dir: Path) -> None:
    decision = detect_mps({"CUDA_MPS_PIPE_DIRECTORY": str(pipe_dir)})
    assert isinstance(decision, Fallback)
    assert "no control socket" in decision.reason


def test_plain_file_is_fallback(pipe_dir: Path) -> None:
    (pipe_dir / "control").write_text("not a socket")
    decision = detect_mps({"CUDA_MPS_PIPE_DIRECTORY": str(pipe_dir)})
    assert isinstance(decision, Fallback)
    assert "not a unix socket" in decision.reason


def test_relative_path_is_refused_with_warning(caplog: pytest.LogCaptureFixture) -> None:
    import logging

    logging.getLogger("twt").propagate = True
    with caplog.at_level("WARNING", logger="twt.mps"):
        decision = detect_mps({"CUDA_MPS_PIPE_DIRECTORY": "relative/dir"})
    assert isinstance(decision, Fallback)
    assert "relative" in decision.reason
    assert any(r.getMessage() == "mps.relative_pipe_dir" for r in caplog.records)


def test_missing_directory_is_fallback(pipe_dir: Path) -> None:
    decision = detect_mps({"CUDA_MPS_PIPE_DIRECTORY": str(pipe_dir / "nope")})
    assert isinstance(decision, Fallback)
    assert "does not exist" in decision.reason


def test_default_directory_used_without_env() -> None:
    decision = detect_mps({})
    if isinstance(decision, Fallback):
        assert DEFAULT_PIPE_DIR in decision.reason or "control" in decision.reason
    else:
        assert decision.pipe_dir == DEFAULT_PIPE_DIR


def test_mps_or_fallback_sees_a_daemon_started_later(pipe_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Not cached for the life of the process: a later daemon is seen once the answer is max_age_s old."""
    from supervisor.host import mps
    from supervisor.store.registry import TenantRegistry

    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(pipe_dir))
    now = [1000.0]
    monkeypatch.setattr(mps, "_cached", None)
    assert isinstance(mps.mps_or_fallback(clock=lambda: now[0]), Fallback)
    sock = _listening_socket(pipe_dir / "control")  # the daemon starts
    try:
        now[0] += 0.5
        assert isinstance(mps.mps_or_fallback(clock=lambda: now[0]), Fallback)  # within max_age_s: reused
        now[0] += 0.6
        assert isinstance(mps.mps_or_fallback(clock=lambda: now[0]), Mps)  # older: probed again
        assert isinstance(TenantRegistry.mps_or_fallback(max_age_s=0), Mps)  # asked to probe now
    finally:
        sock.close()
    (pipe_dir / "control").unlink()
    assert isinstance(TenantRegistry.mps_or_fallback(max_age_s=0), Fallback)  # and a stopped one too
