"""The hardware check's "mix" phase: GPU-time shares between tenants that differ, on real contexts.

    python3 tests/gpu/phase_mix.py [--quick] [--fake]      one JSON line (a child phase)
    tests/gpu/check_gpu.py                                 runs it as the phase "mix"

Like ``phase_share.py``: one :class:`shared.gpu_time.GpuTimeBoard` for device 0 and one spawned
process per tenant instance, each with its own context, stream and pool, every op through
:class:`worker.device_time.DeviceGate` (the lease, CUDA events, chunks). Rounds:

    heavy+chatty  a heavy tenant (cuBLAS GEMM loop) beside a chatty one (a 64-float fill, then
                  ``gap`` of host work, in a loop) at 1:1, against a control whose chatty loop makes
                  no device op: the heavy tenant's GEMMs/s vs the control's (target >= 0.9x), the
                  chatty op's wait for the device p99 (target <= 1 quantum), at 0.1 / 0.3 / 1 ms gaps
    k instances   3 processes of one tenant against 1 of another at 1:1: event time by tenant (50/50)
    kill          the lease holder SIGKILLed mid-chunk (a long GEMM): the board owner reclaims its
                  lease, the waiting tenant's next op runs (check) and how long that took (timing);
                  the time charged before the kill is kept (check), the chunk in flight is charged
                  (timing: at least the time it was seen busy)
    longest hold  the longest single chunk (events) of a huge transpose and of a skinny GEMM right
                  after square ones (target <= 2x the 2 ms chunk target, both)
    spin          a kernel spinning a known number of SM clock cycles (``clock64``) against the
                  events' charge for it (hardware only: the fake driver has no such kernel)

Correct results and "everyone did work" are checks; shares, waits and ratios are timings. With
``--fake`` (``check_gpu.py --dry-run-fake``) every process uses the fake driver and fake cuBLAS:
it proves the wiring, not the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
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


QUANTUM_S = 0.01
CHUNK_S = 0.002


def _backend(fake: bool) -> Any:
    from worker.backends.cuda import CudaBackend

    if fake:
        from tests.helpers.fake_cublas import FakeCublas
        from tests.helpers.fake_cuda import FakeDriver

        drv = FakeDriver(memory_bytes=1 << 30)
        return CudaBackend(0, driver=drv, nvrtc=drv, cublas=FakeCublas(drv))
    return CudaBackend(0)


def _spin(seconds: float) -> None:
    """Host work: a busy loop (a guest computing between its ops), not a sleep."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _tenant(role: str, index: int, board_name: str | None, slot: int | None, block_name: str, n: int, start: Any,
            seconds: float, fake: bool, opts: dict[str, Any], out: Any) -> None:
    """One tenant instance's process; puts its figures. ``role``: heavy, chatty, control (the chatty
    loop without its device op), gemm (a plain GEMM loop), holder (one endless long op: killed),
    foreign (a GEMM loop of another program on the GPU: no board, ``board_name`` None)."""
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
            small = backend.alloc(4 * 64)
            backend.fill_f32(bufs[0], 0.5, n * n)
            backend.fill_f32(bufs[1], 0.25, n * n)
            gemm = (bufs[0], bufs[1], bufs[2], n, n, n)
            gate.op("matmul_f32", backend.matmul_f32, gemm)  # warm: cuBLAS handle, events, the cost model
            gate.op("fill_f32", backend.fill_f32, (small, 1.0, 64))
            gate.release()
            if start is not None:  # every process past its CUDA start-up: all begin together
                start.wait(timeout=120)
            ns0 = block.gpu_time_ns
            done, waits, t0 = 0, [], time.monotonic()
            end = t0 + seconds
            gap = float(opts.get("gap_s", 0.0))
            if role == "holder":
                out.put({"index": index, "role": role, "pid": os.getpid(), "ready": True})
                while True:  # killed mid-chunk by the phase
                    gate.op("matmul_f32", backend.matmul_f32, gemm)
            while time.monotonic() < end:
                if role in ("heavy", "gemm"):
                    gate.op("matmul_f32", backend.matmul_f32, gemm)
                elif role == "foreign":  # no lease: a process the supervisor does not know
                    backend.matmul_f32(*gemm)
                    backend.read(bufs[2], 0, 4)  # waits for the stream
                elif role == "chatty":
                    w0 = gate.run_wait_ns
                    gate.op("fill_f32", backend.fill_f32, (small, 1.0, 64))
                    waits.append(gate.run_wait_ns - w0)
                    _spin(gap)
                else:  # control: the same host work, no device op
                    _spin(gap)
                done += 1
            elapsed = time.monotonic() - t0
            gate.release()
            got = np.frombuffer(backend.read(bufs[2], 0, 4 * n), dtype=np.float32)
            correct = role not in ("heavy", "gemm", "foreign") or bool(np.allclose(got, 0.125 * n, rtol=1e-4))
            for b in (*bufs, small):
                backend.free(b)
            out.put({"index": index, "role": role, "ops": done, "seconds": elapsed, "correct": correct,
                     "device_ns": block.gpu_time_ns - ns0, "chunks": gate.chunks, "waits_ns": waits})
        finally:
            gate.close()
            block.close()
            backend.close()
    except Exception as exc:  # noqa: BLE001 - one result either way
        if start is not None:
            start.abort()  # the others (and the phase) stop waiting for this one
        out.put({"index": index, "role": role, "error": f"{type(exc).__name__}: {exc}"})


