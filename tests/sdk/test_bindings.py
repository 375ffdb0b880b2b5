"""The SDK's bindings stay in step with the host's import table (worker.wasm.abi.IMPORTS).

Two independent checks: ``sdk/generate.py --check`` (the committed files are
what the generator writes from the table), and the compiler's own view: a C
and a Zig guest referencing every binding are built, and the imports the
module declares (names and wasm types) must be exactly the table; their
error-code and unary-op constants, read back by running them, must be the
host's.
"""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType

import pytest
import wasmtime

from shared.wasm_abi import ErrorCode
from tests.helpers.sdk_build import ROOT, SdkBuilder
from tests.helpers.wasm_env import tenant_env
from worker.backends.stub import StubBackend
from worker.wasm import IMPORT_MODULE, IMPORTS, UNARY_OPS
from worker.wasm.tensor_abi import BINARY_OPS, DTYPES, REDUCE_OPS

pytestmark = pytest.mark.timeout(300)  # the first build of a session compiles wasi-libc


def generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("twt_sdk_generate", ROOT / "sdk" / "generate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)
    spec.loader.exec_module(module)
    return module


def test_the_committed_bindings_are_what_the_generator_writes(capsys: pytest.CaptureFixture[str]) -> None:
    gen = generator()
    assert gen.main(["--check"]) == 0, capsys.readouterr().err
    assert (ROOT / "sdk" / "c" / "tensorwasm.h").read_text() == gen.c_header()
    assert (ROOT / "sdk" / "zig" / "tensorwasm.zig").read_text() == gen.zig_module()


def declared_imports(module: bytes) -> dict[str, tuple[tuple[str, ...], str]]:
    out: dict[str, tuple[tuple[str, ...], str]] = {}
    for imp in wasmtime.Module(wasmtime.Engine(), module).imports:
        if imp.module != IMPORT_MODULE:
            continue
        assert isinstance(imp.type, wasmtime.FuncType)
        (result,) = imp.type.results
        out[imp.name] = (tuple(str(p) for p in imp.type.params), str(result))
    return out


def c_source() -> str:
    names = list(IMPORTS)
    cases = "\n".join(f"    case {i}: return (uintptr_t)&twt_{n};" for i, n in enumerate(names))
    codes = ", ".join(f"TWT_{c.name}" for c in ErrorCode)
    ops = ", ".join(f"TWT_OP_{op.upper()}" for op in UNARY_OPS)
    sel = ", ".join([f"TWT_BIN_{o.upper()}" for o in BINARY_OPS] + [f"TWT_RED_{o.upper()}" for o in REDUCE_OPS]
                    + [f"TWT_{d.upper()}" for d in DTYPES])
    return f"""#include <stdint.h>
#include "tensorwasm.h"
TWT_EXPORT(fn_at) uintptr_t fn_at(int32_t i) {{
    switch (i) {{
{cases}
    default: return 0;
    }}
}}
static const int64_t codes[] = {{{codes}}};
static const int32_t ops[] = {{{ops}}};
TWT_EXPORT(code) int64_t code(int32_t i) {{ return codes[i]; }}
TWT_EXPORT(op) int32_t op(int32_t i) {{ return ops[i]; }}
static const int32_t sels[] = {{{sel}}};
TWT_EXPORT(sel) int32_t sel(int32_t i) {{ return sels[i]; }}
TWT_EXPORT(name_is) int32_t name_is(int32_t i, int32_t c) {{ return twt_strerror(codes[i])[0] == c; }}
"""


def zig_source() -> str:
    names = list(IMPORTS)
    cases = "\n".join(f"        {i} => @intFromPtr(&twt.raw.{n})," for i, n in enumerate(names))
    codes = ", ".join(f"twt.code.{c.name}" for c in ErrorCode)
    ops = ", ".join(f".{op}" for op in UNARY_OPS)
    # every checked wrapper analysed (Zig compiles only what is referenced); write/read are generic
    # (anytype) and exercised by slices() instead
    wrapped = "\n".join(f"    n +%= @intFromPtr(&twt.{name});" for name in names if name not in ("write", "read"))
    sel = ", ".join([f"@intFromEnum(twt.Binary.{o})" for o in BINARY_OPS]
                    + [f"@intFromEnum(twt.Reduce.{o})" for o in REDUCE_OPS]
                    + [f"@intFromEnum(twt.DType.{d})" for d in DTYPES])
    return f"""const twt = @import("tensorwasm");
export fn fn_at(i: u32) usize {{
    return switch (i) {{
{cases}
        else => 0,
    }};
}}
const codes = [_]i32{{ {codes} }};
const ops = [_]twt.Unary{{ {ops} }};
export fn code(i: u32) i64 {{ return codes[i]; }}
export fn op(i: u32) i32 {{ return @intFromEnum(ops[i]); }}
export fn roundtrip(c: i32) i32 {{ return twt.toCode(twt.fromCode(c)); }}
export fn checked(c: i32) i32 {{ twt.check(c) catch |err| return twt.toCode(err); return 0; }}
export fn wrappers() usize {{
    var n: usize = 0;
{wrapped}
    return n;
}}
const sels = [_]i32{{ {sel} }};
export fn sel(i: u32) i32 {{ return sels[i]; }}
// write and read take any slice or array pointer, not only bytes
export fn slices() i32 {{
    const h = twt.alloc(16) catch |err| return twt.toCode(err);
    const v = [_]f32{{ 1.5, 2.5, 3.5, 4.5 }};
    twt.write(h, 0, &v) catch |err| return twt.toCode(err);
    const tail: []const f32 = v[2..];
    twt.write(h, 0, tail) catch |err| return twt.toCode(err);
    var back: [4]f32 = undefined;
    twt.read(h, 0, back[0..]) catch |err| return twt.toCode(err);
    return if (back[0] == 3.5 and back[1] == 4.5 and back[2] == 3.5) 1 else 0;
}}
"""


@pytest.mark.parametrize("lang", ["c", "zig"])
def test_the_bindings_declare_exactly_the_host_imports(sdk: SdkBuilder, lang: str) -> None:
    module = sdk.source("bindings.c", c_source()) if lang == "c" else sdk.source("bindings.zig", zig_source())
    assert declared_imports(module) == IMPORTS  # every import, each with the ABI's exact wasm type
    with tenant_env("sdk", StubBackend(), max_memory=4 << 20) as env:
        def call(export: str, *args: int) -> int:
            (result,) = env.host.run(module, export, list(args), fuel=10**6, timeout_s=30.0)["results"]
            assert isinstance(result, int)
            return result

        assert all(call("fn_at", i) != 0 for i in range(len(IMPORTS)))
        assert [call("code", i) for i in range(len(ErrorCode))] == [int(c) for c in ErrorCode]
        assert [call("op", i) for i in range(len(UNARY_OPS))] == list(range(len(UNARY_OPS)))
        selectors = [*range(len(BINARY_OPS)), *range(len(REDUCE_OPS)), *range(len(DTYPES))]
        assert [call("sel", i) for i in range(len(selectors))] == selectors
        if lang == "c":
            assert all(call("name_is", i, ord(c.name[0])) == 1 for i, c in enumerate(ErrorCode))
        else:
            for c in ErrorCode:
                if c is not ErrorCode.OK:
                    assert call("roundtrip", int(c)) == int(c)
                    assert call("checked", int(c)) == int(c)
            assert call("checked", 0) == 0 and call("checked", 7) == 0
            assert call("roundtrip", -99) == int(ErrorCode.INVALID)  # Unknown: a code this SDK predates
            assert call("slices") == 1
            assert call("wrappers") != 0
