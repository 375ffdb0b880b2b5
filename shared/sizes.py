"""Human byte sizes in and out: ``"512MiB"`` <-> ``536870912``.

Binary suffixes (KiB, MiB, GiB, TiB; also K, M, G, T) are powers of 1024,
decimal ones (kB/KB, MB, GB, TB) powers of 1000, because operators write both
(:func:`decimal_size_note` words what a decimal one was taken as). A lower-case
``b`` after an upper-case prefix (``2Gb``, ``512Mb``, ``1Gib``) is the notation
for bits and is refused; all-lower-case units (``2gb``) are read as bytes.
"""

from __future__ import annotations

import re

__all__ = ["MAX_MODULE_BYTES", "check_size_range", "decimal_size_note", "format_size", "parse_size"]

#: the largest WASM module (text or binary) ``run_wasm`` and ``put_module`` accept, in the
#: supervisor and in the worker: compiling is not under a run's deadline, so it stays bounded
MAX_MODULE_BYTES = 32 << 20

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "ki": 1 << 10,
    "kib": 1 << 10,
    "m": 1 << 20,
    "mi": 1 << 20,
    "mib": 1 << 20,
    "g": 1 << 30,
    "gi": 1 << 30,
    "gib": 1 << 30,
    "t": 1 << 40,
    "ti": 1 << 40,
    "tib": 1 << 40,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
}
# [0-9], not \d: \d also matches non-ASCII digits, which int() would accept.
_SIZE_RE = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", re.ASCII)
MAX_SIZE = (1 << 63) - 1


def parse_size(value: object, *, what: str = "size") -> int:
    """Bytes from an int or a string like ``"512MiB"``, ``"2GiB"``, ``"1.5G"``, ``"4096"``.

    Raises ``ValueError`` (negative, unknown unit, >= 2**63) or ``TypeError``.
    """
    if isinstance(value, bool):
        raise TypeError(f"{what} must be an int or a size string, not bool")
    if isinstance(value, int):
        n = value
    elif isinstance(value, str):
        m = _SIZE_RE.fullmatch(value)
        if m is not None and _is_bits(m.group(2)):
            number, prefix = m.group(1), m.group(2)[0].upper()
            raise ValueError(f"invalid {what} {value!r}: a lower-case 'b' means bits; write "
                             f"'{number}{prefix}B' (decimal bytes) or '{number}{prefix}iB' (binary bytes)")
        if not m or m.group(2).lower() not in _UNITS:
            raise ValueError(f"invalid {what} {value!r}: expected e.g. 4096, '512MiB', '2GiB', '1.5GB'")
        number, unit = m.group(1), _UNITS[m.group(2).lower()]
        if "." in number:
            whole, frac = number.split(".")
            n = int(whole) * unit + (int(frac) * unit) // 10 ** len(frac)
        else:
            n = int(number) * unit
    else:
        raise TypeError(f"{what} must be an int or a size string, not {type(value).__name__}")
    return check_size_range(n, what)


def _is_bits(unit: str) -> bool:
    """``Gb``, ``Mb``, ``Kib``: an upper-case prefix and a lower-case ``b`` is how bits are written."""
    return len(unit) >= 2 and unit[0].isupper() and unit.endswith("b") and unit.lower() in _UNITS


def decimal_size_note(value: int | str, *, what: str = "size") -> str | None:
    """What a decimal size (``"2GB"``) was taken as, next to its binary look-alike; None for any other.

    ``2GB`` is 2,000,000,000 bytes, 7 % less than the ``2GiB`` an operator may have meant: the CLI says so.
    """
    if not isinstance(value, str):
        return None
    m = _SIZE_RE.fullmatch(value)
    if not m or m.group(2).lower() not in ("kb", "mb", "gb", "tb"):
        return None
    n = parse_size(value, what=what)
    binary = parse_size(f"{m.group(1)}{m.group(2)[0].upper()}iB")
    return (f"{what} {value.strip()} is decimal: {n:,} bytes ({format_size(n)}); "
            f"write {m.group(1)}{m.group(2)[0].upper()}iB for {binary:,} bytes")


def check_size_range(n: int, what: str) -> int:
    """``n`` if it is a byte count the quota counters can hold (0 .. 2**63 - 1), else ``ValueError``."""
    if n < 0:
        raise ValueError(f"{what} must not be negative, got {n}")
    if n > MAX_SIZE:
        raise ValueError(f"{what} {n} is too large (limit 2**63 - 1 bytes)")
    return n


def format_size(n: int | None) -> str:
    """``536870912`` -> ``"512MiB"``; exact multiples print without decimals, ``None`` -> ``"-"``."""
    if n is None:
        return "-"
    for suffix, unit in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= unit:
            if n % unit == 0:
                return f"{n // unit}{suffix}"
            return f"{n / unit:.1f}{suffix}"
    return f"{n}B"
