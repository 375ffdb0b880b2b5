"""``twt build``: what it makes, and its one-line errors; then ``twt build`` + ``twt run`` as a user runs them.

The library function (``build_module``) in process, the command line
through ``supervisor.cli.main`` and, end to end, the ``twt`` command as a
process against a real supervisor and worker.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import wasmtime

from shared.spec import TenantSpec
from supervisor.cli import main
from supervisor.cli import build as build_cli
from supervisor.tools import build as builder
from supervisor.tools.build import BuildError, build_module
from tests.helpers.cli import twt
from tests.helpers.cluster import supervisor
from tests.helpers.wasm_env import tenant_env
from worker.backends.stub import StubBackend
from worker.wasm.host import memory_limits

# the first build of a session compiles wasi-libc; every build runs the zig compiler (a process)
pytestmark = [pytest.mark.timeout(300), pytest.mark.process]

HELLO = r"""#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "tensorwasm.h"

/* a tenant using libc and the header: n floats of 1.5 through malloc'd guest memory, summed on the host */
TWT_EXPORT(hello) float hello(int32_t n) {
    float *xs = malloc(n * sizeof *xs);
    for (int32_t i = 0; i < n; i++) xs[i] = 1.5f;
    twt_handle h = twt_alloc(n * 4);
    if (h < 0) { printf("alloc: %s\n", twt_strerror(h)); return -1; }
    twt_write(h, 0, xs, n * 4);
    free(xs);
    float total = 0;
    twt_sum_f32(h, n, &total);
    printf("hello from C: sum of %d x 1.5 = %g\n", n, total);
    return total;
}

