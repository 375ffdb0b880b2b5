"""The hardware check of the cuda backend (run by tests/gpu/check.sh; see docs/GPU-QUOTAS.md).

    python3 tests/gpu/check_gpu.py [--quick] [--mps] [--only PHASE,...] [--json-out FILE]
    python3 tests/gpu/check_gpu.py --dry-run-fake --quick     # tests this script on the fake driver (CI)

The orchestrator (this process) never initialises CUDA: every step that
touches the driver runs in a fresh child process (``check_children.py``), and
the tenant steps go through a real supervisor started with ``launch()``.

Phases, in order (``PHASES``); each returns rows of the final table:

    environment versions; NVRTC and cuBLAS of the driver's CUDA major, else the check stops (one line)
    pool        maxSize 64 MiB refuses 128 MiB, exactly 8 steps of 8 MiB, odd-size steps with
                USED/RESERVED_MEM_CURRENT; RELEASE_THRESHOLD caps nothing
    metering    a metered refusal makes no CUDA call; a driver OOM after the meter said yes is rolled back
    isolation   tenant A writes a nonce and reports its device address; tenant B allocates first, then
                reads that address (a copy in one process, a kernel in another): an error or B's own
                bytes, never A's; A's context is unharmed
    residual    A fills memory with a mark and frees+trims it (or is killed); B's fresh memory never has it
    tenants     two tenants under a supervisor: over-cap refusal, neighbour unaffected; crash reclaim =
                free device memory before A registered vs after A's SIGKILL (within a tolerance)
    fault       a kernel fault (sticky error) in one tenant: its request gets CudaError, the worker exits,
                the supervisor restarts it ("CUDA context lost: ..."), the other tenant never notices
    kernels     fill / axpy / sum equal to numpy within float32 tolerance
    pytest      python3 -m pytest -m gpu tests/gpu
    timing      context + stream + pool ready per worker (ms), per-context device memory,
                metered alloc+free against raw cuMemAllocFromPoolAsync + cuMemFreeAsync (<= 1.10x)
    regions     H2D / D2H through a cuMemHostRegister'ed shared-memory region, in pipeline chunks,
                against raw cuMemcpy*Async from cuMemAllocHost memory (>= 0.8x; bytes intact: a check)
    wasm        a tensor op through the WASM host against numpy
    share       GPU-time shares between contexts: 7:3, a cap, the scheduler's overhead (phase_share.py)
    mix         tenants that differ: heavy beside chatty, k instances, the holder SIGKILLed mid-chunk
                (lease reclaimed, charges kept), the longest hold, a spin kernel against its charge (phase_mix.py)
    wasm_share  7:3 and heavy beside chatty through a supervisor and the WASM host (phase_wasm_share.py)
    foreign     a process not on the board running GEMMs during a 1:1 split (phase_foreign.py)
    sync_cpu    the CPU time of a worker blocked in a synchronize (phase_sync_cpu.py)
    settle      queued cuda ops settled once per flush against a synchronise per chunk (phase_settle.py)
    budget_burst  8 workers started at once: the device budget against cuMemGetInfo (phase_budget_burst.py)
    residual_full the residual-data probe with the reader taking 90 % of free memory (phase_residual_full.py)
    overrun     a run past its deadline with device work queued, timed; a light tenant beside it (phase_overrun.py)
    mps         (--mps only) a private MPS daemon, one MPS tenant, the daemon stopped whatever happens

Rows are *checks* (they decide the exit code: 0 when none FAILed) or
*timings* (printed with their target, PASS/MISS, never deciding it). The
table is printed last; ``--json-out FILE`` also writes every phase's raw
figures and the rows as JSON, for docs/GPU-QUOTAS.md.

Adding a phase: write ``def phase_NAME(ctx: Context) -> list[Row]`` (run
CUDA work through ``run_child``; add the child step to
``check_children.CHILDREN``), return ``check(...)`` / ``timing(...)`` rows,
and append ``Phase("NAME", phase_NAME)`` to ``PHASES`` where it belongs.
"""

from __future__ import annotations

import os
import sys


def _child_argv(argv: list[str]) -> tuple[str, list[str]] | None:
    """``--child NAME ARGS...`` as every launcher writes it (no option among ARGS): (NAME, ARGS), else None.

    A child step needs ``check_children`` only: the orchestrator's own imports (argparse, the
    records, the figures, subprocess ...) cost a child ~60 ms of CPU for nothing, and a dry run
    starts some twenty children (more through the phase scripts). Anything else - options beside
    ``--child``, ``--child`` without a name - goes through :func:`main`'s parser as before.
    """
    if len(argv) < 2 or argv[0] != "--child" or argv[1].startswith("-"):
        return None
    if any(a.startswith("--") for a in argv[2:]):
        return None
    return argv[1], argv[2:]


if __name__ == "__main__" and (_step := _child_argv(sys.argv[1:])) is not None:
    _root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if _root not in sys.path:
        sys.path.insert(0, _root)
    from tests.gpu.check_children import run as _run_step

    sys.exit(_run_step(*_step))

import argparse  # noqa: E402 - after the child steps' early exit above
import json  # noqa: E402
import math  # noqa: E402
import select  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from dataclasses import asdict, dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402
from collections.abc import Callable  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from shared.exitcodes import STICKY_CUDA_ERRORS  # noqa: E402
from shared.records import StatusRecord, TenantRecord  # noqa: E402
from tests.gpu import check_children  # noqa: E402
from tests.gpu.check_children import Counting as _Counting  # noqa: E402,F401 - tests/gpu/test_gpu.py uses it
from tests.gpu.figures import nvidia_smi, summarize, write_json  # noqa: E402

MiB = 1 << 20
FAKE = "tests.helpers.fake_cuda"
RECLAIM_TOLERANCE = 16 * MiB  # free memory after a SIGKILL vs before registering: driver bookkeeping only
#: no phase starts later than this after the check began: the device call (GPU.md) runs the check under
#: `timeout 400`, and a phase started just before it may take GRACE_S more
DEFAULT_DEADLINE_S = 320.0


