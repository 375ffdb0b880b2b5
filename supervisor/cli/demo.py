"""``twt demo``: start a supervisor, run the bundled WASM guests of six tenants, check what happened.

Thin: the logic is :func:`supervisor.tools.demo.run_demo`. Exit status 0 when
every outcome was as expected and everything was reclaimed, 4 otherwise.
"""

from __future__ import annotations

import argparse

__all__ = ["add_parser", "run"]


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "demo",
        help="the main job: six tenants, five WAT guests and a C-built transformer block, quotas reclaimed",
        description="Start a supervisor (stub backend without a GPU), register six tenants with different "
        "quotas and run the bundled guests: a correct axpy+sum, one over its GPU cap, a runaway loop, one "
        "whose worker is killed mid-run, a 2-layer MLP, and a transformer block built from C with the SDK "
        "(sdk/examples/c/transformer.c). Prints a table and exits non-zero if anything was unexpected.",
    )
    p.add_argument("--backend", choices=("auto", "stub", "cuda"), default="auto",
                   help="compute backend of the demo's supervisor (default: auto)")
    p.add_argument("--start-method", choices=("spawn", "forkserver"), default=None,
                   help="how the supervisor starts workers (default: its configuration's)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from supervisor.tools.demo import run_demo

    return run_demo(backend=args.backend, start_method=args.start_method)
