"""The hardware check's "sync_cpu" phase: the CPU time of a worker blocked in a synchronize.

    python3 tests/gpu/phase_sync_cpu.py [--quick] [--fake]      one JSON line (a child phase)
    tests/gpu/check_gpu.py                                      runs it as the phase "sync_cpu"

A worker waiting for its device work must sleep in the driver (a blocking sync), not spin a core:
on a host shared by many tenants' workers, a spinning wait costs a core per waiting worker. The
worker's own backend (:class:`worker.backends.cuda.CudaBackend`) in this process enqueues GEMMs
that keep the GPU busy for a while, then waits for them (``read``: the stream synchronised first);
the process's CPU time over that wait against its wall time. Then the same GEMMs one at a time
through the :class:`worker.device_time.DeviceGate` (events around each ~2 ms chunk, the charge read
after each): the worker's whole loop, CPU time against wall time. Rows:

    GEMMs right                                       check
    bare: CPU / wall while blocked in the sync        timing: <= 0.10 (~0: a blocking sync)
    through the gate: CPU / wall of the loop          timing: <= 0.25 (chunks, events, Python)

On the fake driver the device work runs on the CPU at the synchronize, so the ratios say nothing
there (the rows are measured and shown, MISS expected); the wiring and the GEMMs are checked.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.gpu.phase_kit import Result, TableRow, backend, phase_main, run_in_child as _run_in_child  # noqa: E402

__all__ = ["BARE_BOUND", "GATE_BOUND", "run", "run_in_child", "table_rows"]

BARE_BOUND = 0.10
GATE_BOUND = 0.25


def run(*, quick: bool = False, fake: bool = False) -> Result:
    """The phase's figures (see the module docstring)."""
    import numpy as np

    from shared.quota import QuotaBlock
    from worker.device_time import DeviceGate

    n = 64 if fake else 8192
    reps = 2 if fake else (10 if quick else 20)
    be = backend(fake)
    block = QuotaBlock.create("synccpu", name=f"twt-gpucheck{os.getpid()}-synccpu")
    try:
        a, b, c = (be.alloc(4 * n * n) for _ in range(3))
        be.fill_f32(a, 0.5, n * n)
        be.fill_f32(b, 0.25, n * n)
        be.matmul_f32(a, b, c, n, n, n)  # warm: cuBLAS handle, workspace
        be.read(c, 0, 4)
        t_enqueue = time.perf_counter()
        for _ in range(reps):
            be.matmul_f32(a, b, c, n, n, n)
        w0, c0 = time.perf_counter(), time.process_time()
        be.read(c, 0, 4)  # blocked here until the GEMMs are done
        bare_wall, bare_cpu = time.perf_counter() - w0, time.process_time() - c0
        enqueue_s = w0 - t_enqueue
        attached = QuotaBlock.attach(block.name, instance=0)
        gate = DeviceGate(attached, be)
        try:
            w0, c0 = time.perf_counter(), time.process_time()
            for _ in range(reps):
                gate.op("matmul_f32", be.matmul_f32, (a, b, c, n, n, n))
            gate_wall, gate_cpu = time.perf_counter() - w0, time.process_time() - c0
            chunks = gate.chunks
        finally:
            gate.close()
            attached.close()
        got = np.frombuffer(be.read(c, 0, 4 * n), dtype=np.float32)
        correct = bool(np.allclose(got, 0.125 * n, rtol=1e-4))
        for buf in (a, b, c):
            be.free(buf)
    finally:
        be.close()
        block.unlink()
        block.close()
    return {"n": n, "reps": reps, "correct": correct, "enqueue_s": enqueue_s, "bare_wall_s": bare_wall,
            "bare_cpu_s": bare_cpu, "gate_wall_s": gate_wall, "gate_cpu_s": gate_cpu, "gate_chunks": chunks}


def run_in_child(quick: bool = False, timeout_s: float = 300) -> Result:
    """This phase in a fresh process (on the fake when the check runs with ``--dry-run-fake``)."""
    return _run_in_child(__file__, "sync_cpu", quick=quick, timeout_s=timeout_s)


def table_rows(result: Result) -> list[TableRow]:
    """(name, got, want, ok, kind) rows (see the module docstring)."""
    if "error" in result:
        return [("sync_cpu: a worker blocked in a sync", str(result["error"])[:160], "run", False, "check")]
    rows: list[TableRow] = [(f"sync_cpu: {result['reps']} GEMMs {result['n']}^3 right", str(result["correct"]),
                             "True", result["correct"], "check")]
    bare = result["bare_cpu_s"] / max(result["bare_wall_s"], 1e-9)
    rows.append(("sync_cpu: bare, CPU / wall while blocked in the sync",
                 f"{bare:.3f} ({result['bare_cpu_s'] * 1e3:.1f} ms CPU in {result['bare_wall_s'] * 1e3:.1f} ms)",
                 f"<= {BARE_BOUND:g} (a blocking sync)", bare <= BARE_BOUND, "timing"))
    gate = result["gate_cpu_s"] / max(result["gate_wall_s"], 1e-9)
    rows.append(("sync_cpu: through the gate, CPU / wall of the GEMM loop",
                 f"{gate:.3f} ({result['gate_cpu_s'] * 1e3:.1f} ms CPU in {result['gate_wall_s'] * 1e3:.1f} ms, "
                 f"{result['gate_chunks']} chunks)", f"<= {GATE_BOUND:g}", gate <= GATE_BOUND, "timing"))
    return rows


if __name__ == "__main__":
    raise SystemExit(phase_main("sync_cpu", __doc__ or "", run))
