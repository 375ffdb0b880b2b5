"""Fail closed, and say what serves: a configured backend that is not there stops the start; the
chosen backend, device and driver are on /metrics (``twt_backend_info``) and in ``twt status``."""

from __future__ import annotations

import socket
import urllib.request
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from shared.exitcodes import EXIT_FAILED
from supervisor.cli.status import render
from supervisor.lifecycle.backend_select import cuda_version_text, nvidia_driver_version, probe_cuda
from supervisor.observe.prometheus import PrometheusMetrics
from tests.helpers.cli import twt
from tests.helpers.cluster import supervisor
from tests.supervisor.lifecycle.test_cuda_supervisor import cuda_supervisor

pytestmark = pytest.mark.timeout(120)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _metrics(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return r.read().decode()


def test_versions_as_people_write_them(tmp_path: Path) -> None:
    assert cuda_version_text(12040) == "12.4" and cuda_version_text(13000) == "13.0"
    assert cuda_version_text(None) == "" and cuda_version_text(True) == ""
    proprietary = tmp_path / "version"
    proprietary.write_text("NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 22:23:56 UTC 2024\n"
                           "GCC version:  gcc version 12.2.0\n")
    assert nvidia_driver_version(str(proprietary)) == "550.54.15"
    proprietary.write_text("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  570.86.15  Release Build\n")
    assert nvidia_driver_version(str(proprietary)) == "570.86.15"
    assert nvidia_driver_version(str(tmp_path / "absent")) == "unknown"


def test_the_gauge_has_one_series_per_device() -> None:
    metrics = PrometheusMetrics("127.0.0.1:0", registry=CollectorRegistry(), process_metrics=False)
    try:
        metrics.backend_info("cuda", ("0:NVIDIA H200", "1:NVIDIA H200"), "570.86.15", "12.8")
        metrics.backend_info("cuda", ("0:NVIDIA H200", "1:NVIDIA H200"), "570.86.15", "12.8")  # again: replaced
        text = generate_latest(metrics.registry).decode()
        lines = [ln for ln in text.splitlines() if ln.startswith("twt_backend_info{")]
        assert len(lines) == 2
        assert ('twt_backend_info{backend="cuda",cuda_version="12.8",device="1:NVIDIA H200",'
                'driver_version="570.86.15"} 1.0') in lines
    finally:
        metrics.close()


def test_a_stub_supervisor_says_so_on_metrics_and_in_status() -> None:
    port = _free_port()
    with supervisor([], metrics_addr=f"127.0.0.1:{port}") as sup:
        assert 'twt_backend_info{backend="stub",cuda_version="",device="0:stub",driver_version=""} 1.0' \
            in _metrics(port)
        status = sup.client.status()
        assert status.supervisor.driver_version == status.supervisor.cuda_version == ""
        assert "backend stub  start" in render(status)


def test_a_cuda_supervisor_names_its_device_driver_and_cuda_version() -> None:
    port = _free_port()
    with cuda_supervisor({"devices": 1, "driver_version": 12040}, metrics_addr=f"127.0.0.1:{port}") as sup:
        status = sup.client.status()
        sup_rec = status.supervisor
        assert sup_rec.backend == "cuda" and sup_rec.cuda_version == "12.4"
        assert sup_rec.driver_version == nvidia_driver_version()  # this host's kernel module, or "unknown"
        (line,) = [ln for ln in _metrics(port).splitlines() if ln.startswith("twt_backend_info{")]
        assert 'backend="cuda"' in line and 'cuda_version="12.4"' in line and 'device="0:' in line
        assert f'driver_version="{sup_rec.driver_version}"' in line
        assert f"backend cuda (driver {sup_rec.driver_version}, CUDA 12.4)" in render(status)


def test_backend_cuda_without_a_gpu_refuses_to_start(tmp_path: Path) -> None:
    """The real driver bindings on this host: a node configured for the GPU never serves the stub."""
    probe = probe_cuda()
    if probe.get("ok"):
        pytest.skip("a CUDA device is usable here: the refusal needs a host without one")
    config = tmp_path / "tenants.toml"
    config.write_text('[supervisor]\nbackend = "cuda"\n')
    run_dir = tmp_path / "run"
    out = twt("supervise", "--config", str(config), "--run-dir", str(run_dir), timeout=120)
    assert out.returncode == EXIT_FAILED, out.stderr
    assert "backend 'cuda' unavailable" in out.stderr and str(probe["reason"]) in out.stderr
    assert not (run_dir / "supervisor.json").exists()  # never ready, never served
