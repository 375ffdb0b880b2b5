"""The hardware check's "overrun" phase: a run whose device work overruns its deadline and any op queue, timed.

    python3 tests/gpu/phase_overrun.py [--quick] [--fake]      one JSON line (a child phase)
    tests/gpu/check_gpu.py                                     runs it as the phase "overrun"

Through a real supervisor on the cuda backend: a "flood" tenant runs the ``long_job`` guest
(worker/guests/long_job.wat: ``reps`` axpy ops back to back on large vectors) with far more
ops than any per-worker queue of enqueued work holds and than its run's ``timeout_s`` allows;
a "light" tenant beside it runs ``axpy_sum`` on a small vector in a loop. Whatever the worker
queues, the deadline must bound it: the flood's run must end (a typed error) soon after its
deadline, the worker must serve the next run, and the light tenant must keep getting the device.
Then the cost of overrunning a queue: the flood's per-op time in a run of many ops against a run
of a few. Rows:

    the overrunning run ends with a typed error; the flood serves again; light right   check
    reply after the deadline (overshoot)                           timing: <= 2 quanta (20 ms)
    light tenant's wait for the device while flooded, p99          timing: <= 1 quantum (10 ms)
    per-op time, 4096-op run vs 64-op run (256 vs 16 on the fake)  timing: <= 1.10x

With ``--fake`` the worker uses the fake driver: the path and rows are proven, not the figures.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.gpu.phase_kit import (  # noqa: E402
    Result, TableRow, p99, phase_main, run_in_child as _run_in_child, supervisor)

__all__ = ["QUANTUM_S", "run", "run_in_child", "table_rows"]

QUANTUM_S = 0.01
LONG_OPS, SHORT_OPS = 4096, 64


def _light(sup: Any, cap: Any, digest: str, stop: threading.Event, out: dict[str, Any],
           going: threading.Event) -> None:
    """Small axpy+sum runs until ``stop`` (``going`` set after the first): each run's wait for the
    device and whether its sum is right."""
    import numpy as np

    n = 4096
    client = sup.connect(timeout_s=120.0)
    try:
        hx, hy = client.alloc(cap, 4 * n), client.alloc(cap, 4 * n)
        xs = np.ones(n, dtype=np.float32)
        client.write(cap, hx, xs.tobytes())
        while not stop.is_set():
            client.write(cap, hy, xs.tobytes())
            reply = client.run_wasm(cap, digest, "run", [{"handle": hx}, {"handle": hy}, n, 0.5])
            out["waits_s"].append(reply.gpu_wait_s)
            out["right"] = out.get("right", True) and abs(float(reply.results[0]) - 1.5 * n) <= 1e-3 * n
            out["runs"] += 1
            going.set()
    except Exception as exc:  # noqa: BLE001 - reported with the results
        out["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        going.set()
        client.close()


def run(*, quick: bool = False, fake: bool = False) -> Result:
    """The phase's figures (see the module docstring)."""
    from shared.errors import TensorWasmError
    from shared.spec import TenantSpec
    from supervisor.tools.demo import guest_path

    n = 4096 if fake else 1 << 24  # 64 MiB vectors on hardware: ~0.1 ms per axpy on an H200
    deadline_s = 0.1 if fake else 0.5
    out: Result = {"n": n, "deadline_s": deadline_s, "quantum_s": QUANTUM_S}
    with supervisor({"gpu_time_scheduler": True, "gpu_time_quantum_s": QUANTUM_S}) as sup:
        c = sup.client
        spec = {"wasm_timeout_s": 60.0, "request_timeout_s": 120.0, "gpu_memory_bytes_cap": 1 << 30}
        flood = c.register(sup.admin_capability, TenantSpec.from_dict({"tenant_id": "flood", **spec}))
        light = c.register(sup.admin_capability, TenantSpec.from_dict({"tenant_id": "light", **spec}))
        job = c.put_module(flood, guest_path("long_job").read_bytes())
        axpy = c.put_module(light, (ROOT / "worker" / "guests" / "axpy_sum.wat").read_bytes())
        c.run_wasm(flood, job, "run", [n, 2])  # compiled, warm
        lo: dict[str, Any] = {"waits_s": [], "runs": 0}
        stop, going = threading.Event(), threading.Event()
        th = threading.Thread(target=_light, args=(sup, light, axpy, stop, lo, going), daemon=True)
        th.start()
        going.wait(120)  # the light tenant runs before the flood begins
        try:
            t0 = time.monotonic()
            try:
                c.run_wasm(flood, job, "run", [n, 10**9], timeout_s=deadline_s)
                out["overrun_error"] = None
            except TensorWasmError as exc:
                out["overrun_error"] = type(exc).__name__
                out["overrun_message"] = str(exc)[:200]
            out["overrun_reply_s"] = time.monotonic() - t0
        finally:
            stop.set()
            th.join(120)
        out["light"] = lo
        got = c.run_wasm(flood, job, "run", [n, 2])
        out["flood_serves_again"] = abs(float(got.results[0]) - 1.0 * n) <= 1e-3 * n  # 2 x 0.5 x n
        per_op = {}
        long_ops, short_ops = (LONG_OPS // 16, SHORT_OPS // 4) if fake else (LONG_OPS, SHORT_OPS)
        for ops in (short_ops, long_ops):
            t = time.monotonic()
            c.run_wasm(flood, job, "run", [n, ops], timeout_s=60.0)
            per_op[ops] = (time.monotonic() - t) / ops
        out["per_op_s"] = {"long": per_op[long_ops], "short": per_op[short_ops]}
        out["ops"] = {"long": long_ops, "short": short_ops}
    return out


def run_in_child(quick: bool = False, timeout_s: float = 300) -> Result:
    """This phase in a fresh process (on the fake when the check runs with ``--dry-run-fake``)."""
    return _run_in_child(__file__, "overrun", quick=quick, timeout_s=timeout_s)


def table_rows(result: Result) -> list[TableRow]:
    """(name, got, want, ok, kind) rows (see the module docstring)."""
    if "error" in result:
        return [("overrun: a run past its deadline with work queued", str(result["error"])[:160], "run", False,
                 "check")]
    light = result["light"]
    stopped = result["overrun_error"] is not None
    rows: list[TableRow] = [
        ("overrun: the overrunning run ends with a typed error", str(result["overrun_error"]), "an error", stopped,
         "check"),
        ("overrun: the flooding tenant serves its next run right", str(result["flood_serves_again"]), "True",
         result["flood_serves_again"] is True, "check"),
        ("overrun: the light tenant served beside it, every sum right",
         f"{light['runs']} runs, right {light.get('right')}" + (f" ({light['error'][:80]})" if "error" in light else ""),
         "> 0 runs, True", light["runs"] > 0 and light.get("right") is True and "error" not in light, "check"),
    ]
    q_ms = float(result["quantum_s"]) * 1e3
    over = (result["overrun_reply_s"] - result["deadline_s"]) * 1e3
    rows.append(("overrun: reply after the run's deadline (overshoot)", f"{over:.1f} ms past {result['deadline_s']:g} s",
                 f"<= {2 * q_ms:g} ms (2 quanta)", stopped and over <= 2 * q_ms, "timing"))
    wait = p99(light["waits_s"]) * 1e3
    rows.append(("overrun: light tenant's wait for the device while flooded, p99", f"{wait:.2f} ms",
                 f"<= {q_ms:g} ms (1 quantum)", wait <= q_ms, "timing"))
    per_op, ops = result["per_op_s"], result["ops"]
    ratio = per_op["long"] / max(per_op["short"], 1e-12)
    rows.append((f"overrun: per-op time, {ops['long']}-op run vs {ops['short']}-op run",
                 f"{ratio:.2f}x ({per_op['long'] * 1e6:.0f} vs {per_op['short'] * 1e6:.0f} us)",
                 "<= 1.10x", ratio <= 1.10, "timing"))
    return rows


if __name__ == "__main__":
    raise SystemExit(phase_main("overrun", __doc__ or "", run))
