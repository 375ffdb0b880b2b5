"""Registry identity across restarts, key rotation, refusal reasons, the denied-event limiter, stall grace."""

from __future__ import annotations

import multiprocessing
import os
import threading
from typing import Any

import psutil
import pytest

from shared import capability as _cap
from shared.capability import RegistryAdminCapability, TenantCapability
from shared.errors import CapabilityRevoked, TenantIsolationViolation
from shared.spec import TenantSpec
from supervisor.store.audit import DeniedAudit, Denial
from supervisor.store.registry import TenantRegistry
from supervisor.runtime.stall import StallGuard, run_delay_ns
from worker.control import supervisor_alive


def test_a_registry_with_the_stored_key_accepts_capabilities_minted_before() -> None:
    first, admin = TenantRegistry.new()
    with first:
        cap = first.register_with_capability(admin, TenantSpec("acme"))
        first.register_with_capability(admin, TenantSpec("gone"))
        old_gone = first.tenant_capability(admin, "gone")
        first.unregister(admin, "gone")
        key, generations = first.export_key(admin), first.generations()
    # "restart": a new process would read these from the state store
    second, admin2 = TenantRegistry.new(key=key, generations=generations, segment_prefix="restart1")
    with second:
        assert admin2.to_bytes() == admin.to_bytes()  # the admin capability stays the same
        assert second.restore_with_capability(admin2, TenantSpec("acme"), cap.generation) == cap
        assert second.verify(cap) == "acme"
        with pytest.raises(CapabilityRevoked):
            second.verify(old_gone)  # evicted before the restart: stays revoked
        again = second.register_with_capability(admin2, TenantSpec("gone"))
        assert again.generation == old_gone.generation + 1
        with pytest.raises(CapabilityRevoked):
            second.verify(old_gone)  # also once the name is registered again
        with pytest.raises(ValueError, match="behind"):
            second.unregister(admin2, "gone")
            second.restore_with_capability(admin2, TenantSpec("gone"), old_gone.generation)


def test_a_bad_key_is_refused() -> None:
    from supervisor.store.state import RegistryKey

    with pytest.raises(ValueError):
        TenantRegistry.new(key=RegistryKey(b"short", b"s" * 32))


def test_rotate_key_revokes_every_capability_and_mints_a_new_admin() -> None:
    registry, admin = TenantRegistry.new()
    with registry:
        cap = registry.register_with_capability(admin, TenantSpec("acme"))
        old_id = registry.registry_id
        key, admin2 = registry.rotate_key(admin)
        assert registry.registry_id == key.registry_id.hex() != old_id and admin2 != admin
        with pytest.raises(CapabilityRevoked, match="rotated"):
            registry.verify(cap)
        with pytest.raises(CapabilityRevoked):
            registry.verify_admin(admin)
        fresh = registry.tenant_capability(admin2, "acme")  # the tenant stays, with a new capability
        assert registry.verify(fresh) == "acme"
        assert registry.explain_refusal(cap.to_bytes(), admin=False).reason == "revoked"
    # a restart remembers the retired id
    again, _ = TenantRegistry.new(key=key, retired={bytes.fromhex(old_id)}, segment_prefix="rot")
    with again, pytest.raises(CapabilityRevoked):
        again.verify(cap)


def test_every_refusal_has_a_reason_and_only_a_verified_tenant() -> None:
    registry, admin = TenantRegistry.new()
    other, other_admin = TenantRegistry.new()
    with registry, other:
        cap = registry.register_with_capability(admin, TenantSpec("acme"))
        raw = cap.to_bytes()
        forged = raw[:-1] + bytes([raw[-1] ^ 1])
        foreign = other.register_with_capability(other_admin, TenantSpec("acme")).to_bytes()
        explain = registry.explain_refusal
        assert explain(None, admin=False) == Denial("missing", None, None)
        assert explain(raw[:10], admin=False).reason == "truncated"
        assert explain(raw[:-3], admin=False).reason == "truncated"
        assert explain(b"\x09" + raw[1:], admin=False).reason == "malformed"
        assert explain(forged, admin=False) == Denial("forged", None, "acme")
        assert explain(foreign, admin=False) == Denial("foreign", None, "acme")
        assert explain(raw, admin=True) == Denial("wrong_kind", "acme", None)
        assert explain(admin.to_bytes(), admin=False) == Denial("wrong_kind", None, None)
        registry.unregister(admin, "acme")
        assert explain(raw, admin=False) == Denial("revoked", "acme", None)
        with pytest.raises(TenantIsolationViolation):
            registry.verify(TenantCapability.from_bytes(forged))
        # the forged token's claim is never reported as verified
        fields = explain(forged, admin=False).fields("alloc")
        assert fields == {"reason": "forged", "op": "alloc", "tenant": None, "verified": False, "claimed": "acme"}