def _round(tenants: list[tuple[str, str]], *, n: int, seconds: float, fake: bool,
           opts: dict[str, Any] | None = None) -> dict[str, Any]:
    """Processes for ``(role, tenant)`` pairs (one tenant slot per distinct tenant, weight 1) on one
    board, started together; their figures and the board's counters. Tenant "": a foreign process
    on the same GPU that is not on the board (its ops go through no lease)."""
    from shared.gpu_time import GpuTimeBoard
    from tests.gpu.phase_kit import start_together
    from shared.quota import QuotaBlock

    prefix = f"twt-gpucheck{os.getpid()}-mix"
    board = GpuTimeBoard.create(0, quantum_s=QUANTUM_S, name=f"{prefix}-gt")
    names = sorted({t for _, t in tenants})
    blocks = {t: QuotaBlock.create(f"mix{t}", name=f"{prefix}-{t}") for t in names}
    out = _context().Queue()
    try:
        slots = {t: board.add_tenant(1.0) for t in names if t}  # tenant "": a foreign process, not on the board
        start = _context().Barrier(len(tenants) + 1)  # every process past its CUDA start-up, then all at once
        procs = [_context().Process(target=_tenant, args=(role, i, board.name if t else None, slots.get(t), blocks[t].name,
                                                      n, start, seconds, fake, opts or {}, out))
                 for i, (role, t) in enumerate(tenants)]
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
        for r, (_, t) in zip(ordered, tenants):
            r["tenant"] = t
        return {"tenants": ordered, "handoffs": snap.handoffs, "steals": snap.steals, "grants": snap.grants}
    finally:
        for b in blocks.values():
            b.unlink()
            b.close()
        board.unlink()
        board.close()


#: kill rounds tried until one kills the holder while it holds the device (see _kill_round)
KILL_TRIES = 5


def _kill_round(*, n: int, fake: bool) -> dict[str, Any]:
    """The holder SIGKILLed mid-chunk while another tenant waits: reclaimed, the waiter's op runs.

    The waiter's want makes the holder hand the device over at its op's end, and on the fake an op is
    a few microseconds: a checker descheduled between seeing the holder busy and the kill (a loaded
    host) kills a holder that already gave the device away - the scenario did not happen, nothing
    failed. So a round that did not kill a holder holding the device is tried again (at most
    :data:`KILL_TRIES`); the answer says how many rounds it took.
    """
    result: dict[str, Any] = {}
    for tries in range(1, KILL_TRIES + 1):
        result = _kill_once(n=n, fake=fake)
        result["tries"] = tries
        if "error" in result or result.get("held"):
            break
    return result


