"""``twt bench records``: what the checked, typed decode of a reply costs (``shared.wire``).

In one run, ns per decode (medians of round-robin samples), for two replies
a client decodes: ``run_wasm``'s (the per-request hot path) and one tenant of
a ``status`` (two instances, a spec, a quota snapshot, an exit):

    msgpack.unpackb          the bytes to a dict: what every client pays anyway (the floor)
    unchecked                ``cls(**d)`` (no checks, nested maps left as dicts)
    Record.from_wire         every field checked against its annotation, nested records built

Target: the checked decode of a ``run_wasm`` reply costs at most 4x the
unchecked ``cls(**d)`` (both net of the loop, paired per round). The tenant
record's checked decode is reported against ``msgpack.unpackb`` of its bytes.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from itertools import repeat

import msgpack

from shared.quota import QuotaSnapshot
from shared.records import ExitRecord, InstanceRecord, RunResult, TenantRecord
from shared.spec import TenantSpec
from supervisor.tools.bench._report import Report, Target, format_table, paired_ratio, time_loops

__all__ = ["main"]


def _samples() -> tuple[dict[str, object], dict[str, object]]:
    """A run_wasm reply and a tenant record as they come off the wire (decoded msgpack maps)."""
    run = RunResult(results=(42, 1.5), fuel_used=12_345, elapsed_s=0.000125, cached=True, gpu_peak_bytes=4096)
    last = ExitRecord(exit_code=None, signal=9, reason="killed", at=1_700_000_000.5)
    instances = tuple(InstanceRecord(i, 1000 + i, "ready", 0, 1, 0, 12.5, False, last if i else None) for i in range(2))
    quota = QuotaSnapshot("acme", "twt-abc-acme", 1, 0, 8 << 30, 0, 0, 0, 4096, 1 << 30, 8192, 0, 0, None,
                          ((0, 0, 4096), (1, 0, 0)))
    tenant = TenantRecord("acme", "running", 1, pids=(1000, 1001), instances=instances, spec=TenantSpec("acme"),
                          quota=quota, memory_quota_bytes=8 << 30, gpu_bytes_in_use=4096)
    return (msgpack.unpackb(msgpack.packb(run.to_wire())), msgpack.unpackb(msgpack.packb(tenant.to_wire())))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="twt bench records", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--repeat", type=int, default=9)
    args = parser.parse_args(argv)

    run_d, tenant_d = _samples()
    run_b, tenant_b = msgpack.packb(run_d), msgpack.packb(tenant_d)

    def empty(k: int) -> None:
        for _ in repeat(None, k):
            pass

    def loop(fn: Callable[[], object]) -> Callable[[int], None]:
        def run(k: int) -> None:
            for _ in repeat(None, k):
                fn()
        return run

    unpack = msgpack.unpackb
    timings = time_loops(
        {
            "empty loop": (empty, 1),
            "run_wasm: msgpack.unpackb": (loop(lambda: unpack(run_b)), 1),
            "run_wasm: unchecked": (loop(lambda: RunResult(**run_d)), 1),  # type: ignore[arg-type]
            "run_wasm: Record.from_wire": (loop(lambda: RunResult.from_wire(run_d)), 1),
            "tenant: msgpack.unpackb": (loop(lambda: unpack(tenant_b)), 1),
            "tenant: unchecked": (loop(lambda: TenantRecord(**tenant_d)), 1),  # type: ignore[arg-type]
            "tenant: Record.from_wire": (loop(lambda: TenantRecord.from_wire(tenant_d)), 1),
        },
        repeat=args.repeat,
    )
    base = timings["empty loop"]
    rows = [[name, t.ns, t.ns - base.ns] for name, t in timings.items()]
    run_ns = timings["run_wasm: Record.from_wire"].ns - base.ns
    run_ratio = paired_ratio(timings["run_wasm: Record.from_wire"], timings["run_wasm: unchecked"], minus=base)
    tenant_ratio = paired_ratio(timings["tenant: Record.from_wire"], timings["tenant: msgpack.unpackb"], minus=base)
    report = Report("records")
    report.sections.append(("ns per decode", format_table(["path", "ns", "net of loop"], rows)))
    report.sections.append(("what the checks cost", format_table(
        ["figure", "value"],
        [["run_wasm reply: checked decode (ns, net)", run_ns],
         ["run_wasm reply: checked / unchecked (net)", run_ratio],
         ["tenant record: checked decode / msgpack.unpackb (net)", tenant_ratio]],
    )))
    report.targets.append(Target("checked / unchecked run_wasm decode", run_ratio, 4.0, higher_is_better=False))
    report.data.update(
        timings={k: v.to_dict() for k, v in timings.items()},
        run_wasm_checked_ns=run_ns,
        run_wasm_checked_vs_unchecked=run_ratio,
        tenant_checked_vs_unpack=tenant_ratio,
    )
    return report.emit(as_json=args.json)