def test_a_long_unverified_claim_is_shortened() -> None:
    fields = Denial("forged", None, "x" * 63 + "y" * 100).fields("ping")
    assert fields["claimed"] == "x" * 63 + "y" + "..." and fields["verified"] is False


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_denied_events_are_rate_limited_and_the_dropped_are_counted() -> None:
    events: list[tuple[str, dict[str, Any]]] = []
    clock = _Clock()
    audit = DeniedAudit(lambda kind, **f: events.append((kind, f)), rate_per_s=10, burst=5, clock=clock)
    denial = Denial("forged", None, "acme")
    published = [audit.record(denial, "alloc") for _ in range(50)]
    assert published == [True] * 5 + [False] * 45
    assert audit.pending_dropped == 45 and audit.dropped_total == 45
    assert audit.flush() == 0  # no room yet: nothing is published
    clock.now += 0.15  # room for one
    assert audit.record(denial, "free")
    assert events[-1] == ("denied", {**denial.fields("free"), "dropped": 45})
    for _ in range(3):
        audit.record(denial, "alloc")
    assert audit.pending_dropped == 3
    clock.now += 1.0
    assert audit.flush() == 3 and events[-1] == ("denied_dropped", {"dropped": 3})
    assert audit.flush() == 0 and audit.emitted == 6
    with pytest.raises(ValueError):
        DeniedAudit(lambda kind, **f: None, rate_per_s=0)


def test_stall_guard_counts_silence_from_the_resume_and_delays_judgement() -> None:
    guard = StallGuard(threshold_s=1.0, grace_s=3.0, clock=_Clock())
    assert guard.tick(10.0) is None and guard.tick(10.05) is None
    assert guard.silence(last_heard=9.0, now=10.05) == pytest.approx(1.05)
    assert not guard.in_grace(10.05)
    assert guard.tick(20.05) == pytest.approx(10.0)  # SIGSTOP for 10 s
    assert guard.stalls == 1 and guard.in_grace(20.1) and guard.in_grace(23.0) and not guard.in_grace(23.1)
    assert guard.silence(last_heard=10.0, now=20.1) == pytest.approx(0.05)  # not 10 s
    assert guard.silence(last_heard=20.08, now=20.1) == pytest.approx(0.02)
    with pytest.raises(ValueError):
        StallGuard(0, 1)


def test_stall_guard_leaves_a_late_loops_lateness_out_of_silence() -> None:
    """A loop that turns, but each turn late (a loaded host: no single gap is a stall), may not
    yet have read a heartbeat that came: the part of each gap beyond the slack is not silence."""
    guard = StallGuard(threshold_s=1.0, grace_s=3.0, slack_s=0.25, clock=_Clock())
    assert guard.tick(0.0) is None
    for i in range(1, 5):  # four turns 0.75 s apart: 0.5 s late each, never a stall
        assert guard.tick(i * 0.75) is None
    assert guard.stalls == 0 and guard.late_s == pytest.approx(2.0)
    assert guard.silence(last_heard=0.0, now=3.0) == pytest.approx(1.0)
    # only the lateness after the last message counts; a gap straddling it counts its part after it
    assert guard.silence(last_heard=2.25, now=3.0) == pytest.approx(0.25)
    assert guard.silence(last_heard=2.7, now=3.0) == pytest.approx(0.0)
    assert guard.silence(last_heard=3.0, now=3.2) == pytest.approx(0.2)
    # ordinary turns (within the slack) are no lateness
    for i in range(1, 41):
        guard.tick(3.0 + i * 0.05)
    assert guard.late_s == pytest.approx(2.0)
    assert guard.silence(last_heard=3.0, now=5.0) == pytest.approx(2.0)
    with pytest.raises(ValueError):
        StallGuard(1.0, 1.0, slack_s=2.0)


def test_run_delay_of_this_process_names_its_threads() -> None:
    delays = run_delay_ns(os.getpid())
    if delays is None:
        pytest.skip("no per-thread schedstat on this kernel")
    assert threading.get_native_id() in delays and all(ns >= 0 for ns in delays.values())
    assert run_delay_ns(4_194_304 + 12345) is None  # above pid_max: no such process


def _exit_now() -> None:
    pass


def test_supervisor_alive_tells_gone_from_slow() -> None:
    me = psutil.Process()
    assert supervisor_alive(os.getpid(), me.create_time())
    assert supervisor_alive(None, None)  # nothing to check: the parent check and PDEATHSIG hold
    assert not supervisor_alive(os.getpid(), me.create_time() - 100)  # pid reused by another process
    proc = multiprocessing.get_context("spawn").Process(target=_exit_now)
    proc.start()
    pid = proc.pid
    proc.join(30)
    assert pid is not None and not supervisor_alive(pid, None)


def test_capability_mint_is_deterministic_for_a_key() -> None:
    """What makes the admin capability survive a restart: same key, same bytes."""
    a = _cap.mint(RegistryAdminCapability, b"k" * 32, b"r" * 16, 0)
    b = _cap.mint(RegistryAdminCapability, b"k" * 32, b"r" * 16, 0)
    assert a.to_bytes() == b.to_bytes()
