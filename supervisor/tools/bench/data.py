"""``twt bench data``: bulk bytes through the supervisor next to a memcpy of the same size.

Baseline, measured in the same run, round by round: a memcpy (a memoryview
slice assignment, what both our copies are) of the same number of bytes
between two buffers that are already in memory. Ours: a real supervisor
(stub backend, one tenant), a client that writes to and reads from one
device buffer of that size, through

* **frames** - the header/body messages (``regions=False``): what remote
  clients use and what every client used before regions;
* **regions** - shared-memory regions, chunks pipelined (the default path of
  a local client for payloads >= ``bulk_threshold``): ``write``,
  ``write from empty_array`` (an array that lives in a region of its own:
  the worker's copy only), ``read_into`` (into a buffer of the caller's),
  and ``read`` (returns a new
  ``bytes``: one more copy when the payload exceeds the staging region; its
  baseline is a copy into a new ``bytes``, page faults of the new memory
  included).

Targets: write and read of 64 MiB and more at least 0.5x the
memcpy bandwidth of the same size; 1 MiB at least 0.15x the memcpy
bandwidth at DRAM size (the largest size measured); and a small request's
latency unchanged: ping p50 of a region-enabled client within 1.05x of a
frames-only client, interleaved on the same supervisor.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

from shared.capability import TenantCapability
from shared.spec import TenantSpec
from supervisor.tools.bench._report import Report, Target, at_least, count, format_table
from supervisor.client.api import SupervisorClient
from supervisor.client.launch import launch

__all__ = ["main"]

MiB = 1 << 20


def _seconds(fn: Callable[[], object], number: int) -> float:
    t0 = time.perf_counter()
    for _ in range(number):
        fn()
    return (time.perf_counter() - t0) / number


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


def _pings(client: SupervisorClient, cap: TenantCapability, n: int, into: list[float]) -> None:
    for _ in range(n):
        t0 = time.perf_counter()
        client.ping(cap)
        into.append(time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="twt bench data", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--sizes", default="1,16,256", help="payload sizes in MiB, comma-separated")
    parser.add_argument("--rounds", type=count, default=5, help="interleaved rounds per size (medians)")
    parser.add_argument("--frames-max-mib", type=at_least(0), default=256,
                        help="skip the (slow) frame path above this size")
    parser.add_argument("--pings", type=count, default=300, help="pings per client per round")
    args = parser.parse_args(argv)
    try:
        sizes = sorted({at_least(1)(s) * MiB for s in args.sizes.split(",") if s.strip()})
    except argparse.ArgumentTypeError as exc:
        parser.error(f"argument --sizes: each size {exc}")
    if not sizes:
        parser.error("argument --sizes: at least one size in MiB")

    report = Report("data")
    rows: list[list[object]] = []
    figures: dict[str, dict[str, float]] = {}
    ratios: dict[str, dict[str, float]] = {}
    one_mib_rounds: dict[str, list[float]] = {}
    dram_rounds: list[float] = []
    ping_ratio = 1.0
    with launch({"supervisor": {"pool_size": 0, "log_level": "warning"}, "tenant": []}, backend="stub") as sup:
        spec = TenantSpec("bench").with_gpu_memory_bytes_cap(max(sizes) + 16 * MiB)
        cap = sup.client.register(sup.admin_capability, spec)
        fast = SupervisorClient(sup.run_dir, timeout_s=120.0)
        slow = SupervisorClient(sup.run_dir, timeout_s=120.0, regions=False)
        try:
            handle = fast.alloc(cap, max(sizes))
            for size in sizes:
                src = bytearray(size)
                src[:: 4096] = b"\x5a" * len(src[:: 4096])  # touched: no page faults in the loops
                dst = bytearray(size)
                view = memoryview(src)
                out = memoryview(dst)
                number = max(1, min(50, (256 * MiB) // size))

                def memcpy() -> None:
                    out[:] = view

                resident = fast.empty_array(cap, "uint8", size)  # an array living in a region
                resident[:] = 0x5A
                cases: dict[str, Callable[[], object]] = {
                    "memcpy": memcpy,
                    "memcpy to new bytes": lambda: bytes(view),
                    "write regions": lambda: fast.write(cap, handle, view),
                    "write from empty_array": lambda: fast.write(cap, handle, resident),
                    "read_into regions": lambda: fast.read_into(cap, handle, out),
                    "read regions": lambda: fast.read(cap, handle, size),
                }
                if size <= args.frames_max_mib * MiB:
                    cases["write frames"] = lambda: slow.write(cap, handle, view)
                    cases["read frames"] = lambda: slow.read(cap, handle, size)
                for fn in cases.values():  # warm up: staging region made, pages touched
                    fn()
                samples: dict[str, list[float]] = {name: [] for name in cases}
                for _ in range(args.rounds):
                    for name, fn in cases.items():
                        samples[name].append(_seconds(fn, number if "frames" not in name else max(1, number // 4)))
                if size == 1 * MiB:
                    one_mib_rounds = samples
                med = {name: statistics.median(s) for name, s in samples.items()}
                figures[f"{size // MiB}MiB"] = {name: round(_gbps(size, s), 3) for name, s in med.items()}
                # the ratio: median over rounds of (memcpy time / case time) in the same round, so
                # a round that caught the machine busy weighs on both sides alike
                paired = {name: statistics.median(m / t for m, t in zip(samples["memcpy"], s, strict=True))
                          for name, s in samples.items()}
                ratios[f"{size // MiB}MiB"] = paired
                dram_rounds = samples["memcpy"]
                for name, s in med.items():
                    rows.append([f"{size // MiB} MiB {name}", f"{_gbps(size, s):.2f}", f"{paired[name]:.3f}"])
            # small-request latency: a region-enabled client against a frames-only one,
            # alternating in small blocks so both see the same machine
            ping_frames: list[float] = []
            ping_regions: list[float] = []
            for i in range(max(2, args.pings // 25) * max(3, args.rounds)):
                if i % 2:
                    _pings(fast, cap, 25, ping_regions)
                else:
                    _pings(slow, cap, 25, ping_frames)
            frames_p50 = statistics.median(ping_frames) * 1e6
            regions_p50 = statistics.median(ping_regions) * 1e6
            ping_ratio = regions_p50 / frames_p50
            figures["ping_us"] = {"frames_client_p50": round(frames_p50, 1), "regions_client_p50": round(regions_p50, 1)}
        finally:
            fast.close()
            slow.close()

    report.sections.append((
        "bandwidth (GB/s, medians of interleaved rounds; x memcpy: median over rounds of the ratio "
        "to a memcpy of the same size in the same round)",
        format_table(["case", "GB/s", "x memcpy"], rows),
    ))
    report.sections.append(("small requests", format_table(
        ["client", "ping p50 (us)"],
        [["frames only", figures["ping_us"]["frames_client_p50"]],
         ["regions enabled", figures["ping_us"]["regions_client_p50"]]])))
    dram = max(sizes)
    for size in sizes:
        key = f"{size // MiB}MiB"
        paired = ratios[key]
        if size >= 64 * MiB:
            for name in ("write regions", "read_into regions"):
                report.targets.append(Target(f"{size // MiB} MiB {name} vs memcpy", paired[name], 0.5))
            # read() returns a new bytes object: its floor is a copy into a new one
            report.targets.append(Target(f"{size // MiB} MiB read regions vs memcpy to new bytes",
                                         paired["read regions"] / paired["memcpy to new bytes"], 0.5))
        if size == 1 * MiB and dram > size:
            # bandwidth at 1 MiB against memcpy bandwidth at DRAM size, round by round
            for name in ("write regions", "read_into regions", "read regions"):
                per_round = [(size / t) / (dram / m) for t, m in zip(one_mib_rounds[name], dram_rounds, strict=True)]
                report.targets.append(Target(f"1 MiB {name} vs memcpy at {dram // MiB} MiB",
                                             statistics.median(per_round), 0.15))
    report.targets.append(Target("ping p50, regions client vs frames client", ping_ratio, 1.05, higher_is_better=False))
    report.data.update(gbps=figures, ratios={k: {n: round(v, 3) for n, v in r.items()} for k, r in ratios.items()},
                       ping_ratio=round(ping_ratio, 3))
    return report.emit(as_json=args.json)
