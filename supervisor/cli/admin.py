"""Admin commands (they use ``<run dir>/admin.cap``): register, capability, evict, set-quota, scale, fault.

    twt register acme --memory-quota 2GiB --gpu-cap 512MiB --instances 2 --cap-out acme.cap
    twt register --file tenants.toml acme        # a [[tenant]] table (flags given as well override it)
    twt capability acme                          # the capability of a registered tenant, as hex
    twt set-quota acme --gpu-cap 1GiB            # live; --gpu-cap none removes the cap
    twt scale acme 3 --wait
    twt fault acme crash --instance 0
    twt evict acme

A tenant capability is printed as hex on stdout (``CAP=$(twt register acme)``)
or written with ``--cap-out FILE`` (hex and a newline, mode 0600);
``shared.capability.read_capability_file(path)`` reads it back (so does
``twt run --capability FILE``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import tomllib
from collections.abc import Callable
from typing import Any

from shared.capability import TenantCapability, capability_to_text, write_capability_file
from shared.errors import RequestTimeout
from shared.protocol import FAULT_KINDS, QUOTA_KEYS
from shared.records import TenantRecord
from shared.sizes import decimal_size_note, format_size, parse_size
from shared.spec import IsolationKind, RestartPolicy, TenantSpec
from supervisor.cli._common import add_run_dir, non_negative_int, positive_seconds, print_json
from supervisor.cli.status import connect, fetch_tenant

__all__ = ["FAULT_KINDS", "add_parser", "build_spec", "has_spec_flags", "parse_param", "spec_flags", "specs_from_file"]

#: admin calls that may wait for worker processes (register, evict) get at least this long
ADMIN_TIMEOUT_S = 60.0
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


def _say_decimal_sizes(args: argparse.Namespace) -> None:
    """One stderr line per decimal size flag (``2GB`` is 2,000,000,000 B, not 2GiB); plain ints after."""
    for flag, dest, _, _, _ in _SPEC_FLAGS:
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


def parse_param(text: str) -> tuple[str, Any]:
    """``k=v`` -> (k, v) with v an int, a float, a size (``64MiB`` -> bytes), a bool or a string."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"a parameter is KEY=VALUE, got {text!r}")
    raw = raw.strip()
    value: Any
    try:
        value = int(raw)
    except ValueError:
        try:
            value = float(raw)
        except ValueError:
            try:
                value = parse_size(raw)
            except ValueError:
                value = {"true": True, "false": False}.get(raw.lower(), raw)
    return key, value


# ----------------------------------------------------------------- parsers

