"""Which compute backend the workers use: ``--backend auto|stub|cuda``.

The supervisor never initialises CUDA itself (a process that has must not
fork, and the supervisor starts workers), so the probe runs in a short-lived
child process: load the driver, ``cuInit``, count devices, read each
device's name and memory. ``auto`` picks cuda when that works and finds a
device, else stub, and says why; ``cuda`` without a usable driver fails at
start with :class:`BackendUnavailable` and the reason.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Any

from shared.config import SupervisorConfig
from shared.errors import BackendUnavailable

__all__ = ["BackendChoice", "probe_cuda", "select_backend"]

_PROBE = r"""
import json, sys
out = {"ok": False}
try:
    from cuda.bindings import driver as d
except Exception as e:
    out["reason"] = f"cuda-bindings not importable: {type(e).__name__}: {e}"
    print(json.dumps(out)); sys.exit(0)
try:
    err, = d.cuInit(0)
except Exception as e:  # libcuda missing: a RuntimeError subclass from the loader
    out["reason"] = f"CUDA driver not loadable: {type(e).__name__}: {e}"
    print(json.dumps(out)); sys.exit(0)
if err != d.CUresult.CUDA_SUCCESS:
    out["reason"] = f"cuInit failed: {err.name}"
    print(json.dumps(out)); sys.exit(0)
err, n = d.cuDeviceGetCount()
if err != d.CUresult.CUDA_SUCCESS or n == 0:
    out["reason"] = "no CUDA device" if n == 0 else f"cuDeviceGetCount failed: {err.name}"
    print(json.dumps(out)); sys.exit(0)
devices = []
for i in range(n):
    _, dev = d.cuDeviceGet(i)
    _, name = d.cuDeviceGetName(256, dev)
    _, total = d.cuDeviceTotalMem(dev)
    devices.append({"index": i, "name": name.split(b"\0")[0].decode(errors="replace"), "total_bytes": int(total)})
_, ver = d.cuDriverGetVersion()
out.update(ok=True, devices=devices, driver_version=int(ver))
print(json.dumps(out))
"""


@dataclass(frozen=True)
class BackendChoice:
    name: str
    reason: str
    options: dict[str, Any] = field(default_factory=dict)
    devices: tuple[dict[str, Any], ...] = ()


def probe_cuda(timeout_s: float = 60.0) -> dict[str, Any]:
    """Run the CUDA probe in a child process; ``{"ok": bool, "reason"?, "devices"?}``."""
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=timeout_s, check=False
        )
    except subprocess.TimeoutExpired:
        return {"ok": False, "reason": f"CUDA probe did not finish within {timeout_s:g} s"}
    line = proc.stdout.strip().splitlines()[-1:] or [""]
    try:
        result = json.loads(line[0])
    except ValueError:
        tail = (proc.stderr or "").strip().splitlines()[-1:] or ["no output"]
        return {"ok": False, "reason": f"CUDA probe crashed (exit {proc.returncode}): {tail[0]}"}
    return result if isinstance(result, dict) else {"ok": False, "reason": "CUDA probe gave no verdict"}


def select_backend(config: SupervisorConfig) -> BackendChoice:
    stub = BackendChoice(
        "stub",
        "",
        {"capacity_bytes": config.stub_device_capacity_bytes},
        ({"index": 0, "name": "stub", "total_bytes": config.stub_device_capacity_bytes},),
    )
    if config.backend == "stub":
        return BackendChoice("stub", "--backend stub", stub.options, stub.devices)
    probe = probe_cuda()
    if probe.get("ok"):
        devices = tuple(probe.get("devices") or ())
        return BackendChoice(
            "cuda",
            f"CUDA driver {probe.get('driver_version')} with {len(devices)} device(s)"
            + (" (--backend cuda)" if config.backend == "cuda" else " (auto)"),
            {},
            devices,
        )
    reason = str(probe.get("reason", "unknown"))
    if config.backend == "cuda":
        raise BackendUnavailable("cuda", reason)
    return BackendChoice("stub", f"auto: cuda unavailable ({reason})", stub.options, stub.devices)
