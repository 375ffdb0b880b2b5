"""``twt bench wasm``: what running tenant WebAssembly costs, through a real supervisor and worker.

    round trip     ``run_wasm`` of a trivial export of a stored module (by digest: the worker's
                   compiled-module cache hits) against ``ping`` (the same client -> supervisor ->
                   worker path without the WASM host), interleaved round by round
    host call      one ``tensorwasm`` import: a guest loop of N calls minus a loop of 0,
                   divided by N (the import does a full handle check and returns BAD_HANDLE)
    axpy           ``y = a*x + y`` on 16M float32 (64 MiB each) client buffers through the host
                   (``axpy_f32`` in a guest loop of R calls minus a loop of 0, divided by R)
                   against numpy's ``y += a * x`` on arrays of the same size in this process,
                   interleaved round by round

    small op       ``axpy_f32`` on 64 floats (a queued op whose device work is ~1 us: what a chatty
                   tenant issues), a guest loop of ``--small-reps`` calls then the sync at the run's
                   end, minus a loop of 0, divided by the calls: the gate's own cost per queued op

    gemm           ``C = A @ B`` on 512 x 512 float32 client buffers (``matmul_f32`` in a guest
                   loop of R calls minus a loop of 0, divided by R) against numpy's
                   ``np.matmul(a, b, out=c)`` on the same sizes in this process, interleaved

Targets: axpy through the host >= 0.5x numpy's throughput on the stub backend;
GEMM through the host >= 0.9x numpy's matmul, every op under the GPU-time gate. Exit
status 0 when met, 4 when missed, 2 for bad usage.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Callable

from shared.spec import TenantSpec
from supervisor.tools.bench._report import Report, Target, count, device_cpus, format_table
from supervisor.tools.demo import guest_path
from supervisor.client.launch import launch

__all__ = ["main"]

MiB = 1 << 20


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _per_call_us(fn: Callable[[], object], n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        fn()
        out.append((time.perf_counter_ns() - t0) / 1000)
    return out


def _blas_threads(n: int) -> Callable[[], contextlib.AbstractContextManager[object]]:
    """A context that limits numpy's BLAS to ``n`` threads while it is open (``threadpoolctl`` where
    installed; else numpy keeps its own threads, and the table says so): the stub backend's device
    runs one BLAS thread, so a multi-threaded numpy would compare two CPUs against one."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        return contextlib.nullcontext
    return lambda: threadpool_limits(limits=n, user_api="blas")


def _blas_note() -> str:
    try:
        import threadpoolctl  # noqa: F401
    except ImportError:
        return "numpy's own BLAS threads: install threadpoolctl for one, as the stub device"
    return "one BLAS thread, as the stub device"


_BLAS_NOTE = _blas_note()


