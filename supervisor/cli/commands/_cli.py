"""What the command halves of several admin ops share.

The tenant spec's flags (``twt register``, ``twt set-quota``, and ``twt cluster
register`` in :mod:`supervisor.cli.cluster`), the capability output of
``register`` and ``capability``, the lines that describe a tenant record
(``register``, ``set-quota``, ``scale``, ``reset``, ``restart``), and a
supervisor that does not answer a read in time counted as unreachable.
"""

from __future__ import annotations

import argparse
import os
import sys
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from shared.capability import (
    MonitorCapability,
    TenantCapability,
    capability_to_text,
    read_capability_file,
    write_capability_file,
)
from shared.errors import RequestTimeout, SupervisorUnavailable
from shared.records import StatusRecord, TenantRecord
from shared.sizes import decimal_size_note, format_size, parse_size
from shared.spec import IsolationKind, RestartPolicy, TenantSpec
from supervisor.client.api import SupervisorClient
from supervisor.client.cli_args import non_negative_int, positive_seconds, print_json

__all__ = [
    "ADMIN_TIMEOUT_S",
    "SERVICE_TIMEOUT_S",
    "SPEC_FLAGS",
    "add_cap_out",
    "add_capability_option",
    "build_spec",
    "check_cap_out",
    "emit_capability",
    "fetch_tenant",
    "fetch_status",
    "has_spec_flags",
    "instances_line",
    "limits_line",
    "say_decimal_sizes",
    "spec_flags",
    "specs_from_file",
    "tenant_argument",
    "tenant_capability_file",
    "tenant_capability_of",
    "tenant_line",
    "unreachable_on_timeout",
]

#: admin calls that may wait for worker processes (register, evict) get at least this long
ADMIN_TIMEOUT_S = 60.0
#: reload, reset and restart wait for worker processes
SERVICE_TIMEOUT_S = 120.0
_NONE_WORDS = ("none", "unlimited", "off")

# ---------------------------------------------------------------- arg types


class _SizeArg(int):
    """A size flag's bytes, remembering what a decimal unit was taken as (``--gpu-cap 2GB``)."""

    note: str | None = None


