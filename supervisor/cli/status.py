"""``twt status``: every tenant counted, one table row per tenant of the first page (``--all``:
every tenant), or the raw status record with ``--json``.

    $ twt status
    supervisor pid 4242  backend stub  start spawn  pool 2/2 idle  workers 5  rss 61.2MiB  up 3h02m
    tenants 1 (running 1)  instances 2/2 ready
    TENANT  STATE    INST  PIDS       HOST USED/LIMIT  GPU USED/CAP  HIGH HOST/GPU  REFUSED HOST/GPU  RESTARTS  UPTIME
    ------  -------  ----  ---------  --------------  ------------  ------------  ---------------  --------  ------
    acme    running  2/2   4250,4251  0B/8GiB         1MiB/2GiB     0B/1.5MiB     0/3              1         3h01m

``twt top`` refreshes the same table (:func:`render`). The exit status is
for scripts: 0 every tenant is running (or stopped, completed or parked), 1 one is starting,
degraded, failed or evicting (:func:`exit_status`; the summary covers the
tenants past the first page), 3 no supervisor.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
from collections.abc import Sequence

from shared.exitcodes import EXIT_FAILED, EXIT_OK
from shared.records import STATUS_PAGE_MAX, ExitRecord, StatusRecord, StatusSummary, SupervisorRecord, TenantRecord
from shared.sizes import format_size
from supervisor.cli._common import add_run_dir, client_of, print_json, print_table
from supervisor.client.api import SupervisorClient
from supervisor.cli.commands._cli import fetch_status, fetch_tenant

__all__ = ["add_parser", "connect", "exit_status", "fetch_status", "fetch_tenant", "format_duration", "render", "run"]

#: seconds a read-only command waits for an answer before calling the supervisor unreachable
READ_TIMEOUT_S = 10.0
#: tenants the table lists unless --all or --limit says otherwise (the summary line counts them all)
PAGE = 100
HEADERS = ("TENANT", "STATE", "INST", "PIDS", "HOST USED/LIMIT", "GPU USED/CAP", "HIGH HOST/GPU",
           "REFUSED HOST/GPU", "RESTARTS", "UPTIME",
           "GPU WEIGHT/CAP", "GPU TIME", "SHARE")  # GPU time: accounted, and its share over the last 10 s
_MAX_PIDS_SHOWN = 4


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "status",
        help="show every tenant: state, instances, quotas, restarts",
        description="Print one row per tenant (state, ready/wanted instances and their pids, host and GPU "
        "bytes used against their limits, high-water marks, quota refusals, restarts, uptime) under a "
        "header line about the supervisor. --json prints the raw status record for scripts. Exit status: 0 when "
        "every tenant shown is running (or stopped: scaled to 0, or completed: its workers exited 0 and its restart "
        "policy keeps them so), 1 when any is starting, degraded, failed or "
        "evicting, 3 when no supervisor answers.",
    )
    p.add_argument("tenant", nargs="?", metavar="TENANT", help="show only this tenant")
    p.add_argument("--json", action="store_true", help="print the raw status record (JSON) instead of a table "
                   "(every tenant, unless --limit, --after or --state is given)")
    p.add_argument("--all", action="store_true", help=f"list every tenant (the table shows the first {PAGE})")
    p.add_argument("--limit", type=_page_size, metavar="N",
                   help=f"list at most N tenants (1..{STATUS_PAGE_MAX}; the table's default: {PAGE})")
    p.add_argument("--after", metavar="ID", help="list the tenants after this tenant id (the next page; default: from the first)")
    p.add_argument("--state", metavar="STATE", help="list only tenants in this state (running, stopped, ...; default: every state)")
    add_run_dir(p)
    p.set_defaults(func=run)


def connect(args: argparse.Namespace, timeout_s: float = READ_TIMEOUT_S) -> SupervisorClient:
    """A client for ``--run-dir`` or ``--connect`` (SupervisorUnavailable when nothing runs there)."""
    return client_of(args, timeout_s)


#: tenant states that count as healthy for the exit status (stopped: scaled to 0 on purpose; parked:
#: idle, its workers gone until its next request)
HEALTHY_STATES = frozenset({"running", "stopped", "completed", "parked"})


def exit_status(tenants: Sequence[TenantRecord], summary: StatusSummary | None = None) -> int:
    """0 when every tenant shown is running (or stopped: scaled to 0, or completed: every instance exited 0
    and its restart policy keeps it so, or parked); 1 when any is starting, degraded, failed or
    evicting - so ``twt status acme || alert`` works in a script. With the ``summary`` of every tenant
    (a table of the first page), those not shown count too."""
    healthy = all(t.state in HEALTHY_STATES for t in tenants)
    if summary is not None:
        healthy = healthy and all(state in HEALTHY_STATES for state, n in summary.states.items() if n)
    return EXIT_OK if healthy else EXIT_FAILED


def _page_size(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if not 1 <= n <= STATUS_PAGE_MAX:
        raise argparse.ArgumentTypeError(f"must be an int in 1..{STATUS_PAGE_MAX}, got {text!r}")
    return n


def run(args: argparse.Namespace) -> int:
    paged = args.limit is not None or args.after is not None or args.state is not None
    with connect(args) as client:
        if args.tenant is not None:
            record = fetch_tenant(client, args.tenant)
            if args.json:
                print_json(record.to_wire())
            else:
                status = fetch_status(client, limit=1)
                print(render(dataclasses.replace(status, tenants=(record,), summary=None, next=None)), end="")
            return exit_status([record])
        if args.json:
            full = fetch_status(client, limit=args.limit if paged else None, after=args.after, state=args.state)
            print_json(full.to_wire())
            return exit_status(full.tenants)
        limit = None if args.all else (args.limit or PAGE)
        status = fetch_status(client, limit=limit, after=args.after, state=args.state)
    print(render(status), end="")
    return exit_status(status.tenants, status.summary if args.state is None else None)


# ------------------------------------------------------------------ rendering


def format_duration(seconds: float | None) -> str:
    """``3725`` -> ``"1h02m"``; ``None`` -> ``"-"``."""
    if seconds is None:
        return "-"
    s = max(0, int(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def _limit(n: int | None) -> str:
    return "none" if n is None else format_size(n)


def _pids(pids: Sequence[int]) -> str:
    if not pids:
        return "-"
    shown = ",".join(str(p) for p in pids[:_MAX_PIDS_SHOWN])
    return shown + (f",+{len(pids) - _MAX_PIDS_SHOWN}" if len(pids) > _MAX_PIDS_SHOWN else "")


def header_line(sup: SupervisorRecord) -> str:
    pool = sup.pool
    parts = [
        f"supervisor pid {sup.pid}",
        f"backend {sup.backend}" + (f" (driver {sup.driver_version}, CUDA {sup.cuda_version})"
                                    if sup.driver_version or sup.cuda_version else ""),
        f"start {sup.start_method}",
        f"pool {pool.idle}/{pool.size} idle" + (f" ({pool.starting} starting)" if pool.starting else ""),
        f"workers {sup.workers}",
    ]
    if sup.rss_bytes is not None:
        parts.append(f"rss {format_size(sup.rss_bytes)}")
    parts.append(f"up {format_duration(sup.uptime_s)}")
    return "  ".join(parts)


def tenant_row(t: TenantRecord) -> list[str]:
    quota = t.quota
    instances = [i for i in t.instances if not i.draining]
    ready = sum(1 for i in instances if i.state == "ready")
    return [
        t.tenant_id,
        t.state,
        f"{ready}/{len(instances)}",
        _pids(t.pids),
        f"{format_size(t.bytes_in_use)}/{_limit(t.memory_quota_bytes)}",
        f"{format_size(t.gpu_bytes_in_use)}/{_limit(t.gpu_memory_bytes_cap)}",
        f"{format_size(quota.cpu_high_water if quota else 0)}/{format_size(quota.gpu_high_water if quota else 0)}",
        f"{quota.cpu_refusals if quota else 0}/{quota.gpu_refusals if quota else 0}",
        str(t.restarts),
        format_duration(t.uptime_s),
        *gpu_time_cells(t),
    ]


def gpu_time_cells(t: TenantRecord) -> list[str]:
    """The GPU-time columns (docs/GPU-QUOTAS.md): weight/cap, accounted device time, share of the
    device over the last window."""
    g = t.gpu_time
    if not g:
        return ["-", "-", "-"]
    share = g.get("share")
    cap = g.get("cap")
    return [
        f"{g.get('weight', 1.0):g}/{'none' if cap is None else f'{cap:.0%}'}",
        f"{g.get('gpu_time_s', 0.0):.2f}s",
        "-" if share is None else f"{share:.0%}",
    ]


def _notes(t: TenantRecord) -> list[str]:
    """Why a tenant is not healthy: failure reason, instances down and how they last ended."""
    notes = []
    if t.failed_reason:
        notes.append(f"{t.tenant_id}: failed: {t.failed_reason}")
    if t.state == "parked":
        return notes  # idle on purpose: its instances are down until its next request
    for inst in t.instances:
        if inst.state in ("ready", "idle") or inst.draining:
            continue
        last = inst.last_exit
        how = f" (last exit: {last.reason or _exit_text(last)})" if last else ""
        notes.append(f"{t.tenant_id}/{inst.index}: {inst.state}{how}")
    return notes


def _exit_text(last: ExitRecord) -> str:
    if last.signal:
        return f"signal {last.signal}"
    return f"exit code {last.exit_code}"


def summary_line(summary: StatusSummary) -> str:
    """``tenants 10000 (running 12, stopped 9988)  instances 12/12 ready``."""
    states = ", ".join(f"{state} {n}" for state, n in summary.states.items() if n)
    return (f"tenants {summary.tenants}" + (f" ({states})" if states else "")
            + f"  instances {summary.ready}/{summary.instances} ready")


def render(status: StatusRecord) -> str:
    """The header line, the summary of every tenant, the tenant table (the page the record holds)
    and notes on unhealthy tenants, as text."""
    out = io.StringIO()
    out.write(header_line(status.supervisor) + "\n")
    summary = status.summary
    if summary is not None and summary.tenants:
        out.write(summary_line(summary) + "\n")
    if not status.tenants:
        out.write("no tenants registered\n" if summary is None or not summary.tenants else "no tenants listed\n")
        return out.getvalue()
    print_table(HEADERS, [tenant_row(t) for t in status.tenants], out)
    notes = [n for t in status.tenants for n in _notes(t)]
    if notes:
        out.write("\n" + "\n".join(notes) + "\n")
    if status.next is not None:
        out.write(f"\n{len(status.tenants)} listed; more after {status.next!r}: twt status --after "
                  f"{status.next} (or --all)\n")
    return out.getvalue()
