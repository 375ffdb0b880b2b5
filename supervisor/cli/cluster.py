"""``twt cluster up|status|down|register|evict|scale``: a supervisor per GPU node of a Ray cluster ([ray] extra).

    $ twt cluster up --address auto --config tenants.toml --cap-dir ./caps
    acme  node 4be0c2a1f3d9  capability written to caps/acme.twtc
    $ twt cluster status --address auto
    cluster twt  ray 10.0.0.1:6379  ray auth token
    NODE          ALIVE  ENDPOINT              GPUS     FREE/CAPACITY   TENANTS
    ------------  -----  --------------------  -------  --------------  -------
    4be0c2a1f3d9  yes    tcp://10.0.0.5:41231  1 (id 0)  14GiB/15.5GiB   acme
    $ twt cluster register beta --gpu-cap 2GiB --cap-out beta.twtc
    $ twt cluster scale beta 2
    $ twt cluster evict beta
    $ twt cluster down --address auto

``register`` takes the flags of ``twt register`` (or ``--file``) and prints
the cluster capability (``twtc1.``...: a secret, like a capability) or
writes it to ``--cap-out`` (0600). Tenants of ``up --config`` are placed and
registered through the cluster's directory, each once; their capabilities
are printed, or written to ``--cap-dir``.

Typing: Ray is untyped here (mypy follows no ray import), so actor handles and ray.get()
results are dynamically typed; the directory's maps (status, placement, evict and scale results)
are JSON-shaped dicts handed to operators as they are (twt cluster, --json).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from shared.sizes import format_size
from supervisor.cli._common import non_negative_int, print_json, print_table

if TYPE_CHECKING:
    from supervisor.cluster.directory import ClusterStatus
    from supervisor.cluster.ray_cluster import RayCluster

__all__ = ["add_parser", "render", "run"]

ACTIONS = ("up", "status", "down", "register", "evict", "scale")


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from supervisor.cli.commands._cli import spec_flags

    p = sub.add_parser(
        "cluster",
        help="deploy, show or stop a supervisor per GPU node of a Ray cluster; place its tenants",
        description="up: start one supervisor per Ray node with GPUs (a Ray actor each, CURVE TCP frontend on the "
        "node's address) and a detached directory actor that places tenants and re-places them when a node is "
        "lost; the --config file's [[tenant]] tables are placed through it. status: nodes and tenants. down: "
        "stop every node's supervisor and the directory. register TENANT (flags as twt register): place a "
        "tenant, print its cluster capability. evict TENANT. scale TENANT N. See docs/CLUSTER.md.",
    )
    p.add_argument("action", choices=ACTIONS)
    p.add_argument("tenant", nargs="?", metavar="TENANT", help="register, evict, scale: the tenant")
    p.add_argument("count", nargs="?", type=non_negative_int, metavar="N", help="scale: worker instances")
    p.add_argument("--address", default=None, help="Ray cluster address (default: $RAY_ADDRESS or auto)")
    p.add_argument("--name", default="twt", help="the deployment's name (its directory actor), default twt")
    p.add_argument("--config", metavar="FILE",
                   help="up: TOML config of the node supervisors ([supervisor] and [[tenant]] tables) (default: none)")
    p.add_argument("--listen-host", metavar="HOST",
                   help="up: listen on this host instead of each node's Ray address (default: the node's address)")
    p.add_argument("--cap-dir", metavar="DIR",
                   help="up: write each config tenant's cluster capability to DIR/TENANT.twtc (0600) "
                   "(default: print them)")
    p.add_argument("--node", metavar="NODE_ID", help="register: on this node (default: the most free GPU budget)")
    p.add_argument("--cap-out", metavar="FILE",
                   help="register: write the cluster capability to FILE (0600) (default: print it)")
    spec_flags(p)
    p.add_argument("--json", action="store_true", help="print the raw record")
    p.set_defaults(func=run)


def gpus_cell(gpu_ids: list[str]) -> str:
    """``1 (id 0)``, ``2 (ids 0,1)`` or ``0``: how many GPUs the node's supervisor holds, and which."""
    if not gpu_ids:
        return "0"
    return f"{len(gpu_ids)} (id{'s' if len(gpu_ids) > 1 else ''} {','.join(gpu_ids)})"


def render(status: ClusterStatus, out: TextIO | None = None) -> None:
    out = out or sys.stdout
    auth = status.get("ray_auth", "unknown")
    out.write(f"cluster {status.get('cluster')}  ray {status.get('address')}  ray auth {auth}\n")
    if auth != "token":
        out.write("warning: Ray runs without token authentication: whoever reaches its ports runs code on every "
                  "node (RAY_AUTH_MODE=token; docs/CLUSTER.md, Securing a real cluster)\n")
    rows = [
        (n["node_id"][:12], "yes" if n["alive"] else "LOST", n["endpoint"], gpus_cell(list(n["gpu_ids"])),
         f"{format_size(n['free_bytes'])}/{format_size(n['capacity_bytes'])}", ",".join(n["tenants"]) or "-")
        for n in status["nodes"]
    ]
    print_table(("NODE", "ALIVE", "ENDPOINT", "GPUS", "FREE/CAPACITY", "TENANTS"), rows, out)
    if status["tenants"]:
        out.write("\n")
        print_table(("TENANT", "NODE", "STATE", "PLACEMENT", "INST", "EPOCH", "REASON"),
                    [(t["tenant_id"], t["node_id"][:12], t["state"], t["placement"], t.get("instances", 1),
                      t["epoch"], t["reason"] or "") for t in status["tenants"]], out)


