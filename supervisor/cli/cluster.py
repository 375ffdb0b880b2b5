"""``twt cluster up|status|down``: a supervisor per GPU node of a Ray cluster (needs the [ray] extra).

    $ twt cluster up --address auto --config tenants.toml
    $ twt cluster status --address auto
    NODE          ALIVE  ENDPOINT              GPUS  FREE/CAPACITY   TENANTS
    ------------  -----  --------------------  ----  --------------  -------
    4be0c2a1f3d9  yes    tcp://10.0.0.5:41231  0     14GiB/15.5GiB   acme
    $ twt cluster down --address auto
"""

from __future__ import annotations

import argparse
from typing import Any

from shared.sizes import format_size
from supervisor.cli._common import print_json, print_table

__all__ = ["add_parser", "run"]


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "cluster",
        help="deploy, show or stop a supervisor per GPU node of a Ray cluster",
        description="up: start one supervisor per Ray node with GPUs (a Ray actor each, CURVE TCP frontend on the "
        "node's address) and a detached directory actor that places tenants and re-places them when a node is "
        "lost. status: nodes and tenants. down: stop every node's supervisor and the directory. "
        "See docs/CLUSTER.md.",
    )
    p.add_argument("action", choices=["up", "status", "down"])
    p.add_argument("--address", default=None, help="Ray cluster address (default: $RAY_ADDRESS or auto)")
    p.add_argument("--name", default="twt", help="the deployment's name (its directory actor), default twt")
    p.add_argument("--config", metavar="FILE",
                   help="TOML config of the node supervisors ([supervisor] and [[tenant]] tables) (default: none)")
    p.add_argument("--listen-host", metavar="HOST",
                   help="listen on this host instead of each node's Ray address (up) (default: the node's address)")
    p.add_argument("--json", action="store_true", help="print the raw status record")
    p.set_defaults(func=run)


def render(status: dict[str, Any]) -> None:
    rows = [
        (n["node_id"][:12], "yes" if n["alive"] else "LOST", n["endpoint"], ",".join(n["gpu_ids"]) or "-",
         f"{format_size(n['free_bytes'])}/{format_size(n['capacity_bytes'])}", ",".join(n["tenants"]) or "-")
        for n in status["nodes"]
    ]
    print_table(("NODE", "ALIVE", "ENDPOINT", "GPUS", "FREE/CAPACITY", "TENANTS"), rows)
    if status["tenants"]:
        print()
        print_table(("TENANT", "NODE", "STATE", "PLACEMENT", "EPOCH", "REASON"),
                    [(t["tenant_id"], t["node_id"][:12], t["state"], t["placement"], t["epoch"], t["reason"] or "")
                     for t in status["tenants"]])


def run(args: argparse.Namespace) -> int:
    from supervisor.cluster import RayCluster

    if args.action == "up":
        cluster = RayCluster.deploy(args.config, args.address, name=args.name, listen_host=args.listen_host)
    else:
        cluster = RayCluster.connect(args.address, name=args.name)
    if args.action == "down":
        result = cluster.shutdown()
        if args.json:
            print_json(result)
        else:
            print(f"cluster {args.name!r} stopped: {len(result['stopped'])} node supervisor(s)")
        return 0
    status = cluster.status()
    if args.json:
        print_json(status)
    else:
        render(status)
    return 0
