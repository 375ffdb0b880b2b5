"""``twt chaos``: a seeded fault-injection campaign with invariant checks (docs/RELIABILITY.md).

Thin: the campaign is :func:`supervisor.tools.chaos.run_chaos`. Exit status 0 when
every invariant held, 4 when one was violated (the report says which).
"""

from __future__ import annotations

import argparse
import sys

from shared.exitcodes import EXIT_CHECK, EXIT_OK
from supervisor.tools.progress import progress_stream
from supervisor.cli._common import comma_list, print_json

__all__ = ["add_parser", "run"]



def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from supervisor.tools.chaos import ALL_FAULTS, DEFAULT_FAULTS

    p = sub.add_parser(
        "chaos",
        help="seeded fault-injection campaign: nothing lost, nothing leaked, healthy tenants undisturbed",
        description="Start a supervisor (or use the one on --run-dir), register tenants (some faulty, at least "
        "one healthy), run a seeded alloc/free/write/read/run_wasm workload from several client threads, measure "
        "a fault-free baseline, then inject faults into the faulty tenants only. Checks that every request got "
        "a result or a typed error in time, quota counters equal the live allocations and reach zero, no process "
        "or segment leaked, and healthy tenants saw no error and kept their p99 latency. Exit 4 on a violation.",
    )
    p.add_argument("--duration", type=float, default=60.0, metavar="S",
                   help="seconds of workload, baseline phase included (default: 60)")
    p.add_argument("--seed", type=int, default=1, help="seed of the fault schedule and the workload (default: 1)")
    p.add_argument("--tenants", type=int, default=4, metavar="K", help="tenants to register (default: 4)")
    p.add_argument("--faulty", type=int, default=None, metavar="N",
                   help="how many of them get faults (default: half; at least one stays healthy)")
    p.add_argument("--faults", type=comma_list(ALL_FAULTS, "fault kind"), default=DEFAULT_FAULTS, metavar="KIND,...",
                   help=f"fault kinds (default: {','.join(DEFAULT_FAULTS)}; also sigkill, sigstop)")
    p.add_argument("--rate", type=float, default=1.0, metavar="R",
                   help="faults per second across the faulty tenants (default: 1)")
    p.add_argument("--clients", type=int, default=None, metavar="N",
                   help="client threads, at least one per tenant (default: two per tenant, at most 12)")
    p.add_argument("--baseline", type=float, default=None, metavar="S",
                   help="seconds of the fault-free phase (default: a quarter of the duration, 2..15)")
    p.add_argument("--latency-factor", type=float, default=3.0, metavar="X",
                   help="healthy p99 must stay within X times the baseline's (default: 3; 0: do not check)")
    p.add_argument("--grace", type=float, default=1.0, metavar="S",
                   help="seconds past a request's deadline before it counts as late (default: 1)")
    p.add_argument("--backend", choices=("auto", "stub", "cuda"), default="stub",
                   help="backend of the supervisor started here (default: stub)")
    p.add_argument("--start-method", choices=("spawn", "forkserver"), default="forkserver",
                   help="how that supervisor starts workers (default: forkserver)")
    p.add_argument("--run-dir", default=None,
                   help="use the supervisor running on this run directory instead of starting one (default: start one)")
    p.add_argument("--supervisor-log", default=None, metavar="FILE",
                   help="append the started supervisor's log to FILE (default: discarded)")
    p.add_argument("--schedule", action="store_true",
                   help="print the fault schedule and its hash, start nothing")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from supervisor.tools.chaos import (
        ChaosConfig,
        build_schedule,
        format_report,
        run_chaos,
        schedule_hash,
    )

    cfg = ChaosConfig(
        duration_s=args.duration, seed=args.seed, tenants=args.tenants, faulty=args.faulty, faults=args.faults,
        rate=args.rate, clients=args.clients, baseline_s=args.baseline,
        latency_factor=args.latency_factor or None, grace_s=args.grace, backend=args.backend,
        start_method=args.start_method, run_dir=args.run_dir, supervisor_log=args.supervisor_log,
    )
    if args.schedule:
        targets = [(name, inst) for name, healthy, inst in cfg.roles() if not healthy]
        schedule = build_schedule(cfg.seed, cfg.faults, cfg.rate, cfg.fault_phase, targets)
        if args.json:
            print_json({"hash": schedule_hash(schedule), "faults": [f.to_dict() for f in schedule]})
        else:
            for f in schedule:
                params = " ".join(f"{k}={v}" for k, v in f.params)
                print(f"{f.at_s:9.3f}  {f.tenant}/{f.instance}  {'heal' if f.heal else f.kind} {params}".rstrip())
            print(f"schedule {schedule_hash(schedule)}: {len(schedule)} faults")
        return 0
    report = run_chaos(cfg, progress=None if args.json else sys.stderr, live=progress_stream(args.json))
    if args.json:
        print_json(report)
    else:
        print(format_report(report))
    return EXIT_OK if report["ok"] else EXIT_CHECK
