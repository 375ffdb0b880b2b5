"""``twt build SRC... -o OUT.wasm``: compile a C or Zig tenant into a module ``twt run`` accepts.

The command line only: the builder (the Zig toolchain, the source guard, the export check) is
:mod:`supervisor.tools.build`, which the demo uses too.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from shared.exitcodes import EXIT_FAILED, EXIT_OK, EXIT_USAGE
from supervisor.tools.build import (
    DEFAULT_STACK,
    OPTIMIZE,
    SANDBOX_CACHE,
    BuildError,
    build_module,
    cache_dir,
    prepare_toolchain,
)

__all__ = ["add_parser", "run"]


def _size(text: str) -> int:
    try:
        value = int(text, 0)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a byte count: {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"not a positive byte count: {text!r}")
    return value


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "build",
        help="compile a C or Zig tenant to a WASM module (the sdk extra)",
        description="Compile C sources (#include \"tensorwasm.h\") or one Zig root file "
        "(@import(\"tensorwasm\")) with the Zig toolchain of the ziglang package into a wasm32-wasi reactor "
        "module for twt run. Exports are the functions marked TWT_EXPORT(name) in C or `export fn` in Zig. "
        "See docs/GUESTS.md.",
    )
    p.add_argument("sources", type=Path, nargs="*", metavar="SRC", help="C (.c) files, or one .zig file and C files")
    p.add_argument("-o", "--output", type=Path, metavar="OUT.wasm", help="the module to write (required with SRC; no default)")
    p.add_argument("--prepare", action="store_true",
                   help="compile no tenant: build wasi-libc and the compiler runtimes into Zig's cache now "
                   "(a first build otherwise spends ~20 s on them; for images and CI set-up)")
    p.add_argument("-O", "--optimize", choices=tuple(OPTIMIZE), default="safe",
                   help="safe: -O2 / ReleaseSafe; fast: -O3 / ReleaseFast; small: -Oz / ReleaseSmall; "
                   "debug: -O0 -g / Debug, debug info kept")
    p.add_argument("--stack-size", type=_size, default=DEFAULT_STACK, metavar="BYTES",
                   help="the guest's stack, in linear memory")
    p.add_argument("--max-memory", type=_size, default=None, metavar="BYTES",
                   help="declare a maximum linear memory (a multiple of 65536): a run is charged only this much "
                   "of the tenant's host-memory quota (default: none, the tenant's wasm_max_memory_bytes)")
    p.add_argument("-Werror", dest="werror", action="store_true",
                   help="make the C compiler's warnings (-Wall) errors; without it they are printed and the "
                   "build goes on")
    p.add_argument("--sandbox", action="store_true",
                   help=f"run the compiler as the user nobody (needs root), with a Zig cache of its own "
                   f"({SANDBOX_CACHE}): for building sources you do not trust; see docs/SECURITY.md")
    p.add_argument("-v", "--verbose", action="store_true", help="print the compiler command line")
    p.set_defaults(func=run)


def _to_stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _failed(exc: BuildError, command: str) -> int:
    """The compiler's own messages, then one line naming the command; EXIT_FAILED."""
    if exc.output:
        print(exc.output, file=sys.stderr)
    print(f"{command}: error: {exc}", file=sys.stderr)
    return EXIT_FAILED


def run(args: argparse.Namespace) -> int:
    if args.prepare:
        if args.sources or args.output is not None:
            print("twt build: error: --prepare compiles no tenant: give it no SRC and no -o", file=sys.stderr)
            return EXIT_USAGE
        try:
            done = prepare_toolchain(optimize=args.optimize, sandbox=args.sandbox, notify=_to_stderr)
        except BuildError as exc:
            return _failed(exc, "twt build --prepare")
        print(f"prepared the Zig toolchain's cache for {len(done)} kinds of build (C; Zig with C; Zig): "
              f"{cache_dir(args.sandbox)}")
        return EXIT_OK
    if not args.sources or args.output is None:
        print("twt build: error: give the sources (SRC ...) and -o OUT.wasm (or --prepare)", file=sys.stderr)
        return EXIT_USAGE
    try:
        result = build_module(list(args.sources), args.output, optimize=args.optimize,
                              stack_size=args.stack_size, max_memory=args.max_memory, werror=args.werror,
                              sandbox=args.sandbox, notify=_to_stderr)
    except BuildError as exc:
        return _failed(exc, "twt build")
    if result.warnings:  # -Wall's findings are worth reading even when the module was written
        print(result.warnings, file=sys.stderr)
    if args.verbose:
        print(" ".join(result.command))
    print(f"wrote {args.output} ({result.nbytes:,} B): exports {', '.join(result.exports)}"
          f"{'; uses WASI (libc)' if result.wasi else ''}")
    return EXIT_OK
