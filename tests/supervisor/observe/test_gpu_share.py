"""GPU-time shares end to end: a real supervisor, stub devices, workers running GEMM-loop guests.

Correctness, not speed: every wait is for an event (a tenant's accounted
device time reaching an amount, a run's reply), and the tolerances on shares
are wide enough for a loaded 2-core machine (the exact figures are the
benchmark's, ``twt bench share``, and the fake-clock tests').
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from shared.capability import TenantCapability
from shared.errors import InvalidArgument, WorkerLost
from shared.spec import TenantSpec
from supervisor.tools.demo import guest_path
from supervisor.client.launch import SupervisorHandle
from tests.helpers.cluster import supervisor, tenant, wait_for

pytestmark = pytest.mark.timeout(300)

GUEST = guest_path("share").read_bytes()
#: device seconds a share is measured over (the stub device computes on the CPU: each costs about
#: 2 s of CPU, most of it the GEMMs themselves; with ~1 ms GEMMs and 10 ms quanta half a second is
#: ~50 quanta, ~500 GEMMs). Measured with 0.5 s windows, three runs quiet and three beside four CPU
#: burners: the 7:3 split 0.691-0.710 once both tenants run, the 1:3 split 0.245-0.262, the six-way
#: Jain index >= 0.977 - inside the tolerances below (0.1, 0.1, 0.8), which a policy that ignored
#: the weights (0.5, 0.5) or starved a tenant misses by far. The exact figures are ``twt bench share``'s.
WINDOW_S = 0.5
#: the window a cap's share of wall time is asserted over: at most 0.2 plus a 4-quantum burst over
#: the window (0.227 at 1.5 s; 0.253 at 0.75 s, over the asserted 0.25 - so not shorter)
CAP_WINDOW_S = 1.5
#: where only "it ran" is asserted (handoffs on one device, none on another)
SHORT_WINDOW_S = 0.4


class Load:
    """Client threads running ``gemm_loop`` runs for some tenants until stopped (64 GEMMs a run: the
    device seconds, not the requests, are what a share test measures, so few requests carry them)."""

    def __init__(self, sup: SupervisorHandle, caps: dict[str, TenantCapability], threads: int = 2,
                 n: int = 256, reps: int = 64) -> None:
        self.sup = sup
        self.stop = threading.Event()
        self.errors: list[BaseException] = []
        self.threads = [threading.Thread(target=self._loop, args=(cap, n, reps), daemon=True)
                        for cap in caps.values() for _ in range(threads)]

    def _loop(self, cap: TenantCapability, n: int, reps: int) -> None:
        client = self.sup.connect(timeout_s=120.0)
        try:
            digest = client.put_module(cap, GUEST)
            while not self.stop.is_set():
                client.run_wasm(cap, digest, "gemm_loop", [n, reps])
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.errors.append(exc)
        finally:
            client.close()

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(120)
        assert not self.errors, self.errors


def gpu(sup: SupervisorHandle, tid: str) -> dict[str, Any]:
    return tenant(sup.client.status(), tid).gpu_time


def accounted(sup: SupervisorHandle, *tids: str) -> list[float]:
    status = sup.client.status()
    return [tenant(status, t).gpu_time["gpu_time_s"] for t in tids]


def delta_until(sup: SupervisorHandle, tids: tuple[str, ...], device_s: float, timeout_s: float = 200.0
                ) -> list[float]:
    """Each tenant's accounted device seconds from now until they total ``device_s`` more."""
    start = accounted(sup, *tids)

    def grown() -> list[float] | None:
        now = accounted(sup, *tids)
        d = [b - a for a, b in zip(start, now)]
        return d if sum(d) >= device_s else None

    return wait_for(grown, timeout_s=timeout_s, interval_s=0.2, what=f"{device_s} s of device time")


def register(sup: SupervisorHandle, tid: str, **spec: Any) -> TenantCapability:
    return sup.client.register(sup.admin_capability, TenantSpec.from_dict(
        {"tenant_id": tid, "wasm_timeout_s": 120.0, "request_timeout_s": 120.0, **spec}))


