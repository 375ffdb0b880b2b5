"""The command half of ``run_wasm`` / ``twt run TENANT FILE.wasm|FILE.wat --invoke NAME [--arg V ...]``: run one export in a tenant's worker.

Registers nothing: it talks to the running supervisor of ``--run-dir`` with
the tenant's capability, obtained with the admin capability in the run
directory (or read from ``--capability FILE`` by a tenant that holds its
own). Prints the results, or the typed error and exits 1; a guest that called
``exit(n)`` (WASI ``proc_exit``) prints its exit code and exits 1 unless n is 0.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from shared import protocol as proto
from shared.errors import KernelTimeout, SupervisorUnavailable, TensorWasmError, WasmTrap
from shared.exitcodes import EXIT_FAILED, EXIT_OK, EXIT_UNAVAILABLE, EXIT_USAGE
from shared.records import RunResult
from supervisor.cli.commands._base import Connect, OpCommand
from supervisor.cli.commands._buffers import connect_tenant, resolve_handle
from supervisor.cli.commands._cli import add_capability_option
from supervisor.client.cli_args import print_json

__all__ = ["RunWasmCommand", "parse_wasm_arg"]


def _capped_notes(args: argparse.Namespace, outcome: object) -> list[str]:
    """What the user asked for that the tenant's ceilings cut (``--timeout``, ``--fuel``), said so."""
    timeout = fuel = None
    if isinstance(outcome, RunResult):
        timeout, fuel = outcome.timeout_s, outcome.fuel_limit
    elif isinstance(outcome, KernelTimeout):
        timeout = outcome.timeout_s
    elif isinstance(outcome, WasmTrap):
        fuel = outcome.fuel_limit
    notes = []
    if args.timeout is not None and timeout is not None and timeout < args.timeout:
        notes.append(f"--timeout {args.timeout:g} s is above tenant {args.tenant}'s ceiling (its wasm_timeout_s): "
                     f"the run was capped to {timeout:g} s")
    if args.fuel is not None and fuel is not None and fuel < args.fuel:
        notes.append(f"--fuel {args.fuel:,} is above tenant {args.tenant}'s ceiling (its wasm_fuel): "
                     f"the run was capped to {fuel:,}")
    return notes


def _error_json(exc: BaseException) -> dict[str, object]:
    """A failure as JSON: the typed error's wire form, or an OS / usage error's text."""
    if isinstance(exc, TensorWasmError):
        return {"type": type(exc).__name__, **exc.to_dict()}
    if isinstance(exc, OSError):
        text = f"{exc.strerror}: {exc.filename}" if exc.strerror and exc.filename else str(exc)
        return {"type": type(exc).__name__, "code": "os_error", "message": text, "fields": {}}
    return {"type": type(exc).__name__, "code": "usage", "message": str(exc), "fields": {}}


def parse_wasm_arg(text: str) -> object:
    """``42``, ``-1``, ``0x10`` -> int; ``2.5``, ``1e-3``, ``inf`` -> float; ``handle=1:7`` (or a raw
    ``handle=N``) -> a client buffer, looked up among the tenant's buffers before the run is sent."""
    value = text.strip()
    if value.startswith("handle="):
        ref = value[len("handle="):].strip()
        try:
            if ":" in ref:
                proto.parse_handle_text(ref)
                return {"handle": ref}
            handle = int(ref, 0)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"not a buffer handle: {text!r} (handle=INSTANCE:SEQ as twt alloc prints it, e.g. handle=1:7)"
            ) from None
        if handle < 0:
            raise argparse.ArgumentTypeError(f"not a buffer handle: {text!r} (negative)")
        return {"handle": handle}
    try:
        return int(value, 0)
    except ValueError:
        pass
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a wasm argument: {text!r} (use an int, a float or handle=N)"
        ) from None
    if math.isnan(number) and value.lower() not in ("nan", "+nan", "-nan"):
        raise argparse.ArgumentTypeError(f"not a wasm argument: {text!r}")
    return number


class RunWasmCommand(OpCommand):
    name = "run_wasm"
    command = "run"
    help = "run an export of a WASM module in a tenant's worker"
    description = ("Send a module (binary .wasm or .wat text) to the tenant's worker and call one export. "
                   "Prints the results, fuel used and time; a trap, timeout or compile error is printed as the "
                   "typed error with exit code 1.")
    json_help = "print the reply as JSON"

    def arguments(self, p: argparse.ArgumentParser) -> None:
        p.add_argument("tenant", metavar="TENANT", help="a registered tenant")
        p.add_argument("module", type=Path, metavar="MODULE",
                       help="the module: FILE.wasm (binary) or FILE.wat (text)")
        p.add_argument("--invoke", required=True, metavar="NAME", help="the exported function to call")
        p.add_argument("--arg", dest="args", action="append", default=[], type=parse_wasm_arg, metavar="V",
                       help="an argument (repeat, in order): int, float, or handle=INSTANCE:SEQ for a buffer from "
                       "twt alloc (default: none)")
        p.add_argument("--fuel", type=int, default=None,
                       help="fuel for the run (default and ceiling: the tenant's wasm_fuel)")
        p.add_argument("--timeout", type=float, default=None, metavar="S",
                       help="deadline in seconds (default and ceiling: the tenant's wasm_timeout_s)")
        add_capability_option(p)

    def run(self, args: argparse.Namespace, connect: Connect) -> int:
        try:
            module = args.module.read_bytes()
            client, cap = connect_tenant(args, connect, 30.0)
            with client:
                wasm_args = list(args.args)
                if any(isinstance(a, dict) for a in wasm_args):
                    held = client.buffers(cap)
                    wasm_args = [{"handle": resolve_handle(a["handle"], held, args.tenant)} if isinstance(a, dict)
                                 else a for a in wasm_args]
                reply = client.run_wasm(cap, module, args.invoke, wasm_args, fuel=args.fuel,
                                        timeout_s=args.timeout)
        except (TensorWasmError, OSError, ValueError) as exc:
            notes = _capped_notes(args, exc)
            if not args.json:
                for note in notes:
                    print(f"twt: note: {note}", file=sys.stderr)
                raise  # printed by twt's one error handler, with its exit status
            print_json({"ok": False, "error": _error_json(exc), "notes": notes})
            if isinstance(exc, SupervisorUnavailable):
                return EXIT_UNAVAILABLE
            return EXIT_USAGE if isinstance(exc, ValueError) and not isinstance(exc, TensorWasmError) else EXIT_FAILED
        notes = _capped_notes(args, reply)
        if args.json:
            print_json({"ok": reply.exit_code in (None, 0), **reply.to_wire(), "notes": notes})
            return EXIT_OK if reply.exit_code in (None, 0) else EXIT_FAILED
        out = sys.stdout
        for note in notes:
            out.write(f"note: {note}\n")
        out.write(f"results: {list(reply.results)}\n")
        cached = "cached module" if reply.cached else "compiled"
        out.write(f"fuel used: {reply.fuel_used or 0:,}   time: {reply.elapsed_s * 1000:.3f} ms in the worker "
                  f"({cached})\n")
        for line in reply.logs:
            out.write(f"log: {line}\n")
        dropped = reply.logs_dropped
        if dropped:
            out.write(f"log: ... {dropped:,} more line(s) dropped by the log limits\n")
        exit_code = reply.exit_code
        if exit_code is not None:  # the guest called exit() (WASI proc_exit): its code is the run's outcome
            out.write(f"exit code: {exit_code}\n")
            return EXIT_OK if exit_code == 0 else EXIT_FAILED
        return EXIT_OK