@dataclass
class Row:
    """One line of the final table."""

    phase: str
    name: str
    got: str
    want: str
    ok: bool | None  # None: not run / informational
    kind: str = "check"  # "check" decides the exit code, "timing" never does

    @property
    def mark(self) -> str:
        if self.kind == "timing":
            return "----" if self.ok is None else ("PASS" if self.ok else "MISS")
        return "----" if self.ok is None else ("ok  " if self.ok else "FAIL")


@dataclass
class Context:
    """What phases share: options, and every phase's raw results (they go into the JSON)."""

    quick: bool
    fake: bool
    iterations: int
    results: dict[str, dict[str, Any]] = field(default_factory=dict)
    smi: dict[str, Any] = field(default_factory=dict)  # nvidia-smi's view of the GPUs (figures.nvidia_smi)
    #: set by a phase when nothing after it can mean anything (NVRTC/cuBLAS of another CUDA major): one line
    abort: str | None = None


@dataclass(frozen=True)
class Phase:
    name: str
    run: Callable[[Context], list[Row]]


# ------------------------------------------------------------------------------ helpers


def _env() -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path}


#: when the whole check must be done (time.monotonic()); every child's timeout is cut to it
_deadline: float = float("inf")
#: a phase started before the deadline may run this much past it; no step gets less than MIN_STEP_S
GRACE_S = 30.0
MIN_STEP_S = 20.0


def budget(cap_s: float) -> float:
    """A step's timeout: ``cap_s``, cut to the check's deadline + GRACE_S (but at least MIN_STEP_S)."""
    return max(MIN_STEP_S, min(cap_s, _deadline + GRACE_S - time.monotonic()))


def run_child(name: str, *args: str, timeout_s: float = 120) -> dict[str, Any]:
    """Run ``check_children.CHILDREN[name]`` in a fresh process; its last JSON line, or {"error"}.

    A child that hangs (a driver call that never returns) is killed after its
    timeout (cut to the check's deadline) and reported as an error: the
    phase still gives its rows and the check goes on.
    """
    limit = budget(timeout_s)
    try:
        proc = subprocess.run([sys.executable, __file__, "--child", name, *args], capture_output=True, text=True,
                              timeout=limit, env=_env(), cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"error": f"child {name} did not finish within {limit:.0f} s (killed)"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-6:]
        return {"error": f"child {name} exit {proc.returncode}: " + " | ".join(tail)}
    result: dict[str, Any] = json.loads(lines[-1])
    return result


class Held:
    """A child that prints a JSON line, then waits until ``release()`` (isolation writer, holder)."""

    def __init__(self, name: str, *args: str, timeout_s: float = 120, argv: list[str] | None = None) -> None:
        """Start the child; wait (at most ``timeout_s``, cut to the deadline) for its first JSON line.

        ``argv`` replaces the command (tests). A child that prints nothing in
        time is killed and :class:`RuntimeError` says so: a hung driver call
        in the child must not hang the whole check.
        """
        cmd = argv or [sys.executable, __file__, "--child", name, *args]
        # unbuffered bytes: a line read leaves nothing read ahead in a Python buffer, where select()
        # would not see it and communicate() (raw reads) would lose it
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     bufsize=0, env=_env(), cwd=ROOT)
        limit = budget(timeout_s)
        line, timed_out = self._json_line(limit)
        self.first: dict[str, Any] = json.loads(line) if line else {}
        if not self.first:
            if timed_out:
                self.proc.kill()
            self.release(timeout_s=10)
            why = f"printed no JSON line within {limit:.0f} s (killed)" if timed_out else "ended without a JSON line"
            raise RuntimeError(f"child {name} did not start: {why} {self.stderr_tail}")

    stderr_tail = ""

    def step(self, timeout_s: float = 120) -> dict[str, Any]:
        """Say "go" and wait (at most ``timeout_s``, cut to the deadline) for the child's next JSON line."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            self.proc.stdin.write(b"go\n")
        except BrokenPipeError:
            return {"error": "the child has ended"}
        limit = budget(timeout_s)
        line, timed_out = self._json_line(limit)
        if not line:
            return {"error": f"no answer within {limit:.0f} s" if timed_out else "the child ended without answering"}
        result: dict[str, Any] = json.loads(line)
        return result

    def _json_line(self, limit_s: float) -> tuple[str, bool]:
        """The child's next line that is JSON (other output - a library's notice - is skipped), and
        whether ``limit_s`` ran out first ("" at EOF or timeout)."""
        assert self.proc.stdout is not None
        deadline = time.monotonic() + limit_s
        while True:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([self.proc.stdout], [], [], max(0.0, left))
            if not ready:
                return "", True
            line = self.proc.stdout.readline().decode(errors="replace")  # unbuffered: byte by byte
            if not line:
                return "", False
            if line.startswith("{"):
                return line, False

    def release(self, timeout_s: float = 120) -> dict[str, Any]:
        try:
            raw_out, raw_err = self.proc.communicate(b"go\n", timeout=budget(timeout_s))
        except (subprocess.TimeoutExpired, BrokenPipeError):
            self.proc.kill()
            raw_out, raw_err = self.proc.communicate()
        out, err = raw_out.decode(errors="replace"), raw_err.decode(errors="replace")
        lines = [ln for ln in out.splitlines() if ln.startswith("{")]
        self.stderr_tail = " | ".join(err.strip().splitlines()[-4:])
        if self.proc.returncode or not lines:
            return {"error": f"exit {self.proc.returncode}: {self.stderr_tail}"}
        result: dict[str, Any] = json.loads(lines[-1])
        return result


def check(phase: str, name: str, got: Any, want: str, ok: bool | None) -> Row:
    return Row(phase, name, str(got), want, ok, "check")


def timing(phase: str, name: str, got: Any, want: str, ok: bool | None) -> Row:
    return Row(phase, name, str(got), want, ok, "timing")


def _f(value: Any, digits: int = 1) -> str:
    return f"{value:.{digits}f}" if isinstance(value, (int, float)) and not isinstance(value, bool) else str(value)


def _wait(what: str, cond: Callable[[], bool], timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return False


def _supervisor(extra: dict[str, Any] | None = None) -> Any:
    from supervisor.client.launch import launch

    # a liveness window of 20 s, as the child phases' (phase_kit.supervisor): these phases check isolation,
    # reclaim and a fault's restart, not how fast a silent worker is seen, and a worker starved for a few
    # seconds on a loaded one-core host (a dry run in the suite) was killed as hung mid-phase
    settings = {"backend": "cuda", "pool_size": 0, "heartbeat_interval_s": 0.5, "heartbeat_liveness": 40,
                **(extra or {})}
    return launch({"supervisor": settings})


def _tenant(status: StatusRecord, tid: str) -> TenantRecord:
    return next(t for t in status.tenants if t.tenant_id == tid)


# ------------------------------------------------------------------------------ phases


def phase_environment(ctx: Context) -> list[Row]:
    """What this run is made of (informational rows; a mismatch shows here by name first)."""
    r = ctx.results["environment"] = run_child("environment")
    ctx.results["environment"]["nvidia_smi"] = ctx.smi
    pk = r.get("packages", {})
    versions = ", ".join(f"{k} {v}" for k, v in pk.items() if k.startswith(("cuda", "nvmath", "nvidia")))
    gpus = ctx.smi.get("gpus") or [{}]
    return [
        check("environment", "device (nvidia-smi)", f"{gpus[0].get('name')}, driver {gpus[0].get('driver_version')}"
              if "gpus" in ctx.smi else ctx.smi.get("error"), "reported", None),
        check("environment", "CUDA driver / NVRTC / cuBLAS major", f"{r.get('cuda_driver_version', r.get('error'))} / "
              f"{r.get('nvrtc_version')} / {r.get('cublas_major')}" + (f" - {r['mismatch']}" if r.get("mismatch") else ""),
              "one CUDA major (12 or 13)", _environment_ok(ctx, r)),
        check("environment", "packages", versions or r.get("error"), "reported", None),
        check("environment", "cuBLAS bindings", r.get("cublas_bindings", r.get("error")), "import", None),
    ]


def _environment_ok(ctx: Context, r: dict[str, Any]) -> bool:
    """NVRTC and cuBLAS of the driver's CUDA major, else the whole check stops here (one line)."""
    if "error" in r:
        ctx.abort = f"environment: {r['error']}"
    elif r.get("mismatch"):
        ctx.abort = f"environment: {r['mismatch']}"
    return ctx.abort is None