@pytest.fixture(scope="module")
def sup() -> Iterator[SupervisorHandle]:
    with supervisor(devices=[0, 1]) as handle:
        yield handle


def test_weights_cap_and_live_changes(sup: SupervisorHandle) -> None:
    caps = {"w7": register(sup, "w7", gpu_time_weight=7, instances=2, cuda_device_index=0),
            "w3": register(sup, "w3", gpu_time_weight=3, instances=2, cuda_device_index=0)}
    rec = gpu(sup, "w7")
    assert (rec["weight"], rec["cap"]) == (7.0, None)
    try:
        with Load(sup, caps):
            # both tenants running first: the window measures the split, not which client started first
            wait_for(lambda: all(accounted(sup, "w7", "w3")), timeout_s=120, interval_s=0.05,
                     what="both tenants running")
            d = delta_until(sup, ("w7", "w3"), WINDOW_S)
            assert d[0] / sum(d) == pytest.approx(0.7, abs=0.1)
            # the weight, live: from now on 1:3 (w3 keeps its 3)
            rec = sup.client.set_quota(None, "w7", gpu_time_weight=1)
            assert rec.gpu_time["weight"] == 1.0 and rec.spec.gpu_time_weight == 1.0
            d = delta_until(sup, ("w7", "w3"), WINDOW_S)
            assert d[0] / sum(d) == pytest.approx(0.25, abs=0.1)
            # a cap with the weight: w7 gets at most a fifth of the device's time, w3 the rest
            sup.client.set_quota(None, "w7", gpu_time_weight=3, gpu_time_cap=0.2)
            t0 = time.monotonic()
            d = delta_until(sup, ("w7", "w3"), CAP_WINDOW_S)
            elapsed = time.monotonic() - t0
            assert d[0] / elapsed <= 0.2 + 0.05  # the cap: a fraction of wall time, whatever w3 does
            # how w3 fares meanwhile depends on how much CPU the host gives the stub device's w3 -
            # scheduling, not asserted (it once got no more than the capped w7 under two burners;
            # twt bench share measures it)
        # the cap holding w7 back is an event to wait for. With w3 contending, a starved host may
        # leave the device idle so often that w7's half of the busy time stays under its fifth (seen
        # with two burners: no throttle in 120 s), so w7 runs alone against a small cap: any use of
        # the device beyond the cap's burst (a few quanta) must be throttled. The policy's figures
        # are tested on a fake clock (tests/shared/test_gpu_time.py).
        sup.client.set_quota(None, "w7", gpu_time_cap=0.02)
        with Load(sup, {"w7": caps["w7"]}):
            wait_for(lambda: gpu(sup, "w7")["throttled"] > 0, timeout_s=120, interval_s=0.2,
                     what="the cap throttling w7")
    finally:
        for tid in caps:
            sup.client.evict(None, tid)


