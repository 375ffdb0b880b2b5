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
import time
from typing import Protocol, cast

from supervisor.tools.progress import LiveLine, progress_stream

__all__ = ["BENCHES", "main", "run_bench"]

#: name -> module with ``main(argv) -> int``. Later benches (registry, route,
#: scale, wasm) add one line here each.
BENCHES: dict[str, str] = {
    "host": "supervisor.tools.bench.host",  # first: ``all`` says whether the host is steady enough to measure
    "data": "supervisor.tools.bench.data",
    "quota": "supervisor.tools.bench.quota",
    "registry": "supervisor.tools.bench.registry",
    "route": "supervisor.tools.bench.route",
    "scale": "supervisor.tools.bench.scale",
    "wasm": "supervisor.tools.bench.wasm",
    "restore": "supervisor.tools.bench.restore",
    "cluster": "supervisor.tools.bench.cluster",
    "share": "supervisor.tools.bench.share",
    "records": "supervisor.tools.bench.records",
    "scrape": "supervisor.tools.bench.scrape",  # a tenant's ping while the metrics port is scraped
    "density": "supervisor.tools.bench.density",  # 10,000 registered tenants on one supervisor
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
    """``twt bench NAME [options]`` / ``python -m supervisor.tools.bench NAME [options]``."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(_USAGE, file=sys.stdout if args else sys.stderr)
        return 0 if args else 2
    name, rest = args[0], args[1:]
    names = list(BENCHES) if name == "all" else [name]
    # on a terminal (and without --json), a line per benchmark: which one runs, how it ended
    line = LiveLine(progress_stream("--json" in rest))
    status = 0
    for n, bench in enumerate(names, 1):
        line.update(f"bench: {bench} ({n}/{len(names)}) running ...")
        line.done()
        t0 = time.monotonic()
        code = run_bench(bench, rest)
        line.update(f"bench: {bench} ({n}/{len(names)}) {'done' if code == 0 else f'exit {code}'} "
                    f"in {time.monotonic() - t0:.1f} s")
        line.done()
        status = max(status, code)
    return status
