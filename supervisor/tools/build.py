"""The module builder behind ``twt build``: a C or Zig tenant compiled into a module ``twt run`` accepts.

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
written only when the build and the export check succeed. A C debug build
(``-O debug``) compiles each source alone (``-O0 -g``) and links the objects
against the release build's libraries, its debug info kept
(:func:`_debug_c_build`).

The SDK is the ``sdk/`` folder of the checkout this package is installed
from (``pip install -e``, as ``make`` does).

Sources are untrusted (an operator may build a tenant's code): the build
runs on a copy of each source's directory in a fresh temp dir, refuses a C
file that read anything outside it (``#include`` / ``#embed`` of
``/etc/shadow``, ``..``), kills the compiler's whole process group at the
timeout, and with ``--sandbox`` runs the compiler as ``nobody``
(:mod:`supervisor.tools.build_guard`). Builds on one Zig cache take turns
(a lock, with a message while waiting). The compiler's warnings are printed
when the build succeeds too; ``-Werror`` makes them errors.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from supervisor.tools.build_guard import (
    BuildError,
    NoDependencyList,
    SandboxUser,
    cache_lock,
    check_dependencies,
    chown_tree,
    refuse_cimport,
    run_compiler,
    sandbox_user,
    source_dir,
    stage_sources,
)

__all__ = ["BuildError", "BuildResult", "DEFAULT_STACK", "OPTIMIZE", "SANDBOX_CACHE", "build_module", "cache_dir",
           "prepare_toolchain", "sdk_dir"]

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
#: the longest a build waits for another one to let go of the Zig cache (apart from its own timeout)
LOCK_TIMEOUT_S = 600.0


#: the sandbox's Zig cache: outside any home directory (``nobody`` must reach it), owned by ``nobody``
SANDBOX_CACHE = Path("/var/tmp/twt-zig-sandbox")


@dataclass(frozen=True)
class BuildResult:
    """What ``twt build`` made: the module's path, size and exported functions, and the compiler's warnings."""

    out: Path
    nbytes: int
    exports: tuple[str, ...]
    wasi: bool
    command: tuple[str, ...]
    warnings: str = ""


def sdk_dir() -> Path:
    """The SDK folder (``sdk/`` at the root of the checkout); BuildError when it is not there."""
    root = Path(__file__).resolve().parents[2] / "sdk"
    if not (root / "c" / "tensorwasm.h").is_file():
        raise BuildError(f"the guest SDK is not at {root}: twt build needs the source checkout "
                         "installed in development mode (pip install -e '.[sdk]')")
    return root


#: the Python module of the Zig toolchain (the ``ziglang`` wheel: ``python -m ziglang``)
TOOLCHAIN = "ziglang"


def _toolchain_dir() -> Path:
    """The ``ziglang`` package's folder: the ``zig`` binary and ``lib/`` (wasi-libc's headers)."""
    spec = importlib.util.find_spec(TOOLCHAIN)
    if spec is None or not spec.submodule_search_locations:
        raise BuildError("the Zig toolchain is not installed: pip install 'tensor-wasm-tenant[sdk]' "
                         "(the sdk extra: the ziglang package)")
    return Path(next(iter(spec.submodule_search_locations)))


def _zig() -> list[str]:
    """The ``zig`` binary itself (what ``python -m ziglang`` execs): no interpreter a sandbox must reach."""
    return [str(_toolchain_dir() / "zig")]


def cache_dir(sandbox: bool = False) -> Path:
    """Zig's global cache, passed explicitly so no ``.zig-cache`` appears next to the sources."""
    if sandbox:
        return SANDBOX_CACHE
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "zig"


