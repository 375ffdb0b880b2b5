"""The hardware check's figures for the docs: the device as ``nvidia-smi`` names it, and one flat table.

``check_gpu.py`` writes every phase's raw results under ``phases`` in its
JSON; the docs need a dozen numbers out of them. :func:`figures` picks them
out under stable, flat keys (``summary["figures"]``), so whoever fills in
docs/GPU-QUOTAS.md ("Figures from hardware") and docs/PERFORMANCE.md copies
``figures.KEY`` into the row that names it - the mapping is written down in
docs/GPU-QUOTAS.md. A figure whose phase did not run (or failed before
measuring) is ``None``.

:func:`nvidia_smi` asks ``nvidia-smi`` (no CUDA call: the orchestrator never
initialises CUDA) for the device name, the kernel driver's version (e.g.
``570.124.06``; ``cuDriverGetVersion`` only gives the CUDA API level, e.g.
12.8), memory, compute and MIG mode.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

__all__ = ["SMI_FIELDS", "cuda_version", "figures", "nvidia_smi", "parse_nvidia_smi", "summarize", "write_json"]

MiB = 1 << 20
#: what is asked of nvidia-smi, in this order (``--query-gpu``)
SMI_FIELDS = ("index", "name", "driver_version", "memory.total", "memory.used", "compute_mode", "mig.mode.current",
              "persistence_mode")


def parse_nvidia_smi(csv_text: str) -> list[dict[str, str]]:
    """``nvidia-smi --query-gpu=<SMI_FIELDS> --format=csv,noheader,nounits`` output -> one dict per GPU.

    Values stay strings as nvidia-smi prints them (``[N/A]`` included);
    names may contain commas only in theory - a line with more fields than
    asked for is joined back into the name.
    """
    gpus = []
    for line in csv_text.splitlines():
        if not line.strip():
            continue
        parts = [p.strip() for p in line.split(",")]
        extra = len(parts) - len(SMI_FIELDS)
        if extra < 0:
            continue
        if extra:
            parts = [parts[0], ", ".join(parts[1 : 2 + extra]), *parts[2 + extra :]]
        gpus.append(dict(zip(SMI_FIELDS, parts)))
    return gpus


def nvidia_smi(timeout_s: float = 20) -> dict[str, Any]:
    """The GPUs as nvidia-smi reports them: ``{"gpus": [...]}``, or ``{"error": ...}`` without it."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return {"error": "nvidia-smi is not on PATH"}
    try:
        proc = subprocess.run([exe, f"--query-gpu={','.join(SMI_FIELDS)}", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"error": f"nvidia-smi failed: {type(exc).__name__}: {exc}"}
    if proc.returncode:
        return {"error": f"nvidia-smi exit {proc.returncode}: {(proc.stderr or proc.stdout).strip()[:200]}"}
    return {"gpus": parse_nvidia_smi(proc.stdout)}


def cuda_version(value: Any) -> str | None:
    """``cuDriverGetVersion``'s int (12080) as ``"12.8"``; None for anything else."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        return None
    return f"{value // 1000}.{value % 1000 // 10}"


def _get(tree: dict[str, Any], *path: Any) -> Any:
    node: Any = tree
    for key in path:
        if isinstance(node, dict):
            node = node.get(key)
        elif isinstance(node, list) and isinstance(key, int) and -len(node) <= key < len(node):
            node = node[key]
        else:
            return None
    return node


def _rounded(value: Any, digits: int) -> Any:
    return round(value, digits) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def figures(phases: dict[str, Any], smi: dict[str, Any]) -> dict[str, Any]:
    """The figures the docs quote, flat, from the phases' raw results (``None`` where not measured)."""
    gpu0 = (_get(smi, "gpus", 0) or {}) if isinstance(smi, dict) else {}
    out: dict[str, Any] = {
        "device_name": gpu0.get("name") or _get(phases, "pool", "device_name"),
        "driver_version": gpu0.get("driver_version"),
        "cuda_driver_version": cuda_version(_get(phases, "pool", "driver_version"))
        or _get(phases, "environment", "cuda_driver_version"),
        "nvrtc_version": _get(phases, "environment", "nvrtc_version"),
        "cuda_major": _get(phases, "environment", "cuda_major"),
        "cublas_major": _get(phases, "environment", "cublas_major"),
        "kernel_arch": _get(phases, "kernels", "kernel_arch"),
        # GPU.md 1: the pool's maxSize is a hard cap; the release threshold is not
        "maxsize_64mib_alloc_128mib": _get(phases, "pool", "cap64_alloc128"),
        "maxsize_64mib_steps_of_8mib": _get(phases, "pool", "cap64_steps_of_8mib"),
        "maxsize_64mib_readback": _get(phases, "pool", "cap64_max_pool_size_readback"),
        "release_threshold_only_alloc_128_then_256mib": _get(phases, "pool", "threshold64_alloc128"),
        "release_threshold_only_second_alloc": _get(phases, "pool", "threshold64_alloc256_more"),
        # pool rounding vs exact metering: odd-sized allocations under a 64 MiB maxSize
        "pool_odd_alloc_bytes": _get(phases, "pool", "odd_alloc_bytes"),
        "pool_odd_steps": _get(phases, "pool", "odd_steps"),
        "pool_odd_metered_allowance": _get(phases, "pool", "odd_metered_allowance"),
        "pool_odd_used_mem_current": _get(phases, "pool", "odd_used_mem_current"),
        "pool_odd_reserved_mem_current": _get(phases, "pool", "odd_reserved_mem_current"),
        # metering
        "metered_refusal_cuda_calls": _get(phases, "metering", "cuda_calls_during_refusal"),
        # GPU.md 4: isolation
        "isolation_b_at_a_address": _get(phases, "isolation", "reader", "own_addr_is_a_addr"),
        "isolation_copy_result": _get(phases, "isolation", "reader", "copy"),
        "isolation_copy_saw": _get(phases, "isolation", "reader", "copy_saw"),
        "isolation_kernel_result": _get(phases, "isolation", "reader_kernel", "kernel"),
        "isolation_kernel_saw": _get(phases, "isolation", "reader_kernel", "kernel_saw"),
        "isolation_a_bytes_leaked": None if _get(phases, "isolation", "reader", "copy_got_a_bytes") is None
        else bool(_get(phases, "isolation", "reader", "copy_got_a_bytes")
                  or _get(phases, "isolation", "reader_kernel", "kernel_got_a_bytes")),
        "isolation_a_unharmed": _get(phases, "isolation", "writer_after", "nonce_intact"),
        # residual data: B's fresh allocations after A freed+trimmed, or was killed holding them
        "residual_after_free_trim_marks": _get(phases, "residual", "free_trim", "mark_floats_found"),
        "residual_after_kill_marks": _get(phases, "residual", "kill", "mark_floats_found"),
        "residual_read_mib": _get(phases, "residual", "kill", "mib"),
        # GPU.md 2 + 5: two tenants, crash reclaim
        "over_cap_refused": _get(phases, "tenants", "alpha_over_cap_refused"),
        "neighbour_unaffected": _get(phases, "tenants", "beta_after_kill"),
        "reclaim_delta_mib": _rounded(_get(phases, "tenants", "reclaim_delta_mib"), 2),
        "reclaim_free_before_mib": _rounded(_get(phases, "tenants", "free_before_mib"), 1),
        "reclaim_free_after_kill_mib": _rounded(_get(phases, "tenants", "free_after_kill_mib"), 1),
        # GPU.md 4: a kernel fault ends that worker only
        "fault_error": _get(phases, "fault", "faulty_request"),
        "fault_exit_reason": _get(phases, "fault", "last_exit", "reason"),
        "fault_restarted": _get(phases, "fault", "restarted"),
        "fault_neighbour_same_pid": _get(phases, "fault", "calm_same_pid"),
        # GPU.md 6: kernels and tensor ops against numpy
        "kernels_match_numpy": None if "kernels" not in phases else all(
            _get(phases, "kernels", k) is True for k in ("fill_matches_numpy", "axpy_matches_numpy",
                                                          "sum_matches_numpy")),
        "kernels_n": _get(phases, "kernels", "n"),
        "nvrtc_compile_ms": _rounded(_get(phases, "kernels", "nvrtc_compile_ms"), 1),
        "tensor_ops_equal": None,
        "tensor_ops_off": None,
        # GPU.md 7: timings
        "ready_ms": _rounded(_get(phases, "timing", "ready_ms"), 1),
        "per_context_mib": _rounded(_get(phases, "timing", "per_context_mib"), 1),
        "per_worker_loaded_mib": _rounded(_get(phases, "timing", "per_worker_loaded_mib"), 1),
        "kernels_load_ms": _rounded(_get(phases, "timing", "loaded", "kernels_load_ms"), 1),
        "cublas_create_ms": _rounded(_get(phases, "timing", "loaded", "cublas_create_ms"), 1),
        "alloc_free_raw_us": _rounded(_get(phases, "timing", "alloc", "raw_us"), 3),
        "alloc_free_backend_us": _rounded(_get(phases, "timing", "alloc", "backend_us"), 3),
        "alloc_free_metered_us": _rounded(_get(phases, "timing", "alloc", "metered_us"), 3),
        "metered_over_raw": _rounded(_get(phases, "timing", "alloc", "metered_over_raw"), 3),
        "wasm_axpy_sum_1m_ms": _rounded(_get(phases, "wasm", "axpy_sum_1m_ms"), 2),
        "pytest_gpu": _get(phases, "pytest", "summary"),
    }
    ops = _get(phases, "tensor_ops", "ops")
    if isinstance(ops, dict) and ops:
        off = sorted(k for k, v in ops.items() if not (isinstance(v, dict) and v.get("ok")))
        out["tensor_ops_equal"] = f"{len(ops) - len(off)}/{len(ops)}"
        out["tensor_ops_off"] = off
    for row in _get(phases, "regions", "rows") or []:
        if not isinstance(row, dict) or row.get("target") is None:
            continue
        name = str(row.get("name", ""))
        key = f"region_{name[:3].lower()}_{int(row.get('nbytes', 0)) // MiB}mib"
        out[f"{key}_ratio"] = row.get("ratio")
        out[f"{key}_gbps"] = row.get("region_gbps")
        out[f"{key}_raw_pinned_gbps"] = row.get("raw_gbps")
    for g in _get(phases, "tensor_ops", "gemm") or []:
        if not isinstance(g, dict) or "n" not in g:
            continue
        key = f"gemm_{g['n']}"
        out[f"{key}_ratio"] = g.get("ratio")
        out[f"{key}_wasm_us"] = g.get("wasm_us")
        out[f"{key}_cublas_us"] = g.get("cublas_us")
        out[f"{key}_wasm_tflops"] = g.get("wasm_tflops")
        out[f"{key}_cublas_tflops"] = g.get("cublas_tflops")
        out[f"{key}_error"] = g.get("error")
        if g.get("cublas_version") is not None:
            out["cublas_version"] = g["cublas_version"]
    return out


def summarize(phases: dict[str, Any], smi: dict[str, Any], rows: list[dict[str, Any]], started: float,
              not_run: list[str], *, fake: bool, quick: bool, complete: bool) -> dict[str, Any]:
    """check_gpu.py's JSON document: when, what device, the verdict so far, every phase's results, the
    rows (``kind`` "check" decides ``ok``), the figures; ``complete`` False while phases are still to come."""
    failed = [r for r in rows if r.get("kind") == "check" and r.get("ok") is False]
    figs = figures(phases, smi)
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(started)),
        "device": figs["device_name"],
        "driver_version": figs["driver_version"],
        "cuda_driver_version": figs["cuda_driver_version"],
        "fake": fake,
        "quick": quick,
        "seconds": round(time.time() - started, 1),
        "complete": complete,
        "not_run": not_run,
        "ok": not failed and not not_run,
        "figures": figs,
        "phases": phases,
        "rows": rows,
    }


def write_json(path: Path, summary: dict[str, Any]) -> None:
    """Write ``summary`` to ``path`` atomically (a reader never sees half a document)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(summary, indent=1, default=str) + "\n", encoding="utf-8")
    tmp.replace(path)