def phase_pool(ctx: Context) -> list[Row]:
    r = ctx.results["pool"] = run_child("pool")
    steps = r.get("cap64_steps_of_8mib")
    odd = r.get("odd_alloc_bytes")
    readback = r.get("cap64_max_pool_size_readback")
    want_steps = readback // (8 * MiB) if isinstance(readback, int) and readback >= 64 * MiB else 8
    return [
        check("pool", "maxSize 64 MiB, alloc 128 MiB", r.get("cap64_alloc128", r.get("error")),
              "CUDA_ERROR_OUT_OF_MEMORY", r.get("cap64_alloc128") == "CUDA_ERROR_OUT_OF_MEMORY"),
        # exactly 8: 8 MiB is a whole number of granules, so an earlier refusal is the pool's own
        # overhead or rounding - reported as a failure, not passed over
        check("pool", "maxSize 64 MiB, 8 MiB steps", f"{steps} then {r.get('cap64_step_error')} (MAX_POOL_SIZE "
              f"reads {r.get('cap64_max_pool_size_readback')} B)", f"{want_steps}, then OOM",
              steps == want_steps and r.get("cap64_step_error") == "CUDA_ERROR_OUT_OF_MEMORY"),
        check("pool", f"maxSize 64 MiB, {odd} B steps",
              f"{r.get('odd_steps', r.get('error'))} of {r.get('odd_metered_allowance')} metered, then "
              f"{r.get('odd_step_error')}; USED {r.get('odd_used_mem_current')} B, "
              f"RESERVED {r.get('odd_reserved_mem_current')} B", "reported (pool rounding vs exact metering)", None),
        check("pool", "RELEASE_THRESHOLD 64 MiB only, alloc 128+256",
              f"{r.get('threshold64_alloc128')}, {r.get('threshold64_alloc256_more')}", "both succeed (not a cap)",
              r.get("threshold64_alloc128") == r.get("threshold64_alloc256_more") == "CUDA_SUCCESS"),
    ]


def phase_metering(ctx: Context) -> list[Row]:
    r = ctx.results["metering"] = run_child("nocall")
    return [
        check("metering", "metered refusal: CUDA calls made", r.get("cuda_calls_during_refusal", r.get("error")),
              "0", r.get("refused") is True and r.get("cuda_calls_during_refusal") == 0),
        check("metering", "driver OOM after consume: rolled back",
              f"{r.get('driver_refused')}, {r.get('gpu_bytes_after_driver_oom')} B", "True, 48 MiB left",
              r.get("driver_refused") is True and r.get("gpu_bytes_after_driver_oom") == 48 * MiB),
    ]