def test_a_killed_lease_holder_loses_the_device_at_once(sup: SupervisorHandle) -> None:
    hog = register(sup, "hog", cuda_device_index=0)
    nxt = register(sup, "next", cuda_device_index=0)
    client = sup.connect(timeout_s=120.0)
    outcome: dict[str, Any] = {}
    try:
        digest = client.put_module(hog, GUEST)

        def run_hog() -> None:
            c = sup.connect(timeout_s=120.0)
            try:
                c.run_wasm(hog, digest, "gemm_loop", [128, 10**9])
            except WorkerLost as exc:
                outcome["hog"] = exc
            finally:
                c.close()

        hog_thread = threading.Thread(target=run_hog, daemon=True)
        hog_thread.start()
        pid = tenant(sup.client.status(), "hog").pids[0]
        while True:  # freeze the hog while it holds the device
            wait_for(lambda: sup.client.status().devices[0].gpu_time["holder_pid"] == pid, timeout_s=60,
                     what="the hog holding device 0")
            os.kill(pid, signal.SIGSTOP)
            if sup.client.status().devices[0].gpu_time["holder_pid"] == pid:
                break
            os.kill(pid, signal.SIGCONT)

        def run_next() -> None:
            c = sup.connect(timeout_s=120.0)
            try:
                outcome["next"] = c.run_wasm(nxt, c.put_module(nxt, GUEST), "small_op", [16])
            finally:
                c.close()

        next_thread = threading.Thread(target=run_next, daemon=True)
        next_thread.start()
        os.kill(pid, signal.SIGKILL)
        next_thread.join(120)
        hog_thread.join(120)
        assert outcome["next"].results == (0,)  # it got the device: the dead holder's lease passed on
        assert isinstance(outcome.get("hog"), WorkerLost)
        board = sup.client.status().devices[0].gpu_time
        assert board["holder_pid"] != pid
    finally:
        client.close()
        for tid in ("hog", "next"):
            sup.client.evict(None, tid)


def test_a_tenant_on_another_device_is_unaffected(sup: SupervisorHandle) -> None:
    caps = {"d0a": register(sup, "d0a", cuda_device_index=0), "d0b": register(sup, "d0b", cuda_device_index=0)}
    other = register(sup, "d1", cuda_device_index=1)
    try:
        before = sup.client.status().devices[1].gpu_time
        with Load(sup, caps), Load(sup, {"d1": other}, threads=1):
            delta_until(sup, ("d0a", "d0b", "d1"), SHORT_WINDOW_S)
            wait_for(lambda: accounted(sup, "d1")[0] > 0.1, timeout_s=120, what="d1 running")
        status = sup.client.status()
        dev1, dev0 = status.devices[1], status.devices[0]
        assert dev1.tenants == ("d1",) and "d1" not in dev0.tenants
        # nobody else ever took device 1 from d1: no handoffs, no steals there
        assert dev1.gpu_time["handoffs"] == before["handoffs"] == 0
        assert dev1.gpu_time["steals"] == 0
        assert dev0.gpu_time["handoffs"] > 0
    finally:
        for tid in ("d0a", "d0b", "d1"):
            sup.client.evict(None, tid)


def test_many_tenants_all_get_their_turn(sup: SupervisorHandle) -> None:
    caps = {f"m{i}": register(sup, f"m{i}", cuda_device_index=0) for i in range(6)}
    try:
        with Load(sup, caps, threads=1):
            d = delta_until(sup, tuple(caps), WINDOW_S)
        assert all(x > 0 for x in d)
        jain = sum(d) ** 2 / (len(d) * sum(x * x for x in d))
        assert jain >= 0.8
    finally:
        for tid in caps:
            sup.client.evict(None, tid)


def test_bad_policies_are_refused_naming_the_key(sup: SupervisorHandle) -> None:
    for bad in ({"gpu_time_weight": 0}, {"gpu_time_weight": -2.5}, {"gpu_time_cap": 1.5},
                {"gpu_time_cap": 0}, {"gpu_time_weight": "heavy"}):
        key = next(iter(bad))
        with pytest.raises(InvalidArgument, match=key):
            sup.client.call("register", sup.admin_capability, {"spec": {"tenant_id": "bad", **bad}})
    register(sup, "ok")
    try:
        for bad in ({"gpu_time_weight": True}, {"gpu_time_weight": float("nan")}, {"gpu_time_cap": 2},
                    {"gpu_time_cap": "half"}):
            key = next(iter(bad))
            with pytest.raises(InvalidArgument, match=key):
                sup.client.set_quota(None, "ok", **bad)  # type: ignore[arg-type]
        assert gpu(sup, "ok")["weight"] == 1.0  # nothing half-applied
    finally:
        sup.client.evict(None, "ok")


