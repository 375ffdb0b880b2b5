"""The hardware check's "wasm_share" phase: GPU-time shares through the supervisor and the WASM host.

    python3 tests/gpu/phase_wasm_share.py [--quick] [--fake]      one JSON line (a child phase)
    tests/gpu/check_gpu.py                                        runs it as the phase "wasm_share"

``share`` and ``mix`` drive :class:`worker.device_time.DeviceGate` directly; this phase goes the
whole way a tenant goes: a real supervisor on the cuda backend (scheduler on), tenants registered
with their ``gpu_time_weight``, the ``share`` guest (worker/guests/share.wat) run by client threads
through ``run_wasm``, every op through the worker's WASM host, its gate and the lease. Accounted
time is each tenant's ``gpu_time_ns`` in its quota block (sampled by this process); work is what
the guest counts. Rounds:

    7:3     tenants at weights 7 and 3, both saturating: the weight-7 tenant's share of accounted
            time and of work (target 70 % +- 3 points); both served (check)
    chatty  a heavy tenant beside a chatty one (one tiny op per run, then host work) at 1:1:
            the chatty run's wait for the device (``gpu_wait_s`` of its reply), p99 (target <= 1
            quantum); the heavy tenant served (check)

The saturating load is ``gemm_loop`` (cuBLAS GEMMs). Under ``--fake`` a supervised worker has no
cuBLAS (the fake cuBLAS is an object a test hands the backend; a worker loads nvmath's), so the
load there is the guest's ``chatty`` loop with no host work (back-to-back fill kernels): the path
and the rows are proven, not the figures.
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


class _Tenant:
    """One registered tenant: its capability, the guest's digest, its quota block, what it did."""

    def __init__(self, sup: Any, name: str, weight: float) -> None:
        from shared.quota import QuotaBlock
        from shared.spec import TenantSpec
        from supervisor.tools.demo import guest_path

        c = sup.client
        self.name = name
        self.cap = c.register(sup.admin_capability, TenantSpec.from_dict(
            {"tenant_id": name, "gpu_time_weight": weight, "wasm_timeout_s": 120.0, "request_timeout_s": 120.0,
             "gpu_memory_bytes_cap": 1 << 30}))
        self.digest = c.put_module(self.cap, guest_path("share").read_bytes())
        rec = c.status().tenant(name)
        assert rec is not None and rec.quota is not None, f"{name} has no quota block"
        self.block = QuotaBlock.attach(rec.quota.name)
        self.work = 0
        self.runs = 0
        self.waits: list[float] = []
        self.errors: list[str] = []

    def close(self) -> None:
        self.block.close()


def _loop(sup: Any, t: _Tenant, stop: threading.Event, export: str, args: list[Any], ready: threading.Barrier,
          *, wait_s: bool = False) -> None:
    """Runs of ``export`` until ``stop``; the work each run reports, its wait for the device."""
    client = sup.connect(timeout_s=120.0)
    try:
        client.run_wasm(t.cap, t.digest, export, args)  # compiled, warm
        ready.wait(timeout=120)
        while not stop.is_set():
            reply = client.run_wasm(t.cap, t.digest, export, args)
            t.work += max(0, int(reply.results[0]))
            t.runs += 1
            if wait_s:
                t.waits.append(reply.gpu_wait_s)
    except Exception as exc:  # noqa: BLE001 - reported with the results
        t.errors.append(f"{type(exc).__name__}: {exc}")
        ready.abort()
    finally:
        client.close()


def _round(sup: Any, loads: list[tuple[_Tenant, str, list[Any], bool]], seconds: float) -> dict[str, Any]:
    """Start every load together, measure ``seconds``; per tenant: work, runs, accounted ns, waits."""
    stop = threading.Event()
    ready = threading.Barrier(len(loads) + 1)
    threads = [threading.Thread(target=_loop, args=(sup, t, stop, export, args, ready), kwargs={"wait_s": w},
                                daemon=True) for t, export, args, w in loads]
    for th in threads:
        th.start()
    try:
        ready.wait(timeout=180)
    except threading.BrokenBarrierError:
        pass
    ns0 = {t.name: t.block.gpu_time_ns for t, *_ in loads}
    work0 = {t.name: t.work for t, *_ in loads}
    t0 = time.monotonic()
    time.sleep(seconds)
    # the window ends once every tenant has reported work in it, not at a fixed length: on a loaded
    # host (or the fake device beside other work) one run can outlast ``seconds`` (bounded: 120 s)
    end = t0 + 120.0
    while (any(t.work == work0[t.name] for t, *_ in loads) and time.monotonic() < end
           and any(th.is_alive() for th in threads)):
        time.sleep(0.05)
    ns1 = {t.name: t.block.gpu_time_ns for t, *_ in loads}
    work1 = {t.name: t.work for t, *_ in loads}
    elapsed = time.monotonic() - t0
    stop.set()
    for th in threads:
        th.join(120)
    return {"seconds": elapsed, "tenants": {t.name: {"work": work1[t.name] - work0[t.name], "runs": t.runs,
                                                     "device_ns": ns1[t.name] - ns0[t.name],
                                                     "waits_s": t.waits, "errors": t.errors}
                                            for t, *_ in loads}}


