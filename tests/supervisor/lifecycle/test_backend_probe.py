"""The backend probe on a host without a CUDA driver (supervisor.lifecycle.backend_select).

``backend = "auto"`` is the default, so every supervisor on a machine without an NVIDIA driver (a
laptop, a CI runner, ``twt demo``) runs the probe and picks the stub. The real bindings find the
driver with the system's loader only when ``cuInit`` is called, after an import of ~0.1 s; the probe
asks the loader first and says why before that import.
"""

from __future__ import annotations

import ctypes
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from supervisor.client.launch import CHECKOUT
from supervisor.lifecycle.backend_select import _PROBE, probe_cuda
from tests.helpers.timeouts import scaled

pytestmark = pytest.mark.timeout(60)


def _no_driver_here() -> None:
    if importlib.util.find_spec("cuda.bindings") is None:
        pytest.skip("cuda-bindings is not installed here: the probe says that instead")
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return
    pytest.skip("this host has a CUDA driver")


def test_without_a_driver_the_probe_says_so_without_importing_the_bindings() -> None:
    _no_driver_here()
    done = subprocess.run([sys.executable, "-X", "importtime", "-c", _PROBE, "cuda.bindings.driver",
                           "cuda.bindings.nvrtc"], capture_output=True, text=True, timeout=scaled(30), check=True)
    verdict = json.loads(done.stdout.splitlines()[-1])
    assert verdict["ok"] is False
    assert str(verdict["reason"]).startswith("CUDA driver not loadable: libcuda.so.1"), verdict
    imported = {line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")}
    assert "cuda.bindings.driver" not in imported
    assert probe_cuda() == verdict  # what a supervisor's start gets


def test_a_configured_driver_module_is_probed_as_before() -> None:
    """A module named in ``cuda_driver_module`` (the suite's fake here) is imported and asked, driver or not."""
    result = probe_cuda(driver_module="tests.helpers.fake_cuda", nvrtc_module="tests.helpers.fake_cuda")
    assert result["ok"] is True and result["devices"], result


#: run in a fresh interpreter (one thread, this checkout and the drivers' folder on its path): probe
#: with the driver module named, and print the verdict; the caller then knows the prober survived
_PROBING = """
import json, sys
from supervisor.lifecycle.backend_select import probe_cuda
print(json.dumps(probe_cuda(timeout_s=float(sys.argv[2]), driver_module=sys.argv[1], nvrtc_module=sys.argv[1])))
"""

#: driver modules that say where they were imported, crash their process, or never return
_DRIVERS = {
    "where_probed": "import sys\n"
                    "raise ImportError(f\"preloaded={'supervisor.lifecycle.backend_select' in sys.modules}\")\n",
    "crashing_driver": "import os, sys\nsys.stderr.write('the driver blew up\\n')\nsys.stderr.flush()\nos.abort()\n",
    "hanging_driver": "import time\ntime.sleep(3600)\n",
}


def _probe_with(tmp_path: Path, module: str, timeout_s: float = 60.0) -> dict[str, object]:
    for name, source in _DRIVERS.items():
        (tmp_path / f"{name}.py").write_text(source)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(CHECKOUT)])}
    done = subprocess.run([sys.executable, "-c", _PROBING, module, str(timeout_s)], capture_output=True, text=True,
                          env=env, timeout=scaled(60), check=True)
    verdict = json.loads(done.stdout.splitlines()[-1])
    assert isinstance(verdict, dict)
    return verdict


def test_the_probe_is_a_fork_of_the_supervisor_that_has_its_modules_already(tmp_path: Path) -> None:
    """One thread and the driver not imported: the probe forks (no interpreter start, no imports made
    twice), and still imports the driver fresh."""
    verdict = _probe_with(tmp_path, "where_probed")
    assert verdict == {"ok": False, "reason": "cuda-bindings not importable: ImportError: preloaded=True"}


def test_a_driver_that_crashes_the_probe_leaves_the_supervisor_its_reason(tmp_path: Path) -> None:
    verdict = _probe_with(tmp_path, "crashing_driver")
    assert verdict["ok"] is False
    assert "CUDA probe crashed" in str(verdict["reason"]) and "the driver blew up" in str(verdict["reason"]), verdict


def test_a_driver_that_hangs_the_probe_is_given_up_at_the_timeout(tmp_path: Path) -> None:
    verdict = _probe_with(tmp_path, "hanging_driver", timeout_s=1.0)
    assert verdict == {"ok": False, "reason": "CUDA probe did not finish within 1 s"}