def _host_vs_numpy(guest_loop: Callable[[int], object], local_op: Callable[[], object], reps: int,
                   rounds: int) -> tuple[list[float], list[float]]:
    """Seconds per op, one pair a round: through the host and with numpy in this process.

    The host's figure is a guest loop of ``reps`` ops minus a loop of 0 (the
    run's fixed cost), divided by ``reps``; ``local_op`` runs ``reps`` times
    right after, so both sides of a round see the same machine load.
    """
    host: list[float] = []
    local: list[float] = []
    for _ in range(rounds):
        zero = _timed(lambda: guest_loop(0))
        t = _timed(lambda: guest_loop(reps))
        host.append(max(t - zero, 1e-9) / reps)
        t0 = time.perf_counter()
        for _ in range(reps):
            local_op()
        local.append((time.perf_counter() - t0) / reps)
    return host, local


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="twt bench wasm", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="one JSON object instead of tables")
    parser.add_argument("--floats", type=count, default=16 << 20, help="axpy vector length (default 16M)")
    parser.add_argument("--reps", type=count, default=4, help="axpy calls per guest run (default 4)")
    parser.add_argument("--rounds", type=count, default=5, help="interleaved measurement rounds (default 5)")
    parser.add_argument("--calls", type=count, default=200_000, help="host calls per guest run (default 200k)")
    parser.add_argument("--small-reps", type=count, default=20_000,
                        help="axpy_f32 calls on 64 floats per guest run (default 20k)")
    parser.add_argument("--gemm-n", type=count, default=512, help="GEMM size n (n x n @ n x n, default 512)")
    parser.add_argument("--gemm-reps", type=count, default=20, help="matmul calls per guest run (default 20)")
    parser.add_argument("--backend", default="stub", help="supervisor backend (default stub)")
    parser.add_argument("--device-cpus", type=device_cpus, default=(),
                        help="the supervisor's stub_device_cpus ('last': the stub's device thread on the last CPU "
                             "of the affinity set, the worker's other threads and the supervisor on the rest; "
                             "default none: the product's default)")
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0) and 2
    import numpy as np

    n, reps, rounds = args.floats, args.reps, args.rounds
    report = Report("wasm")
    config: dict[str, dict[str, object]] = {"supervisor": {"log_level": "warning", "pool_size": 0}}
    if args.device_cpus:
        config["supervisor"]["stub_device_cpus"] = args.device_cpus  # "last" or CPU numbers, as the config reads them
        report.sections.append(("the stub's device", f"stub_device_cpus = {args.device_cpus!r}"))
    spec = TenantSpec.from_dict({"tenant_id": "bench", "memory_quota_bytes": 16 << 30, "wasm_timeout_s": 600.0,
                                 "wasm_fuel": 10**15, "request_timeout_s": 600.0})
    with launch(config, backend=args.backend) as sup:
        c = sup.client
        cap = c.register(sup.admin_capability, spec)
        digest = c.put_module(cap, guest_path("bench").read_bytes())
        c.run_wasm(cap, digest, "nop")  # compile once; later runs hit the cache

        # -- round trip: run_wasm(nop) vs ping, interleaved
        rt_wasm: list[float] = []
        rt_ping: list[float] = []
        for _ in range(rounds):
            rt_ping += _per_call_us(lambda: c.ping(cap), 200)
            rt_wasm += _per_call_us(lambda: c.run_wasm(cap, digest, "nop"), 200)
        wasm_us, ping_us = statistics.median(rt_wasm), statistics.median(rt_ping)

        # -- one host call
        calls = args.calls
        per_call = []
        for _ in range(rounds):
            zero = _timed(lambda: c.run_wasm(cap, digest, "calls", [0]))
            many = _timed(lambda: c.run_wasm(cap, digest, "calls", [calls]))
            per_call.append((many - zero) / calls * 1e6)
        host_call_us = statistics.median(per_call)

        # -- axpy on n floats: through the host vs numpy here
        rng = np.random.default_rng(0)
        x = rng.standard_normal(n, dtype=np.float32)
        y = rng.standard_normal(n, dtype=np.float32)
        a = np.float32(1e-3)
        hx, hy = c.alloc(cap, 4 * n), c.alloc(cap, 4 * n)
        c.write(cap, hx, x.tobytes())
        c.write(cap, hy, y.tobytes())
        args_of = [{"handle": hx}, {"handle": hy}, n, float(a)]
        host_s, numpy_s = _host_vs_numpy(lambda r: c.run_wasm(cap, digest, "axpy_loop", [*args_of, r]),
                                         lambda: np.add(y, a * x, out=y), reps, rounds)  # y += a * x
        c.free(cap, hx)
        c.free(cap, hy)

        # -- a small queued op: axpy_f32 on 64 floats, the gate's own cost per op
        sx, sy = c.alloc(cap, 4 * 64), c.alloc(cap, 4 * 64)
        x64, y64 = x[:64].copy(), y[:64].copy()
        small_args: list[int | float | dict[str, int]] = [{"handle": sx}, {"handle": sy}, 64, float(a)]
        small_host, small_numpy = _host_vs_numpy(
            lambda r: c.run_wasm(cap, digest, "axpy_loop", [*small_args, r]),
            lambda: np.add(y64, a * x64, out=y64), args.small_reps, rounds)
        c.free(cap, sx)
        c.free(cap, sy)

        # -- GEMM n x n: through the host vs numpy's matmul here
        gn, greps = args.gemm_n, args.gemm_reps
        ga = rng.standard_normal((gn, gn), dtype=np.float32)
        gb = rng.standard_normal((gn, gn), dtype=np.float32)
        gc = np.empty((gn, gn), dtype=np.float32)
        hs = [c.alloc(cap, 4 * gn * gn) for _ in range(3)]
        c.write(cap, hs[0], ga.tobytes())
        c.write(cap, hs[1], gb.tobytes())
        gemm_args = [{"handle": h} for h in hs] + [gn]
        c.run_wasm(cap, digest, "matmul_loop", [*gemm_args, 1])  # warm: BLAS threads, cuBLAS handle
        np.matmul(ga, gb, out=gc)
        one_thread = _blas_threads(1)  # the stub's device runs one BLAS thread: the same for numpy here

        def numpy_gemm() -> None:
            with one_thread():
                np.matmul(ga, gb, out=gc)

        gemm_host, gemm_numpy = _host_vs_numpy(lambda r: c.run_wasm(cap, digest, "matmul_loop", [*gemm_args, r]),
                                               numpy_gemm, greps, rounds)
        got = np.frombuffer(c.read(cap, hs[2], 4 * gn * gn), dtype=np.float32).reshape(gn, gn)
        gemm_equal = bool(np.allclose(got, gc, rtol=1e-4, atol=1e-3))
        for h in hs:
            c.free(cap, h)
        c.evict(sup.admin_capability, "bench")
    ratios = [ns / hs for ns, hs in zip(numpy_s, host_s)]
    ratio = statistics.median(ratios)
    host_axpy, numpy_axpy = statistics.median(host_s), statistics.median(numpy_s)
    moved = 12 * n  # read x, read y, write y

    report.sections.append((
        "round trip (client -> supervisor -> worker -> client), median us",
        format_table(
            ["request", "us", "vs ping"],
            [["ping", ping_us, "1.00x"], ["run_wasm nop (cached module)", wasm_us, f"{wasm_us / ping_us:.2f}x"]],
        ),
    ))
    report.sections.append((
        f"one host call (guest loop of {calls:,} tensorwasm.free calls, minus a loop of 0)",
        format_table(["import", "us per call"], [["free(unknown handle)", host_call_us]]),
    ))
    report.sections.append((
        f"axpy_f32 on {n:,} float32 ({4 * n / MiB:.0f} MiB per vector), median of {rounds} rounds x {reps}",
        format_table(
            ["path", "ms per axpy", "GB/s"],
            [["through the WASM host (stub backend)", host_axpy * 1e3, moved / host_axpy / 1e9],
             ["numpy y += a * x (this process)", numpy_axpy * 1e3, moved / numpy_axpy / 1e9]],
        ),
    ))
    small_us, small_np_us = statistics.median(small_host) * 1e6, statistics.median(small_numpy) * 1e6
    report.sections.append((
        f"a small queued op: axpy_f32 on 64 float32, median of {rounds} rounds x {args.small_reps:,}",
        format_table(
            ["path", "us per op", "vs one host call"],
            [["through the WASM host: queued, under the gate", small_us, f"{small_us / host_call_us:.1f}x"],
             ["numpy y += a * x on 64 floats (this process)", small_np_us, f"{small_np_us / host_call_us:.1f}x"]],
        ),
    ))
    gemm_ratio = statistics.median(gemm_numpy) / statistics.median(gemm_host)
    gflop = 2.0 * gn**3 / 1e9
    report.sections.append((
        f"matmul_f32 {gn}x{gn} @ {gn}x{gn} float32, median of {rounds} rounds x {greps}"
        f" (result {'==' if gemm_equal else '!='} numpy)",
        format_table(
            ["path", "ms per GEMM", "GFLOP/s"],
            [[f"through the WASM host ({args.backend} backend)", statistics.median(gemm_host) * 1e3,
              gflop / statistics.median(gemm_host)],
             [f"numpy np.matmul(a, b, out=c) (this process, {_BLAS_NOTE})", statistics.median(gemm_numpy) * 1e3,
              gflop / statistics.median(gemm_numpy)]],
        ),
    ))
    report.data.update({
        "gemm": {"n": gn, "host_ms": round(statistics.median(gemm_host) * 1e3, 3),
                 "numpy_ms": round(statistics.median(gemm_numpy) * 1e3, 3), "equal": gemm_equal,
                 "ratio": round(gemm_ratio, 3)},
        "round_trip_us": {"ping": round(ping_us, 1), "run_wasm_nop": round(wasm_us, 1)},
        "host_call_us": round(host_call_us, 3),
        "small_op_us": {"host": round(small_us, 3), "numpy": round(small_np_us, 3)},
        "axpy": {"floats": n, "host_ms": round(host_axpy * 1e3, 3), "numpy_ms": round(numpy_axpy * 1e3, 3),
                 "ratios": [round(r, 3) for r in ratios]},
    })
    report.targets.append(Target("axpy through the host vs numpy (throughput)", ratio, 0.5))
    report.targets.append(Target(f"GEMM {gn}^3 through the host vs numpy matmul (throughput)",
                                 gemm_ratio if gemm_equal else 0.0, 0.9))
    return report.emit(as_json=args.json)