def compile_command(sources: list[Path], out: Path, *, optimize: str = "safe",
                    stack_size: int = DEFAULT_STACK, max_memory: int | None = None, werror: bool = False,
                    sdk: Path | None = None, cache: Path | None = None) -> list[str]:
    """The compiler command line for ``sources`` (C files, or one Zig root plus C files).

    ``sdk`` is the SDK folder to name (default: the checkout's), ``cache`` Zig's cache (default: the
    user's). A source whose path starts with ``-`` is refused (the compiler would read it as an option).
    """
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
        if str(src).startswith("-"):
            raise BuildError(f"{src}: a source path starting with '-' would be read as an option: name it ./{src}")
        if not src.is_file():
            raise BuildError(f"{src}: no such file")
    if stack_size < 4096 or stack_size % 16:
        raise BuildError(f"stack size must be at least 4096 and a multiple of 16, got {stack_size}")
    if max_memory is not None and (max_memory < 65536 or max_memory % 65536):
        raise BuildError(f"max memory must be a positive multiple of 65536 (a page), got {max_memory}")
    sdk = sdk if sdk is not None else sdk_dir()
    zig = _zig()
    c_flags, zig_mode = OPTIMIZE[optimize]
    warn = ["-Wall", *(["-Werror"] if werror else [])]
    link = [f"-Wl,-z,stack-size={stack_size}"] + ([f"-Wl,--max-memory={max_memory}"] if max_memory else [])
    strip = [] if optimize == "debug" else ["-s"]
    include = ["-I", str(sdk / "c")]
    if not zig_roots:
        return [*zig, "cc", "--target=wasm32-wasi", "-mexec-model=reactor", *c_flags, *warn, *strip, *include,
                *link, "-o", str(out), *map(str, sources)]
    root = zig_roots[0]
    c_files = [str(s) for s in sources if s.suffix in _C_SUFFIXES]
    cmd = [*zig, "build-exe", "-target", "wasm32-wasi", "-mexec-model=reactor", "-fno-entry", "-rdynamic",
           "-O", zig_mode, "--stack", str(stack_size), "--cache-dir", str(cache or cache_dir()),
           f"-femit-bin={out}", "--name", out.stem]
    if optimize != "debug":
        cmd.append("-fstrip")
    if max_memory:
        cmd.append(f"--max-memory={max_memory}")
    if c_files:
        cmd += ["-lc", *include, "-cflags", *c_flags, *warn, "--", *c_files]
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


def _preprocess_command(source: Path, index: int, optimize: str) -> list[str]:
    """Preprocess one staged C file only, listing every file it read (``#embed`` too) in ``deps/<index>.d``."""
    c_flags, _ = OPTIMIZE[optimize]
    return [*_zig(), "cc", "--target=wasm32-wasi", *c_flags, "-w", "-I", "sdk/c", "-E", "-MD",
            "-MF", f"deps/{index}.d", "-o", f"deps/{index}.i", str(source)]


def _compiler_env(root: Path, cache: Path) -> dict[str, str]:
    """The compiler's whole environment: nothing of the caller's but PATH."""
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(root), "TMPDIR": str(root / "tmp"),
            "ZIG_GLOBAL_CACHE_DIR": str(cache), "ZIG_LOCAL_CACHE_DIR": str(cache), "LANG": "C.UTF-8"}


def _stable_lib_dir(toolchain: Path, cache: Path) -> Path | None:
    """The toolchain's ``lib/`` at a path that is the same in every checkout using ``cache``:
    ``<cache>/twt-zig-lib-<zig version>``, made once (hard links to this checkout's files, a copy on
    another filesystem; built aside, then renamed into place). Call it holding the cache's lock, as
    every build on the cache does. None if the version is unknown or the folder cannot be made (the
    build then uses the toolchain's own ``lib/``).

    Why: Zig keys what it builds on the path of the lib folder (the libraries' compile commands
    name it), so through each checkout's own ``.venv/.../ziglang/lib`` every checkout (a fresh
    clone, a worktree) compiled the Debug-mode wasi-libc and runtimes (a Zig root's ``-O debug``
    build, or a C one whose link-only build could not be made: ~20 s of CPU) again; through this
    one path, once per Zig version per cache. Only those builds use it: the release libraries stay
    keyed on the toolchain's own path, the one a sandboxed build compiles through (its cache,
    seeded from the user's, then finds them). It must be a folder, not a link:
    Zig resolves a link's files to their real paths. The folder's name says its Zig version, and a
    version's files are the same in every checkout.
    """
    versions = [p.name[len(TOOLCHAIN) + 1:-len(".dist-info")] for p in toolchain.parent.glob(f"{TOOLCHAIN}-*.dist-info")]
    if len(versions) != 1 or not re.fullmatch(r"[0-9A-Za-z.+_-]+", versions[0]):
        return None
    stable = cache / f"twt-zig-lib-{versions[0]}"
    if stable.is_dir() and not stable.is_symlink():
        return stable
    aside = cache / f".twt-zig-lib-{versions[0]}.{os.getpid()}"

    def link_or_copy(src: str, dst: str) -> None:
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)

    try:
        cache.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(aside, ignore_errors=True)
        shutil.copytree(toolchain / "lib", aside, copy_function=link_or_copy)
        os.rename(aside, stable)
    except OSError:
        shutil.rmtree(aside, ignore_errors=True)
        return stable if stable.is_dir() and not stable.is_symlink() else None
    return stable


