"""The hardware check's "regions" phase: host<->device copies through shared-memory regions
against raw pinned copies.

    python3 tests/gpu/phase_regions.py [--sizes 64,256] [--repeat 7] [--quick] [--fake]
    tests/gpu/check_gpu.py                                   runs it as the step "regions"

prints one JSON line ``{"phase": "regions", "rows": [...]}``; from Python,
:func:`run` returns the same rows, :func:`run_in_child` runs it in a fresh
process (the orchestrator never initialises CUDA) and :func:`table_rows`
turns the result into check_gpu.py's table rows.

What a tenant's bulk copy does on the cuda backend, measured without the
supervisor's round trips (``twt bench data`` measures those on any machine):
the worker maps a region (:class:`shared.region.Region`), registers its
pages once (``CudaBackend.pin_host`` = ``cuMemHostRegister``), and copies
with ``cuMemcpyHtoDAsync`` / ``cuMemcpyDtoHAsync`` on the tenant's stream,
one synchronised copy per request (``write_host`` / ``read_host``), in
chunks of :data:`shared.region.DEFAULT_CHUNK_BYTES` as the client's pipeline
sends them. Baseline in the same process and run: the same copies from
memory of ``cuMemAllocHost`` (pinned by the driver), one copy of the whole
size + ``cuStreamSynchronize``. Also shown, for the record: a pageable copy
(the frame path's body, not registered).

Each row: ``{"name", "nbytes", "region_gbps", "raw_gbps", "ratio", "target",
"verdict"}`` with ``verdict`` "PASS" when ``ratio >= target`` (0.8), else
"MISS"; pageable rows have ``target`` None and verdict "INFO". A timing
never decides an exit code: the caller prints the rows.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any
from collections.abc import Callable

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

__all__ = ["TARGET", "run", "run_in_child", "table_rows"]

MiB = 1 << 20
#: region copies at least this fraction of raw pinned copies (GPU.md item 7)
TARGET = 0.8


def _median_s(fn: Callable[[], None], repeat: int) -> float:
    fn()  # warm up (first-touch, lazy module loading)
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def fit_sizes(sizes_mib: tuple[int, ...], free_bytes: int) -> tuple[tuple[int, ...], str | None]:
    """The sizes whose region fits the free shared memory (half of it at most: the supervisor's
    segments need room too); when none does, the largest power of two that does (>= 4 MiB). With the
    reason for any change, else None. A container's /dev/shm is often 64 MiB: one measured size beats
    every size SKIPPED."""
    room = free_bytes // 2
    fits = tuple(m for m in sizes_mib if m * MiB + (1 << 16) <= room)
    if len(fits) == len(sizes_mib):
        return fits, None
    dropped = [m for m in sizes_mib if m not in fits]
    if not fits:
        size = 1 << max(0, (room // MiB).bit_length() - 1) if room >= 5 * MiB else 0
        fits = (size,) if size >= 4 else ()
    return fits, (f"/dev/shm has {free_bytes / MiB:.0f} MiB free: {dropped} MiB left out"
                  + (f", {fits[0]} MiB measured instead" if fits and fits[0] not in sizes_mib else ""))


def run(driver: str | Any | None = None, *, sizes_mib: tuple[int, ...] = (64, 256), repeat: int = 7,
        chunk_bytes: int | None = None, device_index: int = 0) -> list[dict[str, Any]]:
    """Time H2D and D2H through a registered region against raw pinned copies; the rows.

    ``driver``: the driver module (name or object); the real
    ``cuda.bindings.driver`` by default, ``tests.helpers.fake_cuda`` to check
    this phase without a GPU.
    """
    from shared.errors import SegmentError
    from shared.region import DEFAULT_CHUNK_BYTES
    from worker.backends._driver import Driver
    from worker.backends.cuda import CudaBackend

    chunk = chunk_bytes or DEFAULT_CHUNK_BYTES
    drv = driver if isinstance(driver, Driver) else Driver(driver)
    backend = CudaBackend(device_index, driver=drv)
    d = drv.mod
    rows: list[dict[str, Any]] = []
    try:
        stream = drv.call("cuStreamCreate", int(d.CUstream_flags.CU_STREAM_NON_BLOCKING))
        try:
            for mib in sizes_mib:
                try:
                    rows += _one_size(drv, backend, stream, mib * MiB, chunk, repeat)
                except SegmentError as exc:  # e.g. a container's small /dev/shm: say so, go on
                    rows.append({"name": f"{mib} MiB region", "nbytes": mib * MiB, "region_gbps": 0.0,
                                 "raw_gbps": 0.0, "ratio": 0.0, "target": None,
                                 "verdict": f"SKIPPED: {exc.detail}", "intact": True})
        finally:
            drv.call("cuStreamDestroy", stream)
    finally:
        backend.close()
    return rows


def _one_size(drv: Any, backend: Any, stream: Any, nbytes: int, chunk: int, repeat: int) -> list[dict[str, Any]]:
    from shared.region import Region

    buf = backend.alloc(nbytes)
    owner = Region.create("gpu-check", nbytes, prefix=f"gpucheck{os.getpid()}")
    region = Region.attach(owner.name, tenant_id="gpu-check")  # mapped as a worker maps it
    host = drv.call("cuMemAllocHost", nbytes)
    pageable = bytearray(nbytes)
    addr = None
    try:
        span = region.data[:nbytes]
        pattern = os.urandom(1 << 16)
        for off in range(0, nbytes, len(pattern)):
            span[off : off + len(pattern)] = pattern[: nbytes - off]
        addr = backend.pin_host(region.data)
        if addr is None:
            raise RuntimeError("cuMemHostRegister refused the region (see the worker's cuda.host_register_failed)")
        dptr = buf.addr
        chunks = [(off, min(chunk, nbytes - off)) for off in range(0, nbytes, chunk)]

        def region_h2d() -> None:  # what write_region requests do, one per chunk
            for off, n in chunks:
                backend.write_host(buf, off, span[off : off + n], addr + off)

        def region_d2h() -> None:
            for off, n in chunks:
                backend.read_host(buf, off, span[off : off + n], addr + off)

        def raw_h2d() -> None:
            drv.call("cuMemcpyHtoDAsync", dptr, host, nbytes, stream)
            drv.call("cuStreamSynchronize", stream)

        def raw_d2h() -> None:
            drv.call("cuMemcpyDtoHAsync", host, dptr, nbytes, stream)
            drv.call("cuStreamSynchronize", stream)

        def pageable_h2d() -> None:
            backend.write(buf, 0, memoryview(pageable))

        times = {name: _median_s(fn, repeat) for name, fn in (
            ("region_h2d", region_h2d), ("raw_h2d", raw_h2d), ("region_d2h", region_d2h),
            ("raw_d2h", raw_d2h), ("pageable_h2d", pageable_h2d))}
        # the bytes made it: what went up through the region comes back through it
        region_h2d()
        check = bytes(span[:4096]) + bytes(span[-4096:])
        span[:4096] = bytes(4096)
        span[-4096:] = bytes(4096)
        region_d2h()
        intact = bytes(span[:4096]) + bytes(span[-4096:]) == check
    finally:
        if addr is not None:
            backend.unpin_host(addr)
        drv.call("cuMemFreeHost", host)
        backend.free(buf)
        region.close()
        owner.unlink()
        owner.close()

    def gbps(s: float) -> float:
        return round(nbytes / s / 1e9, 3) if s > 0 else float("inf")

    out = []
    for direction in ("h2d", "d2h"):
        ratio = times[f"raw_{direction}"] / times[f"region_{direction}"]
        out.append({
            "name": f"{direction.upper()} {nbytes // MiB} MiB region ({chunk // MiB} MiB chunks) vs raw pinned",
            "nbytes": nbytes, "region_gbps": gbps(times[f"region_{direction}"]),
            "raw_gbps": gbps(times[f"raw_{direction}"]), "ratio": round(ratio, 3), "target": TARGET,
            "verdict": "PASS" if ratio >= TARGET else "MISS", "intact": intact,
        })
    out.append({
        "name": f"H2D {nbytes // MiB} MiB pageable (unregistered) vs raw pinned", "nbytes": nbytes,
        "region_gbps": gbps(times["pageable_h2d"]), "raw_gbps": gbps(times["raw_h2d"]),
        "ratio": round(times["raw_h2d"] / times["pageable_h2d"], 3), "target": None, "verdict": "INFO",
        "intact": intact,
    })
    return out


def run_in_child(quick: bool = False, timeout_s: float = 600) -> dict[str, Any]:
    """This phase in a fresh process (on the fake when the check runs with ``--dry-run-fake``)."""
    from tests.gpu.phase_child import last_json_line, run_phase_script

    proc = run_phase_script(__file__, quick=quick, fake_flag="--fake", timeout_s=timeout_s)
    return last_json_line("regions", proc, timeout_s)


def table_rows(result: dict[str, Any]) -> list[tuple[str, str, str, bool | None, str]]:
    """(name, got, want, ok, kind) rows: the bytes intact is a check; the ratios are timings."""
    if "error" in result:
        return [("region copies H2D + D2H keep the bytes", result["error"][:120], "intact", False, "check")]
    rows = result.get("rows", [])
    measured = [r for r in rows if not r["verdict"].startswith("SKIPPED")]
    intact = all(r["intact"] for r in measured)
    out: list[tuple[str, str, str, bool | None, str]] = [
        ("region copies H2D + D2H keep the bytes", (str(intact) if measured else "nothing measured")
         + (f" ({result['note']})" if result.get("note") else ""), "True", intact if measured else None, "check")]
    for r in rows:
        got = f"{r['ratio']:.2f}x ({r['region_gbps']:.1f} vs {r['raw_gbps']:.1f} GB/s)"
        if r["verdict"].startswith("SKIPPED"):
            out.append((r["name"], r["verdict"][:120], "a region of this size", None, "timing"))
        elif r["target"] is None:
            out.append((r["name"], got, "informative", None, "timing"))
        else:
            out.append((r["name"], got, f">= {r['target']}x", r["verdict"] == "PASS", "timing"))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="64,256", help="MiB, comma-separated")
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="16 and 64 MiB, 3 repetitions")
    parser.add_argument("--fake", action="store_true", help="the fake driver (tests.helpers.fake_cuda): no GPU")
    args = parser.parse_args(argv)
    if args.quick:
        args.sizes, args.repeat = "16,64", 3
    driver = "tests.helpers.fake_cuda" if args.fake else os.environ.get("GPU_CHECK_DRIVER_MODULE")
    sizes = tuple(int(s) for s in args.sizes.split(",") if s.strip())
    if args.fake:
        sizes = (1, 4)  # the fake's timings mean nothing: keep it quick
    import shutil

    from shared import _shm

    sizes, note = fit_sizes(sizes, shutil.disk_usage(_shm.SHM_DIR).free)
    try:
        rows = run(driver, sizes_mib=sizes, repeat=args.repeat)
    except Exception as exc:  # noqa: BLE001 - one JSON line either way
        print(json.dumps({"phase": "regions", "error": f"{type(exc).__name__}: {exc}"}))
        return 1
    print(json.dumps({"phase": "regions", "rows": rows, **({"note": note} if note else {})}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
