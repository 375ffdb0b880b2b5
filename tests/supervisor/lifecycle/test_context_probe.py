"""One CUDA context's cost, measured once per device by the start-up probe (a child process: the
supervisor never initialises CUDA) and handed to the workers; never 0 for want of a measure.

The probe creates a throw-away second context three times around ``cuMemGetInfo`` and keeps the
median; where no second context can be had (a full device, compute mode EXCLUSIVE_PROCESS) it
reports the device class's conservative default and the failed call. Placement then gives every
worker on that device the figure as its ``context_bytes`` backend option."""

from __future__ import annotations

import pytest

from shared.cuda_compat import default_context_bytes
from shared.records import ProbedDevice
from shared.spec import TenantSpec
from supervisor.lifecycle.backend_select import probe_cuda
from supervisor.routing.placement import Placement

pytestmark = pytest.mark.timeout(60)

MiB = 1 << 20
GiB = 1 << 30
FAKE = "tests.helpers.fake_cuda"


def _probe(monkeypatch: pytest.MonkeyPatch, **fake: object) -> dict[str, object]:
    for key, value in fake.items():
        monkeypatch.setenv(f"FAKE_CUDA_{key.upper()}", str(value))
    result = probe_cuda(driver_module=FAKE, nvrtc_module=FAKE)
    assert result["ok"], result
    return result


@pytest.mark.parametrize("major", [12, 13])
def test_the_probe_measures_one_context_per_device_in_either_binding_major(monkeypatch: pytest.MonkeyPatch,
                                                                           major: int) -> None:
    result = _probe(monkeypatch, memory=GiB, context_bytes=48 * MiB, devices=2, bindings=major)
    assert str(result["bindings"]).startswith(f"{major}.")
    devices = result["devices"]
    assert isinstance(devices, list) and len(devices) == 2
    for raw in devices:
        dev = ProbedDevice.from_wire(raw)
        assert (dev.context_bytes, dev.context_bytes_source, dev.compute_capability) == (48 * MiB, "measured", "9.0")
        assert dev.free_bytes == GiB - 48 * MiB  # (its own primary context was live)


def test_a_device_without_room_for_a_second_context_gets_the_class_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """A full device: the primary context fits, the probe's second does not. The old worker-side
    measure said 0 here (unmetered exactly when memory is tight); the probe says the default, and why."""
    result = _probe(monkeypatch, memory=64 * MiB, context_bytes=40 * MiB)
    (raw,) = result["devices"]  # type: ignore[misc]
    dev = ProbedDevice.from_wire(raw)
    assert dev.context_bytes == default_context_bytes(9) > 0
    assert dev.context_bytes_source == "default"
    assert "cuCtxCreate: CUDA_ERROR_OUT_OF_MEMORY" in dev.context_note


def test_placement_hands_the_probes_figure_to_every_worker_on_the_device() -> None:
    devices = (ProbedDevice(0, GiB, GiB, "a", "9.0", 300 * MiB, "measured"),
               ProbedDevice(1, GiB, GiB, "b", "8.0", default_context_bytes(8), "default", "cuCtxCreate: ..."))
    p = Placement.create("cuda", devices, reserve_bytes=0)
    try:
        assert p.worker_options(TenantSpec("x"), 0)["context_bytes"] == 300 * MiB
        assert p.worker_options(TenantSpec("x"), 1)["context_bytes"] == 512 * MiB
    finally:
        p.close()
    stub = Placement.create("stub", (ProbedDevice(0, GiB, GiB, "stub"),), reserve_bytes=0)
    try:
        assert "context_bytes" not in stub.worker_options(TenantSpec("x"), 0)  # no context on the stub
    finally:
        stub.close()
