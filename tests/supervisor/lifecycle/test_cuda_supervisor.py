"""Backend selection, device budgets, multi-GPU placement and MPS through a real supervisor.

The cuda backend runs on the fake driver (tests/helpers/fake_cuda.py), named
by the ``cuda_driver_module`` setting that the supervisor's probe and every
worker honour; the fake's behaviour comes from ``FAKE_CUDA_*`` variables in
the supervisor's environment (inherited by probe and workers).
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import socket
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from shared.errors import BackendUnavailable, GpuMemoryExhausted, InvalidArgument, SupervisorUnavailable
from supervisor.host.mps import Fallback, Mps
from shared.spec import TenantSpec
from supervisor.lifecycle.backend_select import probe_cuda
from supervisor.client.launch import SupervisorHandle, launch
from supervisor.routing.placement import MPS_HEADROOM_MIB, Placement, mps_environment
from tests.helpers.cluster import FAST, instance_pid, tenant, wait_for
from tests.helpers.tmp import short_temp_dir

pytestmark = pytest.mark.timeout(120)

MiB = 1 << 20
GiB = 1 << 30
FAKE = "tests.helpers.fake_cuda"


def fake_env(**fake: Any) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FAKE_CUDA_", "CUDA_MPS_"))}
    env.update({f"FAKE_CUDA_{k.upper()}": str(v) for k, v in fake.items()})
    return env


@contextmanager
def cuda_supervisor(fake: dict[str, Any] | None = None, env: dict[str, str] | None = None,
                    **settings: Any) -> Iterator[SupervisorHandle]:
    """A supervisor whose cuda backend is the fake driver."""
    sup = {**FAST, "backend": "cuda", "cuda_driver_module": FAKE, "cuda_nvrtc_module": FAKE, **settings}
    with launch({"supervisor": sup, "tenant": []}, env={**fake_env(**(fake or {})), **(env or {})}) as handle:
        yield handle


def record_of(record_dir: str, pid: int) -> dict[str, Any]:
    path = Path(record_dir) / f"{pid}.json"
    wait_for(path.exists, what=f"fake driver record of pid {pid}")
    doc: dict[str, Any] = json.loads(path.read_text())
    return doc


# ------------------------------------------------------------------ backend selection


def test_auto_picks_cuda_when_the_driver_loads_and_a_device_exists() -> None:
    with cuda_supervisor({"memory": GiB}, backend="auto", device_reserve_bytes=0) as sup:
        c = sup.client
        hello = c.status().supervisor
        assert hello.backend == "cuda"
        assert "CUDA driver" in hello.backend_reason and "(auto)" in hello.backend_reason
        cap = c.register(None, TenantSpec("acme", gpu_memory_bytes_cap=8 * MiB))
        h = c.alloc(cap, 4 * MiB)
        c.write(cap, h, b"on the fake device", offset=100)
        assert c.read(cap, h, 18, offset=100) == b"on the fake device"
        with pytest.raises(GpuMemoryExhausted):
            c.alloc(cap, 5 * MiB)
        status = c.status()
        rec = tenant(status, "acme")
        assert (rec.backend, rec.device, rec.isolation, rec.gpu_bytes_in_use) == ("cuda", 0, "process", 4 * MiB)
        (dev,) = status.devices
        assert dev.name == "Fake CUDA Device" and dev.tenants == ("acme",)
        # the budget also carries the bound worker's fixed overhead (worker.backends.cuda): with the
        # fake driver (no context bytes) that is its fixed scratch, one 2 MiB granule
        assert (dev.budget_limit_bytes, dev.budget_used_bytes) == (GiB, 4 * MiB + 2 * MiB)


def test_workers_take_the_probes_context_figure_and_never_measure_it_themselves(tmp_path: Path) -> None:
    """One context's cost is measured once per device by the start-up probe (in its child process,
    before any worker runs) and handed to every worker in its backend options: the workers create no
    throw-away context, so concurrent starts cannot skew the figure, and the budget charges it."""
    with cuda_supervisor({"memory": GiB, "context_bytes": 48 * MiB}, env={"FAKE_CUDA_RECORD_CALLS": str(tmp_path)},
                         device_reserve_bytes=0) as sup:
        c = sup.client
        c.register(None, TenantSpec("acme"))
        pid = wait_for(lambda: instance_pid(sup, "acme"))
        # the probe's figure (its own primary context was live, so its free bytes are 1 GiB - 48 MiB)
        # plus the worker's 2 MiB scratch
        wait_for(lambda: c.status().devices[0].budget_used_bytes == 48 * MiB + 2 * MiB, what="bound worker charged")
    per_pid = {int(f.stem): [name for name, _ in _records(f)] for f in tmp_path.glob("*.calls")}
    assert per_pid[pid].count("cuCtxCreate") == 0 and "cuMemPoolCreate" in per_pid[pid]
    assert sorted(names.count("cuCtxCreate") for names in per_pid.values())[-1] == 3  # the probe: 3 samples


def _records(path: Path) -> list[tuple[str, tuple[Any, ...]]]:
    out = []
    with open(path, "rb") as f:
        while True:
            try:
                out.append(pickle.load(f))
            except EOFError:
                return out


def test_auto_falls_back_to_stub_and_says_why() -> None:
    with cuda_supervisor({"mode": "no-libcuda"}, backend="auto") as sup:
        hello = sup.client.status().supervisor
        assert hello.backend == "stub"
        assert hello.backend_reason.startswith("auto: cuda unavailable")
        assert "DynamicLibNotFoundError" in hello.backend_reason
        cap = sup.client.register(None, TenantSpec("acme"))
        assert sup.client.alloc(cap, 1024)
        assert tenant(sup.client.status(), "acme").backend == "stub"


def test_auto_with_the_real_bindings_agrees_with_the_probe() -> None:
    probe = probe_cuda()
    with launch({"supervisor": {**FAST, "backend": "auto"}}) as sup:
        hello = sup.client.status().supervisor
    if probe.get("ok"):
        assert hello.backend == "cuda"
    else:
        assert hello.backend == "stub" and str(probe["reason"]) in hello.backend_reason


@pytest.mark.parametrize(("mode", "why"), [("no-libcuda", "DynamicLibNotFoundError"),
                                           ("no-device", "CUDA_ERROR_NO_DEVICE")])
def test_backend_cuda_without_a_usable_driver_fails_at_start(mode: str, why: str, tmp_path: Path) -> None:
    log = tmp_path / "stderr"
    with open(log, "wb") as err, pytest.raises(SupervisorUnavailable, match="exited with code 1"):
        with launch({"supervisor": {**FAST, "backend": "cuda", "cuda_driver_module": FAKE}},
                    env=fake_env(mode=mode), stderr=err, ready_timeout_s=60):
            pass
    text = log.read_text()
    assert "BackendUnavailable" in text and "backend 'cuda' unavailable" in text and why in text


def test_configured_devices_must_exist(tmp_path: Path) -> None:
    log = tmp_path / "stderr"
    with open(log, "wb") as err, pytest.raises(SupervisorUnavailable):
        with launch({"supervisor": {**FAST, "backend": "cuda", "cuda_driver_module": FAKE, "devices": [0, 3]}},
                    env=fake_env(devices=2), stderr=err):
            pass
    assert "device(s) [3] do not exist" in log.read_text()


def test_a_pinned_device_that_is_not_managed_is_refused_and_nothing_registered() -> None:
    with cuda_supervisor({"devices": 1}, backend="cuda") as sup:
        cap = sup.client.register(None, TenantSpec("ok"))
        assert sup.client.alloc(cap, 64)
        with pytest.raises(InvalidArgument, match="cuda_device_index=1 is not a device this supervisor manages"):
            sup.client.register(None, TenantSpec("gone", cuda_device_index=1))
        assert [t.tenant_id for t in sup.client.status().tenants] == ["ok"]


# ------------------------------------------------------------------ the device budget


def test_device_budget_is_never_exceeded_across_tenants_and_instances() -> None:
    limit = 24 * MiB
    with cuda_supervisor({"memory": GiB}, device_reserve_bytes=GiB - limit) as sup:
        c = sup.client
        specs = [TenantSpec("alpha", instances=2), TenantSpec("beta"), TenantSpec("gamma", gpu_memory_bytes_cap=GiB)]
        caps = {s.tenant_id: c.register(None, s) for s in specs}
        assert c.status().devices[0].budget_limit_bytes == limit
        # every worker charges its fixed overhead when it binds (the fake's scratch granule each):
        # wait for all four, so that none binds late into a budget the others have filled
        overhead = 4 * 2 * MiB
        wait_for(lambda: c.status().devices[0].budget_used_bytes == overhead, what="all four workers bound")
        successes: dict[str, int] = {t: 0 for t in caps}
        refusals: dict[str, int] = {t: 0 for t in caps}
        violations: list[str] = []
        stop = threading.Event()
        lock = threading.Lock()

        def sample() -> None:
            with sup.connect() as watcher:
                while not stop.is_set():
                    st = watcher.status()
                    used = st.devices[0].budget_used_bytes
                    # (the tenants' own counters may briefly include a request that the budget is
                    # about to refuse: they are consumed first and rolled back; the budget never is)
                    if used > limit or st.devices[0].budget_high_water > limit:
                        violations.append(f"budget {used} > {limit}")

        def hammer(tid: str) -> None:
            with sup.connect() as client:
                misses = 0
                while misses < 5:
                    try:
                        client.alloc(caps[tid], MiB)
                        with lock:
                            successes[tid] += 1
                    except GpuMemoryExhausted as exc:
                        assert "device 0 budget exhausted" in str(exc)
                        misses += 1
                        with lock:
                            refusals[tid] += 1

        sampler = threading.Thread(target=sample)
        sampler.start()
        workers = [threading.Thread(target=hammer, args=(t,)) for t in caps for _ in range(2)]
        for t in workers:
            t.start()
        for t in workers:
            t.join(60)
        stop.set()
        sampler.join(30)
        assert not violations, violations[:3]
        assert sum(successes.values()) * MiB == limit - overhead  # every byte of the budget, not one more
        assert all(refusals[t] == 10 for t in caps)
        st = c.status()
        dev = st.devices[0]
        assert dev.budget_used_bytes == limit and dev.budget_high_water == limit
        assert sum(t.gpu_bytes_in_use for t in st.tenants) == limit - overhead
        # a tenant whose instances hold bytes (which one got the budget is the host's scheduling: on a
        # loaded host one tenant's hammers may take it all); SIGKILL its fullest instance: its share
        # returns to the tenant and the device
        held = [t for t in ("alpha", "beta") if tenant(st, t).quota.instance_shares]
        owner, other = held[0], ("beta" if held[0] == "alpha" else "alpha")
        shares = {i: g for i, _, g in tenant(st, owner).quota.instance_shares}
        victim = max(shares, key=lambda i: shares[i])
        pid = tenant(st, owner).instances[victim].pid
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: c.status().devices[0].budget_used_bytes == limit - shares[victim],
                 what="the dead instance's share back in the device budget")
        assert tenant(c.status(), owner).gpu_bytes_in_use == successes[owner] * MiB - shares[victim]
        for _ in range(shares[victim] // MiB):
            c.alloc(caps[other], MiB)  # another tenant can use it now
        with pytest.raises(GpuMemoryExhausted):
            c.alloc(caps[other], MiB)


def test_stub_backend_budget_is_the_simulated_capacity() -> None:
    with launch({"supervisor": {**FAST, "backend": "stub", "stub_device_capacity_bytes": 8 * MiB}}) as sup:
        c = sup.client
        a, b = c.register(None, TenantSpec("a")), c.register(None, TenantSpec("b"))
        c.alloc(a, 5 * MiB)
        with pytest.raises(GpuMemoryExhausted, match="device 0 budget exhausted"):
            c.alloc(b, 5 * MiB)
        c.alloc(b, 3 * MiB)
        dev = c.status().devices[0]
        assert (dev.budget_limit_bytes, dev.budget_used_bytes, dev.budget_refusals) == (8 * MiB, 8 * MiB, 1)
        c.evict(None, "a")
        wait_for(lambda: c.status().devices[0].budget_used_bytes == 3 * MiB, what="evicted bytes back")


# ------------------------------------------------------------------ multi-GPU placement


def test_tenants_are_pinned_or_placed_on_the_device_with_most_free_budget(tmp_path: Path) -> None:
    records = str(tmp_path)
    with cuda_supervisor({"devices": 2, "memory": GiB, "record_dir": records},
                         devices=[0, 1], device_reserve_bytes=GiB - 64 * MiB) as sup:
        c = sup.client
        pinned = c.register(None, TenantSpec("pinned", cuda_device_index=0))
        c.alloc(pinned, 32 * MiB)
        c.register(None, TenantSpec("first"))  # device 1: 64 MiB free against 32
        first = c.tenant_capability(None, "first")
        c.alloc(first, 48 * MiB)
        c.register(None, TenantSpec("second"))  # device 0 now: 32 MiB free against 16
        st = c.status()
        assert {t.tenant_id: t.device for t in st.tenants} == {"pinned": 0, "first": 1, "second": 0}
        assert {d.index: d.tenants for d in st.devices} == {0: ("pinned", "second"), 1: ("first",)}
        # the workers really run on those devices (contexts retained there)
        for tid, dev in (("pinned", 0), ("first", 1), ("second", 0)):
            pid = wait_for(lambda: instance_pid(sup, tid), what=f"{tid} ready")
            assert record_of(records, pid)["devices"] == [dev]
        with pytest.raises(InvalidArgument, match=r"cuda_device_index=5 is not a device this supervisor manages "
                                                  r"\(managed: 0, 1"):
            c.register(None, TenantSpec("nowhere", cuda_device_index=5))


def test_placement_policy_unit() -> None:
    devices = tuple({"index": i, "name": "stub", "total_bytes": 100, "free_bytes": 100} for i in (0, 2))
    p = Placement.create("stub", devices, reserve_bytes=0, policy="most-free")
    try:
        assert p.indexes == [0, 2]
        assert p.place(TenantSpec("a")) == 0  # tie: fewest tenants, then lowest index
        assert p.place(TenantSpec("b"), {0: 1}) == 2
        p.budget(2).consume(60)
        assert p.place(TenantSpec("c"), {0: 1, 2: 1}) == 0
        assert p.place(TenantSpec("d", cuda_device_index=2)) == 2
        with pytest.raises(InvalidArgument, match="cuda_device_index=1"):
            p.place(TenantSpec("e", cuda_device_index=1))
        opts = p.worker_options(TenantSpec("f", gpu_memory_bytes_cap=10, recorded_cuda_mem_pool_quota=5), 2)
        assert opts == {"device_index": 2, "budget_segment": p.budget(2).name, "gpu_memory_bytes_cap": 10,
                        "recorded_cuda_mem_pool_quota": 5}
        p.budget(2).release(60)
    finally:
        p.close()
    q = Placement.create("cuda", ({"index": 0, "total_bytes": 1000, "free_bytes": 900},), reserve_bytes=100,
                         policy="first")
    try:
        assert (q.budget(0).capacity_bytes, q.budget(0).limit_bytes) == (900, 800)  # probe's free minus reserve
        assert q.place(TenantSpec("a")) == 0
    finally:
        q.close()


# ------------------------------------------------------------------ MPS


@pytest.mark.parametrize(
    ("cap", "pct", "ordinal", "limit"),
    [
        (None, None, 0, None),
        (1, None, 0, f"0={2 + MPS_HEADROOM_MIB}M"),
        (64 * MiB, 50, 0, f"0={64 + MPS_HEADROOM_MIB}M"),
        (65 * MiB, 1, 1, f"1={66 + MPS_HEADROOM_MIB}M"),
        (GiB + 1, 100, 3, f"3={1026 + MPS_HEADROOM_MIB}M"),
        (80 * GiB, 25, 7, f"7={80 * 1024 + MPS_HEADROOM_MIB}M"),
    ],
)
def test_mps_environment_values(cap: int | None, pct: int | None, ordinal: int, limit: str | None) -> None:
    env = mps_environment("/run/mps", ordinal, cap, pct)
    assert env["CUDA_MPS_PIPE_DIRECTORY"] == "/run/mps"
    assert env.get("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT") == limit
    assert env.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE") == (None if pct is None else str(pct))


def test_isolation_decision_unit(tmp_path: Path) -> None:
    p = Placement.create("stub", ({"index": 0, "total_bytes": 1},), reserve_bytes=0,
                         detect=lambda: Fallback("no control socket in /x"))
    try:
        assert isinstance(p.isolation(TenantSpec("a", isolation="process")), Fallback)
        assert isinstance(p.isolation(TenantSpec("b", isolation="auto")), Fallback)
        with pytest.raises(BackendUnavailable, match="isolation='mps' but no MPS control daemon.*no control socket"):
            p.isolation(TenantSpec("c", isolation="mps"))
    finally:
        p.close()
    no_mps = str(tmp_path / "no-mps")
    p = Placement.create("stub", ({"index": 0, "total_bytes": 1},), reserve_bytes=0,
                         detect=lambda: Mps("/run/mps", "alive"), no_mps_dir=no_mps)
    try:
        proc = TenantSpec("p", isolation="process")
        p.add("p", p.isolation(proc))
        assert p.isolation_of("p") == "process"
        assert p.worker_options(proc, 0)["environment"] == {"CUDA_MPS_PIPE_DIRECTORY": no_mps}
        assert os.path.isdir(no_mps) and not os.listdir(no_mps)
        spec = TenantSpec("d", isolation="auto", gpu_memory_bytes_cap=2 * MiB, sm_percentage=40)
        p.add("d", p.isolation(spec))
        assert p.isolation_of("d") == "mps"
        assert p.worker_options(spec, 0)["environment"] == {
            "CUDA_MPS_PIPE_DIRECTORY": "/run/mps",
            "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": f"0={2 + MPS_HEADROOM_MIB}M",
            "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "40",
        }
    finally:
        p.close()
    assert not os.path.exists(no_mps)  # removed with the placement


def test_isolation_mps_without_a_daemon_is_refused_at_registration(tmp_path: Path) -> None:
    with launch({"supervisor": {**FAST, "backend": "stub"}},
                env={**fake_env(), "CUDA_MPS_PIPE_DIRECTORY": str(tmp_path)}) as sup:
        with pytest.raises(BackendUnavailable) as exc:
            sup.client.register(None, TenantSpec("acme", isolation="mps"))
        assert "isolation='mps'" in str(exc.value) and "no control socket" in str(exc.value)
        assert sup.client.status().tenants == ()
        sup.client.register(None, TenantSpec("auto", isolation="auto"))  # auto falls back to process
        assert tenant(sup.client.status(), "auto").isolation == "process"


def test_mps_workers_get_their_limits_before_cuinit(tmp_path: Path) -> None:
    pipe_dir = tempfile.mkdtemp(prefix="twt-mps-", dir=short_temp_dir())  # short: unix socket paths are limited
    daemon = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # stands in for the MPS control daemon
    try:
        daemon.bind(os.path.join(pipe_dir, "control"))
        daemon.listen(16)
        records = str(tmp_path)
        with cuda_supervisor({"devices": 2, "record_dir": records}, env={"CUDA_MPS_PIPE_DIRECTORY": pipe_dir},
                             devices=[0, 1]) as sup:
            c = sup.client
            c.register(None, TenantSpec("mps", isolation="mps", cuda_device_index=1,
                                        gpu_memory_bytes_cap=100 * MiB, sm_percentage=30))
            c.register(None, TenantSpec("auto", isolation="auto", cuda_device_index=0))
            c.register(None, TenantSpec("proc", isolation="process"))
            st = c.status()
            assert {t.tenant_id: t.isolation for t in st.tenants} == {
                "mps": "mps", "auto": "mps", "proc": "process"}
            env = {tid: record_of(records, wait_for(lambda: instance_pid(sup, tid)))["environment"]
                   for tid in ("mps", "auto", "proc")}
            assert env["mps"] == {
                "CUDA_MPS_PIPE_DIRECTORY": pipe_dir,
                "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": f"1={100 + MPS_HEADROOM_MIB}M",
                "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "30",
            }
            assert env["auto"] == {"CUDA_MPS_PIPE_DIRECTORY": pipe_dir}  # no cap, no percentage
            # process isolation opts out of the live daemon: an empty private pipe directory
            no_mps = os.path.join(sup.run_dir, "no-mps")
            assert env["proc"] == {"CUDA_MPS_PIPE_DIRECTORY": no_mps}
            assert os.listdir(no_mps) == []
    finally:
        daemon.close()
        subprocess.run(["rm", "-rf", pipe_dir], check=False)


# ------------------------------------------------------------------ sticky CUDA errors


def test_a_sticky_cuda_error_ends_the_worker_and_every_request_in_flight_gets_worker_lost() -> None:
    """The request that hit the fault gets CudaError; the ones queued behind it get WorkerLost with
    "CUDA context lost: ..."; the supervisor restarts the instance (on-failure); the neighbour is untouched."""
    from shared.errors import CudaError, WorkerLost, error_from_dict
    from shared.exitcodes import WORKER_CUDA_CONTEXT_LOST

    with cuda_supervisor({"memory": GiB}, device_reserve_bytes=0) as sup:
        c = sup.client
        faulty = c.register(None, TenantSpec("faulty", gpu_memory_bytes_cap=64 * MiB, restart="on-failure"))
        calm = c.register(None, TenantSpec("calm", gpu_memory_bytes_cap=64 * MiB))
        hc = c.alloc(calm, MiB)
        c.write(calm, hc, b"calm")
        calm_pid = instance_pid(sup, "calm")
        old_pid = instance_pid(sup, "faulty")
        c.inject_fault(None, "faulty", "slow", ms=1500)  # the CudaError reply waits: others queue behind it
        c.inject_fault(None, "faulty", "cuda-fault")
        first = c.send("alloc", faulty, {"nbytes": MiB})
        wait_for(lambda: tenant(c.status(), "faulty").instances[0].in_flight >= 1, what="first in flight")
        queued = [c.send("alloc", faulty, {"nbytes": MiB}) for _ in range(2)]
        answers: dict[int, Any] = {}
        for _ in range(3):
            rid, ok, payload, _ = c.recv(timeout_s=30)
            assert not ok
            answers[rid] = error_from_dict(payload)
        assert isinstance(answers[first], CudaError)
        assert answers[first].result_name == "CUDA_ERROR_ILLEGAL_ADDRESS"
        for rid in queued:
            lost = answers[rid]
            assert isinstance(lost, WorkerLost), lost
            assert lost.reason == "CUDA context lost: CUDA_ERROR_ILLEGAL_ADDRESS"
            assert lost.exit_code == WORKER_CUDA_CONTEXT_LOST
        new_pid = wait_for(lambda: (p := instance_pid(sup, "faulty")) != old_pid and p, timeout_s=30,
                           what="restart")
        assert new_pid
        h = c.alloc(faulty, MiB)  # a fresh process, a fresh context
        c.write(faulty, h, b"again")
        assert c.read(faulty, h, 5) == b"again"
        assert instance_pid(sup, "calm") == calm_pid and c.read(calm, hc, 4) == b"calm"
        rec = tenant(c.status(), "faulty").instances[0]
        assert rec.restarts == 1 and rec.last_exit.reason.startswith("CUDA context lost")


def test_a_non_sticky_cuda_error_keeps_the_worker() -> None:
    from shared.errors import GpuMemoryExhausted

    with cuda_supervisor({"memory": GiB}, device_reserve_bytes=0) as sup:
        c = sup.client
        cap = c.register(None, TenantSpec("acme", gpu_memory_bytes_cap=64 * MiB))
        pid = instance_pid(sup, "acme")
        c.inject_fault(None, "acme", "oom")  # the driver's out-of-memory path
        with pytest.raises(GpuMemoryExhausted):
            c.alloc(cap, MiB)
        c.alloc(cap, MiB)
        assert instance_pid(sup, "acme") == pid


def test_cuda_fault_needs_the_cuda_backend() -> None:
    from tests.helpers.cluster import supervisor

    with supervisor([{"name": "acme"}]) as sup:
        c = sup.client
        cap = c.tenant_capability(None, "acme")
        pid = instance_pid(sup, "acme")
        buf = c.alloc(cap, 4096)
        # refused when ordered: armed, it failed the next unrelated request with an
        # InvalidArgument that a client could take for "this buffer is gone"
        with pytest.raises(InvalidArgument, match="cuda backend"):
            c.inject_fault(None, "acme", "cuda-fault")
        c.ping(cap)
        assert c.read(cap, buf, 4096) == bytes(4096)
        assert instance_pid(sup, "acme") == pid


def test_the_probe_names_a_missing_nvrtc_and_the_extra_that_brings_it() -> None:
    from supervisor.lifecycle.backend_select import nvrtc_note

    probe = probe_cuda(driver_module=FAKE, nvrtc_module="tests.helpers.no_such_nvrtc")
    assert probe["ok"] is True and probe["nvrtc"] is None
    assert "ModuleNotFoundError" in probe["nvrtc_reason"]
    note = nvrtc_note(probe)
    assert "NVRTC missing" in note and "tensor-wasm-tenant[cuda]" in note
    present = probe_cuda(driver_module=FAKE, nvrtc_module=FAKE)
    assert present["nvrtc"] == "13.0" and nvrtc_note(present) == ""
