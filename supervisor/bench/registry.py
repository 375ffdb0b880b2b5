"""``twt bench registry``: what the capability check adds to a quota call.

In one run, ns per consume+release pair (medians of round-robin samples):

    QuotaBlock pair          ``block.consume_bytes(n); block.release_bytes(n)`` (the floor)
    registry pair            ``consume_bytes_with_capability(cap, n)`` + release: kind, registry id,
                             MAC (remembered after the first check), generation, then the block
    registry pair, strict    the ``*_strict`` variants
    first check of a token   a fresh registry-side MAC (HMAC-SHA256) per call: the cost a
                             token pays once

Target: the capability check adds at most 3 us per call (per consume or release).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from itertools import repeat

from shared import capability as _cap
from shared.capability import TenantCapability
from shared.spec import TenantSpec
from supervisor.bench._report import Report, Target, format_table, paired_ratio, time_loops
from supervisor.registry import TenantRegistry

__all__ = ["main"]

_N = 64
#: a registry call that takes a capability and a byte count (bound once, outside the timed loop)
_CapOp = Callable[[TenantCapability, int], None]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="twt bench registry", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--repeat", type=int, default=9)
    args = parser.parse_args(argv)

    registry, admin = TenantRegistry.new()
    with registry:
        cap = registry.register_with_capability(admin, TenantSpec("bench"))
        block = registry.block(admin, "bench")
        secret = registry._secret
        n = _N

        def empty(k: int) -> None:
            for _ in repeat(None, k):
                pass

        def bare(k: int, c: Callable[[int], None] = block.consume_bytes, r: Callable[[int], None] = block.release_bytes) -> None:
            for _ in repeat(None, k):
                c(n)
                r(n)

        def checked(k: int, c: _CapOp = registry.consume_bytes_with_capability,
                    r: _CapOp = registry.release_bytes_with_capability, t: TenantCapability = cap) -> None:
            for _ in repeat(None, k):
                c(t, n)
                r(t, n)

        def strict(k: int, c: _CapOp = registry.consume_bytes_with_capability_strict,
                   r: _CapOp = registry.release_bytes_with_capability_strict, t: TenantCapability = cap) -> None:
            for _ in repeat(None, k):
                c(t, n)
                r(t, n)

        def first_check(k: int, ok: Callable[[TenantCapability, bytes], bool] = _cap.mac_ok,
                        t: TenantCapability = cap, s: bytes = secret) -> None:
            for _ in repeat(None, k):
                ok(t, s)
                ok(t, s)

        timings = time_loops(
            {
                "empty loop": (empty, 1),
                "QuotaBlock pair": (bare, 1),
                "registry pair": (checked, 1),
                "registry pair, strict": (strict, 1),
                "fresh MAC check x2": (first_check, 1),
            },
            repeat=args.repeat,
        )
    loop = timings["empty loop"]
    rows = [[name, t.ns, t.ns - loop.ns] for name, t in timings.items()]
    added_ns = (timings["registry pair"].ns - timings["QuotaBlock pair"].ns) / 2
    ratio = paired_ratio(timings["registry pair"], timings["QuotaBlock pair"], minus=loop)
    report = Report("registry")
    report.sections.append(("ns per consume+release pair", format_table(["path", "ns", "net of loop"], rows)))
    report.sections.append(("what the check adds", format_table(
        ["figure", "value"],
        [["ns added per call (pair / 2)", added_ns], ["registry pair / QuotaBlock pair (net)", ratio]],
    )))
    report.targets.append(Target("capability check adds per call", added_ns / 1000, 3.0, higher_is_better=False, unit=" us"))
    report.data.update(
        timings={k: v.to_dict() for k, v in timings.items()},
        added_ns_per_call=added_ns,
        ratio_vs_block=ratio,
    )
    return report.emit(as_json=args.json)
