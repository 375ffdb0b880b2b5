"""The hardware check's "share" phase: GPU-time shares between CUDA contexts of separate processes.

    python3 tests/gpu/phase_share.py [--quick] [--fake]      one JSON line (a child phase)
    tests/gpu/check_gpu.py                                   runs it as the phase "share"

What a tenant's GEMM loop does on the cuda backend, without the supervisor
and the WASM host around it (``twt bench share`` measures the whole path on
the stub): one :class:`shared.gpu_time.GpuTimeBoard` for device 0, and one
spawned process per tenant, each with its own context, stream and pool
(:class:`worker.backends.cuda.CudaBackend`), running ``C = A @ B`` through
cuBLAS in a loop via :class:`worker.device_time.DeviceGate` - the device
lease, CUDA events around each chunk on its stream, ~2 ms row blocks - for
a fixed time after a common start. Rows:

    7:3          two processes, weights 7 and 3: accounted device time (events) and GEMMs done
                 per tenant, shares of the weight-7 one (target 70 % +- 3 points)
    cap          one process with gpu_time_cap 0.25: accounted device time per wall second
                 (target 25 % +- 3 points)
    overhead     one process alone: GEMMs/s through the gate (lease + events + chunks) with the
                 scheduler on vs off (target >= 0.98x), and vs a bare cuBLAS loop with one
                 synchronize per GEMM (informative: what chunking and events cost)

That the GEMMs are right (C checked against the known product) and that
both tenants of the 7:3 row did work are checks; the shares and ratios are
timings. With ``--fake`` (``check_gpu.py --dry-run-fake``) every process uses
the fake driver and fake cuBLAS: it proves the wiring, not the hardware.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

__all__ = ["run", "run_in_child", "table_rows"]



def _context() -> Any:
    from tests.gpu.phase_kit import tenant_context

    return tenant_context()




def _backend(fake: bool) -> Any:
    from worker.backends.cuda import CudaBackend

    if fake:
        from tests.helpers.fake_cublas import FakeCublas
        from tests.helpers.fake_cuda import FakeDriver

        drv = FakeDriver(memory_bytes=1 << 30)
        return CudaBackend(0, driver=drv, nvrtc=drv, cublas=FakeCublas(drv))
    return CudaBackend(0)


def _tenant(index: int, board_name: str | None, slot: int | None, block_name: str, n: int, start: Any,
            seconds: float, fake: bool, raw: bool, out: Any) -> None:
    """One tenant's process: GEMM loop for ``seconds`` once every tenant passed ``start`` (a barrier); puts its figures."""
    import numpy as np

    from shared.gpu_time import GpuTimeBoard
    from shared.quota import QuotaBlock
    from worker.device_time import DeviceGate

    try:
        backend = _backend(fake)
        block = QuotaBlock.attach(block_name, instance=0)
        board = GpuTimeBoard.attach(board_name, tenant_slot=slot) if board_name is not None else None
        gate = DeviceGate(block, backend, board)
        try:
            bufs = [backend.alloc(4 * n * n) for _ in range(3)]
            backend.fill_f32(bufs[0], 0.5, n * n)
            backend.fill_f32(bufs[1], 0.25, n * n)
            args = (bufs[0], bufs[1], bufs[2], n, n, n)
            drv, stream = backend._drv, backend._stream

            def bare() -> None:
                backend.matmul_f32(*args)
                drv.call("cuStreamSynchronize", stream)

            gate.op("matmul_f32", backend.matmul_f32, args)  # warm: cuBLAS handle, events, the rate estimate
            gate.release()
            if start is not None:  # every process past its CUDA start-up: all begin together
                start.wait(timeout=120)
            ns0 = block.gpu_time_ns  # the warm-up's time is not the loop's
            done, t0 = 0, time.monotonic()
            end = t0 + seconds
            while time.monotonic() < end:
                if raw:
                    bare()
                else:
                    gate.op("matmul_f32", backend.matmul_f32, args)
                done += 1
            elapsed = time.monotonic() - t0
            gate.release()
            got = np.frombuffer(backend.read(bufs[2], 0, 4 * n), dtype=np.float32)
            correct = bool(np.allclose(got, 0.125 * n, rtol=1e-4))
            for b in bufs:
                backend.free(b)
            out.put({"index": index, "gemms": done, "seconds": elapsed, "correct": correct, "device_ns": block.gpu_time_ns - ns0,
                     "chunks": gate.chunks})
        finally:
            gate.close()
            block.close()
            backend.close()
    except Exception as exc:  # noqa: BLE001 - one result either way
        if start is not None:
            start.abort()  # the others (and the phase) stop waiting for this one
        out.put({"index": index, "error": f"{type(exc).__name__}: {exc}"})


def _round(tenants: list[tuple[float, float | None]], *, n: int, seconds: float, fake: bool,
           scheduler: bool = True, raw: bool = False, quantum_s: float = 0.01) -> dict[str, Any]:
    """Processes for (weight, cap) tenants on one board, started together; their figures."""
    from shared.gpu_time import GpuTimeBoard
    from shared.quota import QuotaBlock
    from tests.gpu.phase_kit import start_together

    prefix = f"twt-gpucheck{os.getpid()}-share"
    board = GpuTimeBoard.create(0, quantum_s=quantum_s, scheduler=scheduler, name=f"{prefix}-gt")
    blocks = [QuotaBlock.create(f"share{i}", name=f"{prefix}-{i}") for i in range(len(tenants))]
    out = _context().Queue()
    try:
        slots = [board.add_tenant(w, c) for w, c in tenants]
        start = _context().Barrier(len(tenants) + 1)  # every process past its CUDA start-up, then all at once
        procs = [_context().Process(target=_tenant, args=(i, None if raw else board.name, slot, block.name, n,
                                                      start, seconds, fake, raw, out))
                 for i, (slot, block) in enumerate(zip(slots, blocks))]
        for p in procs:
            p.start()
        start_together(start)
        results = [out.get(timeout=seconds + 120) for _ in procs]
        for p in procs:
            p.join(30)
        errors = [r["error"] for r in results if "error" in r]
        if errors:
            return {"error": "; ".join(errors)}
        snap = board.snapshot()
        ordered = sorted(results, key=lambda r: int(r["index"]))
        return {"tenants": ordered, "handoffs": snap.handoffs, "steals": snap.steals, "grants": snap.grants}
    finally:
        for b in blocks:
            b.unlink()
            b.close()
        board.unlink()
        board.close()


