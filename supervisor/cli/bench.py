"""``twt bench NAME|all [options]``: the benchmark programs (see :mod:`supervisor.tools.bench`)."""

from __future__ import annotations

import argparse

__all__ = ["add_parser", "run"]


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from supervisor.tools.bench import BENCHES

    p = sub.add_parser(
        "bench",
        help="run a benchmark program",
        description="Measure against a baseline taken in the same run and print ratios with PASS/MISS "
        f"targets; exit 4 when a target is missed. Benchmarks: {', '.join(BENCHES)}, all.",
    )
    p.add_argument("name", help="benchmark name or 'all'")
    p.add_argument("rest", nargs=argparse.REMAINDER, help="options of that benchmark (e.g. --json, --help)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from supervisor.tools.bench import main as bench_main

    return bench_main([args.name, *args.rest])
