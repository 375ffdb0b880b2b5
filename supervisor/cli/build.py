"""``twt build SRC... -o OUT.wasm``: compile a C or Zig tenant into a module ``twt run`` accepts.

    tenant.c ... ──► zig cc  --target=wasm32-wasi -mexec-model=reactor -I sdk/c ──┐
    tenant.zig [+ .c] ──► zig build-exe -target wasm32-wasi -mexec-model=reactor   ├─► OUT.wasm
                          -fno-entry -rdynamic, module "tensorwasm" = sdk/zig  ──┘   (exports checked)

The compiler is the Zig toolchain of the ``ziglang`` wheel (the ``sdk``
extra), run as ``python -m ziglang``: C and Zig, wasi-libc included, no
system compiler needed. The output is a WASI *reactor*: no ``main``; the
host calls ``_initialize`` (libc's constructors) once per instance and then
the export the run names. Exports are what the sources mark:
``TWT_EXPORT(name)`` in C (``sdk/c/tensorwasm.h``), ``export fn`` in Zig. A
module with none is an error (the host could call nothing).

Defaults: optimised (``-O2`` / ``ReleaseSafe``), debug info stripped, a
256 KiB stack (the linker's default is 16 MiB of linear memory, all charged
to the tenant's quota while the module runs: docs/GUESTS.md). The output is
written only when the build and the export check succeed.

The SDK is the ``sdk/`` folder of the checkout this package is installed
from (``pip install -e``, as ``make`` does).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from shared.exitcodes import EXIT_FAILED, EXIT_OK, EXIT_USAGE

__all__ = ["BuildError", "BuildResult", "OPTIMIZE", "add_parser", "build_module", "run", "sdk_dir"]

#: -O choice -> (C flags, Zig mode)
OPTIMIZE: dict[str, tuple[tuple[str, ...], str]] = {
    "safe": (("-O2",), "ReleaseSafe"),
    "fast": (("-O3",), "ReleaseFast"),
    "small": (("-Oz",), "ReleaseSmall"),
    "debug": (("-O0", "-g"), "Debug"),
}
DEFAULT_STACK = 256 << 10
_C_SUFFIXES = {".c"}
_ZIG_SUFFIXES = {".zig"}
#: the longest a build may take (a first build also compiles wasi-libc into Zig's cache)
BUILD_TIMEOUT_S = 600.0


class BuildError(Exception):
    """A build failed: ``message`` is one line; ``output`` holds the compiler's own messages, if any."""

    def __init__(self, message: str, output: str = "") -> None:
        super().__init__(message)
        self.output = output


@dataclass(frozen=True)
class BuildResult:
    """What ``twt build`` made: the module's path, size and exported functions."""

    out: Path
    nbytes: int
    exports: tuple[str, ...]
    wasi: bool
    command: tuple[str, ...]


def sdk_dir() -> Path:
    """The SDK folder (``sdk/`` at the root of the checkout); BuildError when it is not there."""
    root = Path(__file__).resolve().parents[2] / "sdk"
    if not (root / "c" / "tensorwasm.h").is_file():
        raise BuildError(f"the guest SDK is not at {root}: twt build needs the source checkout "
                         "installed in development mode (pip install -e '.[sdk]')")
    return root


#: the Python module of the Zig toolchain (the ``ziglang`` wheel: ``python -m ziglang``)
TOOLCHAIN = "ziglang"


def _zig() -> list[str]:
    if importlib.util.find_spec(TOOLCHAIN) is None:
        raise BuildError("the Zig toolchain is not installed: pip install 'tensor-wasm-tenant[sdk]' "
                         "(the sdk extra: the ziglang package)")
    return [sys.executable, "-m", TOOLCHAIN]