def run(*, quick: bool = False, fake: bool = False) -> Result:
    """The phase's figures (see the module docstring)."""
    seconds = 0.15 if fake else (2.0 if quick else 4.0)
    n, reps = 2048, 16
    heavy: tuple[str, list[Any]] = ("chatty", [50, 0, 1]) if fake else ("gemm_loop", [n, reps])
    out: Result = {"seconds": seconds, "load": heavy[0], "quantum_s": QUANTUM_S}
    with supervisor({"gpu_time_scheduler": True, "gpu_time_quantum_s": QUANTUM_S}) as sup:
        tenants = [_Tenant(sup, "w7", 7.0), _Tenant(sup, "w3", 3.0)]
        try:
            out["split"] = _round(sup, [(t, heavy[0], heavy[1], False) for t in tenants], seconds)
        finally:
            for t in tenants:
                t.close()
        tenants = [_Tenant(sup, "heavy", 1.0), _Tenant(sup, "chatty", 1.0)]
        try:
            # one tiny op per run, then ~0.3 ms of guest arithmetic (20k iterations of the guest's loop)
            out["chatty"] = _round(sup, [(tenants[0], heavy[0], heavy[1], False),
                                         (tenants[1], "chatty", [1, 20_000, 1], True)], seconds)
        finally:
            for t in tenants:
                t.close()
    return out


def run_in_child(quick: bool = False, timeout_s: float = 300) -> Result:
    """This phase in a fresh process (on the fake when the check runs with ``--dry-run-fake``)."""
    return _run_in_child(__file__, "wasm_share", quick=quick, timeout_s=timeout_s)


def table_rows(result: Result) -> list[TableRow]:
    """(name, got, want, ok, kind) rows (see the module docstring)."""
    if "error" in result:
        return [("wasm_share: shares through the supervisor and WASM", str(result["error"])[:160], "run", False,
                 "check")]
    rows: list[TableRow] = []
    split = result.get("split", {})
    errors = [e for r in (split, result.get("chatty", {})) for t in r.get("tenants", {}).values() for e in t["errors"]]
    if errors or not split:
        return [("wasm_share: shares through the supervisor and WASM", "; ".join(errors)[:160] or "no result", "run",
                 False, "check")]
    w7, w3 = split["tenants"]["w7"], split["tenants"]["w3"]
    served = w7["runs"] > 0 and w3["runs"] > 0 and w7["work"] > 0 and w3["work"] > 0
    rows.append(("wasm_share 7:3: both tenants served through run_wasm",
                 f"{w7['runs']} and {w3['runs']} runs ({result['load']})", "both > 0", served, "check"))
    for what, key in (("accounted time", "device_ns"), ("work", "work")):
        share = w7[key] / max(w7[key] + w3[key], 1)
        rows.append((f"wasm_share 7:3: weight 7's {what}", f"{share:.1%}", "70% +- 3 points", abs(share - 0.7) <= 0.03,
                     "timing"))
    chatty = result["chatty"]["tenants"]
    rows.append(("wasm_share: heavy beside chatty, both served", f"{chatty['heavy']['runs']} heavy runs, "
                 f"{chatty['chatty']['runs']} chatty runs", "both > 0",
                 chatty["heavy"]["runs"] > 0 and chatty["chatty"]["runs"] > 0, "check"))
    q_ms = float(result.get("quantum_s", QUANTUM_S)) * 1e3
    wait = p99(chatty["chatty"]["waits_s"]) * 1e3
    rows.append(("wasm_share: chatty run's wait for the device p99", f"{wait:.2f} ms", f"<= {q_ms:g} ms (1 quantum)",
                 wait <= q_ms, "timing"))
    return rows


if __name__ == "__main__":
    raise SystemExit(phase_main("wasm_share", __doc__ or "", run))
