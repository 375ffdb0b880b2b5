"""Which compute backend the workers use: ``--backend auto|stub|cuda``.

The supervisor never initialises CUDA itself (a process that has must not
fork, and the supervisor starts workers), so the probe runs in a short-lived
child process: load the driver, ``cuInit``, count devices, read each
device's name, compute capability, total and free memory (``cuMemGetInfo`` in a
briefly retained primary context: what the device budget starts from) and what
one more context costs there (a throw-away second context, three samples, the
median; where none can be made, the device class's conservative default from
:mod:`shared.cuda_compat`, with the failed call): measured here once, before
any worker exists, and handed to every worker as its ``context_bytes``
(supervisor.routing.placement), so no worker measures it while others start.
The calls whose shape differs between cuda-bindings 12 and 13 go through
:func:`shared.cuda_compat.driver_api`. The driver module is
``cuda.bindings.driver`` unless ``cuda_driver_module`` names another (the
test suite's fake), and the probe and the workers honour the same name.
``auto`` picks cuda when that works and finds a device, else stub, and says
why; ``cuda`` without a usable driver fails at start with
:class:`BackendUnavailable` and the reason: a production node configured for
the GPU (deploy/ sets ``backend = "cuda"``) never serves the stub because its
driver injection failed - it refuses to start, and the orchestrator says so.
The choice carries the driver's versions (``twt_backend_info``, ``twt status``).

The probe's report is JSON from its process; its devices are checked as shared.records.ProbedDevice.
"""

from __future__ import annotations

import io
import json
import os
import re
import select
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from collections.abc import Mapping
from typing import NoReturn

from shared.config import SupervisorConfig
from shared.errors import NVRTC_INSTALL_HINT, BackendUnavailable
from shared.records import ProbedDevice

__all__ = ["BackendChoice", "cuda_version_text", "nvidia_driver_version", "nvrtc_note", "probe_cuda", "select_backend"]

#: where the NVIDIA kernel module says its version ("... Kernel Module  550.54.15  ...")
NVIDIA_VERSION_FILE = "/proc/driver/nvidia/version"

_PROBE = r"""
import importlib, importlib.util, json, sys
out = {"ok": False}
if sys.argv[1] == "cuda.bindings.driver" and importlib.util.find_spec("cuda.bindings") is not None:
    # the real bindings load the driver (libcuda.so.1) with the system's loader at cuInit, after an
    # import of ~0.1 s: where that loader finds no driver (a host without one, the laptop's default
    # backend auto), say so before the import (imports the ``cuda`` namespace only)
    import ctypes
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        out["reason"] = f"CUDA driver not loadable: {e}"
        print(json.dumps(out)); sys.exit(0)
try:
    d = importlib.import_module(sys.argv[1])
except Exception as e:
    out["reason"] = f"cuda-bindings not importable: {type(e).__name__}: {e}"
    print(json.dumps(out)); sys.exit(0)
from shared.cuda_compat import default_context_bytes, driver_api
from shared.errors import BackendUnavailable
try:
    api = driver_api(d)
except BackendUnavailable as e:
    out["reason"] = e.reason
    print(json.dumps(out)); sys.exit(0)
out["bindings"] = api.version
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
OK = d.CUresult.CUDA_SUCCESS
SAMPLES = 3


def context_cost(dev, primary):
    # cuMemGetInfo around a throw-away second context, SAMPLES times, the median: this probe runs
    # before any worker, so no other start of ours skews it; a foreign allocation skews one sample
    samples = []
    for _ in range(SAMPLES):
        err, before, _ = d.cuMemGetInfo()
        if err != OK:
            return None, f"cuMemGetInfo: {err.name}"
        err, ctx = api.ctx_create(d, 0, dev)
        if err != OK:
            d.cuCtxSetCurrent(primary)
            return None, f"cuCtxCreate: {err.name}"
        err, after, _ = d.cuMemGetInfo()
        d.cuCtxDestroy(ctx)
        d.cuCtxSetCurrent(primary)
        if err != OK:
            return None, f"cuMemGetInfo: {err.name}"
        samples.append(max(0, int(before) - int(after)))
    return sorted(samples)[len(samples) // 2], ""


devices = []
attr = d.CUdevice_attribute
for i in range(n):
    _, dev = d.cuDeviceGet(i)
    _, name = d.cuDeviceGetName(256, dev)
    _, total = d.cuDeviceTotalMem(dev)
    err, major = d.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev)
    err2, minor = d.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev)
    major, minor = (int(major), int(minor)) if err == OK and err2 == OK else (0, 0)
    free, ctx_bytes, note = None, None, "no primary context"
    try:
        err, ctx = d.cuDevicePrimaryCtxRetain(dev)
        if err == OK:
            d.cuCtxSetCurrent(ctx)
            err, f, _ = d.cuMemGetInfo()
            free = int(f) if err == OK else None
            ctx_bytes, note = context_cost(dev, ctx)
            d.cuCtxSetCurrent(d.CUcontext(0))
            d.cuDevicePrimaryCtxRelease(dev)
        else:
            note = f"cuDevicePrimaryCtxRetain: {err.name}"
    except Exception as e:
        note = f"{type(e).__name__}: {e}"
    source = "measured"
    if ctx_bytes is None:  # never 0: the device class's conservative figure, and why
        ctx_bytes, source = default_context_bytes(major), "default"
    devices.append({"index": i, "name": name.split(b"\0")[0].decode(errors="replace"), "total_bytes": int(total),
                    "free_bytes": free, "compute_capability": f"{major}.{minor}", "context_bytes": ctx_bytes,
                    "context_bytes_source": source, "context_note": note})
_, ver = d.cuDriverGetVersion()
out.update(ok=True, devices=devices, driver_version=int(ver))
try:  # NVRTC: only the tensor kernels need it; its own reason when it is missing
    nv = importlib.import_module(sys.argv[2])
    err, major, minor = nv.nvrtcVersion()
    out["nvrtc"] = f"{major}.{minor}" if not err else None
    if err:
        out["nvrtc_reason"] = f"nvrtcVersion failed: {err}"
except Exception as e:  # not installed (ImportError), or libnvrtc not found (a RuntimeError subclass)
    out["nvrtc"] = None
    out["nvrtc_reason"] = f"{type(e).__name__}: {e}"
print(json.dumps(out))
"""