def _sandbox_cache(user: SandboxUser, cache: Path) -> Path:
    """The sandbox's Zig cache, created for ``user``; BuildError if another user owns it (or it is a link)."""
    try:
        cache.mkdir(mode=0o700)
        os.chown(cache, user.uid, user.gid, follow_symlinks=False)
    except FileExistsError:
        pass
    info = os.lstat(cache)
    if not os.path.isdir(cache) or os.path.islink(cache) or info.st_uid != user.uid:
        raise BuildError(f"the sandbox's Zig cache {cache} is not a directory of the user {user.name!r}: "
                         "remove it (twt build --sandbox creates it)")
    return cache


_STAGED = re.compile(r"(?<![\w/.-])src(\d+)/")


def _source_dirs(sources: list[Path]) -> list[str]:
    """Each staged directory (``src<i>``, in :func:`stage_sources`' order) as the user named it: ``""``
    for the current one, else the source's folder with a slash (so messages read as they were given)."""
    seen: dict[Path, str] = {}
    for src in sources:
        real = source_dir(src)
        if real not in seen:
            shown = str(src.parent)
            seen[real] = "" if shown == "." else f"{shown}/"
    return list(seen.values())


def _unstage(output: str, dirs: list[str]) -> str:
    """The compiler's messages with each staged ``src<i>/`` named as the source's own directory."""
    def real(match: re.Match[str]) -> str:
        i = int(match.group(1))
        return dirs[i] if i < len(dirs) else match.group(0)

    return _STAGED.sub(real, output)


def build_module(sources: list[Path], out: Path, *, optimize: str = "safe", stack_size: int = DEFAULT_STACK,
                 max_memory: int | None = None, timeout_s: float = BUILD_TIMEOUT_S, werror: bool = False,
                 sandbox: bool = False, notify: Callable[[str], object] | None = None,
                 cache: Path | None = None) -> BuildResult:
    """Compile ``sources`` into ``out`` (written only on success); BuildError with the compiler's output.

    The build runs on a staged copy of the sources' directories (see
    :mod:`supervisor.tools.build_guard`), holding the Zig cache's lock
    (``notify`` hears once that it waits for another build; the wait is
    bounded by ``LOCK_TIMEOUT_S``, each compiler run by ``timeout_s``); ``sandbox``
    runs the compiler as ``nobody`` with a cache of its own. ``cache`` is
    the Zig cache to use instead of the default (the user's, or with
    ``sandbox`` ``SANDBOX_CACHE``). The result carries the compiler's
    warnings (empty when there are none).
    """
    out = out.resolve()
    # the checks first (absolute paths: a name like "-o.c" is staged as src0/-o.c, never read as an option)
    compile_command([src.absolute() for src in sources], out, optimize=optimize, stack_size=stack_size,
                    max_memory=max_memory)
    user = sandbox_user() if sandbox else None
    cache = cache if cache is not None else cache_dir(sandbox)
    if user is not None:
        _sandbox_cache(user, cache)
    toolchain = _toolchain_dir()
    with tempfile.TemporaryDirectory(prefix="twt-build-") as tmp:
        root = Path(tmp)
        staged = stage_sources(sources, root)
        dirs = _source_dirs(sources)
        sdk = sdk_dir()
        for part in ("c/tensorwasm.h", "zig/tensorwasm.zig"):
            (root / "sdk" / part).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(sdk / part, root / "sdk" / part)
        refuse_cimport(root)
        for sub in ("out", "deps", "tmp", "objs"):
            (root / sub).mkdir()
        if user is not None:
            chown_tree(root, user)
        env = _compiler_env(root, cache)
        staged_out = Path("out") / (out.stem + ".wasm")
        cmd = compile_command([root / s for s in staged], root / staged_out, optimize=optimize,
                              stack_size=stack_size, max_memory=max_memory, werror=werror, sdk=root / "sdk",
                              cache=cache)
        cmd = [_relative(arg, root) for arg in cmd]
        tool = "zig cc" if cmd[1] == "cc" else "zig build-exe"
        unlisted: NoDependencyList | None = None
        with cache_lock(cache, timeout_s=LOCK_TIMEOUT_S, notify=notify):
            for i, src in enumerate(s for s in staged if s.suffix in _C_SUFFIXES):
                code, output = run_compiler(_preprocess_command(src, i, optimize), cwd=root, env=env,
                                            timeout_s=timeout_s, user=user)
                if code != 0:
                    raise BuildError(f"compiling failed (zig cc exit {code}; its messages are above)",
                                     _unstage(output, dirs))
                allowed = [root / "sdk", toolchain, *(root / f"src{n}" for n in range(len(dirs)))]
                try:
                    check_dependencies(root / "deps" / f"{i}.d", root, allowed, _unstage(str(src), dirs))
                except NoDependencyList as exc:
                    unlisted = exc  # refused whatever happens; the compile below says what is missing
                    break
            linked = None
            if optimize == "debug" and cmd[1] == "cc" and unlisted is None:
                linked = _debug_c_build([s for s in staged if s.suffix in _C_SUFFIXES], staged_out, cache=cache,
                                        root=root, env=env, stack_size=stack_size, max_memory=max_memory,
                                        werror=werror, timeout_s=timeout_s, user=user)
            if linked is not None:
                (code, output), cmd = linked
            else:
                # a debug compile reads the toolchain through a path shared by every checkout (not the
                # sandbox's: its cache is another user's); the dependency check above ran on the real
                # one. A release compile reads the toolchain's own path: Zig keys its libraries on the
                # lib folder's path in every mode, and this is the path a sandboxed build (the
                # toolchain's own, whatever its cache) shares with the user's builds
                lib = _stable_lib_dir(toolchain, cache) if user is None and optimize == "debug" else None
                code, output = run_compiler(cmd, cwd=root,
                                            env=env if lib is None else {**env, "ZIG_LIB_DIR": str(lib)},
                                            timeout_s=timeout_s, user=user)
        output = _unstage(output, dirs)
        if code != 0:
            raise BuildError(f"compiling failed ({tool} exit {code}; its messages are above)", output)
        if unlisted is not None:
            raise unlisted
        wasm = _read_regular(root / staged_out)
        exports, wasi = _exports(wasm)
        if not exports:
            raise BuildError("the module exports no function: mark one with TWT_EXPORT(name) in C or "
                             "`export fn` in Zig", output)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp_out = out.with_name(out.name + ".tmp")
        tmp_out.write_bytes(wasm)
        tmp_out.replace(out)
    return BuildResult(out, len(wasm), exports, wasi, tuple(cmd), output)


