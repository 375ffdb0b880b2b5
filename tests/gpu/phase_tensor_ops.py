"""The hardware check's "tensor ops" phase: the WASM ABI's tensor ops on the cuda backend of a real GPU.

    python3 tests/gpu/phase_tensor_ops.py [--quick] [--dry-run-fake]      one JSON line (a child phase)
    tests/gpu/check_gpu.py                                                runs it as the step "tensor_ops"

In one process (CUDA inside), through a real WasmHost over a real
QuotaBlock and the cuda backend (NVRTC kernels, cuBLAS from nvmath-python):

1. every op equal to numpy within float32 tolerance on awkward shapes
   (matmul, add, mul, add_rows, the 12 unary ops, scale, softmax_rows, max,
   argmax_rows, transpose), the model operations once each (``model_ops``:
   GEMM flags and batches, every selector, row reductions, layer norm,
   gather, copy, mask, casts and GemmEx; tests/helpers/model_ops.py), and
   the bundled MLP guest;
2. GEMM throughput: ``matmul_f32`` in a guest loop (``bench.wat``
   ``matmul_loop``, a loop of R minus a loop of 0, then a stream
   synchronize) against cuBLAS called directly (nvmath's ``sgemm`` on the
   same device buffers, same stream, R calls then a synchronize), square
   sizes 512 and 2048. Target: >= 0.8x, printed PASS/MISS, not part of the
   exit code (timings are not correctness).

``--dry-run-fake`` runs the phase against the fake driver and fake cuBLAS
(tests the script, proves nothing about hardware).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MiB = 1 << 20
GEMM_TARGET = 0.8

__all__ = ["phase", "run_in_child", "table_rows"]


def _backend(fake: bool) -> tuple[Any, Any]:
    """(CudaBackend, cuBLAS module) on device 0: the real ones, or the fakes."""
    from worker.backends.cuda import CudaBackend

    if fake:
        import os

        from tests.helpers.fake_cublas import CublasRecorder, FakeCublas
        from tests.helpers.fake_cuda import CallRecorder, FakeDriver

        drv: Any = FakeDriver(memory_bytes=4 << 30)
        cublas: Any = FakeCublas(drv)
        record_dir = os.environ.get("FAKE_CUDA_RECORD_CALLS")
        if record_dir:  # the replay test (tests/worker/test_replay_bindings.py) records this phase's calls
            drv = CallRecorder(drv, record_dir)
            cublas = CublasRecorder(cublas, record_dir)
        return CudaBackend(0, gpu_cap_bytes=2 << 30, driver=drv, nvrtc=drv, cublas=cublas), cublas
    from worker.backends._cublas import load_cublas_module

    return CudaBackend(0, gpu_cap_bytes=2 << 30), load_cublas_module(None)


def _close(got: Any, ref: Any, rtol: float, atol: float = 0.0) -> tuple[bool, float]:
    import numpy as np

    got = np.asarray(got, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    same_nan = bool((np.isnan(got) == np.isnan(ref)).all())
    fin = ~np.isnan(ref)
    with np.errstate(all="ignore"):
        err = np.where(got[fin] == ref[fin], 0.0, np.abs(got[fin] - ref[fin]))  # inf == inf
    with np.errstate(all="ignore"):
        tol = atol + rtol * np.abs(ref[fin])  # (0 * inf is NaN: an exact match passes below anyway)
    with np.errstate(all="ignore"):
        worst = float(np.max(err / np.maximum(np.abs(ref[fin]), 1e-30))) if err.size else 0.0
    return same_nan and bool(((err == 0) | (err <= tol)).all()), worst


def _correctness(host: Any, quick: bool) -> dict[str, Any]:
    import numpy as np

    from worker.wasm import guest_source

    rng = np.random.default_rng(2026)
    out: dict[str, Any] = {}
    backend = host.ctx.backend
    with host.session(guest_source("probe"), fuel=10**9, timeout_s=600) as s:

        def call(name: str, *args: Any) -> int:
            (rc,) = s.call(name, list(args))
            return int(rc)

        def put(arr: Any) -> int:
            a = np.ascontiguousarray(arr, dtype=np.float32).ravel()
            h = call("alloc", max(4, a.nbytes))
            assert h > 0, f"alloc of {a.nbytes} B failed: {h}"
            if a.size:
                backend.write(s.run.buffers[h][0], 0, memoryview(a.tobytes()))
            return h

        def get(h: int, n: int) -> Any:
            return np.frombuffer(backend.read(s.run.buffers[h][0], 0, 4 * n), dtype=np.float32)

        def record(name: str, ok: bool, worst: float) -> None:
            prev = out.get(name, {"ok": True, "worst_rel_err": 0.0})
            out[name] = {"ok": prev["ok"] and ok, "worst_rel_err": max(prev["worst_rel_err"], worst)}

        shapes = [(1, 1, 1), (7, 13, 5), (64, 300, 129), (257, 1000, 33)] + ([] if quick else [(1024, 1024, 1024)])
        for m, k, n in shapes:
            a = rng.standard_normal((m, k), dtype=np.float32)
            b = rng.standard_normal((k, n), dtype=np.float32)
            ha, hb, hc = put(a), put(b), put(np.zeros(m * n))
            rc = call("matmul_f32", ha, hb, hc, m, k, n)
            ref = a.astype(np.float64) @ b.astype(np.float64)
            scale = np.abs(a).astype(np.float64) @ np.abs(b).astype(np.float64)
            got = get(hc, m * n).reshape(m, n).astype(np.float64)
            rel = float(np.max(np.abs(got - ref) / np.maximum(scale, 1e-30)))
            record("matmul_f32", rc == 0 and rel <= 4e-7 * max(1.0, float(np.sqrt(k))) * 8, rel)
            for h in (ha, hb, hc):
                call("free", h)

        n = 100_003 if quick else 4_000_037
        x = (rng.standard_normal(n, dtype=np.float32) * 8).astype(np.float32)
        x[::9973] = np.nan
        x[5::7919] = np.inf
        x[6::7919] = -np.inf
        y = rng.standard_normal(n, dtype=np.float32)
        hx, hy, ho = put(x), put(y), put(np.zeros(n))
        with np.errstate(all="ignore"):
            for name, ref in (("add_f32", x + y), ("mul_f32", x * y)):
                ok = call(name, hx, hy, ho, n) == 0
                record(name, *_close(get(ho, n), ref, rtol=0)) if ok else record(name, False, 1.0)
            unary = {"relu": (np.where((x > 0) | np.isnan(x), x, np.float32(0)), 0), "exp": (np.exp(x), 2e-6),
                     "tanh": (np.tanh(x), 2e-6), "sigmoid": (1 / (1 + np.exp(-x)), 2e-6), "neg": (-x, 0),
                     "sqrt": (np.sqrt(x), 0), "abs": (np.abs(x), 0)}
            from tests.helpers.model_ops import ref_unary
            from worker.wasm.tensor_abi import UNARY_OPS

            for name in ("log", "gelu", "silu", "rsqrt", "recip"):  # CUDA's logf/tanhf/expf: a few ulp
                unary[name] = (ref_unary(name, x), 0 if name in ("rsqrt", "recip") else 2e-6)
            for op, name in enumerate(UNARY_OPS):
                ref, rtol = unary[name]
                ok = call("unary_f32", op, hx, ho, n) == 0
                res = _close(get(ho, n), ref, rtol=rtol, atol=1e-5 if name in ("gelu", "silu") else 1e-37)
                record(f"unary_f32/{name}", ok and res[0], res[1])
            hz = put(x)
            ok = call("scale_f32", hz, -1.5, n) == 0
            res = _close(get(hz, n), x * np.float32(-1.5), rtol=0)
            record("scale_f32", ok and res[0], res[1])
            ok = call("max_f32", hy, n, 0) == 0 and s.call("load_f32", [0])[0] == float(y.max())
            record("max_f32", ok, 0.0)
            ok = call("max_f32", hx, n, 0) == 0 and np.isnan(s.call("load_f32", [0])[0])  # a NaN wins
            record("max_f32", bool(ok), 0.0)
        for h in (hx, hy, ho, hz):
            call("free", h)

        for rows, cols in [(1, 1), (513, 1001), (3, 70_000), (4000, 10)] if not quick else [(1, 1), (37, 301)]:
            mat = (rng.standard_normal((rows, cols), dtype=np.float32) * 6).astype(np.float32)
            mat[0, cols // 2] = mat[0].max() + 1  # a clear winner, then a tie
            if cols > 2:
                mat[-1, 1] = mat[-1, 2] = mat[-1].max() + 2
            v = rng.standard_normal(cols, dtype=np.float32)
            hm, hv, ht = put(mat), put(v), put(np.zeros(rows * cols))
            ok = call("transpose_f32", hm, ht, rows, cols) == 0
            record("transpose_f32", ok and bool((get(ht, rows * cols).reshape(cols, rows) == mat.T).all()), 0.0)
            if 4 * rows <= 60_000:
                ok = call("argmax_rows_f32", hm, rows, cols, 0) == 0
                got = np.frombuffer(bytes(s.guest_memory()[: 4 * rows]), dtype="<i4")
                record("argmax_rows_f32", ok and bool((got == mat.argmax(axis=1)).all()), 0.0)
            ok = call("add_rows_f32", hm, hv, rows, cols) == 0
            summed = mat + v
            res = _close(get(hm, rows * cols).reshape(rows, cols), summed, rtol=0)
            record("add_rows_f32", ok and res[0], res[1])
            ok = call("softmax_rows_f32", hm, rows, cols) == 0
            e = np.exp(summed.astype(np.float64) - summed.max(axis=1, keepdims=True))
            res = _close(get(hm, rows * cols).reshape(rows, cols), e / e.sum(axis=1, keepdims=True),
                         rtol=5e-5, atol=1e-9)
            record("softmax_rows_f32", ok and res[0], res[1])
            for h in (hm, hv, ht):
                call("free", h)
        # the second-round ops (GEMM flags and batches, selectors, reductions, norms, gather, copy,
        # mask, f16/bf16), each against numpy (tests/helpers/model_ops.py)
        from tests.helpers.model_ops import check_every_op

        try:
            check_every_op(s, seed=5)
            record("model_ops", True, 0.0)
        except AssertionError as exc:
            print(f"model_ops: {exc}", file=sys.stderr)
            record("model_ops", False, 1.0)
    out["mlp"] = _mlp(host)
    return out


def _mlp(host: Any) -> dict[str, Any]:
    import numpy as np

    from tests.helpers.wasm_env import mlp_forward

    batch, d_in, hidden, d_out = 1024, 784, 512, 10
    rng = np.random.default_rng(7)
    p = {"x": rng.standard_normal((batch, d_in)), "w1": rng.standard_normal((d_in, hidden)) / np.sqrt(d_in),
         "b1": rng.standard_normal(hidden) * 0.1, "w2": rng.standard_normal((hidden, d_out)) / np.sqrt(hidden),
         "b2": rng.standard_normal(d_out) * 0.1}
    p = {k: v.astype(np.float32) for k, v in p.items()}
    with mlp_forward(host, p, batch, d_in, hidden, d_out, timeout_s=60) as mlp:
        reply, got = mlp.reply, mlp.out
    h64 = np.maximum(p["x"].astype(np.float64) @ p["w1"] + p["b1"], 0)
    logits = h64 @ p["w2"] + p["b2"]
    e = np.exp(logits - logits.max(axis=1, keepdims=True))
    ok, worst = _close(got, e / e.sum(axis=1, keepdims=True), rtol=1e-4, atol=1e-7)
    return {"ok": ok and reply["results"] == [0], "worst_rel_err": worst}


def _gemm(host: Any, cublas: Any, n: int, reps: int, rounds: int) -> dict[str, Any]:
    """Per-GEMM seconds through the WASM host and through cuBLAS directly, same buffers, same stream."""
    import ctypes

    import numpy as np

    from worker.wasm import guest_source

    backend = host.ctx.backend
    drv, stream = backend._drv, backend._stream
    alloc = host.ctx.allocator
    rng = np.random.default_rng(n)
    ws_bytes = backend.gemm_workspace_bytes()  # what the host lends per run on this device (32 MiB on Hopper)
    hs = [alloc.alloc(4 * n * n) for _ in range(3)] + [alloc.alloc(ws_bytes)]
    try:
        bufs = [alloc.lookup(h) for h in hs[:3]]
        ws = alloc.lookup(hs[3])
        for buf in bufs[:2]:
            backend.write(buf, 0, memoryview(rng.standard_normal(n * n, dtype=np.float32).tobytes()))
        module = guest_source("bench")
        args = [{"handle": h} for h in hs[:3]] + [n]

        def wasm(r: int) -> float:
            t0 = time.perf_counter()
            reply = host.run(module, "matmul_loop", [*args, r], fuel=10**12, timeout_s=600)
            drv.call("cuStreamSynchronize", stream)
            assert reply["results"] == [0], reply
            return time.perf_counter() - t0

        handle = cublas.create()
        try:
            cublas.set_stream(handle, int(stream))  # (resets the workspace: set it after)
            cublas.set_pointer_mode(handle, int(cublas.PointerMode.HOST))
            # the same workspace the WASM host lends per run (gemm_workspace_bytes): without it cuBLAS
            # would take its default one and the two paths would differ in more than the host's overhead
            cublas.set_workspace(handle, int(ws.ptr), ws.nbytes)
            version = int(cublas.get_version(handle))
            one, zero = ctypes.c_float(1.0), ctypes.c_float(0.0)
            a, b, c = (int(buf.ptr) for buf in bufs)
            op_n = int(cublas.Operation.N)

            def direct(r: int) -> float:
                t0 = time.perf_counter()
                for _ in range(r):
                    cublas.sgemm(handle, op_n, op_n, n, n, n, ctypes.addressof(one), b, n, a, n,
                                 ctypes.addressof(zero), c, n)
                drv.call("cuStreamSynchronize", stream)
                return time.perf_counter() - t0

            wasm(2)
            direct(2)  # warm: module compiled, cuBLAS kernels loaded
            host_s, direct_s = [], []
            for _ in range(rounds):
                host_s.append(max(wasm(reps) - wasm(0), 1e-9) / reps)
                direct_s.append(direct(reps) / reps)
        finally:
            cublas.destroy(handle)
    finally:
        for h in hs:
            alloc.free(h)
    ratio = statistics.median(direct_s) / statistics.median(host_s)  # throughput: WASM / direct
    flops = 2.0 * n**3
    return {"n": n, "reps": reps, "wasm_us": round(statistics.median(host_s) * 1e6, 2),
            "cublas_us": round(statistics.median(direct_s) * 1e6, 2),
            "wasm_tflops": round(flops / statistics.median(host_s) / 1e12, 3),
            "cublas_tflops": round(flops / statistics.median(direct_s) / 1e12, 3),
            "ratio": round(ratio, 3), "target": GEMM_TARGET, "verdict": "PASS" if ratio >= GEMM_TARGET else "MISS",
            "workspace_bytes": ws_bytes, "cublas_version": version}


def phase(*, quick: bool = False, fake: bool = False) -> dict[str, Any]:
    """The whole phase in this process; a JSON-able summary (``ok``: every op equal to numpy)."""
    from shared.quota import QuotaBlock
    from shared.spec import TenantSpec
    from worker.context import TenantContext
    from worker.wasm import WasmHost

    backend, cublas = _backend(fake)
    cap = 2 << 30
    spec = TenantSpec.from_dict({"tenant_id": "tensorops", "memory_quota_bytes": 4 << 30, "gpu_memory_bytes_cap": cap,
                                 "wasm_max_memory_bytes": 1 << 20, "wasm_timeout_s": 600.0, "wasm_fuel": 10**12})
    result: dict[str, Any] = {"backend": backend.info().get("device_name")}
    with QuotaBlock.create("tensorops", memory_quota_bytes=4 << 30, gpu_memory_bytes_cap=cap) as owner:
        ctx = TenantContext(spec, 0, 0, QuotaBlock.attach(owner.name, instance=0), backend)
        host = WasmHost(ctx)
        ctx.extensions[WasmHost.EXTENSION] = host
        try:
            # each part reports its own failure: one broken op (or cuBLAS missing) must not cost the
            # others' results, nor the GEMM timings
            try:
                ops = _correctness(host, quick or fake)
                result["ops"] = ops
                result["ok"] = all(v["ok"] for v in ops.values())
            except Exception as exc:  # noqa: BLE001 - reported in the JSON, the phase goes on
                result["ops_error"] = f"{type(exc).__name__}: {exc}"
                result["ok"] = False
            sizes = [(64, 4, 2)] if fake else ([(512, 100, 3), (2048, 10, 3)] if quick else
                                               [(512, 400, 5), (2048, 40, 5)])
            result["gemm"] = []
            for n, reps, rounds in sizes:
                try:
                    result["gemm"].append(_gemm(host, cublas, n, reps, rounds))
                except Exception as exc:  # noqa: BLE001 - e.g. cuBLAS missing: a timing row says so
                    result["gemm"].append({"n": n, "error": f"{type(exc).__name__}: {exc}"})
        finally:
            ctx.close()
        result["gpu_bytes_after"] = owner.gpu_bytes_in_use
    result["ok"] = result.get("ok", False) and result["gpu_bytes_after"] == 0
    return result


def run_in_child(quick: bool = False, timeout_s: float = 900) -> dict[str, Any]:
    """The phase in a fresh process (the orchestrator never initialises CUDA): its JSON line."""
    from tests.gpu.phase_child import run_phase_script

    proc = run_phase_script(__file__, quick=quick, fake_flag="--dry-run-fake", timeout_s=timeout_s)
    if proc is None:
        return {"error": f"tensor_ops did not finish within {timeout_s:.0f} s (killed)"}
    return parse_child(proc.returncode, proc.stdout, proc.stderr)


def parse_child(returncode: int, stdout: str, stderr: str) -> dict[str, Any]:
    """The phase child's result: its JSON line whatever its exit code (exit 1 = some op differs from
    numpy, and the line says which, with the GEMM timings); ``{"error"}`` only when there is none."""
    lines = [ln for ln in stdout.splitlines() if ln.startswith("{")]
    if not lines:
        tail = (stderr or stdout).strip().splitlines()[-5:]
        return {"error": f"tensor_ops exit {returncode}: " + " | ".join(tail)}
    result: dict[str, Any] = json.loads(lines[-1])
    if returncode and result.get("ok") is not False:
        result["ok"] = False
        result["ops_error"] = f"tensor_ops exit {returncode}"
    return result


def table_rows(result: dict[str, Any]) -> list[tuple[str, str, str, bool | None]]:
    """check_gpu.py's table rows: correctness counts, GEMM timings only inform (ok None)."""
    if "error" in result:
        return [("tensor ops vs numpy", result["error"][:120], "all equal", False)]
    ops = result.get("ops", {})
    bad = sorted(k for k, v in ops.items() if not v["ok"])
    got = f"{len(ops) - len(bad)}/{len(ops)} equal" + (f", off: {bad}" if bad else "")
    if result.get("ops_error"):
        got += f"; {result['ops_error'][:120]}"
    rows: list[tuple[str, str, str, bool | None]] = [
        ("tensor ops vs numpy (cuda backend)", got, "all within float32 tolerance",
         bool(ops) and not bad and not result.get("ops_error") and result.get("gpu_bytes_after") == 0),
    ]
    for g in result.get("gemm", []):
        if "error" in g:
            rows.append((f"GEMM {g['n']}^3 via WASM / cuBLAS direct", f"ERROR {g['error'][:120]}",
                         f">= {GEMM_TARGET}x (informative)", None))
            continue
        rows.append((f"GEMM {g['n']}^3 via WASM / cuBLAS direct",
                     f"{g['verdict']} {g['ratio']:.2f}x ({g['wasm_us']:.0f} vs {g['cublas_us']:.0f} us, "
                     f"{g['wasm_tflops']} vs {g['cublas_tflops']} TFLOP/s)", f">= {g['target']}x (informative)", None))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller shapes and fewer repetitions")
    parser.add_argument("--dry-run-fake", action="store_true", help="the fake driver and cuBLAS (tests the script)")
    parser.add_argument("--table", action="store_true", help="also print the table rows")
    args = parser.parse_args()
    result = phase(quick=args.quick, fake=args.dry_run_fake)
    print(json.dumps(result))
    if args.table:
        for name, got, want, ok in table_rows(result):
            mark = "ok  " if ok else ("----" if ok is None else "FAIL")
            print(f"{mark} {name}  {got}   (want {want})")
    return 0 if result.get("ok") else 1


if __name__ == "__main__":
    sys.exit(main())