#: register flag -> (TenantSpec field, argparse type, metavar, help)
_SPEC_FLAGS: tuple[tuple[str, str, Any, str, str], ...] = (
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
)
#: set-quota's help for each limit it changes (the flags are register's, from _SPEC_FLAGS)
_SET_QUOTA_HELP = {
    "memory_quota_bytes": "host memory quota, e.g. 2GiB (default: unchanged)",
    "gpu_memory_bytes_cap": "GPU byte cap; none removes it (default: unchanged)",
    "recorded_cuda_mem_pool_quota": "recorded CUDA pool quota (retention hint); none clears it (default: unchanged)",
    "gpu_time_weight": "GPU-time weight, > 0 (default: unchanged)",
    "gpu_time_cap": "GPU-time ceiling, a fraction in (0, 1]; none removes it (default: unchanged)",
}


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Every admin command: its own arguments, then ``--json`` and the run-dir options."""
    for name, help_text, description, arguments, json_help, run in _commands():
        p = sub.add_parser(name, help=help_text, description=description)
        arguments(p)
        p.add_argument("--json", action="store_true", help=json_help)
        add_run_dir(p)
        p.set_defaults(func=run)


_Command = tuple[str, str, str, Callable[[argparse.ArgumentParser], None], str, Callable[[argparse.Namespace], int]]


def _commands() -> tuple[_Command, ...]:
    """(name, help, description, its own arguments, --json help, what runs it) of each admin command."""
    return (
        ("register", "register a tenant (flags or a TOML file) and print its capability",
         "Register a tenant with the running supervisor and print its capability as hex "
         "(or write it to --cap-out). Returns once every instance is ready. With --file, the tenant "
         "comes from a TOML file: one tenant table, or [[tenant]] tables (name the one to register; a "
         "[supervisor] table is ignored, so the supervisor's own config file works); flags override it.",
         _register_arguments, "print {tenant, capability} as JSON", run_register),
        ("capability", "print the capability of a registered tenant",
         "Print (or write with --cap-out) the current capability of a registered tenant, e.g. one "
         "registered from the supervisor's config file. Capabilities minted before an eviction stay revoked.",
         _capability_arguments, "print {tenant, capability} as JSON", run_capability),
        ("evict", "stop a tenant's workers, revoke its capabilities, free its quota block",
         "Evict a tenant: its workers are stopped (in-flight requests answered), every capability "
         "minted for it is revoked, and its shared-memory quota block is unlinked. Returns once the workers exited.",
         _tenant_argument, "print the supervisor's answer as JSON", run_evict),
        ("set-quota", "change a tenant's limits live",
         "Change a tenant's limits while it runs (the limits live in its shared-memory block). "
         "Lowering a limit below current use refuses new allocations until use falls under it; nothing "
         "already allocated is taken away. Omitted limits stay as they are.",
         _set_quota_arguments, "print the tenant's status record as JSON", run_set_quota),
        ("scale", "run N worker instances for a tenant (live)",
         "Change how many worker processes serve a tenant. New instances share the tenant's quota; "
         "scaling down drains instances (their in-flight requests finish) before stopping them.",
         _scale_arguments, "print the tenant's status record as JSON", run_scale),
        ("fault", "inject a fault into one of a tenant's workers (testing)",
         "Break one worker on purpose. Kinds: crash (SIGKILL), segfault, exit (param code), "
         "hang, slow (param ms), oom (param count), corrupt (param count), drop (param count), "
         "leak (param bytes). Returns once the fault is armed, or once the process is gone for "
         "crash/segfault/exit.",
         _fault_arguments, "print the supervisor's answer as JSON", run_fault),
    )


def _tenant_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("tenant", metavar="TENANT")


def _add_cap_out(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cap-out", metavar="FILE",
                   help="write the capability (hex text) to FILE, mode 0600, instead of printing it (default: print it)")


def _register_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("tenant", nargs="?", metavar="TENANT", help="tenant id (optional with --file)")
    spec_flags(p)
    _add_cap_out(p)


def spec_flags(p: argparse.ArgumentParser) -> None:
    """``--file TOML`` and every tenant spec flag (``twt register``, ``twt cluster register``)."""
    p.add_argument("--file", metavar="TOML", help="read the tenant spec from this TOML file (default: none, flags only)")
    for flag, dest, typ, metavar, text in _SPEC_FLAGS:
        p.add_argument(flag, dest=dest, type=typ, metavar=metavar, help=text, default=argparse.SUPPRESS)
    p.add_argument("--isolation", choices=[k.value for k in IsolationKind], default=argparse.SUPPRESS,
                   help="process (default), mps, or auto")
    p.add_argument("--restart", choices=[k.value for k in RestartPolicy], default=argparse.SUPPRESS,
                   help="restart policy (default always)")


def has_spec_flags(args: argparse.Namespace) -> bool:
    """Whether any tenant spec flag (or --file) was given."""
    return bool(getattr(args, "file", None)) or any(
        hasattr(args, dest) for dest in [d for _, d, _, _, _ in _SPEC_FLAGS] + ["isolation", "restart"])


def _capability_arguments(p: argparse.ArgumentParser) -> None:
    _tenant_argument(p)
    _add_cap_out(p)


def _set_quota_arguments(p: argparse.ArgumentParser) -> None:
    _tenant_argument(p)
    for flag, dest, kind, metavar, _ in _SPEC_FLAGS:  # the register flags of the limits set_quota changes
        if dest in QUOTA_KEYS:
            p.add_argument(flag, dest=dest, type=kind, metavar=metavar, default=argparse.SUPPRESS,
                           help=_SET_QUOTA_HELP[dest])


def _scale_arguments(p: argparse.ArgumentParser) -> None:
    _tenant_argument(p)
    p.add_argument("instances", type=non_negative_int, metavar="N")
    p.add_argument("--wait", action="store_true", help="return once exactly N instances are ready")
    p.add_argument("--timeout", type=positive_seconds, default=60.0, metavar="S",
                   help="with --wait: give up (exit 1) after S seconds (default 60)")


def _fault_arguments(p: argparse.ArgumentParser) -> None:
    _tenant_argument(p)
    p.add_argument("kind", choices=FAULT_KINDS, metavar="KIND", help=f"one of {', '.join(FAULT_KINDS)}")
    p.add_argument("--instance", type=non_negative_int, default=None, metavar="I",
                   help="instance index (default: the first ready one)")
    p.add_argument("--param", dest="params", type=parse_param, action="append", default=[], metavar="KEY=VALUE",
                   help="fault parameter, e.g. --param ms=500, --param bytes=64MiB (repeatable; default: none, the fault's own defaults)")


# ------------------------------------------------------------------ helpers


def specs_from_file(path: str) -> list[dict[str, Any]]:
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


def _tenant_name(table: dict[str, Any]) -> str | None:
    name = table.get("tenant_id", table.get("name"))
    return None if name is None else str(name)


def build_spec(args: argparse.Namespace) -> TenantSpec:
    """The spec from --file and/or the flags (flags win); ValueError/TypeError name what is wrong."""
    _say_decimal_sizes(args)
    base: dict[str, Any] = {}
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
    for _, dest, _, _, _ in _SPEC_FLAGS:
        if hasattr(args, dest):
            base[dest] = getattr(args, dest)
    for dest in ("isolation", "restart"):
        if hasattr(args, dest):
            base[dest] = getattr(args, dest)
    try:
        return TenantSpec.from_dict({**base, "tenant_id": tid})
    except TypeError as exc:  # a wrongly typed value in the file or on the command line: the user's input
        raise ValueError(str(exc)) from None


def _check_cap_out(path: str | None) -> None:
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


def _emit_capability(args: argparse.Namespace, tenant_id: str, cap: TenantCapability,
                     applied: TenantRecord | None = None) -> None:
    """The capability (stdout, or --cap-out) and, from register, the limits the supervisor applied:
    on stdout beside --cap-out, else on stderr (``CAP=$(twt register acme)`` captures only the capability)."""
    hex_cap = capability_to_text(cap)
    if args.cap_out:
        write_capability_file(args.cap_out, cap)
    if args.json:
        out: dict[str, Any] = {"tenant": tenant_id, "capability": None if args.cap_out else hex_cap,
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
        print(_limits_line(applied) + f"; {_instances_line(applied).split(': ', 1)[1]}",
              file=sys.stdout if args.cap_out else sys.stderr)


def _applied_limits(rec: TenantRecord) -> dict[str, Any]:
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


def _limits_line(rec: TenantRecord) -> str:
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


def _instances_line(rec: TenantRecord) -> str:
    wanted = [i for i in rec.instances if not i.draining]
    ready = [i for i in wanted if i.state == "ready"]
    pids = ",".join(str(i.pid) for i in ready) or "-"
    line = f"{rec.tenant_id}: {len(wanted)} instance(s), {len(ready)} ready (pids {pids}), state {rec.state}"
    if rec.state == "stopped":
        line += f"; its requests are refused (TenantStopped) until `twt scale {rec.tenant_id} N`"
    return line


# ----------------------------------------------------------------- commands


def run_register(args: argparse.Namespace) -> int:
    spec = build_spec(args)
    _check_cap_out(args.cap_out)
    with connect(args, timeout_s=ADMIN_TIMEOUT_S) as client:
        cap = client.register(None, spec)
        rec = fetch_tenant(client, str(spec.tenant_id))
    _emit_capability(args, str(spec.tenant_id), cap, rec)
    return 0


def run_capability(args: argparse.Namespace) -> int:
    _check_cap_out(args.cap_out)
    with connect(args) as client:
        cap = client.tenant_capability(None, args.tenant)
    _emit_capability(args, args.tenant, cap)
    return 0


def run_evict(args: argparse.Namespace) -> int:
    with connect(args, timeout_s=ADMIN_TIMEOUT_S) as client:
        result = client.evict(None, args.tenant)
    if args.json:
        print_json(result.to_wire())
    else:
        pids = ", ".join(str(p) for p in result.pids) or "none"
        print(f"evicted {result.evicted} (workers stopped: {pids})")
    return 0


def run_set_quota(args: argparse.Namespace) -> int:
    _say_decimal_sizes(args)
    changes = {k: getattr(args, k) for k in QUOTA_KEYS if hasattr(args, k)}
    if not changes:
        raise ValueError("set-quota needs at least one of --memory-quota, --gpu-cap, --pool-quota, "
                         "--gpu-time-weight, --gpu-time-cap")
    with connect(args) as client:
        rec = client.set_quota(None, args.tenant, **changes)
    if args.json:
        print_json(rec.to_wire())
    else:
        print(_limits_line(rec))
        for note in _over_limit_notes(rec):
            print(note)
    return 0


def _over_limit_notes(rec: TenantRecord) -> list[str]:
    """A limit set below what the tenant holds is accepted; say so, with the numbers."""
    tid = rec.tenant_id
    notes = []
    for what, used, limit in (("host", rec.bytes_in_use, rec.memory_quota_bytes),
                              ("GPU", rec.gpu_bytes_in_use, rec.gpu_memory_bytes_cap)):
        if limit is not None and used > limit:
            notes.append(f"{tid}: note: {format_size(used)} of {what} memory is in use, above the new limit of "
                         f"{format_size(limit)}; nothing is taken away, new {what} allocations are refused until "
                         "use falls below it")
    return notes


def run_scale(args: argparse.Namespace) -> int:
    with connect(args) as client:
        rec = client.scale(None, args.tenant, args.instances)
        if args.wait:
            deadline = time.monotonic() + args.timeout
            while not _scaled(rec, args.instances):
                if time.monotonic() >= deadline:
                    print(_instances_line(rec), file=sys.stderr)
                    raise RequestTimeout("scale", args.timeout, message=(
                        f"{args.tenant} did not reach {args.instances} ready instance(s) within {args.timeout:g} s"))
                time.sleep(0.05)
                rec = fetch_tenant(client, args.tenant)
    if args.json:
        print_json(rec.to_wire())
    else:
        print(_instances_line(rec))
    return 0


def _scaled(rec: TenantRecord, n: int) -> bool:
    wanted = [i for i in rec.instances if not i.draining]
    # drained instances must be gone too, so "scale 1 --wait" means one process left
    return (len(wanted) == n and all(i.state == "ready" for i in wanted)
            and not any(i.draining and i.pid is not None for i in rec.instances))


def run_fault(args: argparse.Namespace) -> int:
    params = dict(args.params)
    if len(params) != len(args.params):
        raise ValueError("a --param key is given twice")
    with connect(args, timeout_s=ADMIN_TIMEOUT_S) as client:
        result = client.inject_fault(None, args.tenant, args.kind, instance=args.instance, **params)
    if args.json:
        print_json(result.to_wire())
    else:
        where = f"{result.tenant}/{result.instance}"
        extra = " ".join(f"{k}={v}" for k, v in sorted(result.to_wire().items())
                         if v is not None and k not in ("tenant", "instance", "kind", "pid", "ok", "ref"))
        print(f"fault {args.kind} -> {where} (pid {result.pid}){(' ' + extra) if extra else ''}")
    return 0