def _kill_once(*, n: int, fake: bool) -> dict[str, Any]:
    """One round of :func:`_kill_round`."""
    from shared.gpu_time import GpuTimeBoard
    from shared.quota import QuotaBlock

    prefix = f"twt-gpucheck{os.getpid()}-kill"
    board = GpuTimeBoard.create(0, quantum_s=QUANTUM_S, name=f"{prefix}-gt")
    blocks = [QuotaBlock.create(f"kill{i}", name=f"{prefix}-{i}") for i in range(2)]
    out = _context().Queue()
    proc = None
    try:
        slots = [board.add_tenant(1.0) for _ in range(2)]
        proc = _context().Process(target=_tenant, args=("holder", 0, board.name, slots[0], blocks[0].name, n,
                                                    None, 0.0, fake, {}, out))
        proc.start()
        ready = out.get(timeout=120)
        if "error" in ready:
            return {"error": ready["error"]}
        deadline = time.monotonic() + 60
        while not ((snap := board.snapshot()).busy and snap.holder_pid == ready["pid"]):
            if time.monotonic() > deadline:
                return {"error": "the holder never held the device busy"}
            time.sleep(0.0005)
        busy_since = time.monotonic_ns()  # the chunk began no later than this
        waiter = GpuTimeBoard.attach(board.name, tenant_slot=slots[1])
        try:
            waiter.want(time.monotonic_ns())
            used_before = int(board.snapshot().tenants[slots[0]]["used_ns"] or 0)
            block_before = blocks[0].gpu_time_ns
            killed_at = time.monotonic_ns()
            os.kill(ready["pid"], signal.SIGKILL)  # mid-chunk: the owner word says busy
            proc.join(30)
            t0 = time.monotonic()
            reclaimed = board.reclaim_dead()
            got = waiter.acquire(time.monotonic_ns() + 10**10)
            took = time.monotonic() - t0
            waiter.finish(0)
            snap = board.snapshot()
            used_after = int(snap.tenants[slots[0]]["used_ns"] or 0) if slots[0] in snap.tenants else None
            return {"reclaimed": [list(r) for r in reclaimed], "held": any(r[2] for r in reclaimed),
                    "waiter_got_it_s": took, "waited_ns": got,
                    # charges made before the kill are kept; the killed chunk's own time (at least
                    # killed_at - busy_since of device work) should be charged to its tenant too
                    "used_before_ns": used_before, "used_after_ns": used_after,
                    "block_before_ns": block_before, "block_after_ns": blocks[0].gpu_time_ns,
                    "in_flight_seen_ns": killed_at - busy_since}
        finally:
            waiter.close()
    finally:
        if proc is not None and proc.is_alive():
            proc.kill()
            proc.join(10)
        for b in blocks:
            b.unlink()
            b.close()
        board.unlink()
        board.close()


def _longest_hold(*, n: int, fake: bool) -> dict[str, Any]:
    """Every chunk's event time of a huge transpose, and of a skinny GEMM after square ones."""
    import numpy as np

    from shared.quota import QuotaBlock
    from worker.device_time import DeviceGate

    block = QuotaBlock.create("hold", name=f"twt-gpucheck{os.getpid()}-hold")
    backend = _backend(fake)
    chunks: list[int] = []
    try:
        gate = DeviceGate(QuotaBlock.attach(block.name, instance=0), backend)
        timer = gate._timer_()
        real = timer.time

        def timed(fn: Any, *args: Any) -> int:
            ns = real(fn, *args)
            chunks.append(ns)
            return ns

        timer.time = timed  # type: ignore[method-assign]
        rows, cols = (256, 256) if fake else (16384, 16384)
        x = backend.alloc(4 * rows * cols)
        t = backend.alloc(4 * rows * cols)
        backend.fill_f32(x, 1.0, rows * cols)
        chunks.clear()
        gate.op("transpose_f32", backend.transpose_f32, (x, t, rows, cols))
        transpose = list(chunks)
        backend.free(x)
        backend.free(t)
        sq = 64 if fake else 4096
        a, b, c = (backend.alloc(4 * sq * sq) for _ in range(3))
        for buf in (a, b):
            backend.fill_f32(buf, 0.5, sq * sq)
        for _ in range(3):
            gate.op("matmul_f32", backend.matmul_f32, (a, b, c, sq, sq, sq))
        for buf in (a, b, c):
            backend.free(buf)
        m, k = (4096, 8) if fake else (1 << 22, 16)
        a, b, c = backend.alloc(4 * m * k), backend.alloc(4 * k * k), backend.alloc(4 * m * k)
        backend.fill_f32(a, 1.0, m * k)
        backend.fill_f32(b, 1.0, k * k)
        chunks.clear()
        gate.op("matmul_f32", backend.matmul_f32, (a, b, c, m, k, k))
        skinny = list(chunks)
        got = np.frombuffer(backend.read(c, 0, 4 * k), dtype=np.float32)
        correct = bool(np.allclose(got, float(k)))
        for buf in (a, b, c):
            backend.free(buf)
        gate.close()
        return {"transpose": {"rows": rows, "cols": cols, "chunks": len(transpose), "longest_ns": max(transpose)},
                "skinny_after_square": {"m": m, "k": k, "chunks": len(skinny), "first_ns": skinny[0],
                                        "longest_ns": max(skinny), "correct": correct}}
    finally:
        backend.close()
        block.unlink()
        block.close()