def test_cli_register_set_quota_and_status(sup: SupervisorHandle) -> None:
    from tests.helpers.cli import twt

    r = twt("register", "cli", "--gpu-time-weight", "2.5", "--gpu-time-cap", "25%", "--run-dir", sup.run_dir,
            "--cap-out", os.path.join(sup.run_dir, "cli.cap"))
    assert r.returncode == 0, r.stderr
    try:
        rec = gpu(sup, "cli")
        assert (rec["weight"], rec["cap"]) == (2.5, 0.25)
        r = twt("set-quota", "cli", "--gpu-time-weight", "4", "--gpu-time-cap", "none", "--run-dir", sup.run_dir)
        assert r.returncode == 0, r.stderr
        assert "GPU time weight 4, cap none" in r.stdout
        assert (gpu(sup, "cli")["weight"], gpu(sup, "cli")["cap"]) == (4.0, None)
        r = twt("status", "--run-dir", sup.run_dir)
        assert r.returncode == 0, r.stderr
        assert "GPU WEIGHT/CAP" in r.stdout and "SHARE" in r.stdout
        line = next(ln for ln in r.stdout.splitlines() if ln.startswith("cli "))
        assert line.split()[-3:-1] == ["4/none", "0.00s"]
        r = twt("set-quota", "cli", "--gpu-time-cap", "1.5", "--run-dir", sup.run_dir)
        assert r.returncode == 2 and "fraction" in r.stderr
    finally:
        sup.client.evict(None, "cli")


def _thread_nices(pid: int) -> dict[str, int]:
    """The worker's threads by kernel name (the main thread under its own tid) -> nice value."""
    out: dict[str, int] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                name = f.read().strip()
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                nice = int(f.read().rsplit(")", 1)[1].split()[16])
        except FileNotFoundError:
            continue  # a thread that ended meanwhile
        out["main" if int(tid) == pid else name] = nice
    return out


def test_worker_guest_nice_is_checked_and_reaches_the_bind() -> None:
    """The key takes 0..19 (a file or ``TWT_WORKER_GUEST_NICE``); the placement passes a non-zero
    value in a worker's bind options, and none for 0."""
    from shared.config import load_config
    from shared.records import ProbedDevice
    from supervisor.routing.placement import Placement

    assert load_config(environ={"TWT_WORKER_GUEST_NICE": "3"}).worker_guest_nice == 3
    for bad in ("-1", "20", "x"):
        with pytest.raises(Exception, match="WORKER_GUEST_NICE|worker_guest_nice"):
            load_config(environ={"TWT_WORKER_GUEST_NICE": bad})
    for nice, want in ((4, 4), (0, None)):
        p = Placement.create("stub", (ProbedDevice(0, 1 << 30, 1 << 30, "stub"),), reserve_bytes=0, guest_nice=nice)
        try:
            assert p.worker_options(TenantSpec("t"), 0).get("guest_nice") == want
        finally:
            p.close()


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="per-thread nice values: Linux /proc")
def test_the_guest_runs_below_the_threads_that_drive_the_device() -> None:
    """``worker_guest_nice``: a bound worker's executor thread (the guest and its host calls) runs
    that many nice steps below its device thread and its epoch thread (read from /proc: what the
    kernel schedules by); those keep the worker's normal priority."""
    with supervisor(worker_guest_nice=7) as sup2:
        cap = register(sup2, "nice")
        client = sup2.connect(timeout_s=120.0)
        try:
            digest = client.put_module(cap, GUEST)
            assert client.run_wasm(cap, digest, "gemm_loop", [16, 2]).results == (2,)  # queued fills
            pid = tenant(sup2.client.status(), "nice").pids[0]

            def named() -> dict[str, int] | None:
                t = _thread_nices(pid)
                return t if {"twt-device", "twt-wasm-epoch"} <= set(t) else None

            threads = wait_for(named, timeout_s=60, what="the device and epoch threads named")
            assert threads is not None
            normal = threads["twt-device"]
            assert threads["twt-wasm-epoch"] == normal, threads
            assert threads["main"] == min(19, normal + 7), threads
        finally:
            client.close()