def _size(value: str) -> int:
    try:
        n = _SizeArg(parse_size(value))
        n.note = decimal_size_note(value)
        return n
    except (TypeError, ValueError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def say_decimal_sizes(args: argparse.Namespace) -> None:
    """One stderr line per decimal size flag (``2GB`` is 2,000,000,000 B, not 2GiB); plain ints after."""
    for flag, dest, _, _, _ in SPEC_FLAGS:
        value = getattr(args, dest, None)
        if isinstance(value, _SizeArg):
            if value.note is not None:
                print(f"twt: note: {flag} {value.note}", file=sys.stderr)
            setattr(args, dest, int(value))


def _size_or_none(value: str) -> int | None:
    return None if value.strip().lower() in _NONE_WORDS else _size(value)


def _weight(value: str) -> float:
    """A GPU-time weight: a number > 0 (the supervisor checks the range again, naming the key)."""
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a weight is a number > 0, got {value!r}") from None
    if not number > 0 or number == float("inf"):
        raise argparse.ArgumentTypeError(f"a weight is a number > 0, got {value!r}")
    return number


def _fraction_or_none(value: str) -> float | None:
    """A GPU-time cap: ``none``, a fraction in (0, 1], or a percentage (``25%``)."""
    text = value.strip().lower()
    if text in _NONE_WORDS:
        return None
    try:
        number = float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a cap is a fraction in (0, 1], a percentage or none, got {value!r}") from None
    if not 0 < number <= 1:
        raise argparse.ArgumentTypeError(f"a cap is a fraction in (0, 1], a percentage or none, got {value!r}")
    return number


def _seconds_or_none(value: str) -> float | None:
    """A time in seconds > 0, or ``none``."""
    if value.strip().lower() in _NONE_WORDS:
        return None
    return positive_seconds(value)


# ----------------------------------------------------------------- the tenant spec's flags

#: register flag -> (TenantSpec field, argparse type, metavar, help)
SPEC_FLAGS: tuple[tuple[str, str, Callable[[str], object], str, str], ...] = (
    ("--memory-quota", "memory_quota_bytes", _size, "SIZE", "host memory quota, e.g. 2GiB (default 8GiB)"),
    ("--gpu-cap", "gpu_memory_bytes_cap", _size_or_none, "SIZE|none", "hard GPU byte cap (default none: counted, never refused)"),
    ("--pool-quota", "recorded_cuda_mem_pool_quota", _size_or_none, "SIZE|none",
     "recorded CUDA pool quota (a retention hint, not a cap; default none)"),
    ("--device", "cuda_device_index", non_negative_int, "N", "CUDA device index (default: placement policy)"),
    ("--sm-percentage", "sm_percentage", non_negative_int, "PCT", "MPS active thread percentage 1..100 (MPS only; default none: all SMs)"),
    ("--instances", "instances", non_negative_int, "N", "worker processes sharing the quota (default 1)"),
    ("--max-restarts", "max_restarts", non_negative_int, "N", "restarts allowed within --restart-window (default 5)"),
    ("--restart-window", "restart_window_s", positive_seconds, "S", "restart intensity window in seconds (default 60)"),
    ("--max-in-flight", "max_in_flight", non_negative_int, "N", "requests in flight before Overloaded (default 64)"),
    ("--request-timeout", "request_timeout_s", positive_seconds, "S", "per-request deadline in seconds (default 30)"),
    ("--wasm-fuel", "wasm_fuel", non_negative_int, "N", "default and ceiling of a WASM run's fuel (default 2000000000)"),
    ("--wasm-timeout", "wasm_timeout_s", positive_seconds, "S", "default and ceiling of a WASM run's time (default 10)"),
    ("--wasm-max-memory", "wasm_max_memory_bytes", _size, "SIZE", "largest WASM linear memory (default 256MiB)"),
    ("--gpu-time-weight", "gpu_time_weight", _weight, "W",
     "work-conserving weight of the tenant's GPU time on its device (default 1)"),
    ("--gpu-time-cap", "gpu_time_cap", _fraction_or_none, "F|none",
     "hard ceiling on the tenant's fraction of its device's time, 0 < F <= 1 (default none)"),
    ("--idle-timeout", "idle_timeout_s", _seconds_or_none, "S|none",
     "park the tenant after S seconds without a request (default none: never parks)"),
)
def spec_flags(p: argparse.ArgumentParser) -> None:
    """``--file TOML`` and every tenant spec flag (``twt register``, ``twt cluster register``)."""
    p.add_argument("--file", metavar="TOML", help="read the tenant spec from this TOML file (default: none, flags only)")
    for flag, dest, typ, metavar, text in SPEC_FLAGS:
        p.add_argument(flag, dest=dest, type=typ, metavar=metavar, help=text, default=argparse.SUPPRESS)
    p.add_argument("--isolation", choices=[k.value for k in IsolationKind], default=argparse.SUPPRESS,
                   help="process (default), mps, or auto")
    p.add_argument("--restart", choices=[k.value for k in RestartPolicy], default=argparse.SUPPRESS,
                   help="restart policy (default always)")


def has_spec_flags(args: argparse.Namespace) -> bool:
    """Whether any tenant spec flag (or --file) was given."""
    return bool(getattr(args, "file", None)) or any(
        hasattr(args, dest) for dest in [d for _, d, _, _, _ in SPEC_FLAGS] + ["isolation", "restart"])


def specs_from_file(path: str) -> list[dict[str, object]]:
    """Tenant tables from a TOML file: ``[[tenant]]`` tables, or the top level as one tenant table."""
    try:
        with open(path, "rb") as f:
            doc = tomllib.load(f)
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{path} is not valid TOML: {exc}") from None
    if "tenant" in doc:
        tables = doc["tenant"]
        if isinstance(tables, dict):
            tables = [tables]
        if not isinstance(tables, list) or not all(isinstance(t, dict) for t in tables):
            raise ValueError(f"{path}: 'tenant' must be [[tenant]] tables")
        return [dict(t) for t in tables]
    doc.pop("supervisor", None)
    return [dict(doc)]


def _tenant_name(table: dict[str, object]) -> str | None:
    name = table.get("tenant_id", table.get("name"))
    return None if name is None else str(name)


def build_spec(args: argparse.Namespace) -> TenantSpec:
    """The spec from --file and/or the flags (flags win); ValueError/TypeError name what is wrong."""
    say_decimal_sizes(args)
    base: dict[str, object] = {}
    tid = args.tenant
    if args.file:
        tables = specs_from_file(args.file)
        have = ", ".join(str(_tenant_name(t)) for t in tables)
        if args.tenant is None:
            if len(tables) != 1:
                raise ValueError(f"{args.file} holds {len(tables)} tenants ({have}); name the one to register")
            table = tables[0]
        else:
            named = [t for t in tables if _tenant_name(t) == args.tenant]
            if not named and len(tables) == 1 and _tenant_name(tables[0]) is None:
                named = tables  # one unnamed table: TENANT names it
            if not named:
                raise ValueError(f"{args.file} has no tenant {args.tenant!r} (it has: {have})")
            table = named[0]
        tid = args.tenant or _tenant_name(table)
        base = {k: v for k, v in table.items() if k not in ("name", "tenant_id")}
    if tid is None:
        raise ValueError("register needs a TENANT id (on the command line, or as name = ... in --file)")
    for _, dest, _, _, _ in SPEC_FLAGS:
        if hasattr(args, dest):
            base[dest] = getattr(args, dest)
    for dest in ("isolation", "restart"):
        if hasattr(args, dest):
            base[dest] = getattr(args, dest)
    try:
        return TenantSpec.from_dict({**base, "tenant_id": tid})
    except TypeError as exc:  # a wrongly typed value in the file or on the command line: the user's input
        raise ValueError(str(exc)) from None


def check_cap_out(path: str | None) -> None:
    """Fail before registering when the capability could not be written afterwards."""
    if path is None:
        return
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise ValueError(f"--cap-out {path}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise PermissionError(f"--cap-out {path}: directory {parent} is not writable")
    if os.path.isdir(path):
        raise ValueError(f"--cap-out {path} is a directory")


def emit_capability(args: argparse.Namespace, tenant_id: str, cap: TenantCapability | MonitorCapability,
                     applied: TenantRecord | None = None) -> None:
    """The capability (stdout, or --cap-out) and, from register, the limits the supervisor applied:
    on stdout beside --cap-out, else on stderr (``CAP=$(twt register acme)`` captures only the capability)."""
    hex_cap = capability_to_text(cap)
    if args.cap_out:
        write_capability_file(args.cap_out, cap)
    if args.json:
        out: dict[str, object] = {"tenant": tenant_id, "capability": None if args.cap_out else hex_cap,
                               "cap_file": args.cap_out}
        if applied is not None:
            out["limits"] = _applied_limits(applied)
        print_json(out)
        return
    if args.cap_out:
        print(f"{tenant_id}: capability written to {args.cap_out}")
    else:
        print(hex_cap)
    if applied is not None:
        print(limits_line(applied) + f"; {instances_line(applied).split(': ', 1)[1]}",
              file=sys.stdout if args.cap_out else sys.stderr)


def _applied_limits(rec: TenantRecord) -> dict[str, object]:
    """The limits a registered tenant runs with, from its status record (what the supervisor applied)."""
    keys = ("memory_quota_bytes", "gpu_memory_bytes_cap", "recorded_cuda_mem_pool_quota", "instances",
            "cuda_device_index", "isolation", "restart", "max_restarts", "restart_window_s", "max_in_flight",
            "request_timeout_s", "wasm_fuel", "wasm_timeout_s", "wasm_max_memory_bytes")
    spec = rec.spec.to_dict() if rec.spec is not None else {}
    limits = {k: spec[k] for k in keys if k in spec}
    limits["memory_quota_bytes"] = rec.memory_quota_bytes
    limits["gpu_memory_bytes_cap"] = rec.gpu_memory_bytes_cap
    limits["device"] = rec.device
    return limits


def limits_line(rec: TenantRecord) -> str:
    cap = rec.gpu_memory_bytes_cap
    pool = rec.quota.cuda_mem_pool_quota_bytes if rec.quota else None
    return (f"{rec.tenant_id}: memory quota {format_size(rec.memory_quota_bytes)}, "
            f"GPU cap {'none' if cap is None else format_size(cap)}, "
            f"pool quota {'none' if pool is None else format_size(pool)} "
            f"(in use: {format_size(rec.bytes_in_use)} host, {format_size(rec.gpu_bytes_in_use)} GPU)"
            + _gpu_time_text(rec))


def _gpu_time_text(rec: TenantRecord) -> str:
    g = rec.gpu_time
    if not g:
        return ""
    cap = g.get("cap")
    return (f"; GPU time weight {g.get('weight', 1.0):g}, cap {'none' if cap is None else f'{cap:.0%}'}, "
            f"{g.get('gpu_time_s', 0.0):.3f} s accounted")


def instances_line(rec: TenantRecord) -> str:
    wanted = [i for i in rec.instances if not i.draining]
    ready = [i for i in wanted if i.state == "ready"]
    pids = ",".join(str(i.pid) for i in ready) or "-"
    line = f"{rec.tenant_id}: {len(wanted)} instance(s), {len(ready)} ready (pids {pids}), state {rec.state}"
    if rec.state == "stopped":
        line += f"; its requests are refused (TenantStopped) until `twt scale {rec.tenant_id} N`"
    return line


# ----------------------------------------------------------------- arguments and lines


def tenant_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("tenant", metavar="TENANT")


def add_cap_out(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cap-out", metavar="FILE",
                   help="write the capability (hex text) to FILE, mode 0600, instead of printing it (default: print it)")


def tenant_line(rec: TenantRecord) -> str:
    pids = ",".join(str(p) for p in rec.pids) or "-"
    return f"{rec.tenant_id}: state {rec.state}, pids {pids}, generation {rec.generation}"


R = TypeVar("R")


def unreachable_on_timeout(client: SupervisorClient, call: Callable[[], R]) -> R:
    try:
        return call()
    except RequestTimeout:
        raise SupervisorUnavailable(
            client.run_dir, f"no answer within {client.timeout_s:g} s (supervisor hung or overloaded?)"
        ) from None


# ----------------------------------------------------------------- a tenant's own capability


def tenant_capability_file(path: Path, tenant: str) -> TenantCapability:
    """The tenant capability in ``path``; refuses one that names another tenant, naming both."""
    cap = read_capability_file(path)
    if not isinstance(cap, TenantCapability):
        raise ValueError(f"--capability {path} holds the admin capability, not tenant {tenant!r}'s")
    if cap.tenant_id != tenant:
        raise ValueError(
            f"--capability {path} is the capability of tenant {cap.tenant_id!r}, not of {tenant!r}: "
            f"run as {cap.tenant_id!r} or give {tenant!r}'s capability (twt capability {tenant} --cap-out FILE)"
        )
    return cap


def add_capability_option(p: argparse.ArgumentParser) -> None:
    """``--capability FILE``: a tenant acting with its own capability instead of the run dir's admin.cap."""
    p.add_argument("--capability", type=Path, default=None, metavar="FILE",
                   help="the tenant's capability file (as written by --cap-out: hex text; raw bytes are read "
                   "too); default: obtained with the run dir's admin.cap")


def tenant_capability_of(client: SupervisorClient, tenant: str, from_file: TenantCapability | None) -> TenantCapability:
    """``tenant``'s capability: the one read from ``--capability`` (:func:`tenant_capability_file`, read
    before connecting, so a wrong file is refused first), else asked for with the admin capability."""
    if from_file is not None:
        return from_file
    cap = client.tenant_capability(client.admin, tenant)
    if cap.tenant_id != tenant:  # pragma: no cover - the supervisor answers for the name asked
        raise ValueError(f"capability is for {cap.tenant_id!r}, not {tenant!r}")
    return cap


def fetch_status(client: SupervisorClient, *, limit: int | None = None, after: str | None = None,
                 state: str | None = None) -> StatusRecord:
    """The status record (every tenant, or the page ``limit``/``after`` names; see
    :meth:`SupervisorClient.status`); a supervisor that does not answer in time counts as
    unreachable (exit 3)."""
    return unreachable_on_timeout(client, lambda: client.status(limit=limit, after=after, state=state))


def fetch_tenant(client: SupervisorClient, tenant: str) -> TenantRecord:
    """One tenant's record (as :func:`fetch_status`, for one tenant)."""
    return unreachable_on_timeout(client, lambda: client.tenant_status(None, tenant))
