"""Write the guest SDK's bindings (sdk/c/tensorwasm.h, sdk/zig/tensorwasm.zig) from the host's import table.

    worker.wasm.abi.IMPORTS     name -> (wasm parameter types, result type)   the truth
    worker.wasm.TENSOR_OPS      parameter names and roles, one doc line       per tensor op
    shared.wasm_abi.ErrorCode   TWT_<NAME> / error.<Name>
    worker.wasm.UNARY_OPS       TWT_OP_<NAME> / Unary.<name>
    BINARY_OPS, REDUCE_OPS      TWT_BIN_<NAME> / Binary.<name>, TWT_RED_<NAME> / Reduce.<name>
    DTYPES                      TWT_<NAME> / DType.<name>
    BASE below                  names, C types and docs of the eight base imports

Run it after changing the ABI: ``.venv/bin/python sdk/generate.py`` (``--check``
exits 1 when the files differ). tests/sdk/test_bindings.py runs ``--check``
and also compiles every binding and compares the wasm import types the
compiler emits with the table, so a hand edit or a new op cannot drift.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from shared.wasm_abi import ErrorCode
from worker.wasm.abi import IMPORT_MODULE, IMPORTS
from worker.wasm.tensor_abi import BINARY_OPS, DTYPES, REDUCE_OPS, TENSOR_OPS, UNARY_OPS

SDK = Path(__file__).resolve().parent
C_HEADER = SDK / "c" / "tensorwasm.h"
ZIG_MODULE = SDK / "zig" / "tensorwasm.zig"

#: the base imports: (C result type, [(name, C type)], doc)
BASE: dict[str, tuple[str, list[tuple[str, str]], str]] = {
    "alloc": ("twt_handle", [("nbytes", "int64_t")],
              "A new buffer of `nbytes` (> 0) bytes, metered against the tenant's GPU quota; its handle (> 0) "
              "or a negative error code (TWT_GPU_QUOTA, TWT_DEVICE_OOM, TWT_TOO_MANY_HANDLES ...)."),
    "free": ("int32_t", [("h", "twt_handle")],
             "Frees a buffer this run allocated; TWT_NOT_OWNED for a client buffer passed in."),
    "write": ("int32_t", [("h", "twt_handle"), ("dst_off", "int64_t"), ("src", "const void *"), ("len", "uint32_t")],
              "Copies `len` bytes of guest memory at `src` into the buffer at byte offset `dst_off`."),
    "read": ("int32_t", [("h", "twt_handle"), ("src_off", "int64_t"), ("dst", "void *"), ("len", "uint32_t")],
             "Copies `len` bytes of the buffer from byte offset `src_off` into guest memory at `dst`."),
    "fill_f32": ("int32_t", [("h", "twt_handle"), ("value", "float"), ("count", "int64_t")],
                 "Sets the first `count` floats of the buffer to `value`."),
    "axpy_f32": ("int32_t", [("n", "int64_t"), ("a", "float"), ("x", "twt_handle"), ("y", "twt_handle")],
                 "`y[:n] = a * x[:n] + y[:n]` in float32 (`x` may be `y`)."),
    "sum_f32": ("int32_t", [("h", "twt_handle"), ("count", "int64_t"), ("out", "float *")],
                "The float32 sum of the first `count` floats, stored at `out`."),
    "log": ("int32_t", [("msg", "const char *"), ("len", "uint32_t")],
            "One log line (UTF-8) into the run's `logs`; TWT_RATE_LIMITED when dropped."),
}
#: C type of each tensor-op role; a ``ptr`` parameter is typed per op below
_ROLE_C = {"buf": "twt_handle", "dim": "int64_t", "f32": "float", "op": "int32_t"}
_PTR_C = {"max_f32": "float *", "argmax_rows_f32": "int32_t *", "gather_rows_f32": "const int32_t *"}
#: Zig enum of an ``op``-role parameter (by op and parameter name); the rest stay i32
_ZIG_ENUM = {("unary_f32", "op"): "Unary", ("binary_f32", "op"): "Binary", ("binary_rows_f32", "op"): "Binary",
             ("scalar_f32", "op"): "Binary", ("reduce_rows_f32", "op"): "Reduce",
             ("cast", "src_dtype"): "DType", ("cast", "dst_dtype"): "DType",
             ("gemm_ex", "ab_dtype"): "DType", ("gemm_ex", "c_dtype"): "DType"}
#: the Zig wrappers whose doc differs from the C one (they take slices, not pointer and length)
_ZIG_DOC = {
    "write": "Copies the bytes of `src` (any slice or array pointer: `[]const u8`, `[]const f32` ...) into "
             "the buffer at byte offset `dst_off`.",
    "read": "Fills `dst` (any mutable slice or array pointer: `[]u8`, `[]f32` ...) with the buffer's bytes "
            "from byte offset `src_off`.",
    "log": "One log line (UTF-8) into the run's `logs`; error.RateLimited when dropped.",
}
#: wasm type of each C type used above (what clang lowers it to on wasm32)
_C_WASM = {"twt_handle": "i64", "int64_t": "i64", "int32_t": "i32", "uint32_t": "i32", "float": "f32"}
#: C type -> Zig type in the raw externs
_C_ZIG = {"twt_handle": "Handle", "int64_t": "i64", "int32_t": "i32", "uint32_t": "u32", "float": "f32",
          "const void *": "[*]const u8", "void *": "[*]u8", "const char *": "[*]const u8", "float *": "*f32",
          "int32_t *": "[*]i32", "const int32_t *": "[*]const i32"}


def _wasm_of(ctype: str) -> str:
    return "i32" if ctype.endswith("*") else _C_WASM[ctype]


def signatures() -> dict[str, tuple[str, list[tuple[str, str]], str]]:
    """Every import in table order: (C result type, [(parameter, C type)], doc); checked against IMPORTS."""
    out: dict[str, tuple[str, list[tuple[str, str]], str]] = {}
    ops = {op.name: op for op in TENSOR_OPS}
    for name, (wasm_params, wasm_result) in IMPORTS.items():
        if name in BASE:
            result, params, doc = BASE[name]
        elif name in ops:
            op = ops[name]
            params = [(pname, _PTR_C.get(name, "void *") if role == "ptr" else _ROLE_C[role]) for role, pname in op.roles]
            result, doc = "int32_t", re.sub(r"\s+", " ", op.doc).strip() + "."
        else:
            raise SystemExit(f"import {name!r} is neither a base import nor a tensor op: add it to sdk/generate.py BASE")
        got = tuple(_wasm_of(t) for _, t in params), _wasm_of(result)
        if got != (wasm_params, wasm_result):
            raise SystemExit(f"sdk/generate.py: {name} lowers to {got}, the ABI says {(wasm_params, wasm_result)}")
        out[name] = (result, params, doc)
    return out


def _zig_error(name: str) -> str:
    return "".join(part.capitalize() for part in name.lower().split("_"))


# ------------------------------------------------------------------ C


def c_header() -> str:
    lines = [
        "/* tensorwasm.h - the `tensorwasm` guest ABI for C tenants (docs/WASM-ABI.md, docs/GUESTS.md).",
        " *",
        " * GENERATED by sdk/generate.py from the host's import table (worker/wasm/abi.py); do not edit.",
        " * Build with `twt build tenant.c -o tenant.wasm`; mark exports with TWT_EXPORT(name).",
        " * Every function returns TWT_OK (0) or a negative TWT_* error code (twt_alloc: a handle > 0).",
        " * Sizes and counts are elements or bytes as named; tensors are float32, row-major. */",
        "#ifndef TENSORWASM_H",
        "#define TENSORWASM_H",
        "",
        "#include <stdint.h>",
        "",
        "#ifdef __cplusplus",
        'extern "C" {',
        "#endif",
        "",
        "/* A buffer (device memory) of this run: 1, 2, 3 ... in the order obtained; client buffers first. */",
        "typedef int64_t twt_handle;",
        "",
        "/* Error codes (shared/wasm_abi.py). */",
    ]
    for code in ErrorCode:
        lines.append(f"#define TWT_{code.name} ({int(code)})")
    lines += ["", "/* unary_f32 operations. */"]
    for i, op in enumerate(UNARY_OPS):
        lines.append(f"#define TWT_OP_{op.upper()} {i}")
    lines += ["", "/* binary_f32, binary_rows_f32 and scalar_f32 operations. */"]
    for i, op in enumerate(BINARY_OPS):
        lines.append(f"#define TWT_BIN_{op.upper()} {i}")
    lines += ["", "/* reduce_rows_f32 operations. */"]
    for i, op in enumerate(REDUCE_OPS):
        lines.append(f"#define TWT_RED_{op.upper()} {i}")
    lines += ["", "/* Element types of twt_cast and twt_gemm_ex (f16: IEEE half, bf16: bfloat16). */"]
    for i, dt in enumerate(DTYPES):
        lines.append(f"#define TWT_{dt.upper()} {i}")
    lines += [
        "",
        "/* Marks a function as an export the host can call: `TWT_EXPORT(forward) int32_t forward(...)`. */",
        "#define TWT_EXPORT(name) __attribute__((export_name(#name)))",
        f'#define TWT_IMPORT(name) __attribute__((import_module("{IMPORT_MODULE}"), import_name(#name)))',
        "",
    ]
    for name, (result, params, doc) in signatures().items():
        lines.append(f"/* {doc} */")
        args = ", ".join(f"{t}{'' if t.endswith('*') else ' '}{p}" for p, t in params)
        lines.append(f"TWT_IMPORT({name}) {result} twt_{name}({args});")
    lines += [
        "",
        "/* The name of an error code (\"GPU_QUOTA\" ...), for messages. */",
        "static inline const char *twt_strerror(int64_t code) {",
        "    switch (code) {",
    ]
    for code in ErrorCode:
        lines.append(f'    case TWT_{code.name}: return "{code.name}";')
    lines += [
        '    default: return code > 0 ? "OK" : "UNKNOWN";',
        "    }",
        "}",
        "",
        "/* Logs a NUL-terminated string as one line. */",
        "static inline int32_t twt_log_str(const char *msg) {",
        "    return twt_log(msg, (uint32_t)__builtin_strlen(msg));",
        "}",
        "",
        "#ifdef __cplusplus",
        "}",
        "#endif",
        "",
        "#endif /* TENSORWASM_H */",
        "",
    ]
    return "\n".join(lines)


# ------------------------------------------------------------------ Zig


def _zig_wrapper(name: str, params: list[tuple[str, str]], result: str, doc: str) -> list[str]:
    """A checked wrapper: error codes become ``Error``, guest pointers become slices or results."""
    zparams: list[str] = []
    args: list[str] = []
    before: list[str] = []
    ret, tail = "void", "return check(raw.{call});"
    for pname, ctype in params:
        if name == "log" and ctype == "const char *":
            zparams.append(f"{pname}: []const u8")
            args.append(f"{pname}.ptr")
        elif name in ("write", "read") and ctype in ("const void *", "void *"):
            zparams.append(f"{pname}: anytype")
            before.append(f"const bytes = std.mem.sliceAsBytes({pname});")
            args.append("bytes.ptr")
        elif pname == "len" and name in ("write", "read"):
            args.append("@intCast(bytes.len)")
        elif pname == "len" and name == "log":
            args.append("@intCast(msg.len)")
        elif ctype == "const int32_t *":
            zparams.append(f"{pname}: []const i32")
            args.append(f"{pname}.ptr")
        elif ctype == "float *":
            before.append(f"var {pname}: f32 = undefined;")
            args.append(f"&{pname}")
            ret, tail = "f32", f"try check(raw.{{call}});\nreturn {pname};"
        elif ctype == "int32_t *":
            zparams.append(f"{pname}: []i32")
            args.append(f"{pname}.ptr")
        elif ctype.endswith("*"):
            zparams.append(f"{pname}: {_C_ZIG.get(ctype, '[*]u8')}")
            args.append(pname)
        elif (name, pname) in _ZIG_ENUM:
            zparams.append(f"{pname}: {_ZIG_ENUM[name, pname]}")
            args.append(f"@intFromEnum({pname})")
        elif pname in ("trans_a", "trans_b"):
            zparams.append(f"{pname}: bool")
            args.append(f"@intFromBool({pname})")
        else:
            zparams.append(f"{pname}: {_C_ZIG[ctype]}")
            args.append(pname)
    call = f"{name}({', '.join(args)})"
    if result == "twt_handle":
        ret = "Handle"
        tail = "const h = raw.{call};\nif (h < 0) return fromCode(h);\nreturn h;"
    lines = [f"/// {_ZIG_DOC.get(name, doc)}", f"pub fn {name}({', '.join(zparams)}) Error!{ret} {{"]
    lines += [f"    {b}" for b in before]
    lines += [f"    {t}" for t in tail.format(call=call).split("\n")]
    lines.append("}")
    return lines


def zig_module() -> str:
    sigs = signatures()
    lines = [
        "//! tensorwasm.zig - the `tensorwasm` guest ABI for Zig tenants (docs/WASM-ABI.md, docs/GUESTS.md).",
        "//!",
        "//! GENERATED by sdk/generate.py from the host's import table (worker/wasm/abi.py); do not edit.",
        '//! `const twt = @import("tensorwasm");` then `try twt.matmul_f32(...)`; error codes are `twt.Error`.',
        "//! `twt.raw` has the imports as declared by the host (negative codes, no error set).",
        "//! Build with `twt build tenant.zig -o tenant.wasm`; exports are `export fn`.",
        "",
        'const std = @import("std");',
        "",
        "/// A buffer (device memory) of this run: 1, 2, 3 ... in the order obtained; client buffers first.",
        "pub const Handle = i64;",
        "",
        "/// Every error code of the ABI (shared/wasm_abi.py), plus Unknown for a code this SDK predates.",
        "pub const Error = error{",
    ]
    for code in ErrorCode:
        if code is not ErrorCode.OK:
            lines.append(f"    {_zig_error(code.name)},")
    lines += [
        "    Unknown,",
        "};",
        "",
        "/// The numeric codes, as in C's TWT_* constants.",
        "pub const code = struct {",
    ]
    for code in ErrorCode:
        lines.append(f"    pub const {code.name}: i32 = {int(code)};")
    lines += [
        "};",
        "",
        "/// The error of a negative code.",
        "pub fn fromCode(c: i64) Error {",
        "    return switch (c) {",
    ]
    for code in ErrorCode:
        if code is not ErrorCode.OK:
            lines.append(f"        {int(code)} => error.{_zig_error(code.name)},")
    lines += [
        "        else => error.Unknown,",
        "    };",
        "}",
        "",
        "/// The ABI code of an error, for an export's integer result; an error of the guest's own",
        "/// (e.g. its allocator's OutOfMemory) is INVALID.",
        "pub fn toCode(err: anyerror) i32 {",
        "    return switch (err) {",
    ]
    for code in ErrorCode:
        if code is not ErrorCode.OK:
            lines.append(f"        error.{_zig_error(code.name)} => {int(code)},")
    lines += [
        "        else => code.INVALID,",
        "    };",
        "}",
        "",
        "/// `c` as a Zig error (0 and positive results are success).",
        "pub fn check(c: i32) Error!void {",
        "    if (c < 0) return fromCode(c);",
        "}",
        "",
        "/// unary_f32 operations.",
        "pub const Unary = enum(i32) {",
    ]
    for i, op in enumerate(UNARY_OPS):
        lines.append(f"    {op} = {i},")
    for title, enum, names in (("binary_f32, binary_rows_f32 and scalar_f32 operations.", "Binary", BINARY_OPS),
                               ("reduce_rows_f32 operations.", "Reduce", REDUCE_OPS),
                               ("Element types of cast and gemm_ex.", "DType", DTYPES)):
        lines += ["};", "", f"/// {title}", f"pub const {enum} = enum(i32) {{"]
        lines += [f"    {n} = {i}," for i, n in enumerate(names)]
    lines += [
        "};",
        "",
        "/// The imports exactly as the host declares them.",
        "pub const raw = struct {",
    ]
    for name, (result, params, doc) in sigs.items():
        zargs = ", ".join(f"{p}: {_C_ZIG[t]}" for p, t in params)
        lines.append(f"    /// {doc}")
        lines.append(f'    pub extern "{IMPORT_MODULE}" fn {name}({zargs}) {_C_ZIG[result]};')
    lines += ["};", ""]
    for name, (result, params, doc) in sigs.items():
        lines += _zig_wrapper(name, params, result, doc)
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the files differ from what would be written")
    args = parser.parse_args(argv)
    stale = []
    for path, text in ((C_HEADER, c_header()), (ZIG_MODULE, zig_module())):
        if path.exists() and path.read_text() == text:
            continue
        if args.check:
            stale.append(str(path.relative_to(SDK.parent)))
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            print(f"wrote {path.relative_to(SDK.parent)}")
    if stale:
        print(f"out of date: {', '.join(stale)}; run: .venv/bin/python sdk/generate.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