def _cache_dir() -> Path:
    """Zig's global cache, passed explicitly so no ``.zig-cache`` appears next to the sources."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "zig"


def compile_command(sources: list[Path], out: Path, *, optimize: str = "safe",
                    stack_size: int = DEFAULT_STACK, max_memory: int | None = None) -> list[str]:
    """The compiler command line for ``sources`` (C files, or one Zig root plus C files)."""
    if optimize not in OPTIMIZE:
        raise BuildError(f"unknown optimisation {optimize!r}: one of {', '.join(OPTIMIZE)}")
    if not sources:
        raise BuildError("no source files")
    zig_roots = [s for s in sources if s.suffix in _ZIG_SUFFIXES]
    others = [s for s in sources if s.suffix not in _C_SUFFIXES | _ZIG_SUFFIXES]
    if others:
        raise BuildError(f"{others[0]}: not a C (.c) or Zig (.zig) source")
    if len(zig_roots) > 1:
        raise BuildError(f"one Zig root file per module, got {len(zig_roots)}: "
                         f"{', '.join(map(str, zig_roots))} (import the others from it)")
    for src in sources:
        if not src.is_file():
            raise BuildError(f"{src}: no such file")
    if stack_size < 4096 or stack_size % 16:
        raise BuildError(f"stack size must be at least 4096 and a multiple of 16, got {stack_size}")
    if max_memory is not None and (max_memory < 65536 or max_memory % 65536):
        raise BuildError(f"max memory must be a positive multiple of 65536 (a page), got {max_memory}")
    sdk = sdk_dir()
    zig = _zig()
    c_flags, zig_mode = OPTIMIZE[optimize]
    link = [f"-Wl,-z,stack-size={stack_size}"] + ([f"-Wl,--max-memory={max_memory}"] if max_memory else [])
    strip = [] if optimize == "debug" else ["-s"]
    include = ["-I", str(sdk / "c")]
    if not zig_roots:
        return [*zig, "cc", "--target=wasm32-wasi", "-mexec-model=reactor", *c_flags, "-Wall", *strip, *include,
                *link, "-o", str(out), *map(str, sources)]
    root = zig_roots[0]
    c_files = [str(s) for s in sources if s.suffix in _C_SUFFIXES]
    cmd = [*zig, "build-exe", "-target", "wasm32-wasi", "-mexec-model=reactor", "-fno-entry", "-rdynamic",
           "-O", zig_mode, "--stack", str(stack_size), "--cache-dir", str(_cache_dir()),
           f"-femit-bin={out}", "--name", out.stem]
    if optimize != "debug":
        cmd.append("-fstrip")
    if max_memory:
        cmd.append(f"--max-memory={max_memory}")
    if c_files:
        cmd += ["-lc", *include, "-cflags", *c_flags, "-Wall", "--", *c_files]
    cmd += ["--dep", "tensorwasm", f"-Mroot={root}", f"-Mtensorwasm={sdk / 'zig' / 'tensorwasm.zig'}"]
    return cmd


def _exports(wasm: bytes) -> tuple[tuple[str, ...], bool]:
    """The exported functions a run may call (not ``_initialize``), and whether the module imports WASI."""
    import wasmtime

    try:
        module = wasmtime.Module(wasmtime.Engine(), wasm)
    except wasmtime.WasmtimeError as exc:
        raise BuildError(f"the compiler wrote an invalid module: {str(exc).strip().splitlines()[0]}") from None
    names = tuple(e.name for e in module.exports
                  if isinstance(e.type, wasmtime.FuncType) and e.name != "_initialize")
    wasi = any(i.module == "wasi_snapshot_preview1" for i in module.imports)
    return names, wasi


def build_module(sources: list[Path], out: Path, *, optimize: str = "safe", stack_size: int = DEFAULT_STACK,
                 max_memory: int | None = None, timeout_s: float = BUILD_TIMEOUT_S) -> BuildResult:
    """Compile ``sources`` into ``out`` (written only on success); BuildError with the compiler's output."""
    out = out.resolve()
    with tempfile.TemporaryDirectory(prefix="twt-build-") as tmp:
        staged = Path(tmp) / (out.stem + ".wasm")
        cmd = compile_command(sources, staged, optimize=optimize, stack_size=stack_size, max_memory=max_memory)
        try:
            proc = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                                  timeout=timeout_s, check=False)
        except subprocess.TimeoutExpired:
            raise BuildError(f"the compiler did not finish within {timeout_s:g} s") from None
        output = (proc.stderr + proc.stdout).strip()
        if proc.returncode != 0:
            tool = "zig cc" if cmd[3] == "cc" else "zig build-exe"
            raise BuildError(f"compiling failed ({tool} exit {proc.returncode}; its messages are above)", output)
        wasm = staged.read_bytes()
        exports, wasi = _exports(wasm)
        if not exports:
            raise BuildError("the module exports no function: mark one with TWT_EXPORT(name) in C or "
                             "`export fn` in Zig", output)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp_out = out.with_name(out.name + ".tmp")
        tmp_out.write_bytes(wasm)
        tmp_out.replace(out)
    return BuildResult(out, len(wasm), exports, wasi, tuple(cmd))


