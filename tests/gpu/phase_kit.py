"""What the hardware check's phase scripts share: a backend, a supervisor, the child's entry, the rows.

A phase script (``phase_*.py``) runs in a fresh process (the orchestrator never initialises CUDA),
prints its figures as one JSON line, and gives the orchestrator rows through its ``table_rows``:
``(name, got, want, ok, kind)``, where ``kind`` is "check" (decides the exit code) or "timing"
(a measured figure against its stated bound: PASS/MISS, never deciding it). ``ok`` None: not
measurable here (the fake driver, a host without the feature) - the row still says why.

Sizes: ``Sizes.of(quick, fake)`` picks the hardware size, the quick one, or the fake driver's tiny
one (the dry run in the test suite: the wiring, in a fraction of a second of device work).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeAlias

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

__all__ = ["MiB", "Result", "TableRow", "backend", "is_fake", "meminfo", "p99", "phase_main", "run_in_child",
           "start_together", "supervisor", "tenant_context", "timing_row"]

MiB = 1 << 20
Result: TypeAlias = dict[str, Any]
#: (name, got, want, ok, kind) - see the module docstring
TableRow: TypeAlias = tuple[str, str, str, "bool | None", str]


#: what every tenant process of a phase imports: loaded once by the forkserver (see :func:`tenant_context`)
_PRELOAD = ["numpy", "shared.gpu_time", "shared.quota", "worker.device_time", "worker.backends.cuda",
            "tests.helpers.fake_cuda", "tests.helpers.fake_cublas"]


def tenant_context() -> Any:
    """The multiprocessing context for a phase's tenant processes: a forkserver that imported the
    worker's modules once (numpy, the cuda backend, the fakes) and forks each tenant from there.

    Each tenant still gets a process of its own with its own CUDA context (the forkserver never
    initialises CUDA: importing ``cuda.bindings`` does not, and a fork before ``cuInit`` is safe),
    without paying the imports again - a third of a second of CPU per process, a dozen processes a
    phase."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def is_fake() -> bool:
    """True when this process runs the check on the fake driver (``check_gpu.py --dry-run-fake``)."""
    return os.environ.get("GPU_CHECK_DRIVER_MODULE") == "tests.helpers.fake_cuda"


def backend(fake: bool, *, memory_bytes: int = 1 << 30) -> Any:
    """A worker's cuda backend on device 0 in this process: the fake driver and fake cuBLAS, or the real ones."""
    from worker.backends.cuda import CudaBackend

    if fake:
        from tests.helpers.fake_cublas import FakeCublas
        from tests.helpers.fake_cuda import FakeDriver

        drv = FakeDriver(memory_bytes=memory_bytes)
        return CudaBackend(0, driver=drv, nvrtc=drv, cublas=FakeCublas(drv))
    return CudaBackend(0)


@contextmanager
def supervisor(extra: dict[str, Any] | None = None) -> Iterator[Any]:
    """A real supervisor on the cuda backend (the fake one under ``--dry-run-fake``: the orchestrator
    puts ``TWT_CUDA_*_MODULE`` in the environment every child inherits)."""
    from supervisor.client.launch import launch

    # a generous heartbeat: these phases measure shares and waits, not how fast a dead worker is seen,
    # and eight workers starting at once on a loaded CI host must not be killed as silent
    settings = {"backend": "cuda", "pool_size": 0, "heartbeat_interval_s": 2.0, "heartbeat_liveness": 10,
                **(extra or {})}
    with launch({"supervisor": settings}) as sup:
        yield sup


def meminfo(timeout_s: float = 60) -> Result:
    """``cuMemGetInfo`` from a fresh process (``check_gpu.py --child meminfo``): {"free", "total"} or {"error"}."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    try:
        proc = subprocess.run([sys.executable, str(ROOT / "tests" / "gpu" / "check_gpu.py"), "--child", "meminfo"],
                              capture_output=True, text=True, timeout=timeout_s, env=env, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"error": f"meminfo did not finish within {timeout_s:.0f} s"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode or not lines:
        return {"error": f"meminfo exit {proc.returncode}: {(proc.stderr or proc.stdout).strip()[-200:]}"}
    result: Result = json.loads(lines[-1])
    return result


def p99(values: list[float]) -> float:
    """The 99th percentile (nearest rank); inf for no values (a bound it can never meet)."""
    ordered = sorted(values)
    return float(ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]) if ordered else float("inf")


def timing_row(name: str, value: float | None, unit: str, want: str, ok: Callable[[float], bool],
               note: str = "") -> TableRow:
    """A measured figure against its bound; ``value`` None: not measured (the row says so)."""
    if value is None:
        return (name, note or "not measured", want, None, "timing")
    return (name, f"{value:.3g} {unit}".rstrip() + (f" ({note})" if note else ""), want, ok(value), "timing")


def start_together(start: Any, timeout_s: float = 180) -> None:
    """The phase's side of a start barrier its tenant processes wait on (``multiprocessing.Barrier``):
    a tenant that failed before it broke it (its error comes through the results queue), so a broken
    barrier is not an error here."""
    import threading

    try:
        start.wait(timeout=timeout_s)
    except threading.BrokenBarrierError:
        pass


def run_in_child(script: str, phase: str, *, quick: bool, timeout_s: float) -> Result:
    """``script`` in a fresh process (``--fake`` when the check runs on the fake driver); its JSON line."""
    from tests.gpu.phase_child import last_json_line, run_phase_script

    proc = run_phase_script(script, quick=quick, fake_flag="--fake", timeout_s=timeout_s)
    return last_json_line(phase, proc, timeout_s)


def phase_main(phase: str, doc: str, run: Callable[..., Result], argv: list[str] | None = None) -> int:
    """A phase script's entry: ``[--quick] [--fake]``, one JSON line either way (an error is a result)."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="shorter rounds, smaller sizes")
    parser.add_argument("--fake", action="store_true", help="the fake driver and cuBLAS: no GPU")
    args = parser.parse_args(argv)
    try:
        result = run(quick=args.quick, fake=args.fake)
    except Exception as exc:  # noqa: BLE001 - one JSON line either way
        print(json.dumps({"phase": phase, "error": f"{type(exc).__name__}: {exc}"}))
        return 1
    print(json.dumps({"phase": phase, **result}))
    return 0