@dataclass(frozen=True)
class BackendChoice:
    name: str
    reason: str
    options: dict[str, object] = field(default_factory=dict)
    devices: tuple[ProbedDevice, ...] = ()
    #: the NVIDIA kernel driver's version ("550.54.15"; "" on the stub, "unknown" where unreadable)
    driver_version: str = ""
    #: the CUDA version the driver supports, from cuDriverGetVersion ("12.4"; "" on the stub)
    cuda_version: str = ""

    def device_labels(self) -> tuple[str, ...]:
        """One ``INDEX:NAME`` per device used: the ``device`` label of ``twt_backend_info``."""
        return tuple(f"{d.index}:{d.name}" for d in self.devices)


def cuda_version_text(version: object) -> str:
    """``cuDriverGetVersion``'s integer as people write it: 12040 -> "12.4" ("" when not an int)."""
    if not isinstance(version, int) or isinstance(version, bool) or version <= 0:
        return ""
    return f"{version // 1000}.{version % 1000 // 10}"


def nvidia_driver_version(path: str = NVIDIA_VERSION_FILE) -> str:
    """The NVIDIA kernel module's version from ``/proc/driver/nvidia/version``; "unknown" without it
    (a container without the file, or the fake driver of the tests)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read(4096)
    except OSError:
        return "unknown"
    found = re.search(r"Kernel Module(?:\s+for\s+\S+)?\s+([0-9][0-9.]*)", text)
    return found.group(1) if found else "unknown"


def probe_cuda(timeout_s: float = 60.0, driver_module: str | None = None,
               nvrtc_module: str | None = None) -> dict[str, object]:
    """Run the CUDA probe in a child process; ``{"ok": bool, "reason"?, "devices"?, "nvrtc"?, "nvrtc_reason"?}``.

    The child is a fork of this process where that copies nothing the probe could trip on (one
    thread, so no lock another thread holds; neither module imported here, so the probe imports
    them fresh, as a new interpreter would), else a fresh interpreter. Either way a driver that
    crashes or hangs the probe ends only the child. A fork skips the interpreter's start and the
    imports this process has made already: on a host without a driver 25 -> 4.5 ms of CPU a probe,
    with the suite's fake driver 99 -> 48 ms."""
    argv = [driver_module or "cuda.bindings.driver", nvrtc_module or "cuda.bindings.nvrtc"]
    if _forkable(argv):
        stdout, stderr, status = _run_forked(argv, timeout_s)
    else:
        try:
            proc = subprocess.run([sys.executable, "-c", _PROBE, *argv], capture_output=True, text=True,
                                  timeout=timeout_s, check=False)
        except subprocess.TimeoutExpired:
            stdout, stderr, status = None, "", ""
        else:
            stdout, stderr, status = proc.stdout, proc.stderr or "", f"exit {proc.returncode}"
    if stdout is None:
        return {"ok": False, "reason": f"CUDA probe did not finish within {timeout_s:g} s"}
    line = stdout.strip().splitlines()[-1:] or [""]
    try:
        result = json.loads(line[0])
    except ValueError:
        tail = stderr.strip().splitlines()[-1:] or ["no output"]
        return {"ok": False, "reason": f"CUDA probe crashed ({status}): {tail[0]}"}
    return result if isinstance(result, dict) else {"ok": False, "reason": "CUDA probe gave no verdict"}


def _forkable(argv: list[str]) -> bool:
    """May the probe run in a fork of this process? One thread, and neither module imported."""
    if any(name in sys.modules for name in argv):
        return False
    try:
        return len(os.listdir("/proc/self/task")) == 1
    except OSError:  # no /proc (not Linux): a fresh interpreter
        return False


