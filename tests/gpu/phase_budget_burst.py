"""The hardware check's "budget_burst" phase: the device budget against ``cuMemGetInfo``, 8 workers at once.

    python3 tests/gpu/phase_budget_burst.py [--quick] [--fake]      one JSON line (a child phase)
    tests/gpu/check_gpu.py                                          runs it as the phase "budget_burst"

A real supervisor on the cuda backend; eight tenants registered at the same moment from eight
client threads (their workers start together: context, stream, pool, the metered per-context
overhead), each allocating 64 MiB and writing to it. Then the supervisor's device budget (what it
believes the tenants hold, context overhead included: ``status().devices[0].budget_used_bytes``)
against what the device really lost (``cuMemGetInfo``'s free memory before the burst minus after,
read by a fresh process). A budget that counts less than the device lost admits a tenant that then
meets a driver OOM. Rows:

    8 tenants registered and served, their bytes read back                     check
    budget used >= the tenants' metered bytes                                  check
    budget used vs device memory taken (cuMemGetInfo delta)                    timing: >= taken - 16 MiB
                                                                               (never under-counts)

On the fake driver each process has its own fake device, so ``cuMemGetInfo`` from another process
cannot see the workers' memory: that row is "hardware only" there.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.gpu.phase_kit import (  # noqa: E402
    MiB, Result, TableRow, meminfo, phase_main, run_in_child as _run_in_child, supervisor)

__all__ = ["TENANTS", "TOLERANCE_BYTES", "run", "run_in_child", "table_rows"]

TENANTS = 8
ALLOC_BYTES = 64 * MiB
TOLERANCE_BYTES = 16 * MiB


def _tenant(sup: Any, i: int, start: threading.Barrier, out: dict[int, Any]) -> None:
    from shared.spec import TenantSpec

    client = sup.connect(timeout_s=120.0)
    try:
        start.wait(timeout=120)
        cap = client.register(sup.admin_capability, TenantSpec(f"burst{i}", gpu_memory_bytes_cap=256 * MiB))
        h = client.alloc(cap, ALLOC_BYTES)
        mark = f"burst tenant {i}".encode()
        client.write(cap, h, mark, offset=ALLOC_BYTES - 64)
        out[i] = {"served": client.read(cap, h, len(mark), offset=ALLOC_BYTES - 64) == mark}
    except Exception as exc:  # noqa: BLE001 - reported with the results
        out[i] = {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        client.close()


def run(*, quick: bool = False, fake: bool = False) -> Result:
    """The phase's figures (see the module docstring)."""
    out: Result = {"tenants": TENANTS, "alloc_bytes": ALLOC_BYTES, "fake": fake}
    with supervisor() as sup:
        dev0 = sup.client.status().devices[0]
        out["budget_used_before"] = dev0.budget_used_bytes
        out["before"] = meminfo()
        start = threading.Barrier(TENANTS)
        got: dict[int, Any] = {}
        threads = [threading.Thread(target=_tenant, args=(sup, i, start, got), daemon=True) for i in range(TENANTS)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(180)
        out["results"] = [got.get(i, {"error": "no result"}) for i in range(TENANTS)]
        out["after"] = meminfo()
        st = sup.client.status()
        dev = st.devices[0]
        out["budget_used_after"] = dev.budget_used_bytes
        out["budget_refusals"] = dev.budget_refusals
        out["tenant_bytes"] = sum(t.gpu_bytes_in_use for t in st.tenants if t.tenant_id.startswith("burst"))
    return out


def run_in_child(quick: bool = False, timeout_s: float = 300) -> Result:
    """This phase in a fresh process (on the fake when the check runs with ``--dry-run-fake``)."""
    return _run_in_child(__file__, "budget_burst", quick=quick, timeout_s=timeout_s)


def table_rows(result: Result) -> list[TableRow]:
    """(name, got, want, ok, kind) rows (see the module docstring)."""
    if "error" in result:
        return [("budget_burst: 8 workers at once", str(result["error"])[:160], "run", False, "check")]
    results = result["results"]
    served = sum(1 for r in results if r.get("served") is True)
    errors = [r["error"] for r in results if "error" in r]
    rows: list[TableRow] = [(f"budget_burst: {result['tenants']} tenants started at once, served",
                             f"{served} of {result['tenants']}" + (f" ({errors[0][:100]})" if errors else ""),
                             f"{result['tenants']}", served == result["tenants"], "check")]
    used = result["budget_used_after"] - result["budget_used_before"]
    rows.append(("budget_burst: budget used >= the tenants' metered bytes",
                 f"{used / MiB:.1f} MiB >= {result['tenant_bytes'] / MiB:.1f} MiB", "True",
                 used >= result["tenant_bytes"], "check"))
    before, after = result.get("before", {}), result.get("after", {})
    if result.get("fake"):
        rows.append(("budget_burst: budget used vs device memory taken (cuMemGetInfo)",
                     "hardware only (a fake device per process)", f">= taken - {TOLERANCE_BYTES // MiB} MiB", None,
                     "timing"))
    elif "error" in before or "error" in after:
        rows.append(("budget_burst: budget used vs device memory taken (cuMemGetInfo)",
                     str(before.get("error") or after.get("error"))[:160], f">= taken - {TOLERANCE_BYTES // MiB} MiB",
                     None, "timing"))
    else:
        taken = before["free"] - after["free"]
        rows.append(("budget_burst: budget used vs device memory taken (cuMemGetInfo)",
                     f"{used / MiB:.1f} MiB counted, {taken / MiB:.1f} MiB taken ({used / max(taken, 1):.2f}x)",
                     f">= taken - {TOLERANCE_BYTES // MiB} MiB", used >= taken - TOLERANCE_BYTES, "timing"))
    return rows


if __name__ == "__main__":
    raise SystemExit(phase_main("budget_burst", __doc__ or "", run))