_SPIN_SRC = r"""
extern "C" __global__ void twt_spin(long long cycles, long long* out) {
    long long t0 = clock64();
    while (clock64() - t0 < cycles) { }
    if (threadIdx.x == 0 && blockIdx.x == 0) out[0] = clock64() - t0;
}
"""


def _spin_kernel(*, fake: bool) -> dict[str, Any]:
    """A kernel spinning a known number of SM cycles, charged through the gate's events."""
    if fake:
        return {"skipped": "the fake driver has no clock64 kernel: hardware only"}
    import ctypes

    from shared.quota import QuotaBlock
    from worker.device_time import DeviceGate

    block = QuotaBlock.create("spin", name=f"twt-gpucheck{os.getpid()}-spin")
    backend = _backend(False)
    try:
        from cuda.bindings import driver as cu, nvrtc  # type: ignore[import-not-found]

        backend.fill_f32(backend.alloc(4), 0.0, 1)  # the context, the stream
        drv = backend._drv
        err, prog = nvrtc.nvrtcCreateProgram(_SPIN_SRC.encode(), b"spin.cu", 0, [], [])
        major = drv.call("cuDeviceGetAttribute",
                         cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, backend._dev)
        minor = drv.call("cuDeviceGetAttribute",
                         cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, backend._dev)
        nvrtc.nvrtcCompileProgram(prog, 1, [f"--gpu-architecture=sm_{major}{minor}".encode()])
        _, size = nvrtc.nvrtcGetCUBINSize(prog)
        cubin = b" " * size
        nvrtc.nvrtcGetCUBIN(prog, cubin)
        module = drv.call("cuModuleLoadData", cubin)
        fn = drv.call("cuModuleGetFunction", module, b"twt_spin")
        clock_khz = drv.call("cuDeviceGetAttribute", cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_CLOCK_RATE,
                             backend._dev)
        out = backend.alloc(8)
        gate = DeviceGate(QuotaBlock.attach(block.name, instance=0), backend)
        target_ms = 5.0
        cycles = int(target_ms * clock_khz)
        c_cycles = ctypes.c_longlong(cycles)
        c_out = ctypes.c_void_p(int(out.ptr))
        params = (ctypes.c_void_p * 2)(ctypes.addressof(c_cycles), ctypes.addressof(c_out))

        def launch() -> None:
            drv.call("cuLaunchKernel", fn, 1, 1, 1, 32, 1, 1, 0, backend._stream, ctypes.addressof(params), 0)

        charges = []
        for _ in range(5):
            before = gate.run_time_ns
            gate.op("twt_spin", launch, ())
            charges.append(gate.run_time_ns - before)
        spun = int.from_bytes(backend.read(out, 0, 8), "little")
        gate.close()
        return {"target_ms": target_ms, "clock_khz": clock_khz, "cycles_spun": spun,
                "spun_ms": spun / clock_khz, "charged_ms": [c / 1e6 for c in charges], "err": int(err)}
    except Exception as exc:  # noqa: BLE001 - reported as the row's result
        return {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        backend.close()
        block.unlink()
        block.close()


def run(*, quick: bool = False, fake: bool = False) -> dict[str, Any]:
    """The phase's figures (see the module docstring)."""
    n = 64 if fake else 4096
    seconds = 0.15 if fake else (1.5 if quick else 3.0)  # the fake: the wiring, not the figures
    out: dict[str, Any] = {"n": n, "seconds": seconds, "quantum_s": QUANTUM_S, "gaps": {}}
    for gap_ms in ((0.3,) if fake else (0.1, 1.0) if quick else (0.1, 0.3, 1.0)):
        opts = {"gap_s": gap_ms / 1e3}
        out["gaps"][str(gap_ms)] = {
            "control": _round([("heavy", "h"), ("control", "c")], n=n, seconds=seconds, fake=fake, opts=opts),
            "mix": _round([("heavy", "h"), ("chatty", "c")], n=n, seconds=seconds, fake=fake, opts=opts),
        }
    out["k"] = _round([("gemm", "a"), ("gemm", "a"), ("gemm", "a"), ("gemm", "b")], n=n, seconds=seconds,
                      fake=fake)
    out["kill"] = _kill_round(n=n if fake else 8192, fake=fake)
    out["hold"] = _longest_hold(n=n, fake=fake)
    out["spin"] = _spin_kernel(fake=fake)
    return out


def run_in_child(quick: bool = False, timeout_s: float = 300) -> dict[str, Any]:
    """This phase in a fresh process (on the fake when the check runs with ``--dry-run-fake``)."""
    from tests.gpu.phase_child import last_json_line, run_phase_script

    proc = run_phase_script(__file__, quick=quick, fake_flag="--fake", timeout_s=timeout_s)
    return last_json_line("mix", proc, timeout_s)


def _p99(values: list[int]) -> float:
    ordered = sorted(values)
    return float(ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]) if ordered else float("inf")


