"""The hardware check's "settle" phase: queued cuda ops settled per flush against a synchronise per chunk.

    python3 tests/gpu/phase_settle.py [--quick] [--fake]      one JSON line (a child phase)
    tests/gpu/check_gpu.py                                    runs it as the phase "settle"

The worker's own backend and :class:`worker.device_time.DeviceGate` in this process, two ways over
the same ops: *synchronous* (``gate.op``: events around each chunk, ``cuEventSynchronize`` on its
end before the next - what a read or an op whose result the guest reads does) and *queued*
(``gate.submit``: the device thread launches each chunk between an event pair of its
``CudaStretchTimer`` and waits only at a flush - ~2 ms of estimated work, a full ring of 16 pairs,
or the stretch's end - polling ``cuEventQuery``, then ``cuEventElapsedTime`` per pair). Two
workloads: a small elementwise op (``scale_f32``: a few us of device work, where a synchronise per
op costs most) and a GEMM (``matmul_f32``, tens of us). Rows:

    queued ops right, charged, timed by the stretch timer; fewer settles than chunks     check
    settles per chunk (a settle per flush, not per chunk)        timing: <= 0.25
    wall per op, queued / synchronous (small op)                 timing: <= 0.5x
    wall per op, queued / synchronous (GEMM)                     timing: <= 1.0x
    charge per op, queued / synchronous (both: the GPU clock)    timing: 0.8-1.25x
    host time per submit (the guest's call returns)              timing: reported

With ``--fake`` the fake driver runs the device work on the CPU when a query or synchronize reaches
it and times it by the host's clock: the path, the counts and the results are proven, not the
figures (the timing rows are shown, MISS expected).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.gpu.phase_kit import (  # noqa: E402
    Result, TableRow, backend, phase_main, run_in_child as _run_in_child, timing_row)

__all__ = ["SETTLES_PER_CHUNK_BOUND", "run", "run_in_child", "table_rows"]

SETTLES_PER_CHUNK_BOUND = 0.25


def _measure(be: Any, block_name: str, name: str, args: tuple[Any, ...], reps: int, queued: bool) -> Result:
    """``reps`` of op ``name`` through a fresh gate, synchronous or queued: wall, CPU, charge, counts."""
    from shared.quota import QuotaBlock
    from worker.device_time import DeviceGate

    block = QuotaBlock.attach(block_name, instance=0)
    gate = DeviceGate(block, be)
    fn = getattr(be, name)
    until = time.monotonic_ns() + 120 * 10**9
    try:
        # warm: kernels, cuBLAS, the device thread and its ring of events, the cost model's first chunk
        (gate.submit if queued else gate.op)(name, fn, args, until)
        gate.sync(until)
        charged0 = block.gpu_time_ns
        chunks0 = gate.chunks
        timer = gate._qtimer
        settles0 = getattr(timer, "settles", 0)
        w0, c0 = time.perf_counter(), time.process_time()
        for _ in range(reps):
            (gate.submit if queued else gate.op)(name, fn, args, until)
        submitted = time.perf_counter() - w0
        gate.sync(until)
        wall, cpu = time.perf_counter() - w0, time.process_time() - c0
        timer = gate._qtimer
        return {"wall_s": wall, "cpu_s": cpu, "submit_s": submitted, "charged_s": (block.gpu_time_ns - charged0) / 1e9,
                "chunks": gate.chunks - chunks0, "settles": getattr(timer, "settles", 0) - settles0,
                "timer": type(timer).__name__ if queued else "CudaEventTimer"}
    finally:
        gate.close()
        block.close()


def run(*, quick: bool = False, fake: bool = False) -> Result:
    """The phase's figures (see the module docstring)."""
    import numpy as np

    from shared.quota import QuotaBlock

    n_small = 1024 if fake else 1 << 16
    n_gemm = 32 if fake else 512
    reps = 40 if fake else (500 if quick else 2000)
    be = backend(fake)
    owner = QuotaBlock.create("settle", name=f"twt-gpucheck{os.getpid()}-settle")
    out: Result = {"n_small": n_small, "n_gemm": n_gemm, "reps": reps}
    try:
        x = be.alloc(4 * n_small)
        be.write(x, 0, memoryview(np.ones(n_small, np.float32).tobytes()))
        a, b, c = (be.alloc(4 * n_gemm * n_gemm) for _ in range(3))
        for buf, value in ((a, 0.5), (b, 0.25)):
            be.write(buf, 0, memoryview(np.full(n_gemm * n_gemm, value, np.float32).tobytes()))
        for label, name, args in (("small", "scale_f32", (x, 1.0, n_small)),
                                  ("gemm", "matmul_f32", (a, b, c, n_gemm, n_gemm, n_gemm))):
            out[label] = {mode: _measure(be, owner.name, name, args, reps, mode == "queued")
                          for mode in ("sync", "queued")}
        small = np.frombuffer(be.read(x, 0, 4 * n_small), np.float32)
        gemm = np.frombuffer(be.read(c, 0, 4 * n_gemm * n_gemm), np.float32)
        out["correct"] = bool((small == 1.0).all() and np.allclose(gemm, 0.125 * n_gemm, rtol=1e-4))
        for buf in (x, a, b, c):
            be.free(buf)
    finally:
        be.close()
        owner.unlink()
        owner.close()
    return out