TWT_EXPORT(bye) int32_t bye(int32_t code) { printf("bye %d\n", code); exit(code); }
"""


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_a_c_tenant_builds_into_a_reactor(tmp_path: Path) -> None:
    out = tmp_path / "out" / "hello.wasm"
    result = build_module([write(tmp_path, "hello.c", HELLO)], out, max_memory=4 << 20)
    assert result.out == out.resolve() and result.exports == ("hello", "bye") and result.wasi
    wasm = out.read_bytes()
    module = wasmtime.Module(wasmtime.Engine(), wasm)
    names = {e.name for e in module.exports}
    assert {"memory", "_initialize", "hello", "bye"} <= names
    # the declared maximum, and the small stack instead of the linker's 16 MiB (charged while a run lasts)
    limits = memory_limits(wasm)
    assert limits is not None and limits[1] == (4 << 20) // 65536 and limits[0] * 65536 < 1 << 20


@pytest.mark.parametrize(
    ("files", "options", "match"),
    [
        ({"a.rs": "fn main() {}"}, {}, "not a C (.c) or Zig (.zig) source"),
        ({"a.zig": "", "b.zig": ""}, {}, "one Zig root file per module"),
        ({"a.c": "int x;"}, {"optimize": "turbo"}, "unknown optimisation"),
        ({"a.c": "int x;"}, {"stack_size": 1000}, "stack size"),
        ({"a.c": "int x;"}, {"max_memory": 1000}, "multiple of 65536"),
    ],
)
def test_bad_builds_are_refused_before_compiling(tmp_path: Path, files: dict[str, str], options: dict[str, object],
                                                 match: str) -> None:
    sources = [write(tmp_path, name, text) for name, text in files.items()]
    with pytest.raises(BuildError) as exc:
        build_module(sources, tmp_path / "x.wasm", **options)  # type: ignore[arg-type]
    assert match in str(exc.value)
    assert not (tmp_path / "x.wasm").exists()
    with pytest.raises(BuildError, match="no such file"):
        build_module([tmp_path / "missing.c"], tmp_path / "x.wasm")


def test_the_compilers_messages_and_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = write(tmp_path, "bad.c", '#include "tensorwasm.h"\nTWT_EXPORT(f) int f(void) { return twt_nope(); }\n')
    out = tmp_path / "bad.wasm"
    assert main(["build", str(src), "-o", str(out)]) == 1
    err = capsys.readouterr().err
    assert "bad.c:2" in err and "twt_nope" in err  # the compiler's own message, with file and line
    assert err.strip().splitlines()[-1].startswith("twt build: error: compiling failed (zig cc exit 1")
    assert not out.exists()


def test_a_module_without_exports_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = write(tmp_path, "none.c", "int helper(int x) { return x + 1; }\n")
    assert main(["build", str(src), "-o", str(tmp_path / "none.wasm")]) == 1
    assert "exports no function: mark one with TWT_EXPORT(name)" in capsys.readouterr().err
    assert not (tmp_path / "none.wasm").exists()


def test_a_missing_compiler_names_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(builder, "TOOLCHAIN", "ziglang_not_installed_here")
    src = write(tmp_path, "a.c", "int x;")
    assert main(["build", str(src), "-o", str(tmp_path / "a.wasm")]) == 1
    err = capsys.readouterr().err.strip()
    assert err == ("twt build: error: the Zig toolchain is not installed: pip install 'tensor-wasm-tenant[sdk]' "
                   "(the sdk extra: the ziglang package)")


def test_prepare_builds_every_kind_of_guest_and_refuses_sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """``twt build --prepare`` (make's install step runs it): the three ways a build drives the
    compiler, each a real module with its export; with a SRC or -o it is a usage error, and a
    plain ``twt build`` without them says what it needs."""
    results = builder.prepare_toolchain()
    assert [r.exports for r in results] == [("prepare",)] * 3
    assert [r.command[1] for r in results] == ["cc", "build-exe", "build-exe"]
    assert results[0].wasi and results[1].wasi  # both printed through libc: wasi-libc is in the cache
    monkeypatch.setattr(build_cli, "prepare_toolchain", lambda **_: results)  # the CLI's part: built above
    assert main(["build", "--prepare"]) == 0
    assert "prepared the Zig toolchain's cache for 3 kinds of build" in capsys.readouterr().out
    src = write(tmp_path, "a.c", "int x;")
    assert main(["build", "--prepare", str(src)]) == 2
    assert "--prepare compiles no tenant" in capsys.readouterr().err
    assert main(["build"]) == 2
    assert "give the sources (SRC ...) and -o OUT.wasm (or --prepare)" in capsys.readouterr().err
    assert main(["build", str(src)]) == 2


def test_zig_with_a_c_helper(tmp_path: Path) -> None:
    helper = write(tmp_path, "helper.c", "#include <string.h>\nint helper_len(const char *s) { return strlen(s); }\n")
    root = write(tmp_path, "main.zig", 'const std = @import("std");\nconst twt = @import("tensorwasm");\n'
                 "extern fn helper_len(s: [*:0]const u8) c_int;\n"
                 'export fn run() i32 { twt.log("zig + c") catch {}; std.debug.print("stderr {d}\\n", .{42}); '
                 'return helper_len("four"); }\n')
    result = build_module([root, helper], tmp_path / "mixed.wasm")
    assert result.exports == ("run",)
    with tenant_env("sdk", StubBackend(), max_memory=4 << 20) as env:
        reply = env.host.run(result.out.read_bytes(), "run", [], fuel=10**8, timeout_s=30.0)
    assert reply["results"] == [4] and reply["logs"] == ["zig + c", "stderr 42"]


def test_twt_build_then_twt_run(tmp_path: Path) -> None:
    """The issue's 'done when': a C tenant with printf and malloc, two commands, a result."""
    src = write(tmp_path, "hello.c", HELLO)
    wasm = tmp_path / "hello.wasm"
    built = twt("build", str(src), "-o", str(wasm), timeout=280)
    assert built.returncode == 0, built.stderr
    assert built.stdout.strip() == f"wrote {wasm} ({wasm.stat().st_size:,} B): exports hello, bye; uses WASI (libc)"
    spec = TenantSpec.from_dict({"tenant_id": "acme", "gpu_memory_bytes_cap": 1 << 20})
    with supervisor() as sup:
        sup.client.register(None, spec)
        rd = sup.run_dir
        ran = twt("run", "acme", str(wasm), "--invoke", "hello", "--arg", "1000", "--run-dir", rd)
        assert ran.returncode == 0, ran.stderr
        lines = ran.stdout.splitlines()
        assert lines[0] == "results: [1500.0]"
        assert "log: hello from C: sum of 1000 x 1.5 = 1500" in lines
        bye = twt("run", "acme", str(wasm), "--invoke", "bye", "--arg", "3", "--run-dir", rd)
        assert bye.returncode == 1 and bye.stdout.splitlines()[-2:] == ["log: bye 3", "exit code: 3"]
        ok = twt("run", "acme", str(wasm), "--invoke", "bye", "--arg", "0", "--run-dir", rd)
        assert ok.returncode == 0 and ok.stdout.splitlines()[-1] == "exit code: 0"


def _fake_toolchain(tmp_path: Path, version: str = "0.99.1") -> Path:
    """A ``ziglang`` folder as pip lays it out: ``lib/`` beside ``ziglang-<version>.dist-info``."""
    toolchain = tmp_path / "site" / builder.TOOLCHAIN
    (toolchain / "lib" / "libc" / "include").mkdir(parents=True)
    (toolchain / "lib" / "libc" / "include" / "stdio.h").write_text("/* stdio */\n")
    (toolchain / "lib" / "std.zig").write_text("// std\n")
    (tmp_path / "site" / f"{builder.TOOLCHAIN}-{version}.dist-info").mkdir()
    return toolchain


def test_the_stable_lib_dir_is_one_real_folder_per_zig_version(tmp_path: Path) -> None:
    """Debug builds are keyed on the lib folder's path: every checkout names the same one (a real
    folder of hard links, not a link, whose files Zig would resolve to the checkout's own paths)."""
    toolchain, cache = _fake_toolchain(tmp_path), tmp_path / "cache"
    stable = builder._stable_lib_dir(toolchain, cache)
    assert stable == cache / "twt-zig-lib-0.99.1" and stable.is_dir() and not stable.is_symlink()
    copy, original = stable / "libc" / "include" / "stdio.h", toolchain / "lib" / "libc" / "include" / "stdio.h"
    assert copy.read_text() == "/* stdio */\n" and copy.stat().st_ino == original.stat().st_ino
    assert not [p for p in cache.iterdir() if p.name.startswith(".")]  # nothing left aside
    # another checkout of the same version finds it and names the same path
    assert builder._stable_lib_dir(_fake_toolchain(tmp_path / "other"), cache) == stable


def test_no_stable_lib_dir_where_the_version_is_unknown_or_a_link_holds_its_name(tmp_path: Path) -> None:
    toolchain, cache = _fake_toolchain(tmp_path), tmp_path / "cache"
    (tmp_path / "site" / f"{builder.TOOLCHAIN}-1.0.0.dist-info").mkdir()  # two versions: which?
    assert builder._stable_lib_dir(toolchain, cache) is None
    toolchain = _fake_toolchain(tmp_path / "b")
    cache.mkdir(exist_ok=True)
    (cache / "twt-zig-lib-0.99.1").symlink_to(tmp_path)
    assert builder._stable_lib_dir(toolchain, cache) is None  # the build then uses the toolchain's own lib
    assert (cache / "twt-zig-lib-0.99.1").is_symlink() and not [p for p in cache.iterdir() if p.name.startswith(".")]


def _recording_compiler(seen: list[tuple[list[str], dict[str, str]]],
                        verbose_link: str | None = None) -> Callable[..., tuple[int, str]]:
    """A stand-in for run_compiler that records each command and its environment: the preprocessor's
    pass writes an empty dependency list; ``cc -c`` writes its object; ``build-exe`` prints
    ``verbose_link`` (when given; else it fails); ``wasm-ld`` writes a module exporting ``f`` where
    its ``-o`` says; anything else fails."""

    def compiler(cmd: list[str], **kw: object) -> tuple[int, str]:
        env, cwd = kw["env"], Path(str(kw["cwd"]))
        assert isinstance(env, dict)
        seen.append((cmd, env))
        if "-E" in cmd:
            (cwd / cmd[cmd.index("-MF") + 1]).write_text("deps/x.i:\n")
            return 0, ""
        if cmd[1] == "cc" and "-c" in cmd:
            (cwd / cmd[cmd.index("-o") + 1]).write_bytes(b"\0asm object")
            return 0, ""
        if cmd[1] == "build-exe" and verbose_link is not None:
            return 0, verbose_link
        if cmd[1] == "wasm-ld":
            (cwd / cmd[cmd.index("-o") + 1]).write_bytes(wasmtime.wat2wasm('(module (func (export "f")))'))
            return 0, ""
        return 1, "stopped here"

    return compiler


def test_a_debug_compile_reads_the_stable_lib_dir_and_the_dependency_check_and_a_release_compile_the_real_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Zig keys its libraries on the lib folder's path in every mode: the Debug ones (a Zig root's debug
    build) are shared by every checkout through the stable folder; the release ones stay on the
    toolchain's own path, which a sandboxed build (whose cache is seeded from the user's) compiles
    through too."""
    seen: list[tuple[list[str], dict[str, str]]] = []
    monkeypatch.setattr(builder, "run_compiler", _recording_compiler(seen))
    toolchain = _fake_toolchain(tmp_path)
    monkeypatch.setattr(builder, "_toolchain_dir", lambda: toolchain)
    src, root = tmp_path / "a.c", tmp_path / "a.zig"
    src.write_text("int f(void) { return 1; }\n")
    root.write_text("export fn g() i32 { return 1; }\n")
    with pytest.raises(BuildError, match="compiling failed"):
        build_module([root, src], tmp_path / "a.wasm", cache=tmp_path / "cache", optimize="debug")
    (pre, pre_env), (cmd, env) = seen
    assert "-E" in pre and "ZIG_LIB_DIR" not in pre_env and cmd[1] == "build-exe"
    lib = Path(env["ZIG_LIB_DIR"])
    assert lib == tmp_path / "cache" / "twt-zig-lib-0.99.1" and not lib.is_symlink()
    assert (lib / "std.zig").read_text() == "// std\n"
    seen.clear()
    with pytest.raises(BuildError, match="compiling failed"):
        build_module([src], tmp_path / "a.wasm", cache=tmp_path / "cache")
    (pre, pre_env), (_, env) = seen
    assert "-E" in pre and "ZIG_LIB_DIR" not in pre_env and "ZIG_LIB_DIR" not in env


def test_a_debug_c_build_links_its_objects_against_the_release_libraries_unstripped(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``-O debug`` of C sources: each compiled alone with debug info, linked by ``build-exe`` against
    the release libraries (stripped, on the toolchain's own path: what a release build left in the
    cache), then that link's own command run again without its strip option - no Debug-mode
    wasi-libc to compile, and the module keeps the sources' debug info."""
    seen: list[tuple[list[str], dict[str, str]]] = []
    cache = tmp_path / "cache"
    printed = f"wasm-ld --error-limit=0 -s --no-entry -o objs/module.wasm {cache}/o/ab/libc.a objs/0.o objs/1.o\n"
    monkeypatch.setattr(builder, "run_compiler", _recording_compiler(seen, printed))
    toolchain = _fake_toolchain(tmp_path)
    monkeypatch.setattr(builder, "_toolchain_dir", lambda: toolchain)
    sources = [write(tmp_path, "a.c", "int f(void) { return 1; }\n"), write(tmp_path, "b.c", "int g;\n")]
    result = build_module(sources, tmp_path / "dbg.wasm", cache=cache, optimize="debug", werror=True)
    assert result.exports == ("f",) and (tmp_path / "dbg.wasm").read_bytes()[:4] == b"\0asm"
    compiles = [cmd for cmd, _ in seen if cmd[1] == "cc" and "-c" in cmd]
    assert [c[c.index("-o") + 1] for c in compiles] == ["objs/0.o", "objs/1.o"]
    assert all({"-O0", "-g", "-Werror", "-fsanitize-trap=undefined"} <= set(c) for c in compiles)
    (exe, exe_env), = [(cmd, env) for cmd, env in seen if cmd[1] == "build-exe"]
    assert {"-fstrip", "--verbose-link", "-lc", "objs/0.o", "objs/1.o"} <= set(exe) and "ZIG_LIB_DIR" not in exe_env
    assert exe[exe.index("-O") + 1] == "ReleaseSafe"
    (link, _), = [(cmd, env) for cmd, env in seen if cmd[1] == "wasm-ld"]
    # the printed line, less its strip option, writing where the one-step build writes
    assert link[2:] == ["--error-limit=0", "--no-entry", "-o", "out/dbg.wasm", f"{cache}/o/ab/libc.a",
                        "objs/0.o", "objs/1.o"]
    assert result.command == tuple(link)
    assert not (cache / "twt-zig-lib-0.99.1").exists()  # no Debug-mode libraries asked for


