"""The human-readable campaign report.

Typing: the reports (and the event maps they are built from) are JSON-shaped dicts,
written here and read back by key to print and check them; their values stay dynamically typed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["format_report"]

# --------------------------------------------------------------------------- the report


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:g}"


def format_report(report: Mapping[str, Any]) -> str:
    """The report as text: schedule, fault table, tenant table, invariant verdicts."""
    cfg, sched = report["config"], report["schedule"]
    lines = [
        (
            f"twt chaos: seed {cfg['seed']}, {cfg['duration_s']:g} s ({cfg['baseline_s']:g} s baseline + "
            f"{cfg['fault_phase_s']:g} s faults), {cfg['tenants']} tenants ({cfg['faulty']} faulty), "
            f"{cfg['clients']} clients, rate {cfg['rate']:g}/s"
        ),
        f"schedule {sched['hash']}: {sched['faults']} faults "
        + ", ".join(f"{k} {n}" for k, n in sched["by_kind"].items()),
    ]
    sup = report.get("supervisor")
    if sup:
        lines.append(
            f"supervisor pid {sup['pid']}, backend {sup['backend']}, {sup['start_method']}"
            + ("" if sup["started_here"] else " (already running)")
        )
    lines.append("")
    rows = [
        [
            "fault",
            "delivered",
            "armed",
            "exited",
            "signalled",
            "skipped",
            "deaths",
            "detect p50/max ms",
            "recover p50/max ms",
        ]
    ]
    for kind, s in report.get("faults", {}).items():
        rows.append(
            [
                kind,
                s.get("delivered", 0),
                s.get("armed", 0),
                s.get("exited", 0),
                s.get("signalled", 0),
                s.get("skipped", 0),
                s.get("deaths", 0),
                f"{_ms(s['detect_ms_p50'])}/{_ms(s['detect_ms_max'])}",
                f"{_ms(s['recover_ms_p50'])}/{_ms(s['recover_ms_max'])}",
            ]
        )
    lines += _table(rows)
    lines.append("")
    rows = [["tenant", "requests", "ok", "errors", "p99 base ms", "p99 faults ms"]]
    for t in report.get("tenants", []):
        errs = ", ".join(f"{k} {n}" for k, n in t["errors"].items()) or "-"
        rows.append(
            [
                t["tenant"],
                t["requests"],
                t["ok"],
                errs,
                _ms(t["latency"]["baseline"]["p99_ms"]),
                _ms(t["latency"]["faults"]["p99_ms"]),
            ]
        )
    lines += _table(rows)
    lost = report.get("lost_allocations")
    if lost:
        lines.append(
            f"\nallocations lost with dead instances (reclaimed): {lost['buffers']} buffers, "
            f"{lost['bytes']:,} B; worker deaths: {report['worker_deaths']['total']} "
            f"({report['worker_deaths']['not_from_a_fault']} not from a fault, "
            f"{report['worker_deaths'].get('deadline_enforced', 0)} a faulty tenant's run deadline enforced)"
        )
    lines.append("")
    for c in report.get("checks", []):
        lines.append(f"{'PASS' if c['ok'] else 'FAIL'}  {c['name']}: {c['detail']}")
    phases = report.get("phases_s")
    if phases:
        lines.append("\nsteps (s): " + ", ".join(f"{name} {seconds:g}" for name, seconds in phases.items()))
    if report.get("heal_errors"):
        lines.append("heal answered: " + "; ".join(report["heal_errors"]))
    if report.get("settled_after_free") is False:
        lines.append("the tenants did not settle after the frees (waited out the settle bound)")
    verdict = "all invariants hold" if report.get("ok") else "INVARIANT VIOLATED"
    lines.append(f"\nchaos: {verdict} ({report.get('elapsed_s')} s)")
    return "\n".join(lines)


def _table(rows: Sequence[Sequence[object]]) -> list[str]:
    cells = [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(cells[0]))]
    out = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
    out.insert(1, "  ".join("-" * w for w in widths))
    return out