def run_in_child(quick: bool = False, timeout_s: float = 300) -> Result:
    """This phase in a fresh process (on the fake when the check runs with ``--dry-run-fake``)."""
    return _run_in_child(__file__, "settle", quick=quick, timeout_s=timeout_s)


def table_rows(result: Result) -> list[TableRow]:
    """(name, got, want, ok, kind) rows (see the module docstring)."""
    if "error" in result:
        return [("settle: queued ops settled per flush", str(result["error"])[:160], "run", False, "check")]
    small, gemm = result["small"], result["gemm"]
    charged = all(w["queued"]["charged_s"] > 0 and w["queued"]["timer"] == "CudaStretchTimer"
                  and 0 < w["queued"]["settles"] < w["queued"]["chunks"] for w in (small, gemm))
    rows: list[TableRow] = [(f"settle: {result['reps']} queued ops each way right, charged, fewer settles than chunks",
                             f"{result['correct']}, {charged}", "True, True", result["correct"] and charged, "check")]
    q = small["queued"]
    per_chunk = q["settles"] / max(1, q["chunks"])
    # how often the queue runs dry (a settle at each stretch's end) depends on the host: a figure
    rows.append(timing_row("settle: settles per queued chunk (small op)", per_chunk, "",
                           f"<= {SETTLES_PER_CHUNK_BOUND:g} (per flush)", lambda v: v <= SETTLES_PER_CHUNK_BOUND,
                           f"{q['settles']} / {q['chunks']}"))
    for label, work, bound in (("small op", small, 0.5), ("GEMM", gemm, 1.0)):
        ratio = work["queued"]["wall_s"] / max(work["sync"]["wall_s"], 1e-9)
        per_op = work["queued"]["wall_s"] / result["reps"] * 1e6, work["sync"]["wall_s"] / result["reps"] * 1e6
        rows.append(timing_row(f"settle: wall per op, queued / synchronous ({label})", ratio, "x", f"<= {bound:g}x",
                               lambda v, b=bound: v <= b, f"{per_op[0]:.1f} vs {per_op[1]:.1f} us"))
        charge = work["queued"]["charged_s"] / max(work["sync"]["charged_s"], 1e-12)
        rows.append(timing_row(f"settle: charge per op, queued / synchronous ({label})", charge, "x", "0.8-1.25x",
                               lambda v: 0.8 <= v <= 1.25))
    submit_us = small["queued"]["submit_s"] / result["reps"] * 1e6
    rows.append(timing_row("settle: host time per submit (small op)", submit_us, "us", "reported", lambda v: True))
    return rows


if __name__ == "__main__":
    raise SystemExit(phase_main("settle", __doc__ or "", run))
