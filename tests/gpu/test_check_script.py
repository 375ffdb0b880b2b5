"""The hardware check script itself, run on the fake driver (``--dry-run-fake --quick``).

This proves the script works - every phase runs, the table and the JSON come
out, timings never decide the exit code - so the few minutes of a real GPU
are not spent on a broken script. It proves nothing about hardware.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.gpu.check_gpu import PHASES, Row
from tests.helpers import gpu_dry_run, timeouts, zygote

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], Path]:
    """The run's one ``--dry-run-fake --quick`` run of the whole check (about 30 s), which two tests
    here, the share phase's test and the bindings replay read (tests/helpers/gpu_dry_run.py)."""
    run = gpu_dry_run.dry_run(tmp_path_factory)
    return run.proc, run.json_out


def test_dry_run_on_the_fake_passes_every_phase_and_writes_the_json(
        dry_run: tuple[subprocess.CompletedProcess[str], Path], tmp_path_factory: pytest.TempPathFactory) -> None:
    proc, out = dry_run
    assert proc.returncode == 0, gpu_dry_run.why_failed(proc)
    # its processes forked from a preloaded interpreter (the device's fresh starts: the plain runs below)
    assert gpu_dry_run.dry_run(tmp_path_factory).forked is zygote.enabled()
    lines = proc.stdout.strip().splitlines()
    assert lines[-1].startswith("PASSED")  # the table comes last
    doc = json.loads(out.read_text())
    assert doc["ok"] is True and doc["fake"] is True
    assert {p.name for p in PHASES} <= set(doc["phases"])
    rows = doc["rows"]
    assert not [r for r in rows if r["kind"] == "check" and r["ok"] is False]
    by_phase = {r["phase"] for r in rows if r["kind"] == "check" and r["ok"] is True}
    assert {"environment", "pool", "metering", "isolation", "residual", "tenants", "fault", "kernels"} <= by_phase
    fault = doc["phases"]["fault"]
    assert fault["faulty_request"] == "CUDA_ERROR_ILLEGAL_ADDRESS"
    assert fault["last_exit"]["reason"] == "CUDA context lost: CUDA_ERROR_ILLEGAL_ADDRESS"
    # B allocated first and read its own buffer back; copy and kernel probes ran in separate processes
    iso, iso_k = doc["phases"]["isolation"]["reader"], doc["phases"]["isolation"]["reader_kernel"]
    assert iso["own_reads_back"] is True and iso_k["own_reads_back"] is True
    assert iso["copy_got_a_bytes"] is False and iso_k["kernel_got_a_bytes"] is False
    assert iso["context_lost"] is None  # the copy's error is not sticky: it cannot mask the kernel probe
    assert iso_k["kernel"] == "CUDA_ERROR_ILLEGAL_ADDRESS" and iso_k["context_lost"] == "CUDA_ERROR_ILLEGAL_ADDRESS"
    residual = doc["phases"]["residual"]
    assert residual["free_trim"]["mark_floats_found"] == 0 and residual["kill"]["mark_floats_found"] == 0
    assert residual["writer_freed"]["reserved_after_trim"] == 0
    pool = doc["phases"]["pool"]
    assert pool["odd_steps"] == pool["odd_metered_allowance"] == 21  # the fake aligns to 512 B: 21 fit
    assert pool["odd_reserved_mem_current"] == 64 << 20
    assert any(r["kind"] == "timing" for r in rows)


def test_the_cuda_majors_must_match_or_the_check_stops_with_one_line() -> None:
    from tests.gpu.check_children import match_cuda_major

    assert match_cuda_major("13.0", "13.0", {"nvidia-cublas": "13.1.0"}) == {"cuda_major": 13, "cublas_major": 13}
    assert match_cuda_major("12.8", "12.9", {"nvidia-cublas-cu12": "12.9.1"}) == {"cuda_major": 12, "cublas_major": 12}
    nvrtc13_on_12 = match_cuda_major("12.8", "13.0", {"nvidia-cublas-cu12": "12.9.1"})
    assert "NVRTC 13.0 does not match the driver's CUDA 12.8" in nvrtc13_on_12["mismatch"]
    assert ".whl-cu12/" in nvrtc13_on_12["mismatch"] and "\n" not in nvrtc13_on_12["mismatch"]
    cublas13_on_12 = match_cuda_major("12.8", "12.8", {"nvidia-cublas": "13.1.0"})
    assert cublas13_on_12["mismatch"].startswith("cuBLAS 13.x does not match")
    assert "neither 12.x nor 13.x" in match_cuda_major("11.8", "11.8", {})["mismatch"]