#: a debug C build's link: the release libraries (those ``twt build --prepare`` compiles), stripped
_DEBUG_LINK_MODE = "ReleaseSafe"
#: the linker options that strip the output, left out of a debug C build's final link
_STRIP_OPTIONS = frozenset({"-s", "--strip-all", "-S", "--strip-debug"})


def _debug_c_build(sources: list[Path], out: Path, *, cache: Path, root: Path, env: dict[str, str],
                   stack_size: int, max_memory: int | None, werror: bool, timeout_s: float,
                   user: SandboxUser | None) -> tuple[tuple[int, str], list[str]] | None:
    """A C debug build (``-O debug``) linked against the release libraries: ``((exit code, output),
    the final command)``, or None where that link cannot be made (the caller then builds as before).

    Why: a single ``zig cc -O0 -g`` links libraries built with debug info, which Zig compiles once
    more (wasi-libc and the runtimes again, ~20-30 s of CPU on a fresh cache), though a trap's
    source lines come from the tenant's own objects. So each source is compiled alone (``-O0 -g``,
    undefined behaviour trapping where it happens, named by that line: there is no UBSan runtime
    without those libraries), ``zig build-exe`` links the objects against the release libraries
    (stripped, those of a release build: in the cache once anything was built) and prints the
    linker's command line, which then runs again without its strip options, so the module keeps
    the objects' debug info. A compile error is the build's answer; a link that fails or prints no
    command line (another Zig release) gives None.
    """
    zig = _zig()
    c_flags, _ = OPTIMIZE["debug"]
    warn = ["-Wall", *(["-Werror"] if werror else [])]
    outputs: list[str] = []
    objects: list[str] = []
    for i, src in enumerate(sources):
        obj = f"objs/{i}.o"
        cmd = [*zig, "cc", "--target=wasm32-wasi", *c_flags, "-fsanitize-trap=undefined", *warn, "-I", "sdk/c",
               "-c", "-o", obj, str(src)]
        code, output = run_compiler(cmd, cwd=root, env=env, timeout_s=timeout_s, user=user)
        outputs.append(output)
        if code != 0:
            return (code, "".join(outputs)), cmd
        objects.append(obj)
    if any(c.isspace() for c in str(cache) + str(root)):  # the printed command line splits at spaces
        return None
    linked = "objs/module.wasm"  # a name of ours: nothing the caller or a source named is in the command
    cmd = [*zig, "build-exe", "-target", "wasm32-wasi", "-mexec-model=reactor", "-fno-entry", "-O", _DEBUG_LINK_MODE,
           "-fstrip", "--stack", str(stack_size), *([f"--max-memory={max_memory}"] if max_memory else []),
           "--cache-dir", str(cache), "-lc", *objects, f"-femit-bin={linked}", "--name", "module", "--verbose-link"]
    code, output = run_compiler(cmd, cwd=root, env=env, timeout_s=timeout_s, user=user)
    lines = [line.split(" ") for line in output.splitlines() if line.startswith("wasm-ld ")]
    if code != 0 or len(lines) != 1:
        return None
    args = [arg for arg in lines[0][1:] if arg and arg not in _STRIP_OPTIONS]
    if not _known_link(args, linked, objects, cache):
        return None
    # the module goes where the one-step build writes it, written by the compiler (as the sandbox's
    # user with --sandbox), not moved there by this process
    link = [*zig, "wasm-ld", *(str(out) if arg == linked else arg for arg in args)]
    code, output = run_compiler(link, cwd=root, env=env, timeout_s=timeout_s, user=user)
    if code != 0:
        return None
    return (0, "".join(outputs) + output), link