#: what :func:`prepare_toolchain` compiles: one guest per way ``twt build`` drives the compiler (C
#: alone through ``zig cc``; Zig with a C helper through ``zig build-exe -lc``; Zig alone), each
#: printing through libc, so every library a first build would compile lands in Zig's cache
_PREPARE_SOURCES: dict[str, str] = {
    "prepare_c.c": '#include <stdio.h>\n#include "tensorwasm.h"\n'
                   'TWT_EXPORT(prepare) int prepare(void) { return printf("ready\\n") > 0 ? 0 : 1; }\n',
    "prepare_helper.c": '#include <stdio.h>\nint prepare_helper(void) { return printf("ready\\n") > 0 ? 0 : 1; }\n',
    "prepare_zig.zig": 'const twt = @import("tensorwasm");\n'
                       'extern fn prepare_helper() c_int;\n'
                       'export fn prepare() i32 { return prepare_helper(); }\n',
    "prepare_zig_only.zig": 'const twt = @import("tensorwasm");\nexport fn prepare() i32 { return 0; }\n',
}


def prepare_toolchain(*, optimize: str = "safe", timeout_s: float = BUILD_TIMEOUT_S) -> list[BuildResult]:
    """Compile what a first build compiles (wasi-libc, the compiler runtimes) into Zig's cache now.

    Why: the first ``twt build`` on a machine spends ~20 s of CPU building wasi-libc and its
    runtimes before it compiles the tenant's code (later builds take well under a second). An
    image or a CI job pays it once at set-up instead (``make`` does, when it installs the venv).
    Returns the three throw-away builds (C alone, Zig with a C helper, Zig alone).
    """
    with tempfile.TemporaryDirectory(prefix="twt-prepare-") as tmp:
        src = Path(tmp)
        for name, text in _PREPARE_SOURCES.items():
            (src / name).write_text(text)
        plans = [[src / "prepare_c.c"], [src / "prepare_zig.zig", src / "prepare_helper.c"],
                 [src / "prepare_zig_only.zig"]]
        return [build_module(sources, src / f"out{i}.wasm", optimize=optimize, timeout_s=timeout_s)
                for i, sources in enumerate(plans)]


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
    p.add_argument("-v", "--verbose", action="store_true", help="print the compiler command line")
    p.set_defaults(func=run)


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
            done = prepare_toolchain(optimize=args.optimize)
        except BuildError as exc:
            return _failed(exc, "twt build --prepare")
        print(f"prepared the Zig toolchain's cache for {len(done)} kinds of build (C; Zig with C; Zig): "
              f"{_cache_dir()}")
        return EXIT_OK
    if not args.sources or args.output is None:
        print("twt build: error: give the sources (SRC ...) and -o OUT.wasm (or --prepare)", file=sys.stderr)
        return EXIT_USAGE
    try:
        result = build_module(list(args.sources), args.output, optimize=args.optimize,
                              stack_size=args.stack_size, max_memory=args.max_memory)
    except BuildError as exc:
        return _failed(exc, "twt build")
    if args.verbose:
        print(" ".join(result.command))
    print(f"wrote {args.output} ({result.nbytes:,} B): exports {', '.join(result.exports)}"
          f"{'; uses WASI (libc)' if result.wasi else ''}")
    return EXIT_OK