def test_a_driver_of_another_cuda_major_stops_the_check_with_one_line(tmp_path: Path) -> None:
    """The fake NVRTC is 13.0; a driver reporting CUDA 12.8 must not get as far as failed kernels."""
    out = tmp_path / "check.json"
    proc = gpu_dry_run.run_check(["--dry-run-fake", "--quick", "--only", "environment,pool,kernels", "--json-out",
                                  str(out)], timeout_s=timeouts.scaled(120),
                                 env={**os.environ, "FAKE_CUDA_DRIVER_VERSION": "12080"})
    assert proc.returncode == 1
    (line,) = [ln for ln in proc.stderr.splitlines() if ln.startswith("check_gpu:")]
    assert line.startswith("check_gpu: environment: NVRTC 13.0 does not match the driver's CUDA 12.8")
    assert ".whl-cu12/" in line
    doc = json.loads(out.read_text())
    assert doc["not_run"] == ["pool", "kernels"] and doc["ok"] is False
    assert doc["figures"]["cuda_major"] == 12


def test_a_missed_timing_target_never_fails_the_run() -> None:
    miss = Row("timing", "metered / raw", "1.5x", "<= 1.10x", False, "timing")
    fail = Row("pool", "cap", "CUDA_SUCCESS", "OOM", False, "check")
    assert miss.mark == "MISS" and fail.mark == "FAIL"


def test_an_unknown_phase_is_refused() -> None:
    proc = gpu_dry_run.run_check(["--dry-run-fake", "--only", "nosuch"], timeout_s=timeouts.scaled(60))
    assert proc.returncode == 2 and "unknown phase" in proc.stderr


# ------------------------------------------------------------------ the check survives what hardware may do


def _check(*argv: str, env: dict[str, str] | None = None, timeout_s: float = 200) -> subprocess.CompletedProcess[str]:
    """The check with ``argv``; ``timeout_s``: a quiet machine's hang guard (scaled here)."""
    return gpu_dry_run.run_check(list(argv), timeout_s=timeouts.scaled(timeout_s), env=env)


def test_phases_past_the_deadline_are_reported_not_run_and_the_json_is_written(tmp_path: Path) -> None:
    out = tmp_path / "check.json"
    proc = _check("--dry-run-fake", "--quick", "--deadline-s", "0", "--json-out", str(out))
    assert proc.returncode == 1, proc.stdout[-2000:]  # incomplete: not a pass
    assert proc.stdout.strip().splitlines()[-1].startswith("INCOMPLETE")
    doc = json.loads(out.read_text())
    assert doc["complete"] is True and doc["ok"] is False
    assert doc["not_run"] == [p.name for p in PHASES]
    assert all(r["ok"] is None and "not run" in r["got"] for r in doc["rows"])


#: the check with its hardware deadline (DEFAULT_DEADLINE_S) already passed when it starts
_PAST_DEFAULT_DEADLINE = """
import sys
from tests.gpu import check_gpu
check_gpu.DEFAULT_DEADLINE_S = 0.0
sys.exit(check_gpu.main(sys.argv[1:]))
"""