def phase_isolation(ctx: Context) -> list[Row]:
    out: dict[str, Any] = {}
    ctx.results["isolation"] = out
    try:
        writer = Held("isolation_writer", str(int(time.time())))
    except RuntimeError as exc:
        out["error"] = str(exc)
        return [check("isolation", "B reads A's device address", str(exc), "an error, never A's bytes", False)]
    out["writer"] = writer.first
    probe = (str(writer.first["addr"]), str(writer.first["nbytes"]), repr(writer.first["nonce_sum"]))
    try:
        # B allocates first in each (likely at A's very address), then probes; copy and kernel in
        # separate processes, so that a sticky error from one cannot hide what the other does
        out["reader"] = run_child("isolation_reader", *probe, "copy")
        out["reader_kernel"] = run_child("isolation_reader", *probe, "kernel")
    finally:
        out["writer_after"] = writer.release()
    rd, rk, wa = out["reader"], out["reader_kernel"], out["writer_after"]
    return [
        check("isolation", "B's own buffer (allocated first)", f"at A's address: {rd.get('own_addr_is_a_addr')}, "
              f"reads back: {rd.get('own_reads_back', rd.get('error'))}", "reads back B's bytes",
              rd.get("own_reads_back") is True and rk.get("own_reads_back") is True),
        check("isolation", "B copies from A's address", f"{rd.get('copy', rd.get('error'))}, saw {rd.get('copy_saw')}",
              "an error or B's own bytes, never A's", "error" not in rd and rd.get("copy_got_a_bytes") is False),
        check("isolation", "B's kernel reads A's address", f"{rk.get('kernel', rk.get('error'))}, saw "
              f"{rk.get('kernel_saw')}", "never A's bytes (on hardware: a sticky error in B, or B's own bytes)",
              "error" not in rk and rk.get("kernel_got_a_bytes") is False),
        check("isolation", "A after B's attempts", f"nonce intact {wa.get('nonce_intact')}, "
              f"context works {wa.get('context_works', wa.get('error'))}", "True, True",
              wa.get("nonce_intact") is True and wa.get("context_works") is True),
    ]


def phase_residual(ctx: Context) -> list[Row]:
    """A fills memory with a mark and gives it back (freed and trimmed, or SIGKILLed holding it); B then
    allocates without writing and reads: the driver must scrub what another process had."""
    mib = 16 if ctx.quick or ctx.fake else 64
    out: dict[str, Any] = {}
    ctx.results["residual"] = out
    rows: list[Row] = []
    for how in ("free_trim", "kill"):
        try:
            writer = Held("residual_writer", str(mib))
        except RuntimeError as exc:
            out[how] = {"error": str(exc)}
            rows.append(check("residual", f"after A's {how}", str(exc), "no A bytes", False))
            continue
        if how == "free_trim":
            out["writer_freed"] = writer.step()
            out[how] = run_child("residual_reader", str(4 * mib))
            writer.release()
        else:
            writer.proc.kill()
            writer.release(timeout_s=10)
            out[how] = run_child("residual_reader", str(4 * mib))
        r = out[how]
        rows.append(check("residual", f"B reads fresh memory after A's {how.replace('_', '+')}",
                          f"{r.get('mark_floats_found', r.get('error'))} of A's marks in {r.get('mib')} MiB "
                          f"({r.get('nonzero_floats')} non-zero floats)", "0 (never A's bytes)",
                          "error" not in r and r.get("mark_floats_found") == 0))
    return rows


def phase_tenants(ctx: Context) -> list[Row]:
    from shared.errors import GpuMemoryExhausted
    from shared.spec import TenantSpec

    out: dict[str, Any] = {}
    ctx.results["tenants"] = out
    with _supervisor({"device_reserve_bytes": "1GiB"}) as sup:
        c = sup.client
        out["backend_reason"] = c.status().supervisor.backend_reason
        b = c.register(None, TenantSpec("beta", gpu_memory_bytes_cap=256 * MiB))
        hb = c.alloc(b, 64 * MiB)
        c.write(b, hb, b"beta unaffected", offset=1000)
        before = run_child("meminfo")  # free device memory before A registered
        a = c.register(None, TenantSpec("alpha", gpu_memory_bytes_cap=256 * MiB, restart="never"))
        c.alloc(a, 192 * MiB)
        try:
            c.alloc(a, 128 * MiB)
            out["alpha_over_cap_refused"] = False
        except GpuMemoryExhausted:
            out["alpha_over_cap_refused"] = True
        out["beta_unaffected"] = c.read(b, hb, 15, offset=1000) == b"beta unaffected"
        during = run_child("meminfo")
        pid = _tenant(c.status(), "alpha").instances[0].pid
        os.kill(pid, signal.SIGKILL)
        out["alpha_counter_zeroed"] = _wait("zeroed", lambda: _tenant(c.status(), "alpha").gpu_bytes_in_use == 0)
        after: dict[str, Any] = {}

        def reclaimed() -> bool:
            after.update(run_child("meminfo"))
            return "error" in after or "error" in before or after["free"] >= before["free"] - RECLAIM_TOLERANCE

        _wait("reclaimed", reclaimed, timeout_s=20)
        out["beta_after_kill"] = c.read(b, hb, 15, offset=1000) == b"beta unaffected"
        if "error" in before or "error" in after:
            out["memory_error"] = before.get("error") or after.get("error")
        else:
            out["free_before_mib"] = before["free"] / MiB
            out["free_with_alpha_mib"] = during.get("free", 0) / MiB
            out["free_after_kill_mib"] = after["free"] / MiB
            out["reclaim_delta_mib"] = (after["free"] - before["free"]) / MiB
    delta = out.get("reclaim_delta_mib")
    return [
        check("tenants", "A over its cap / B unaffected", f"{out.get('alpha_over_cap_refused')} / "
              f"{out.get('beta_unaffected')}", "True / True",
              out.get("alpha_over_cap_refused") is True and out.get("beta_unaffected") is True),
        check("tenants", "SIGKILL A: counters zeroed, B unaffected", f"{out.get('alpha_counter_zeroed')}, "
              f"{out.get('beta_after_kill')}", "True, True",
              out.get("alpha_counter_zeroed") is True and out.get("beta_after_kill") is True),
        check("tenants", "crash reclaim: free after kill - before A", f"{_f(delta, 2)} MiB" if delta is not None
              else out.get("memory_error"), f"|delta| <= {RECLAIM_TOLERANCE // MiB} MiB",
              delta is not None and abs(delta) <= RECLAIM_TOLERANCE / MiB),
    ]