@pytest.mark.parametrize("printed", [None, "", "wasm-ld -s -o out/elsewhere.wasm objs/0.o\n",
                                     "wasm-ld -s -o objs/module.wasm -o /etc/x objs/0.o\n",
                                     "wasm-ld -s -o objs/module.wasm objs/0.o --Map=/etc/x\n",
                                     "wasm-ld -s -o objs/module.wasm objs/0.o /etc/x.a\n",
                                     "wasm-ld -s -o objs/module.wasm -z stack-size=1,x objs/0.o\n",
                                     "wasm-ld -o objs/module.wasm objs/0.o\nwasm-ld -o objs/module.wasm objs/0.o\n"])
def test_a_debug_c_build_without_a_usable_link_line_builds_in_one_step(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, printed: str | None) -> None:
    """A link that fails, or prints no command line, or two, or one that writes elsewhere than asked or
    holds an option or an input not known here (the command is run again): the single ``zig cc -O0
    -g`` build (its own Debug-mode libraries, through the stable lib folder)."""
    seen: list[tuple[list[str], dict[str, str]]] = []
    monkeypatch.setattr(builder, "run_compiler", _recording_compiler(seen, printed))
    toolchain = _fake_toolchain(tmp_path)
    monkeypatch.setattr(builder, "_toolchain_dir", lambda: toolchain)
    src = write(tmp_path, "a.c", "int f(void) { return 1; }\n")
    with pytest.raises(BuildError, match="compiling failed"):
        build_module([src], tmp_path / "a.wasm", cache=tmp_path / "cache", optimize="debug")
    assert not [cmd for cmd, _ in seen if cmd[1] == "wasm-ld"]
    last, env = seen[-1]
    assert last[1] == "cc" and "-c" not in last and {"-O0", "-g"} <= set(last)
    assert env["ZIG_LIB_DIR"] == str(tmp_path / "cache" / "twt-zig-lib-0.99.1")