def table_rows(result: dict[str, Any]) -> list[tuple[str, str, str, bool | None, str]]:
    """(name, got, want, ok, kind) rows: correctness and "everyone worked" are checks, the rest timings."""
    if "error" in result:
        return [("mix: tenants that differ under the lease", result["error"][:160], "run", False, "check")]
    rows: list[tuple[str, str, str, bool | None, str]] = []
    q_ms = float(result.get("quantum_s", QUANTUM_S)) * 1e3
    for gap, rounds in result.get("gaps", {}).items():
        failed = [f"{k}: {v['error']}" for k, v in rounds.items() if "error" in v]
        if failed:
            rows.append((f"mix {gap} ms: heavy beside chatty", "; ".join(failed)[:160], "run", False, "check"))
            continue
        heavy_c, _ = rounds["control"]["tenants"]
        heavy_m, chatty = rounds["mix"]["tenants"]
        ok = heavy_m["correct"] and heavy_c["correct"] and chatty["ops"] > 0
        rows.append((f"mix {gap} ms: GEMMs right, the chatty tenant served", f"{chatty['ops']} chatty ops", "True",
                     ok, "check"))
        ratio = (heavy_m["ops"] / heavy_m["seconds"]) / max(heavy_c["ops"] / heavy_c["seconds"], 1e-9)
        rows.append((f"mix {gap} ms: heavy GEMMs/s beside chatty vs control", f"{ratio:.2f}x", ">= 0.9x",
                     ratio >= 0.9, "timing"))
        p99 = _p99(chatty["waits_ns"]) / 1e6
        rows.append((f"mix {gap} ms: chatty wait per op p99", f"{p99:.2f} ms", f"<= {q_ms:g} ms", p99 <= q_ms,
                     "timing"))
    k = result.get("k", {})
    if "error" in k:
        rows.append(("mix: 3 instances vs 1", k["error"][:160], "run", False, "check"))
    elif k:
        by = {"a": 0, "b": 0}
        for t in k["tenants"]:
            by[t["tenant"]] += t["device_ns"]
        share = by["a"] / max(by["a"] + by["b"], 1)
        rows.append(("mix: 3 instances vs 1, every instance worked", str(all(t["ops"] > 0 for t in k["tenants"])),
                     "True", all(t["ops"] > 0 for t in k["tenants"]), "check"))
        rows.append(("mix: 3 instances vs 1 at 1:1, the 3-instance tenant's event time", f"{share:.1%}",
                     "50% +- 5 points", abs(share - 0.5) <= 0.05, "timing"))
    kill = result.get("kill", {})
    if "error" in kill:
        rows.append(("mix: holder SIGKILLed mid-chunk", kill["error"][:160], "reclaimed", False, "check"))
    elif kill:
        rows.append(("mix: holder SIGKILLed mid-chunk, its lease reclaimed, the waiter runs",
                     f"held={kill['held']}, {kill['waiter_got_it_s'] * 1e3:.1f} ms, round {kill.get('tries', 1)}",
                     "held=True", bool(kill["held"]), "check"))
        if "used_before_ns" in kill:
            after, block_after = kill["used_after_ns"], kill["block_after_ns"]
            kept = after is not None and after >= kill["used_before_ns"] and block_after >= kill["block_before_ns"]
            rows.append(("mix: holder SIGKILLed, the time charged before the kill kept (board, quota block)",
                         f"{kill['used_before_ns'] / 1e6:.2f} -> {(after or 0) / 1e6:.2f} ms, "
                         f"{kill['block_before_ns'] / 1e6:.2f} -> {block_after / 1e6:.2f} ms", "never less", kept,
                         "check"))
            charged = (after or 0) - kill["used_before_ns"]
            rows.append(("mix: holder SIGKILLed, its chunk in flight charged", f"{charged / 1e6:.3f} ms charged, "
                         f">= {kill['in_flight_seen_ns'] / 1e6:.3f} ms of it seen busy", ">= the time seen busy",
                         charged >= kill["in_flight_seen_ns"], "timing"))
    hold = result.get("hold", {})
    if "error" in hold:
        rows.append(("mix: longest hold", hold["error"][:160], "run", False, "check"))
    elif hold:
        tr, sk = hold["transpose"], hold["skinny_after_square"]
        rows.append(("mix: skinny GEMM after square ones is right", str(sk["correct"]), "True", sk["correct"],
                     "check"))
        limit = 2 * CHUNK_S * 1e9
        rows.append(("mix: skinny GEMM after square ones, first / longest chunk",
                     f"{sk['first_ns'] / 1e6:.2f} / {sk['longest_ns'] / 1e6:.2f} ms ({sk['chunks']} chunks)",
                     "<= 4 ms", sk["longest_ns"] <= limit, "timing"))
        rows.append((f"mix: transpose {tr['rows']}x{tr['cols']}, longest chunk",
                     f"{tr['longest_ns'] / 1e6:.2f} ms ({tr['chunks']} chunks)", "<= 4 ms",
                     tr["longest_ns"] <= limit, "timing"))
    spin = result.get("spin", {})
    if "skipped" in spin:
        rows.append(("mix: spin kernel of known length vs its charge", spin["skipped"], "hardware", None, "timing"))
    elif "error" in spin:
        rows.append(("mix: spin kernel of known length vs its charge", spin["error"][:160], "run", None, "timing"))
    elif spin:
        worst = max(abs(c - spin["spun_ms"]) / spin["spun_ms"] for c in spin["charged_ms"])
        rows.append(("mix: spin kernel of known length vs its charge (events)",
                     f"spun {spin['spun_ms']:.2f} ms, charged {', '.join(f'{c:.2f}' for c in spin['charged_ms'])}",
                     "within 5 %", worst <= 0.05, "timing"))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1.5 s rounds instead of 3, gaps 0.1 and 1 ms")
    parser.add_argument("--fake", action="store_true", help="the fake driver and cuBLAS: no GPU")
    args = parser.parse_args(argv)
    try:
        result = run(quick=args.quick, fake=args.fake)
    except Exception as exc:  # noqa: BLE001 - one JSON line either way
        print(json.dumps({"phase": "mix", "error": f"{type(exc).__name__}: {exc}"}))
        return 1
    print(json.dumps({"phase": "mix", **result}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