#: the linker options a debug C build's printed link may hold (a value after ``=``); any other, and the
#: build links as before: the command line is run again, so nothing in it may write or read elsewhere
_LINK_FLAGS = ("--error-limit=", "--export-memory", "--stack-first", "--no-entry", "--build-id=", "--max-memory=",
               "--initial-memory=", "--export-dynamic", "--export-table", "--growable-table")


def _known_link(args: list[str], linked: str, objects: list[str], cache: Path) -> bool:
    """Whether ``args`` (a printed link, its strip options dropped) is the link this build asked for:
    one output, ``linked``; every object; the rest options of :data:`_LINK_FLAGS`, ``-z
    stack-size=N``, or libraries in the cache's ``o/``."""
    libraries = f"{cache}/o/"
    outputs = 0
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "-o":
            if args[i + 1:i + 2] != [linked]:
                return False
            outputs += 1
            i += 2
            continue
        if arg == "-z":
            if not re.fullmatch(r"stack-size=[0-9]+", args[i + 1] if i + 1 < len(args) else ""):
                return False
            i += 2
            continue
        known = (arg in objects or (arg.startswith(libraries) and ".." not in arg)
                 or any(arg == f or (f.endswith("=") and arg.startswith(f)) for f in _LINK_FLAGS))
        if not known:
            return False
        i += 1
    return outputs == 1 and set(objects) <= set(args)


def _relative(arg: str, root: Path) -> str:
    """``arg`` with the staged root's absolute prefix dropped (the compiler runs in ``root``)."""
    prefix = f"{root}/"
    if arg.startswith(prefix):
        return arg[len(prefix):]
    for flag in ("-femit-bin=", "-Mroot=", "-Mtensorwasm="):
        if arg.startswith(flag + prefix):
            return flag + arg[len(flag) + len(prefix):]
    return arg


def _read_regular(path: Path) -> bytes:
    """The module the compiler wrote, opened without following a link (a sandboxed build owns the folder)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as exc:
        raise BuildError(f"the compiler wrote no module ({exc.strerror})") from None
    with os.fdopen(fd, "rb") as f:
        return f.read()


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


def prepare_toolchain(*, optimize: str = "safe", timeout_s: float = BUILD_TIMEOUT_S, sandbox: bool = False,
                      notify: Callable[[str], object] | None = None) -> list[BuildResult]:
    """Compile what a first build compiles (wasi-libc, the compiler runtimes) into Zig's cache now.

    Why: the first ``twt build`` on a machine spends ~20 s of CPU building wasi-libc and its
    runtimes before it compiles the tenant's code (later builds take well under a second). An
    image or a CI job pays it once at set-up instead (``make`` does, when it installs the venv).
    Returns the three throw-away builds (C alone, Zig with a C helper, Zig alone). ``sandbox``
    prepares the sandbox's own cache (``--sandbox`` builds use it).
    """
    with tempfile.TemporaryDirectory(prefix="twt-prepare-") as tmp:
        src = Path(tmp)
        for name, text in _PREPARE_SOURCES.items():
            (src / name).write_text(text)
        plans = [[src / "prepare_c.c"], [src / "prepare_zig.zig", src / "prepare_helper.c"],
                 [src / "prepare_zig_only.zig"]]
        return [build_module(sources, src / f"out{i}.wasm", optimize=optimize, timeout_s=timeout_s,
                             sandbox=sandbox, notify=notify)
                for i, sources in enumerate(plans)]
