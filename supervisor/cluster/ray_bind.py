"""Ray on the address the operator names: what binds where, and Ray's directories private.

What the installed Ray (2.60) does, measured with ``ss -ltnp`` on its processes
(docs/CLUSTER.md, "Securing a real cluster"):

* **Loopback (one host: the benches, the tests, a laptop).** With
  ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` in the environment of the process that
  starts Ray (``ray start`` or a driver's ``ray.init(address="local")``) and the
  node address ``127.0.0.1``, every Ray process binds 127.0.0.1 only: the GCS,
  the raylet (node and object manager), every core worker (drivers included),
  the runtime-env agent and the autoscaler monitor's metrics. Without that
  variable Ray replaces a loopback ``--node-ip-address`` / ``_node_ip_address``
  by the host's primary address (``resolve_ip_for_localhost``) and its C++
  servers then bind the wildcard (``*``): ``_node_ip_address="127.0.0.1"``
  alone does not keep Ray on loopback. The variable also refuses worker nodes
  that join with ``ray start --address`` (a multi-host cluster needs Ray's
  cluster mode).
* **Another address (a multi-host cluster).** ``--node-ip-address=ADDR`` is
  what Ray advertises and what its Python agents bind (the runtime-env agent);
  its C++ servers - the GCS, the raylet's node manager and object manager,
  every core worker - bind the wildcard whatever the flag says, and the
  autoscaler monitor's metrics (port 44217) and the dashboard agent bind every
  interface. No flag or variable of this Ray changes that: firewall the Ray
  ports to the cluster's own nodes and turn on Ray's token authentication.

Ray creates its temporary root, session, log, socket and runtime-resource
directories mode 0777 (``ray._common.utils.try_make_directory_shared``).
:func:`private_ray_temp_dir` puts them under a fresh 0700 directory of ours
and :func:`tighten` makes those Ray made 0700 once it is up.

Owns: nothing (functions only). Threads: any.
"""

from __future__ import annotations

import ipaddress
import os
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "LOOPBACK_RAY_ENV",
    "Listener",
    "exposed",
    "init_loopback_ray",
    "listeners_of",
    "loopback_ray_env",
    "private_ray_temp_dir",
    "tighten",
]

#: the environment that keeps a one-host Ray on 127.0.0.1 (see the module docstring); set it
#: before ``ray`` is imported (its constants are read at import) and in ``ray start``'s environment
LOOPBACK_RAY_ENV: Mapping[str, str] = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


def loopback_ray_env() -> None:
    """Keep the Ray this process starts (``ray.init(address="local", _node_ip_address="127.0.0.1")``)
    on loopback: :data:`LOOPBACK_RAY_ENV` in ``os.environ`` (Ray's children inherit it), and in
    Ray's constants when ``ray`` was imported already."""
    import sys

    os.environ.update(LOOPBACK_RAY_ENV)
    constants = sys.modules.get("ray._private.ray_constants")
    if constants is not None:  # read at import: the module attribute is what Ray consults later
        constants.ENABLE_RAY_CLUSTER = False  # type: ignore[attr-defined]


def init_loopback_ray(temp_dir: str, **options: Any) -> Any:
    """``ray.init`` of a new one-node Ray of this process's own, every process of it bound to
    127.0.0.1, no dashboard, its directories 0700 (``temp_dir``: from :func:`private_ray_temp_dir`);
    returns the ``ray`` module. ``options`` go to ``ray.init`` (num_cpus, namespace, ...)."""
    loopback_ray_env()
    import ray

    ray.init(address="local", _node_ip_address="127.0.0.1", _temp_dir=temp_dir, include_dashboard=False,
             **options)
    tighten(temp_dir)
    return ray


def private_ray_temp_dir(parent: str | None = None) -> str:
    """A Ray temp dir (``_temp_dir`` / ``--temp-dir``) inside a fresh 0700 directory of ours:
    whatever modes Ray gives what it makes there, no other user can reach it. Remove
    ``os.path.dirname(result)`` when done."""
    root = tempfile.mkdtemp(prefix="twt-ray-", dir=parent)  # 0700
    path = os.path.join(root, "ray")
    os.mkdir(path, 0o700)
    return path


def tighten(temp_dir: str) -> list[str]:
    """Make every directory under ``temp_dir`` (itself included) 0700 and every file there
    0600 or stricter for group and others (Ray made them 0777/0644); the paths changed.
    Symlinks are left alone; a path gone meanwhile is skipped."""
    changed = []
    for top, dirs, files in os.walk(temp_dir):
        for path, want in [(top, 0o700)] + [(os.path.join(top, f), None) for f in files]:
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                continue
            if os.path.islink(path):
                continue
            mode = st.st_mode & 0o7777
            new = want if want is not None else mode & 0o700
            if mode != new:
                try:
                    os.chmod(path, new)
                except FileNotFoundError:
                    continue
                changed.append(path)
        dirs[:] = [d for d in dirs if not os.path.islink(os.path.join(top, d))]
    return changed


@dataclass(frozen=True, slots=True)
class Listener:
    """A listening TCP socket: its process and local address."""

    pid: int
    name: str
    ip: str
    port: int

    @property
    def wildcard(self) -> bool:
        return self.ip in ("0.0.0.0", "::", "*")


def listeners_of(pids: Iterable[int]) -> list[Listener]:
    """The listening TCP sockets of ``pids`` (``ss -ltnp``, through psutil)."""
    import psutil

    wanted = set(pids)
    out = []
    for conn in psutil.net_connections(kind="tcp"):
        if conn.status != psutil.CONN_LISTEN or conn.pid not in wanted:
            continue
        try:
            name = psutil.Process(conn.pid).name()
        except psutil.Error:
            name = "?"
        out.append(Listener(conn.pid, name, conn.laddr.ip, conn.laddr.port))
    return out


def exposed(listeners: Iterable[Listener], address: str) -> list[Listener]:
    """The listeners not bound to ``address`` (an IPv4 one may show as ``::ffff:ADDR`` on a dual-stack
    socket): a wildcard, or another interface."""
    want = ipaddress.ip_address(address)
    out = []
    for lst in listeners:
        try:
            ip = ipaddress.ip_address(lst.ip)
        except ValueError:
            out.append(lst)
            continue
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        if ip != want:
            out.append(lst)
    return out
