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
import subprocess
import sys

import pytest

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