def phase_fault(ctx: Context) -> list[Row]:
    from shared.errors import CudaError, TensorWasmError
    from shared.spec import TenantSpec

    out: dict[str, Any] = {}
    ctx.results["fault"] = out
    with _supervisor() as sup:
        c = sup.client
        calm = c.register(None, TenantSpec("calm", gpu_memory_bytes_cap=64 * MiB))
        faulty = c.register(None, TenantSpec("faulty", gpu_memory_bytes_cap=64 * MiB, restart="on-failure"))
        hc = c.alloc(calm, MiB)
        c.write(calm, hc, b"calm", offset=0)
        calm_pid = _tenant(c.status(), "calm").instances[0].pid
        old_pid = _tenant(c.status(), "faulty").instances[0].pid
        c.inject_fault(None, "faulty", "cuda-fault")
        try:
            c.alloc(faulty, MiB)
            out["faulty_request"] = "succeeded"
        except CudaError as exc:
            out["faulty_request"] = exc.result_name
        except TensorWasmError as exc:
            out["faulty_request"] = f"{type(exc).__name__}: {exc}"

        def restarted() -> bool:
            inst = _tenant(c.status(), "faulty").instances[0]
            return inst.pid not in (None, old_pid) and inst.state == "ready"

        out["restarted"] = _wait("restart", restarted, timeout_s=30)
        inst = _tenant(c.status(), "faulty").instances[0]
        out["last_exit"] = inst.last_exit.to_wire() if inst.last_exit else None
        out["restarts"] = inst.restarts
        try:
            h = c.alloc(faulty, MiB)
            c.write(faulty, h, b"again", offset=0)
            out["faulty_works_again"] = c.read(faulty, h, 5) == b"again"
        except TensorWasmError as exc:
            out["faulty_works_again"] = f"{type(exc).__name__}: {exc}"
        out["calm_same_pid"] = _tenant(c.status(), "calm").instances[0].pid == calm_pid
        out["calm_data"] = c.read(calm, hc, 4) == b"calm"
    reason = (out.get("last_exit") or {}).get("reason")
    error = out.get("faulty_request")
    return [
        check("fault", "faulting request's answer", error, "CudaError, a sticky error (ILLEGAL_ADDRESS)",
              error in STICKY_CUDA_ERRORS),
        check("fault", "worker exit reason, restarted, works", f"{reason!r}, {out.get('restarted')}, "
              f"{out.get('faulty_works_again')}", "'CUDA context lost: <that error>', True, True",
              reason == f"CUDA context lost: {error}" and out.get("restarted") is True
              and out.get("faulty_works_again") is True),
        check("fault", "other tenant notices nothing", f"same pid {out.get('calm_same_pid')}, data "
              f"{out.get('calm_data')}", "True, True", out.get("calm_same_pid") is True and out.get("calm_data") is True),
    ]


def phase_kernels(ctx: Context) -> list[Row]:
    n = (1 << 20) + 3 if ctx.quick else 16 * MiB + 3
    r = ctx.results["kernels"] = run_child("kernels", str(n))
    return [check("kernels", f"fill / axpy / sum vs numpy ({n:,} floats)",
                  f"{r.get('fill_matches_numpy')} / {r.get('axpy_matches_numpy')} / {r.get('sum_matches_numpy')}"
                  if "error" not in r else r["error"], "True / True / True",
                  all(r.get(k) is True for k in ("fill_matches_numpy", "axpy_matches_numpy", "sum_matches_numpy")))]


