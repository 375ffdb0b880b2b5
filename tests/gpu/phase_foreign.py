"""The hardware check's "foreign" phase: a program the supervisor does not know on the GPU during a split.

    python3 tests/gpu/phase_foreign.py [--quick] [--fake]      one JSON line (a child phase)
    tests/gpu/check_gpu.py                                     runs it as the phase "foreign"

Two tenants at 1:1 on one :class:`shared.gpu_time.GpuTimeBoard` (GEMM loops through
:class:`worker.device_time.DeviceGate`, one process each, as in ``phase_mix.py``), beside a third
process running the same GEMMs on its own context with no lease at all - another user's job on a
shared GPU. The board cannot schedule it; what must hold is that the two tenants still split the
time they get 1:1, and that they still get work done. Rows:

    every process worked, every GEMM right                         check
    the tenants' split of event time with the foreign process      timing: 50 % +- 5 points
    the tenants' GEMMs/s with the foreign process vs without it    timing: informative (the GPU is
                                                                   shared three ways: ~2/3 expected)

With ``--fake`` the processes use the fake driver: it proves the wiring, not the figures.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.gpu.phase_kit import Result, TableRow, phase_main, run_in_child as _run_in_child  # noqa: E402

__all__ = ["run", "run_in_child", "table_rows"]

SPLIT_TOLERANCE = 0.05


def run(*, quick: bool = False, fake: bool = False) -> Result:
    """The phase's figures (see the module docstring)."""
    from tests.gpu.phase_mix import _round

    n = 64 if fake else 4096
    seconds = 0.15 if fake else (1.5 if quick else 3.0)
    return {"n": n, "seconds": seconds,
            "alone": _round([("gemm", "a"), ("gemm", "b")], n=n, seconds=seconds, fake=fake),
            "foreign": _round([("gemm", "a"), ("gemm", "b"), ("foreign", "")], n=n, seconds=seconds, fake=fake)}


def run_in_child(quick: bool = False, timeout_s: float = 300) -> Result:
    """This phase in a fresh process (on the fake when the check runs with ``--dry-run-fake``)."""
    return _run_in_child(__file__, "foreign", quick=quick, timeout_s=timeout_s)


def table_rows(result: Result) -> list[TableRow]:
    """(name, got, want, ok, kind) rows (see the module docstring)."""
    if "error" in result:
        return [("foreign: a foreign process during a 1:1 split", str(result["error"])[:160], "run", False, "check")]
    failed = [f"{k}: {result[k]['error']}" for k in ("alone", "foreign") if "error" in result.get(k, {})]
    if failed:
        return [("foreign: a foreign process during a 1:1 split", "; ".join(failed)[:160], "run", False, "check")]
    alone, mixed = result["alone"]["tenants"], result["foreign"]["tenants"]
    worked = all(t["ops"] > 0 and t["correct"] for t in [*alone, *mixed])
    rows: list[TableRow] = [("foreign: every process worked, every GEMM right",
                             ", ".join(f"{t['role']}{t['tenant'] or ''} {t['ops']}" for t in mixed), "True", worked,
                             "check")]
    a, b = (t for t in mixed if t["tenant"])
    share = a["device_ns"] / max(a["device_ns"] + b["device_ns"], 1)
    rows.append(("foreign: 1:1 tenants' split of event time beside a foreign process", f"{share:.1%}",
                 f"50% +- {SPLIT_TOLERANCE * 100:g} points", abs(share - 0.5) <= SPLIT_TOLERANCE, "timing"))

    def rate(ts: list[Result]) -> float:
        return float(sum(t["ops"] / max(t["seconds"], 1e-9) for t in ts if t["tenant"]))

    ratio = rate(mixed) / max(rate(alone), 1e-9)
    rows.append(("foreign: tenants' GEMMs/s beside the foreign process vs without it", f"{ratio:.2f}x",
                 "informative (~0.67x: three ways)", None, "timing"))
    return rows


if __name__ == "__main__":
    raise SystemExit(phase_main("foreign", __doc__ or "", run))
