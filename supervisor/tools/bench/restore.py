"""``twt bench restore``: how long a restarted supervisor takes to bring its tenants back.

In one run (stub backend), per round:

* **register**: a supervisor with an empty state registers N tenants from
  scratch, one ``register`` call after the other (each returns once its
  worker is ready) - what an operator's script does after a restart without
  durable state;
* it is stopped; a new supervisor starts on the same state directory and
  restores the N tenants (registry key, specs, generations; every instance
  started). **restore** is its time from start to ready minus the time from
  start to ready of a supervisor with an empty state, measured in the same
  round (process start-up is not restore work);
* every capability minted before the restart is checked to still work.

Target: restore <= 2x register (the median over rounds).

Typing: the reports (and the event maps they are built from) are JSON-shaped dicts,
written here and read back by key to print and check them; their values stay dynamically typed.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from contextlib import AbstractContextManager
from typing import Any

from shared.spec import TenantSpec
from supervisor.tools.bench._report import Report, Target, count, format_table
from supervisor.client.launch import SupervisorHandle, launch

__all__ = ["main"]


def _start(state_dir: str, method: str) -> AbstractContextManager[SupervisorHandle]:
    return launch(
        {"supervisor": {"pool_size": 2, "log_level": "warning"}, "tenant": []},
        backend="stub",
        start_method=method,
        extra_args=["--state-dir", state_dir],
        ready_timeout_s=300.0,
    )


def _round(n: int, method: str) -> dict[str, Any]:  # a JSON report row (numbers), read back below
    state = tempfile.mkdtemp(prefix="twt-bench-state-")
    empty_state = tempfile.mkdtemp(prefix="twt-bench-empty-")
    try:
        with _start(state, method) as sup:
            t0 = time.perf_counter()
            caps = [sup.client.register(None, TenantSpec(f"t{i:03d}")) for i in range(n)]
            register_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        with _start(empty_state, method):
            empty_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        with _start(state, method) as sup:
            ready_s = time.perf_counter() - t0
            running = sum(1 for rec in sup.client.status().tenants if rec.state == "running")
            served = sum(1 for cap in caps if sup.client.ping(cap).tenant)
        return {"register_s": register_s, "empty_start_s": empty_s, "restored_start_s": ready_s,
                "restore_s": max(0.0, ready_s - empty_s), "running": running, "served": served}
    finally:
        shutil.rmtree(state, ignore_errors=True)
        shutil.rmtree(empty_state, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="twt bench restore", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--tenants", type=count, default=64, help="tenants to register and restore (default 64)")
    parser.add_argument("--rounds", type=count, default=3, help="rounds; medians are reported (default 3)")
    parser.add_argument("--start-method", choices=["spawn", "forkserver"], default="forkserver")
    args = parser.parse_args(argv)
    report = Report("restore")
    rounds = [_round(args.tenants, args.start_method) for _ in range(max(1, args.rounds))]

    def med(key: str) -> float:
        return float(statistics.median(r[key] for r in rounds))

    ratio = med("restore_s") / med("register_s")
    report.sections.append((f"{args.tenants} tenants, {args.start_method}, median of {len(rounds)} (s)", format_table(
        ["figure", "value"],
        [
            [f"register {args.tenants} from scratch", med("register_s")],
            ["start to ready, empty state", med("empty_start_s")],
            [f"start to ready, {args.tenants} tenants restored", med("restored_start_s")],
            ["restore (the difference)", med("restore_s")],
            ["restore / register", ratio],
            ["tenants running after restore (min)", min(r["running"] for r in rounds)],
            ["old capabilities served (min)", min(r["served"] for r in rounds)],
        ],
    )))
    report.targets += [
        Target(f"restore of {args.tenants} vs registering them", ratio, 2.0, higher_is_better=False),
        Target("capabilities minted before the restart served", float(min(r["served"] for r in rounds)),
               float(args.tenants), unit=""),
    ]
    report.data.update(rounds=rounds, ratio=ratio)
    return report.emit(as_json=args.json)