def phase_pytest(ctx: Context) -> list[Row]:
    if ctx.fake:
        ctx.results["pytest"] = {"skipped": "fake driver: the gpu tests need a device"}
        return [check("pytest", "pytest -m gpu", "not run on the fake", "all passed", None)]
    limit = budget(240)
    try:
        proc = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider",
                               str(ROOT / "tests" / "gpu")], capture_output=True, text=True, timeout=limit,
                              cwd=ROOT, env=_env())
    except subprocess.TimeoutExpired as exc:
        tail = (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        ctx.results["pytest"] = {"error": f"timed out after {limit:.0f} s", "output_tail": tail.splitlines()[-15:]}
        return [check("pytest", "pytest -m gpu", f"timed out after {limit:.0f} s", "all passed", False)]
    last = (proc.stdout.strip().splitlines() or [""])[-1]
    ctx.results["pytest"] = {"rc": proc.returncode, "summary": last,
                             "output_tail": proc.stdout.strip().splitlines()[-15:] if proc.returncode else []}
    return [check("pytest", "pytest -m gpu", last, "all passed", proc.returncode == 0 and "skipped" not in last)]


def phase_timing(ctx: Context) -> list[Row]:
    out: dict[str, Any] = {}
    ctx.results["timing"] = out
    out["alloc"] = t = run_child("timing", str(ctx.iterations))
    before = run_child("meminfo")
    holder = Held("holder")
    try:
        during = run_child("meminfo")
        out["loaded"] = holder.step()  # + kernel modules, their scratch, a cuBLAS handle
        loaded = run_child("meminfo")
    finally:
        holder.release()
    out["ready_ms"] = holder.first.get("ready_ms")
    if "error" not in before and "error" not in during:
        out["per_context_mib"] = (before["free"] - during["free"]) / MiB
    if "error" not in before and "error" not in loaded:
        out["per_worker_loaded_mib"] = (before["free"] - loaded["free"]) / MiB
    ratio = t.get("metered_over_raw")
    return [
        timing("timing", "context+stream+pool ready per worker", f"{_f(out.get('ready_ms'))} ms "
               f"(cuInit {_f(t.get('cuinit_ms'))} ms)", "reported", None),
        timing("timing", "device memory per worker context", f"{_f(out.get('per_context_mib'))} MiB", "reported",
               None),
        timing("timing", "... with kernels + cuBLAS handle loaded", f"{_f(out.get('per_worker_loaded_mib'))} MiB"
               + (f" ({out['loaded']['error'][:80]})" if out.get("loaded", {}).get("error") else
                  f" (loaded in {_f(out.get('loaded', {}).get('kernels_load_ms'))} + "
                  f"{_f(out.get('loaded', {}).get('cublas_create_ms'))} ms)"), "reported", None),
        timing("timing", "alloc+free 1 MiB raw / backend / metered", f"{_f(t.get('raw_us'), 2)} / "
               f"{_f(t.get('backend_us'), 2)} / {_f(t.get('metered_us'), 2)} us", "reported", None),
        timing("timing", "metered / raw alloc+free", f"{_f(ratio, 3)}x" if ratio else t.get("error"), "<= 1.10x",
               None if ratio is None else ratio <= 1.10),
    ]


def phase_wasm(ctx: Context) -> list[Row]:
    import importlib.util

    guest = ROOT / "worker" / "guests" / "axpy_sum.wat"
    if importlib.util.find_spec("wasmtime") is None or not guest.exists():
        ctx.results["wasm"] = {"skipped": "wasmtime or worker/guests/axpy_sum.wat missing"}
        return [check("wasm", "WASM axpy+sum vs numpy", "skipped", "matches numpy", None)]
    import numpy as np

    from shared.spec import TenantSpec

    n = 1 << 20
    xs = np.arange(n, dtype=np.float32) / n
    ys = np.ones(n, dtype=np.float32)
    with _supervisor() as sup:
        c = sup.client
        cap = c.register(None, TenantSpec("wasm", gpu_memory_bytes_cap=64 * MiB))
        hx, hy = c.alloc(cap, 4 * n), c.alloc(cap, 4 * n)
        c.write(cap, hx, xs.tobytes())
        digest = c.put_module(cap, guest.read_bytes())
        times, result = [], {}
        for _ in range(3 if ctx.quick else 5):
            c.write(cap, hy, ys.tobytes())
            t0 = time.perf_counter()
            result = c.run_wasm(cap, digest, "run", [{"handle": hx}, {"handle": hy}, n, 0.5])
            times.append((time.perf_counter() - t0) * 1000)
    want = float(np.sum(ys + np.float32(0.5) * xs, dtype=np.float64))
    got = float(result.results[0])
    r = ctx.results["wasm"] = {"axpy_sum_1m_ms": statistics.median(times), "got": got, "want": want,
                               "matches_numpy": abs(got - want) <= 1e-5 * abs(want)}
    return [check("wasm", "WASM axpy+sum 1M floats vs numpy", f"{_f(r['axpy_sum_1m_ms'])} ms, {r['matches_numpy']}",
                  "matches numpy", r["matches_numpy"])]


def phase_tensor_ops(ctx: Context) -> list[Row]:
    """The WASM ABI's tensor ops on the cuda backend (tests/gpu/phase_tensor_ops.py, in a child).

    Every op and the MLP guest equal to numpy decide the exit code; GEMM through
    the WASM host against cuBLAS called directly is a timing row (target >= 0.8x).
    """
    from tests.gpu.phase_tensor_ops import run_in_child, table_rows

    result = ctx.results["tensor_ops"] = run_in_child(quick=ctx.quick, timeout_s=budget(150))
    rows: list[Row] = []
    for name, got, want, ok in table_rows(result):
        if name.startswith("GEMM"):
            verdict = got.split(" ", 1)[0]
            rows.append(timing("tensor_ops", name, got, want, None if verdict not in ("PASS", "MISS")
                               else verdict == "PASS"))
        else:
            rows.append(check("tensor_ops", name, got, want, ok))
    return rows


def phase_regions(ctx: Context) -> list[Row]:
    """Bulk copies through shared-memory regions (tests/gpu/phase_regions.py, in a child).

    H2D and D2H from a region registered with cuMemHostRegister, in the chunks
    the client pipeline sends, against raw cuMemcpy*Async from cuMemAllocHost
    memory of the same size: timing rows (target >= 0.8x); that the bytes come
    back intact is a check.
    """
    from tests.gpu.phase_regions import run_in_child, table_rows

    result = ctx.results["regions"] = run_in_child(quick=ctx.quick, timeout_s=budget(120))
    return [(check if kind == "check" else timing)("regions", name, got, want, ok)
            for name, got, want, ok, kind in table_rows(result)]


def phase_share(ctx: Context) -> list[Row]:
    """GPU-time shares between processes' contexts (tests/gpu/phase_share.py, in a child): 7:3, a cap,
    the scheduler's overhead with cuBLAS GEMMs. Correct GEMMs decide the exit code; shares are timings."""
    from tests.gpu.phase_share import run_in_child, table_rows

    result = ctx.results["share"] = run_in_child(quick=ctx.quick, timeout_s=budget(200))
    return [(check if kind == "check" else timing)("share", name, got, want, ok)
            for name, got, want, ok, kind in table_rows(result)]


def phase_mix(ctx: Context) -> list[Row]:
    """GPU-time shares between tenants that differ (tests/gpu/phase_mix.py, in a child): heavy beside
    chatty, k instances, the holder killed mid-chunk, the longest hold, a spin kernel's charge."""
    from tests.gpu.phase_mix import run_in_child, table_rows

    result = ctx.results["mix"] = run_in_child(quick=ctx.quick, timeout_s=budget(200))
    return [(check if kind == "check" else timing)("mix", name, got, want, ok)
            for name, got, want, ok, kind in table_rows(result)]


def _child_phase(name: str, module: str, cap_s: float) -> Callable[[Context], list[Row]]:
    """A phase run by ``tests/gpu/<module>.py`` in a fresh process (its ``run_in_child``), turned into
    rows by its ``table_rows``: checks decide the exit code, timings are PASS/MISS against their bound."""
    def phase(ctx: Context) -> list[Row]:
        import importlib

        mod = importlib.import_module(f"tests.gpu.{module}")
        result = ctx.results[name] = mod.run_in_child(quick=ctx.quick, timeout_s=budget(cap_s))
        return [(check if kind == "check" else timing)(name, row_name, got, want, ok)
                for row_name, got, want, ok, kind in mod.table_rows(result)]

    phase.__doc__ = f"tests/gpu/{module}.py (see its docstring)"
    return phase


def phase_residual_full(ctx: Context) -> list[Row]:
    """The residual-data probe with the reader taking most of the device (tests/gpu/phase_residual_full.py)."""
    from tests.gpu.phase_residual_full import run, table_rows

    result = ctx.results["residual_full"] = run(quick=ctx.quick, fake=ctx.fake, timeout_s=budget(120))
    return [(check if kind == "check" else timing)("residual_full", name, got, want, ok)
            for name, got, want, ok, kind in table_rows(result)]


def phase_mps(ctx: Context) -> list[Row]:
    from shared.spec import TenantSpec
    from supervisor.client.launch import launch

    pipe = tempfile.mkdtemp(prefix="twt-mps-pipe-", dir="/tmp")
    logs = tempfile.mkdtemp(prefix="twt-mps-log-", dir="/tmp")
    env = {**_env(), "CUDA_MPS_PIPE_DIRECTORY": pipe, "CUDA_MPS_LOG_DIRECTORY": logs}
    out: dict[str, Any] = {"pipe_dir": pipe, "log_dir": logs}
    ctx.results["mps"] = out
    try:
        if shutil.which("nvidia-cuda-mps-control") is None:
            out["skipped"] = "nvidia-cuda-mps-control is not on PATH (no MPS on this host)"
            return [check("mps", "MPS tenant (private daemon)", out["skipped"], "True", None)]
        started = subprocess.run(["nvidia-cuda-mps-control", "-d"], env=env, capture_output=True, text=True,
                                 timeout=30)
        if started.returncode:
            # optional: a host (or container) that may not run a daemon is reported, not failed
            out["skipped"] = f"nvidia-cuda-mps-control -d failed: {(started.stderr or started.stdout).strip()[:200]}"
            return [check("mps", "MPS tenant (private daemon)", out["skipped"], "True", None)]
        try:
            time.sleep(1.0)
            with launch({"supervisor": {"backend": "cuda", "pool_size": 0}}, env=env) as sup:
                c = sup.client
                cap = c.register(None, TenantSpec("mps", isolation="mps", gpu_memory_bytes_cap=256 * MiB,
                                                  sm_percentage=50))
                h = c.alloc(cap, 128 * MiB)
                c.write(cap, h, b"mps", offset=0)
                out["mps_tenant_works"] = c.read(cap, h, 3) == b"mps"
                out["isolation"] = {t.tenant_id: t.isolation for t in c.status().tenants}
        finally:
            quit_ = subprocess.run(["bash", "-c", "echo quit | nvidia-cuda-mps-control"], env=env,
                                   capture_output=True, text=True, timeout=60)
            out["quit_rc"] = quit_.returncode
    finally:
        log = Path(logs) / "control.log"  # the daemon's own account, for the JSON; then the directories go
        if log.exists():
            out["control_log_tail"] = log.read_text(errors="replace").splitlines()[-20:]
        shutil.rmtree(logs, ignore_errors=True)
        if not (Path(pipe) / "control").exists():  # never under a daemon still running
            shutil.rmtree(pipe, ignore_errors=True)
    mode = (out.get("isolation") or {}).get("mps")
    return [check("mps", "MPS tenant (private daemon): works, isolation", f"{out.get('mps_tenant_works', out.get('error'))}"
                  f", {mode}", "True, mps", out.get("mps_tenant_works") is True and mode == "mps")]


#: in this order: what the docs need first; ``pytest -m gpu`` (a re-check, the longest) last, so a run
#: that meets its deadline loses the least
PHASES: list[Phase] = [
    Phase("environment", phase_environment),
    Phase("pool", phase_pool),
    Phase("metering", phase_metering),
    Phase("isolation", phase_isolation),
    Phase("residual", phase_residual),
    Phase("tenants", phase_tenants),
    Phase("fault", phase_fault),
    Phase("kernels", phase_kernels),
    Phase("tensor_ops", phase_tensor_ops),
    Phase("timing", phase_timing),
    Phase("regions", phase_regions),
    Phase("wasm", phase_wasm),
    Phase("share", phase_share),
    Phase("mix", phase_mix),
    Phase("wasm_share", _child_phase("wasm_share", "phase_wasm_share", 120)),
    Phase("foreign", _child_phase("foreign", "phase_foreign", 90)),
    Phase("sync_cpu", _child_phase("sync_cpu", "phase_sync_cpu", 60)),
    Phase("settle", _child_phase("settle", "phase_settle", 90)),
    Phase("budget_burst", _child_phase("budget_burst", "phase_budget_burst", 90)),
    Phase("residual_full", phase_residual_full),
    Phase("overrun", _child_phase("overrun", "phase_overrun", 90)),
    Phase("pytest", phase_pytest),
]
OPTIONAL_PHASES: dict[str, Phase] = {"mps": Phase("mps", phase_mps)}


# ------------------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("child_args", nargs="*", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="fewer iterations, smaller tensors")
    parser.add_argument("--iterations", type=int, default=None, help="alloc+free timing iterations (2000)")
    parser.add_argument("--mps", action="store_true", help="also run the MPS phase (starts a private daemon)")
    parser.add_argument("--only", default="", help="comma-separated phases to run (default: all)")
    parser.add_argument("--json-out", type=Path, help="also write the phases' figures and the rows as JSON here")
    parser.add_argument("--deadline-s", type=float, default=None,
                        help="phases not started by then are skipped (reported; exit 1): the whole check fits "
                        f"an outer time limit (default {DEFAULT_DEADLINE_S:g} s; none with --dry-run-fake)")
    parser.add_argument("--dry-run-fake", action="store_true",
                        help="run against the fake driver (tests this script; proves nothing about hardware)")
    args = parser.parse_args(argv)
    if args.dry_run_fake:
        from tests.helpers.fake_cuda import default_bindings_major

        # FAKE_CUDA_BINDINGS: the major every fake of the run speaks, as each would find it (the
        # installed cuda-bindings', unless already set), found once here: each process of the run
        # (children, phase scripts, their tenants, the supervisors' workers) otherwise imported
        # importlib.metadata to read the same version (~25 ms of CPU a process)
        os.environ.update(GPU_CHECK_DRIVER_MODULE=FAKE, GPU_CHECK_NVRTC_MODULE=FAKE,
                          TWT_CUDA_DRIVER_MODULE=FAKE, TWT_CUDA_NVRTC_MODULE=FAKE,
                          FAKE_CUDA_BINDINGS=str(default_bindings_major()))
        # the fake device computes with numpy in every process of the run (children, phase scripts,
        # their tenants' workers): one BLAS thread each, as the stub backend's workers have
        # (worker.backends.stub.one_blas_thread). OpenBLAS's own threads spin between calls: with
        # one per core in each of these short processes the run's CPU went to their waiting
        # (numpy's import plus a few small GEMMs: ~130 -> 85 ms of CPU a process). Set unless the
        # caller set them.
        for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ.setdefault(var, "1")
    if args.child:
        return check_children.run(args.child, args.child_args)

    phases = [*PHASES, *([OPTIONAL_PHASES["mps"]] if args.mps else [])]
    if args.only:
        wanted = {p.strip() for p in args.only.split(",") if p.strip()}
        known = {p.name for p in PHASES} | set(OPTIONAL_PHASES)
        if wanted - known:
            parser.error(f"unknown phase(s) {sorted(wanted - known)}; known: {sorted(known)}")
        phases = [p for p in [*PHASES, *OPTIONAL_PHASES.values()] if p.name in wanted]
    if args.deadline_s is None:
        # the default fits the device call's outer limit (hardware); a dry run's caller is a test, whose
        # own scaled timeout is its limit: on a loaded host the dry run's phases take several times
        # their quiet 35 s, and a phase skipped for a deadline meant for hardware failed the run
        args.deadline_s = math.inf if args.dry_run_fake else DEFAULT_DEADLINE_S
    global _deadline
    _deadline = time.monotonic() + args.deadline_s
    ctx = Context(quick=args.quick, fake=args.dry_run_fake,
                  iterations=args.iterations or (300 if args.quick else 2000),
                  smi={"error": "fake driver: nvidia-smi not asked"} if args.dry_run_fake else nvidia_smi())
    started = time.time()
    rows: list[Row] = []
    not_run: list[str] = []
    summary: dict[str, Any] = {}
    for phase in phases:
        if ctx.abort is not None:
            not_run.append(phase.name)
            ctx.results[phase.name] = {"skipped": f"not run: {ctx.abort}"}
            rows.append(check(phase.name, f"{phase.name} phase", "not run (the environment is wrong)", "runs", None))
        elif time.monotonic() >= _deadline:
            not_run.append(phase.name)
            ctx.results[phase.name] = {"skipped": f"not run: the check's deadline ({args.deadline_s:g} s) passed"}
            rows.append(check(phase.name, f"{phase.name} phase", "not run (deadline passed)", "runs", None))
        else:
            t0 = time.perf_counter()
            try:
                new = phase.run(ctx)
            except Exception as exc:  # noqa: BLE001 - a failed phase is a FAIL row; the others still run
                ctx.results.setdefault(phase.name, {})["error"] = f"{type(exc).__name__}: {exc}"
                new = [check(phase.name, f"{phase.name} phase", f"{type(exc).__name__}: {exc}", "runs", False)]
            seconds = round(time.perf_counter() - t0, 1)
            ctx.results.setdefault(phase.name, {})["seconds"] = seconds
            rows.extend(new)
            for row in new:
                print(f"[{phase.name} {seconds:>5.1f}s] {row.mark} {row.name}: {row.got}  (want {row.want})",
                      flush=True)
        summary = summarize(ctx.results, ctx.smi, [{**asdict(r), "mark": r.mark.strip()} for r in rows], started,
                            not_run, fake=ctx.fake, quick=ctx.quick, complete=phase is phases[-1])
        if args.json_out:  # after every phase: a run cut short by an outer timeout keeps what it measured
            write_json(args.json_out, summary)
    if not phases:
        summary = summarize(ctx.results, ctx.smi, [], started, not_run, fake=ctx.fake, quick=ctx.quick, complete=True)
    failed = [r for r in rows if r.kind == "check" and r.ok is False]
    print()
    print(f"GPU check - {summary['device']} - driver {summary['driver_version']} (CUDA "
          f"{summary['cuda_driver_version']}) - {summary['date']} - {summary['seconds']} s"
          + (" - FAKE DRIVER (proves nothing about hardware)" if ctx.fake else ""))
    width = max((len(r.name) for r in rows), default=10)
    for r in rows:
        print(f"{r.mark} {r.phase:<9} {r.name:<{width}}  {r.got}   (want {r.want})")
    if ctx.abort is not None:
        print(f"check_gpu: {ctx.abort}", file=sys.stderr)  # the one line that says what to fix
    verdict = "FAILED" if failed else ("INCOMPLETE" if not_run else "PASSED")
    print(f"{verdict}: {len(failed)} failed check(s)" + (f", {len(not_run)} phase(s) not run (deadline): "
                                                         f"{', '.join(not_run)}" if not_run else "")
          + "; timings never decide the exit code")
    return 0 if not failed and not not_run else 1


if __name__ == "__main__":
    sys.exit(main())
