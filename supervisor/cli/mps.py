"""``twt mps``: is NVIDIA MPS usable here, and why (works without a GPU)."""

from __future__ import annotations

import argparse

from supervisor.host.mps import Mps, detect_mps
from supervisor.cli._common import print_json

__all__ = ["add_parser", "run"]


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("mps", help="probe for a live NVIDIA MPS daemon",
                       description="Print whether MPS would be used (isolation = auto) and the reason.")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    decision = detect_mps()
    if args.json:
        print_json({"mps": decision.active, "reason": decision.reason,
                    "pipe_dir": decision.pipe_dir if isinstance(decision, Mps) else None})
    elif isinstance(decision, Mps):
        print(f"mps: yes ({decision.pipe_dir}): {decision.reason}")
    else:
        print(f"mps: no (process isolation): {decision.reason}")
    return 0
