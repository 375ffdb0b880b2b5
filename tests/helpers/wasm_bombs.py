"""Hostile WASM binaries built byte by byte (no toolchain needed).

``compile_bomb``: functions whose ``nlocals`` i64 locals are each set from a
call and all summed at the end, so every one is live across every call.
Cranelift's compile time grows superlinearly with that (measured here: 2,000
locals 0.08 s, 8,000 0.9 s, 16,000 3.4 s, for one function of 144 KB); a
2 MiB module of such functions compiles for about a minute. Fuel and epochs
do not apply while compiling.

``output_flood``: a WASI guest whose ``fd_write`` calls carry 1,024 iovecs
over 1 MiB of newlines (``once``: the 1 MiB split across them; ``flood``:
each names the whole 1 MiB, so one call is 1 GiB, made again and again).
Handled a line at a time in Python (~12.7 us a line), one call of ``once``
held the worker ~13 s and one of ``flood`` hours, past any deadline.
"""

from __future__ import annotations

__all__ = ["OUTPUT_FLOOD_LINES", "compile_bomb", "output_flood", "small_module"]


def _leb(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _section(sid: int, payload: bytes) -> bytes:
    return bytes([sid]) + _leb(len(payload)) + payload


def _vec(items: list[bytes]) -> bytes:
    return _leb(len(items)) + b"".join(items)


def compile_bomb(nfuncs: int = 2, nlocals: int = 16_000) -> bytes:
    """A valid module exporting ``run: () -> i64`` that is slow to compile."""
    types = _section(1, _vec([b"\x60\x00\x01\x7e"]))
    funcs = _section(3, _vec([_leb(0)] * nfuncs))
    exports = _section(7, _vec([_leb(3) + b"run" + b"\x00" + _leb(0)]))
    bodies = []
    for _ in range(nfuncs):
        code = bytearray(_vec([_leb(nlocals) + b"\x7e"]))
        for i in range(nlocals):
            code += b"\x10" + _leb(0) + b"\x21" + _leb(i)  # local i = call 0
        code += b"\x42\x00"  # i64.const 0
        for i in range(nlocals):
            code += b"\x20" + _leb(i) + b"\x7c"  # + local i
        code += b"\x0b"
        bodies.append(_leb(len(code)) + bytes(code))
    return b"\0asm\x01\0\0\0" + types + funcs + exports + _section(10, _vec(bodies))


def small_module(value: int) -> bytes:
    """``(func (export "run") (result i64) i64.const value)``: distinct bytes per value."""
    types = _section(1, _vec([b"\x60\x00\x01\x7e"]))
    funcs = _section(3, _vec([_leb(0)]))
    exports = _section(7, _vec([_leb(3) + b"run" + b"\x00" + _leb(0)]))
    body = b"\x00" + b"\x42" + _sleb(value) + b"\x0b"
    return b"\0asm\x01\0\0\0" + types + funcs + exports + _section(10, _vec([_leb(len(body)) + body]))


def _sleb(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if (n == 0 and not b & 0x40) or (n == -1 and b & 0x40):
            out.append(b)
            return bytes(out)
        out.append(b | 0x80)


#: newlines in the output flood's buffer (one call of ``once`` writes exactly these)
OUTPUT_FLOOD_LINES = 1 << 20


def output_flood() -> bytes:
    """WAT of a WASI guest: ``once`` (one fd_write, 1,024 iovecs over 1 MiB of newlines) and ``flood``
    (fd_write of 1,024 iovecs each naming the same 1 MiB, in an endless loop); both return the errno."""
    return f"""
(module
  (import "wasi_snapshot_preview1" "fd_write" (func $w (param i32 i32 i32 i32) (result i32)))
  (memory (export "memory") 18 18)
  ;; the newlines at 65536; 1,024 iovecs at 0: each 1 KiB of them (spread) or all of them
  (func $setup (param $spread i32)
    (local $i i32)
    (memory.fill (i32.const 65536) (i32.const 10) (i32.const {OUTPUT_FLOOD_LINES}))
    (loop $next
      (i32.store (i32.shl (local.get $i) (i32.const 3))
        (select (i32.add (i32.const 65536) (i32.shl (local.get $i) (i32.const 10))) (i32.const 65536)
                (local.get $spread)))
      (i32.store offset=4 (i32.shl (local.get $i) (i32.const 3))
        (select (i32.const 1024) (i32.const {OUTPUT_FLOOD_LINES}) (local.get $spread)))
      (local.set $i (i32.add (local.get $i) (i32.const 1)))
      (br_if $next (i32.lt_u (local.get $i) (i32.const 1024)))))
  (func (export "once") (result i32)
    (call $setup (i32.const 1))
    (call $w (i32.const 1) (i32.const 0) (i32.const 1024) (i32.const 8192)))
  (func (export "flood") (result i32)
    (local $errno i32)
    (call $setup (i32.const 0))
    (loop $again
      (local.set $errno (call $w (i32.const 1) (i32.const 0) (i32.const 1024) (i32.const 8192)))
      (br_if $again (i32.eqz (local.get $errno))))
    (local.get $errno))
)
""".encode()