@pytest.mark.parametrize("fake", [True, False], ids=["dry-run", "hardware"])
def test_a_dry_run_has_no_deadline_of_its_own(fake: bool) -> None:
    """The default deadline fits the device call's outer limit; a dry run's caller (a test) bounds it with
    its own timeout, so a loaded host that takes longer than that deadline still runs every phase. The
    hardware default stays (the phase asked for is skipped; no GPU is touched)."""
    argv = ["--dry-run-fake"] if fake else []
    proc = subprocess.run([sys.executable, "-c", _PAST_DEFAULT_DEADLINE, *argv, "--quick", "--only", "environment"],
                          capture_output=True, text=True, timeout=timeouts.scaled(120), cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    last = proc.stdout.strip().splitlines()[-1]
    if fake:
        assert proc.returncode == 0 and last.startswith("PASSED"), proc.stdout[-2000:] + proc.stderr[-2000:]
    else:
        assert proc.returncode == 1 and last.startswith("INCOMPLETE"), proc.stdout[-2000:] + proc.stderr[-2000:]


def test_the_json_is_rewritten_after_every_phase(tmp_path: Path) -> None:
    """A run killed by an outer timeout keeps what it measured: the JSON exists after the first phase.

    Every process of this run starts as on the device (the run's one dry run forks them:
    tests/helpers/gpu_dry_run.py): ``--child`` steps through ``run_child`` and ``Held`` (isolation)
    and a phase script (settle); test_the_mps_phase_runs_with_a_stand_in_daemon's supervisor, with
    its spawned worker, is the device's too."""
    out = tmp_path / "check.json"
    proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "gpu" / "check_gpu.py"), "--dry-run-fake", "--quick",
                             "--only", "environment,pool,isolation,settle", "--json-out", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    seen: list[dict[str, object]] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:  # each phase prints its rows once it is done
            if line.startswith("[pool") and out.exists():
                seen.append(json.loads(out.read_text()))
                break
    finally:
        proc.communicate(timeout=120)
    assert proc.returncode == 0
    assert seen and seen[0]["complete"] is False and "environment" in seen[0]["phases"]  # type: ignore[operator]
    final = json.loads(out.read_text())
    assert final["complete"] is True and {"environment", "pool", "isolation", "settle"} <= set(final["phases"])
    checks = [r for r in final["rows"] if r["kind"] == "check" and r["ok"] is not None]
    assert {r["phase"] for r in checks} >= {"isolation", "settle"} and all(r["ok"] for r in checks), checks


def test_a_child_that_hangs_is_killed_and_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.gpu import check_gpu

    monkeypatch.setattr(check_gpu, "MIN_STEP_S", 0.5)
    result = check_gpu.run_child("sleep", "60", timeout_s=1)
    assert "did not finish within" in result["error"]
    with pytest.raises(RuntimeError, match="printed no JSON line within"):
        check_gpu.Held("sleeper", timeout_s=1, argv=[sys.executable, "-c", "import time; time.sleep(60)"])
    # a notice before the JSON line is skipped, and a second line comes through step()
    talker = [sys.executable, "-c", "import sys; print('a notice'); print('{\"n\": 1}', flush=True); "
              "sys.stdin.readline(); print('{\"n\": 2}', flush=True); sys.stdin.readline(); print('{\"n\": 3}')"]
    held = check_gpu.Held("talker", timeout_s=30, argv=talker)
    assert held.first == {"n": 1} and held.step() == {"n": 2} and held.release() == {"n": 3}


#: ``check_gpu.py --child meminfo`` run as the launchers run it (``__main__``), in a process that then says
#: which of the orchestrator's own modules the child step loaded
_CHILD_STEP = """
import json, runpy, sys
sys.argv = [sys.argv[1], "--child", "meminfo"]
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
except SystemExit as exc:
    code = exc.code
print(json.dumps({"code": code, "loaded": sorted(m for m in ("argparse", "shared.records", "tests.gpu.figures")
                                                 if m in sys.modules)}))
"""