def run(*, quick: bool = False, fake: bool = False) -> dict[str, Any]:
    """The phase's figures (see the module docstring)."""
    n = 64 if fake else 4096
    # on the fake (the wiring: correct GEMMs, both tenants served) a short busy loop per round
    seconds = 0.15 if fake else (3.0 if quick else 6.0)
    out: dict[str, Any] = {"n": n, "seconds": seconds}
    out["split"] = _round([(7.0, None), (3.0, None)], n=n, seconds=seconds, fake=fake)
    out["cap"] = _round([(1.0, 0.25)], n=n, seconds=seconds, fake=fake)
    out["solo_on"] = _round([(7.0, None)], n=n, seconds=seconds / 2, fake=fake)
    out["solo_off"] = _round([(7.0, None)], n=n, seconds=seconds / 2, fake=fake, scheduler=False)
    out["bare"] = _round([(1.0, None)], n=n, seconds=seconds / 2, fake=fake, raw=True)
    return out


def run_in_child(quick: bool = False, timeout_s: float = 300) -> dict[str, Any]:
    """This phase in a fresh process (on the fake when the check runs with ``--dry-run-fake``)."""
    from tests.gpu.phase_child import last_json_line, run_phase_script

    proc = run_phase_script(__file__, quick=quick, fake_flag="--fake", timeout_s=timeout_s)
    return last_json_line("share", proc, timeout_s)


def _rate(r: dict[str, Any]) -> float:
    return float(r["gemms"]) / max(float(r["seconds"]), 1e-9)


def table_rows(result: dict[str, Any]) -> list[tuple[str, str, str, bool | None, str]]:
    """(name, got, want, ok, kind) rows: correctness and "both worked" are checks, shares are timings."""
    if "error" in result:
        return [("share: GEMM loops under the GPU-time lease", result["error"][:160], "run", False, "check")]
    rows: list[tuple[str, str, str, bool | None, str]] = []
    rounds = {k: result.get(k, {}) for k in ("split", "cap", "solo_on", "solo_off", "bare")}
    failed = {k: v["error"] for k, v in rounds.items() if "error" in v}
    if failed:
        return [("share: GEMM loops under the GPU-time lease", "; ".join(f"{k}: {v}" for k, v in failed.items())[:160],
                 "run", False, "check")]
    everyone = [t for v in rounds.values() for t in v["tenants"]]
    correct = all(t["correct"] for t in everyone)
    rows.append(("share: every GEMM under the lease equals A @ B", str(correct), "True", correct, "check"))
    a, b = rounds["split"]["tenants"]
    both = a["gemms"] > 0 and b["gemms"] > 0
    rows.append(("share 7:3: both tenants did work", f"{a['gemms']} and {b['gemms']} GEMMs", "both > 0", both,
                 "check"))
    time_share = a["device_ns"] / max(a["device_ns"] + b["device_ns"], 1)
    work_share = a["gemms"] / max(a["gemms"] + b["gemms"], 1)
    for what, share in (("accounted time (CUDA events)", time_share), ("work (GEMMs)", work_share)):
        rows.append((f"share 7:3: weight 7's {what}", f"{share:.1%} ({rounds['split']['handoffs']} handoffs)",
                     "70% +- 3 points", abs(share - 0.7) <= 0.03, "timing"))
    cap = rounds["cap"]["tenants"][0]
    cap_share = cap["device_ns"] / 1e9 / cap["seconds"]
    rows.append(("share: gpu_time_cap 0.25 alone, device time per second", f"{cap_share:.1%}", "25% +- 3 points",
                 abs(cap_share - 0.25) <= 0.03, "timing"))
    on, off, bare = (_rate(rounds[k]["tenants"][0]) for k in ("solo_on", "solo_off", "bare"))
    rows.append(("share: alone, scheduler on vs off (GEMMs/s)", f"{on / off:.2f}x ({on:.0f} vs {off:.0f})",
                 ">= 0.98x", on / off >= 0.98, "timing"))
    rows.append(("share: alone through the gate vs bare cuBLAS + sync (GEMMs/s)",
                 f"{on / bare:.2f}x ({on:.0f} vs {bare:.0f}; {rounds['solo_on']['tenants'][0]['chunks']} chunks)",
                 "informative", None, "timing"))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 s rounds instead of 6")
    parser.add_argument("--fake", action="store_true", help="the fake driver and cuBLAS: no GPU")
    args = parser.parse_args(argv)
    try:
        result = run(quick=args.quick, fake=args.fake)
    except Exception as exc:  # noqa: BLE001 - one JSON line either way
        print(json.dumps({"phase": "share", "error": f"{type(exc).__name__}: {exc}"}))
        return 1
    print(json.dumps({"phase": "share", **result}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