def _run_forked(argv: list[str], timeout_s: float) -> tuple[str | None, str, str]:
    """The probe in a forked child: (its stdout, or None past ``timeout_s``; its stderr; how it ended)."""
    read_fd, write_fd = os.pipe()
    with tempfile.TemporaryFile() as errors:
        pid = os.fork()
        if pid == 0:  # the child: never returns
            _probe_child(argv, write_fd, errors.fileno())
        os.close(write_fd)
        out = bytearray()
        deadline = time.monotonic() + timeout_s
        timed_out = False
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([read_fd], [], [], left)[0]:
                    timed_out = True
                    break
                chunk = os.read(read_fd, 65536)
                if not chunk:
                    break
                out += chunk
        finally:
            os.close(read_fd)
            if timed_out:
                os.kill(pid, signal.SIGKILL)
            _, raw = os.waitpid(pid, 0)
        errors.seek(0)
        err = errors.read(1 << 16).decode(errors="replace")
    if timed_out:
        return None, err, ""
    code = os.waitstatus_to_exitcode(raw)
    return out.decode(errors="replace"), err, f"exit {code}" if code >= 0 else f"signal {-code}"


def _probe_child(argv: list[str], out_fd: int, err_fd: int) -> NoReturn:
    """Run :data:`_PROBE` as ``python -c`` would, its verdict to ``out_fd``, then exit."""
    code = 1
    try:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # this process's handlers are not its own
            signal.signal(sig, signal.SIG_DFL)
        signal.set_wakeup_fd(-1)
        os.dup2(err_fd, 2)
        sys.stdout = io.TextIOWrapper(io.FileIO(out_fd, "w"), encoding="utf-8")
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), encoding="utf-8")
        sys.argv = ["-c", *argv]
        try:
            exec(compile(_PROBE, "<probe>", "exec"), {"__name__": "__main__"})
            code = 0
        except SystemExit as done:
            code = done.code if isinstance(done.code, int) else 0
        sys.stdout.flush()
    except BaseException:  # noqa: BLE001 - the parent reports it as a crash, with its last line
        traceback.print_exc()
    finally:
        try:
            sys.stderr.flush()
        finally:
            os._exit(code)


def nvrtc_note(probe: Mapping[str, object]) -> str:
    """The backend reason's NVRTC part: empty when NVRTC loads, else why not and what brings it."""
    if probe.get("nvrtc") or "nvrtc_reason" not in probe:
        return ""
    return (f"; NVRTC missing, so fill/axpy/sum are unavailable ({probe['nvrtc_reason']}): "
            f"{NVRTC_INSTALL_HINT}")


def select_backend(config: SupervisorConfig) -> BackendChoice:
    cap = config.stub_device_capacity_bytes
    stub_indexes = config.devices if isinstance(config.devices, tuple) else (0,)
    stub = BackendChoice(
        "stub",
        "",
        {"capacity_bytes": cap},
        tuple(ProbedDevice(i, cap, cap, "stub") for i in stub_indexes),
    )
    if config.backend == "stub":
        return BackendChoice("stub", "--backend stub", stub.options, stub.devices)
    probe = probe_cuda(driver_module=config.cuda_driver_module, nvrtc_module=config.cuda_nvrtc_module)
    if probe.get("ok"):
        listed = probe.get("devices") or []
        if not isinstance(listed, list):
            raise BackendUnavailable("cuda", f"the CUDA probe listed no devices: {listed!r:.80}")
        found = tuple(ProbedDevice.from_wire(d) for d in listed)  # checked: a malformed report is a ProtocolError
        devices = found
        if isinstance(config.devices, tuple):
            present = {d.index for d in found}
            missing = [i for i in config.devices if i not in present]
            if missing:
                raise BackendUnavailable(
                    "cuda", f"devices {list(config.devices)} configured, but device(s) {missing} do not exist "
                    f"({len(found)} CUDA device(s) visible)"
                )
            devices = tuple(d for d in found if d.index in config.devices)
        options: dict[str, object] = {
            k: v
            for k, v in (("driver_module", config.cuda_driver_module), ("nvrtc_module", config.cuda_nvrtc_module))
            if v
        }
        names = ", ".join(f"{d.index}: {d.name}" for d in devices)
        return BackendChoice(
            "cuda",
            f"CUDA driver {probe.get('driver_version')} (cuda-bindings {probe.get('bindings')}) with "
            f"{len(found)} device(s), using [{names}]"
            + (" (--backend cuda)" if config.backend == "cuda" else " (auto)")
            + nvrtc_note(probe),
            options,
            devices,
            driver_version=nvidia_driver_version(),
            cuda_version=cuda_version_text(probe.get("driver_version")),
        )
    reason = str(probe.get("reason", "unknown"))
    if config.backend == "cuda":
        raise BackendUnavailable("cuda", reason)
    return BackendChoice("stub", f"auto: cuda unavailable ({reason})", stub.options, stub.devices)