def test_a_child_step_loads_none_of_the_orchestrators_modules() -> None:
    """A dry run starts some twenty ``--child`` processes (more through the phase scripts): each runs
    its step from check_children alone, without the orchestrator's parser, records and figures
    (~60 ms of CPU a child), and prints the step's JSON line as before."""
    from tests.gpu.check_gpu import _child_argv

    assert _child_argv(["--child", "meminfo"]) == ("meminfo", [])
    assert _child_argv(["--child", "residual_reader_most", "0.9", "4", "-1"]) == ("residual_reader_most",
                                                                                   ["0.9", "4", "-1"])
    # anything else goes through main()'s parser, as before
    for argv in (["--child"], ["--child", "--quick"], ["--child", "pool", "--quick"], ["--quick"], []):
        assert _child_argv(argv) is None, argv
    env = {**os.environ, "PYTHONPATH": str(ROOT), "GPU_CHECK_DRIVER_MODULE": "tests.helpers.fake_cuda",
           "GPU_CHECK_NVRTC_MODULE": "tests.helpers.fake_cuda"}
    proc = subprocess.run([sys.executable, "-c", _CHILD_STEP, str(ROOT / "tests" / "gpu" / "check_gpu.py")],
                          capture_output=True, text=True, timeout=timeouts.scaled(60), cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    step, report = (json.loads(line) for line in proc.stdout.strip().splitlines()[-2:])
    assert step["free"] > 0 and step["total"] >= step["free"]
    assert report == {"code": 0, "loaded": []}


def test_mps_on_a_host_without_it_is_not_a_failure() -> None:
    env = {**os.environ, "PATH": os.path.dirname(sys.executable)}  # no nvidia-cuda-mps-control here
    proc = _check("--dry-run-fake", "--quick", "--mps", "--only", "mps", env=env)
    assert proc.returncode == 0, proc.stdout[-2000:]
    assert "---- mps" in proc.stdout and "not on PATH" in proc.stdout


def test_nvidia_smi_lines_parse_into_the_device_and_driver() -> None:
    from tests.gpu.figures import cuda_version, parse_nvidia_smi

    gpus = parse_nvidia_smi("0, NVIDIA H200, 570.124.06, 143771, 1, Default, [N/A], Enabled\n\n"
                            "1, NVIDIA H200 NVL, Rev, 2, 580.65, 143771, 0, Default, Disabled, Disabled\n")
    assert gpus[0]["name"] == "NVIDIA H200" and gpus[0]["driver_version"] == "570.124.06"
    assert gpus[0]["memory.total"] == "143771" and gpus[0]["mig.mode.current"] == "[N/A]"
    assert gpus[1]["name"] == "NVIDIA H200 NVL, Rev, 2" and gpus[1]["driver_version"] == "580.65"
    assert cuda_version(12080) == "12.8" and cuda_version(13000) == "13.0" and cuda_version(None) is None


def test_the_docs_name_every_figure_and_only_figures_the_check_writes(
        dry_run: tuple[subprocess.CompletedProcess[str], Path]) -> None:
    """docs/GPU-QUOTAS.md's "how to fill this in" maps ``figures.KEY`` to rows: the keys exist."""
    import re

    proc, out = dry_run
    assert proc.returncode == 0, proc.stdout[-2000:]
    written = set(json.loads(out.read_text())["figures"])
    doc = (ROOT / "docs" / "GPU-QUOTAS.md").read_text()
    section = doc[doc.index("### Figures from hardware"):]
    named = set(re.findall(r"`figures\.([a-z0-9_<>]+)`", section))
    assert named, "the section maps no figure"
    patterns = {n: re.compile("^" + re.sub(r"<[a-z]+>", "[a-z0-9]+", n) + "$") for n in named}
    unknown = {n for n, pat in patterns.items() if not any(pat.match(k) for k in written)}
    assert not unknown, f"the docs name figures the check does not write: {sorted(unknown)}"
    unmapped = {k for k in written if not any(pat.match(k) for pat in patterns.values())}
    assert not unmapped, f"figures the docs do not say where to put: {sorted(unmapped)}"


def test_a_tensor_op_that_differs_keeps_every_other_result() -> None:
    """The phase child exits 1 when an op differs from numpy; its JSON line (which op, the GEMM timings)
    is the result, not an anonymous "exit 1"."""
    from tests.gpu.phase_tensor_ops import parse_child, table_rows

    line = json.dumps({"ok": False, "ops": {"add_f32": {"ok": True, "worst_rel_err": 0.0},
                                            "softmax_rows_f32": {"ok": False, "worst_rel_err": 1e-3}},
                       "gemm": [{"n": 512, "ratio": 0.9, "wasm_us": 10.0, "cublas_us": 9.0, "wasm_tflops": 1.0,
                                 "cublas_tflops": 1.1, "target": 0.8, "verdict": "PASS"}], "gpu_bytes_after": 0})
    result = parse_child(1, "noise\n" + line + "\n", "")
    assert result["ops"]["softmax_rows_f32"]["ok"] is False and result["gemm"][0]["ratio"] == 0.9
    rows = table_rows(result)
    assert rows[0][3] is False and "softmax_rows_f32" in rows[0][1]
    assert rows[1][0].startswith("GEMM 512") and rows[1][1].startswith("PASS")
    assert "error" in parse_child(-9, "", "Killed")


CUBLAS_MISSING = """
import json
from tests.gpu import phase_tensor_ops
from tests.helpers.fake_cublas import FakeCublas
from tests.helpers.fake_cuda import FakeDriver
from worker.backends.cuda import CudaBackend

def backend(fake):
    drv = FakeDriver(memory_bytes=4 << 30)
    cublas = FakeCublas(drv)
    def no_library():
        raise RuntimeError("libcublas.so.13: cannot open shared object file (fake)")
    cublas.create = no_library
    return CudaBackend(0, gpu_cap_bytes=2 << 30, driver=drv, nvrtc=drv, cublas=cublas), cublas

phase_tensor_ops._backend = backend
print(json.dumps(phase_tensor_ops.phase(quick=True, fake=True)))
"""


def test_cublas_missing_costs_the_gemm_rows_only() -> None:
    """Every op but matmul still compared with numpy; each GEMM size says why it has no timing.

    In a child process, as the check runs it (a WASM host in the pytest process would also put
    wasmtime's trap handlers under whatever a later test installs)."""
    from tests.gpu import phase_tensor_ops

    proc = subprocess.run([sys.executable, "-c", CUBLAS_MISSING], capture_output=True, text=True, timeout=100,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["ok"] is False
    assert not result["ops"]["matmul_f32"]["ok"] and result["ops"]["add_f32"]["ok"]
    assert result["gemm"] and all("libcublas" in g["error"] for g in result["gemm"])
    rows = phase_tensor_ops.table_rows(result)
    assert rows[1][1].startswith("ERROR") and rows[1][3] is None


def test_region_sizes_shrink_to_a_small_dev_shm() -> None:
    from tests.gpu.phase_regions import fit_sizes

    assert fit_sizes((64, 256), 24 << 30) == ((64, 256), None)
    sizes, note = fit_sizes((64, 256), 64 << 20)  # a container's default /dev/shm
    assert sizes == (16,) or sizes == (32,)
    assert note and "64 MiB free" in note
    assert fit_sizes((64, 256), 4 << 20)[0] == ()


def test_the_extension_builds_without_werror_and_says_when_headers_are_missing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import sysconfig

    from tests.gpu import build_ext

    assert "-Werror" not in build_ext.FLAGS  # another gcc's new warning must not cost the hardware run
    (tmp_path / "shared").mkdir()
    (tmp_path / "shared" / "_atomics.c").write_text("/* */\n")
    monkeypatch.setattr(build_ext, "ROOT", tmp_path)
    paths = {**sysconfig.get_paths(), "include": str(tmp_path / "no-headers")}
    monkeypatch.setattr(sysconfig, "get_paths", lambda: paths)
    assert build_ext.main() == 2
    assert "Python.h is missing" in capsys.readouterr().err


def test_the_mps_phase_runs_with_a_stand_in_daemon_and_stops_it(tmp_path: Path) -> None:
    """The MPS phase has never run on hardware: its flow (private directories, the supervisor and the MPS
    tenant given them, the daemon stopped at the end) runs here against tests/gpu/fake_mps_control.py."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    exe = bindir / "nvidia-cuda-mps-control"
    exe.write_text(f"#!/bin/sh\nexec {sys.executable} {ROOT / 'tests' / 'gpu' / 'fake_mps_control.py'} \"$@\"\n")
    exe.chmod(0o755)
    env = {**os.environ, "PATH": f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}"}
    out = tmp_path / "check.json"
    proc = _check("--dry-run-fake", "--quick", "--mps", "--only", "mps", "--json-out", str(out), env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    mps = json.loads(out.read_text())["phases"]["mps"]
    assert mps["mps_tenant_works"] is True and mps["isolation"] == {"mps": "mps"}
    pipe = Path(mps["pipe_dir"])
    assert not (pipe / "control").exists()  # "quit" reached the daemon: its socket is gone