def _write_secret(path: Path, text: str) -> None:
    """``text`` and a newline, in a new 0600 file (replaced atomically)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="ascii") as f:
        f.write(text + "\n")
    os.replace(tmp, path)


def _needs(args: argparse.Namespace, *, tenant: bool, instances: bool = False) -> None:
    """Refuse arguments an action does not take, and missing ones it needs (before Ray is contacted)."""
    if tenant and args.tenant is None:
        raise ValueError(f"cluster {args.action} needs a TENANT")
    if not tenant and args.tenant is not None:
        raise ValueError(f"cluster {args.action} takes no TENANT (got {args.tenant!r})")
    if instances and args.count is None:
        raise ValueError("cluster scale needs TENANT and N")
    if not instances and args.count is not None:
        raise ValueError(f"cluster {args.action} takes no N")


def run(args: argparse.Namespace) -> int:
    from supervisor.cli.commands._cli import build_spec, has_spec_flags

    action = args.action
    _needs(args, tenant=action in ("register", "evict", "scale"), instances=action == "scale")
    if action != "register" and (has_spec_flags(args) or args.node or args.cap_out):
        raise ValueError(f"cluster {action} takes no tenant spec flags, --node or --cap-out (they are register's)")
    if action != "up" and (args.config or args.listen_host or args.cap_dir):
        raise ValueError(f"--config, --listen-host and --cap-dir go with cluster up, not {action}")
    if args.cap_dir and not os.path.isdir(args.cap_dir):
        raise ValueError(f"--cap-dir {args.cap_dir} is not a directory")
    spec = None
    if action == "register":
        spec = build_spec(args)

    from supervisor.cluster import RayCluster

    if action == "up":
        cluster = RayCluster.deploy(args.config, args.address, name=args.name, listen_host=args.listen_host)
        return _report_up(args, cluster)
    cluster = RayCluster.connect(args.address, name=args.name)
    if action == "down":
        stopped = cluster.shutdown()
        if args.json:
            print_json(stopped)
        else:
            print(f"cluster {args.name!r} stopped: {len(stopped['stopped'])} node supervisor(s)")
        return 0
    if action == "register":
        assert spec is not None
        cc = cluster.register(spec, node=args.node)
        if args.cap_out:
            _write_secret(Path(args.cap_out), cc.to_text())
        if args.json:
            print_json({"tenant": cc.tenant_id, "node_id": cc.node_id, "endpoint": cc.endpoint,
                        "capability": None if args.cap_out else cc.to_text(), "cap_file": args.cap_out})
        elif args.cap_out:
            print(f"{cc.tenant_id}: placed on node {cc.node_id[:12]} ({cc.endpoint}); capability written to "
                  f"{args.cap_out}")
        else:
            print(cc.to_text())
            print(f"{cc.tenant_id}: placed on node {cc.node_id[:12]} ({cc.endpoint})", file=sys.stderr)
        return 0
    if action == "evict":
        evicted = cluster.evict(args.tenant)
        if args.json:
            print_json(evicted)
        else:
            print(f"evicted {args.tenant} from node {str(evicted.get('node_id'))[:12]}")
        return 0
    if action == "scale":
        scaled = cluster.scale(args.tenant, args.count)
        if args.json:
            print_json(scaled)
        else:
            pids = ",".join(str(p) for p in scaled.get("pids") or []) or "-"
            print(f"{args.tenant}: {args.count} instance(s) on node {str(scaled['node_id'])[:12]}, state "
                  f"{scaled.get('state')} (pids {pids})")
        return 0
    status = cluster.status()
    if args.json:
        print_json(status)
    else:
        render(status)
    return 0


def _report_up(args: argparse.Namespace, cluster: RayCluster) -> int:
    """After ``up``: the config tenants' cluster capabilities (printed, or written to --cap-dir)."""
    status = cluster.status()
    written = {}
    for tid, cc in cluster.registered.items():
        if args.cap_dir:
            path = Path(args.cap_dir) / f"{tid}.twtc"
            _write_secret(path, cc.to_text())
            written[tid] = str(path)
    if args.json:
        print_json({**status, "registered": {tid: (written.get(tid) if args.cap_dir else cc.to_text())
                                             for tid, cc in cluster.registered.items()}})
        return 0
    render(status)
    for tid, cc in cluster.registered.items():
        where = f"capability written to {written[tid]}" if args.cap_dir else cc.to_text()
        print(f"{tid}  node {cc.node_id[:12]}  {where}")
    return 0
