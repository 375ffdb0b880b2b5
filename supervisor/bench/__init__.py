"""Benchmark programs (``twt bench NAME``): each prints figures measured against
baselines in the same run and exits 4 when it misses a target (2: bad usage,
such as an unknown name).

Every benchmark is a module with ``main(argv: list[str] | None = None) -> int``,
listed in :data:`BENCHES` by name; ``all`` runs each in turn. Modules are
imported only when run, so listing them costs nothing.
"""

from __future__ import annotations

import importlib
import sys
from typing import Protocol, cast

__all__ = ["BENCHES", "main", "run_bench"]

#: name -> module with ``main(argv) -> int``. Later benches (registry, route,
#: scale, wasm) add one line here each.
BENCHES: dict[str, str] = {
    "data": "supervisor.bench.data",
    "quota": "supervisor.bench.quota",
    "registry": "supervisor.bench.registry",
    "route": "supervisor.bench.route",
    "scale": "supervisor.bench.scale",
    "wasm": "supervisor.bench.wasm",
    "restore": "supervisor.bench.restore",
}

_USAGE = "usage: twt bench {NAME|all} [--json] [bench options]   (NAME: " + ", ".join(BENCHES) + ")"


class _Bench(Protocol):
    def main(self, argv: list[str] | None = None) -> int: ...


def run_bench(name: str, argv: list[str] | None = None) -> int:
    """Run one benchmark by name; its exit status (2 for an unknown name)."""
    module_path = BENCHES.get(name)
    if module_path is None:
        print(
            f"twt bench: unknown benchmark {name!r}; choose one of: {', '.join(BENCHES)}, all",
            file=sys.stderr,
        )
        return 2
    module = cast(_Bench, importlib.import_module(module_path))
    return module.main(list(argv or []))


def main(argv: list[str] | None = None) -> int:
    """``twt bench NAME [options]`` / ``python -m supervisor.bench NAME [options]``."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(_USAGE, file=sys.stdout if args else sys.stderr)
        return 0 if args else 2
    name, rest = args[0], args[1:]
    if name != "all":
        return run_bench(name, rest)
    status = 0
    for bench in BENCHES:
        status = max(status, run_bench(bench, rest))
    return status
