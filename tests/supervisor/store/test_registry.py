from __future__ import annotations

import subprocess
import sys
import threading
from dataclasses import dataclass

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, invariant, rule

from shared.capability import (
    CAPABILITY_VERSION,
    RegistryAdminCapability,
    TenantCapability,
    capability_from_bytes,
)
from shared.errors import (
    AlreadyRegistered,
    CapabilityFromForeignRegistry,
    CapabilityRevoked,
    GpuMemoryExhausted,
    MemoryExhausted,
    TenantIsolationViolation,
    UnknownTenant,
)
from shared.spec import TenantSpec
from supervisor.store.registry import TenantRegistry
from supervisor.store.tenant_quota import TenantQuota
from tests.helpers import hygiene


def test_register_consume_release() -> None:
    with TenantRegistry.new()[0] as _:
        pass
    registry, admin = TenantRegistry.new()
    with registry:
        cap = registry.register_with_capability(
            admin, TenantSpec("acme").with_memory_quota_bytes(1000).with_gpu_memory_bytes_cap(100)
        )
        segment = registry.get(admin, "acme").segment
        assert isinstance(cap, TenantCapability) and cap.tenant_id == "acme"
        registry.consume_bytes_with_capability(cap, 600)
        registry.consume_gpu_bytes_with_capability(cap, 100)
        with pytest.raises(MemoryExhausted) as cpu:
            registry.consume_bytes_with_capability(cap, 401)
        assert (cpu.value.requested, cpu.value.limit, cpu.value.current) == (401, 1000, 600)
        assert cpu.value.tenant_id == "acme" and cpu.value.is_retryable()
        with pytest.raises(GpuMemoryExhausted) as gpu:
            registry.consume_gpu_bytes_with_capability(cap, 1)
        assert (gpu.value.requested, gpu.value.limit, gpu.value.current) == (1, 100, 100)
        registry.release_bytes_with_capability(cap, 600)
        registry.release_gpu_bytes_with_capability(cap, 100)
        info = registry.get(admin, "acme")
        assert info.quota.bytes_in_use == 0 and info.quota.gpu_bytes_in_use == 0
        assert info.quota.cpu_refusals == 1 and info.quota.gpu_refusals == 1
        assert info.quota.cpu_high_water == 600
        assert registry.len() == len(registry) == 1 and "acme" in registry
    assert segment not in hygiene.twt_segments()


def test_defaults_and_uncapped_gpu() -> None:
    registry, admin = TenantRegistry.new()
    with registry:
        cap = registry.register_with_capability(admin, TenantSpec("acme"))
        info = registry.get(admin, "acme")
        assert info.quota.memory_quota_bytes == 8 << 30
        assert info.quota.gpu_memory_bytes_cap is None
        registry.consume_gpu_bytes_with_capability(cap, (1 << 63) - 1)  # never refused
        with pytest.raises(GpuMemoryExhausted):  # but overflow is
            registry.consume_gpu_bytes_with_capability(cap, (1 << 63) - 1)
            registry.consume_gpu_bytes_with_capability(cap, (1 << 63) - 1)


def test_admin_queries_and_set_quota() -> None:
    registry, admin = TenantRegistry.new()
    with registry:
        for name in ("b", "a"):
            registry.register_with_capability(admin, TenantSpec(name))
        assert registry.tenant_ids(admin) == ["a", "b"]
        assert [t.tenant_id for t in registry.tenants(admin)] == ["a", "b"]
        info = registry.set_quota(admin, "a", memory_quota_bytes="1MiB", gpu_memory_bytes_cap="2MiB")
        assert info.quota.memory_quota_bytes == 1 << 20 and info.quota.gpu_memory_bytes_cap == 2 << 20
        assert info.spec.gpu_memory_bytes_cap == 2 << 20
        assert registry.set_quota(admin, "a", gpu_memory_bytes_cap=None).quota.gpu_memory_bytes_cap is None
        with pytest.raises(ValueError):
            registry.set_quota(admin, "a", memory_quota_bytes=-5)
        assert registry.get(admin, "a").quota.memory_quota_bytes == 1 << 20  # unchanged
        with pytest.raises(UnknownTenant):
            registry.get(admin, "zzz")
        with pytest.raises(UnknownTenant):
            registry.unregister(admin, "zzz")
        with pytest.raises(AlreadyRegistered):
            registry.register_with_capability(admin, TenantSpec("a"))


def test_revocation_and_reregistration() -> None:
    registry, admin = TenantRegistry.new()
    with registry:
        old = registry.register_with_capability(admin, TenantSpec("acme"))
        registry.consume_bytes_with_capability(old, 10)
        registry.unregister(admin, "acme")
        with pytest.raises(CapabilityRevoked):
            registry.consume_bytes_with_capability(old, 1)
        new = registry.register_with_capability(admin, TenantSpec("acme"))
        assert new.generation == old.generation + 1
        with pytest.raises(CapabilityRevoked):
            registry.consume_bytes_with_capability(old, 1)
        with pytest.raises(TenantIsolationViolation):  # revoked is a violation too
            registry.consume_bytes_with_capability_strict(old, 1)
        registry.consume_bytes_with_capability(new, 5)
        assert registry.get(admin, "acme").quota.bytes_in_use == 5  # fresh block


def test_register_entry_keeps_the_callers_record_and_generations_name_every_tenant() -> None:
    """The supervisor's registry keeps the tenant's runtime record as its entry (one record a
    tenant); the generations map holds only tenants not registered now, yet generations()
    names every one, evicted ones included, and a name registered again moves on from it."""

    @dataclass(eq=False)
    class Entry:
        spec: TenantSpec
        block: TenantQuota
        generation: int
        registered_at: float = 1.5

    registry, admin = TenantRegistry.new(generations={"gone": 4})
    with registry:
        cap, entry = registry.register_entry(admin, TenantSpec("acme"), Entry)
        assert isinstance(entry, Entry) and entry.generation == cap.generation == 1
        assert registry.block(admin, "acme") is entry.block and registry.get(admin, "acme").registered_at == 1.5
        assert registry.verify(cap) == "acme"
        with pytest.raises(ValueError, match="behind"):  # would un-revoke generation 4's capabilities
            registry.register_entry(admin, TenantSpec("gone"), Entry, generation=3)
        cap2, again = registry.register_entry(admin, TenantSpec("gone"), Entry, generation=4)
        assert again.generation == cap2.generation == 4
        assert registry.generations() == {"acme": 1, "gone": 4}
        registry.unregister(admin, "acme")
        assert registry.generations() == {"acme": 1, "gone": 4}
        cap3, back = registry.register_entry(admin, TenantSpec("acme"), Entry)
        assert back.generation == cap3.generation == 2 and back is not entry
        with pytest.raises(CapabilityRevoked):
            registry.verify(cap)


def test_wrong_kinds_refused() -> None:
    registry, admin = TenantRegistry.new()
    with registry:
        cap = registry.register_with_capability(admin, TenantSpec("acme"))
        with pytest.raises(TenantIsolationViolation):
            registry.tenants(cap)  # type: ignore[arg-type]
        with pytest.raises(TenantIsolationViolation):
            registry.consume_bytes_with_capability(admin, 1)  # type: ignore[arg-type]
        with pytest.raises(TenantIsolationViolation):
            TenantCapability.from_bytes(admin.to_bytes())
        with pytest.raises(TenantIsolationViolation):
            RegistryAdminCapability.from_bytes(cap.to_bytes())


def test_no_public_constructor_and_immutable() -> None:
    registry, admin = TenantRegistry.new()
    with registry:
        with pytest.raises(TypeError):
            TenantCapability(b"x", b"y", 1, "acme")
        with pytest.raises(AttributeError):
            admin._raw = b""  # type: ignore[misc]
        assert capability_from_bytes(admin.to_bytes()) == admin
        import pickle

        assert pickle.loads(pickle.dumps(admin)) == admin


def test_two_registries_same_names_fully_separate() -> None:
    ra, admin_a = TenantRegistry.new()
    rb, admin_b = TenantRegistry.new()
    with ra, rb:
        cap_a = ra.register_with_capability(admin_a, TenantSpec("acme"))
        cap_b = rb.register_with_capability(admin_b, TenantSpec("acme"))
        for call in (
            lambda: ra.consume_bytes_with_capability(cap_b, 1),
            lambda: ra.release_gpu_bytes_with_capability(cap_b, 1),
            lambda: rb.consume_gpu_bytes_with_capability(cap_a, 1),
            lambda: ra.tenants(admin_b),
            lambda: rb.register_with_capability(admin_a, TenantSpec("x")),
            lambda: rb.unregister(admin_a, "acme"),
            lambda: rb.set_quota(admin_a, "acme", memory_quota_bytes=1),
        ):
            with pytest.raises(TenantIsolationViolation):
                call()
        for call in (
            lambda: ra.consume_bytes_with_capability_strict(cap_b, 1),
            lambda: rb.release_bytes_with_capability_strict(cap_a, 1),
            lambda: ra.tenants_strict(admin_b),
            lambda: rb.unregister_strict(admin_a, "acme"),
            lambda: rb.register_with_capability_strict(admin_a, TenantSpec("x")),
            lambda: ra.consume_gpu_bytes_with_capability_strict(cap_b, 1),
            lambda: ra.release_gpu_bytes_with_capability_strict(cap_b, 1),
            lambda: ra.tenant_ids_strict(admin_b),
            lambda: ra.get_strict(admin_b, "acme"),
            lambda: ra.set_quota_strict(admin_b, "acme", memory_quota_bytes=1),
        ):
            with pytest.raises(CapabilityFromForeignRegistry) as exc:
                call()
            assert exc.value.expected_registry != exc.value.actual_registry
        assert ra.get(admin_a, "acme").quota.bytes_in_use == 0
        assert rb.get(admin_b, "acme").quota.bytes_in_use == 0
        # and with their own registry's capabilities, the strict variants do the work
        ra.consume_gpu_bytes_with_capability_strict(cap_a, 5)
        assert ra.snapshot_with_capability(cap_a).gpu_bytes_in_use == 5
        ra.release_gpu_bytes_with_capability_strict(cap_a, 5)
        assert ra.tenant_ids_strict(admin_a) == ["acme"]
        assert ra.get_strict(admin_a, "acme").spec.tenant_id == "acme"
        assert ra.set_quota_strict(admin_a, "acme", memory_quota_bytes=4096).spec.memory_quota_bytes == 4096
        ra.register_with_capability_strict(admin_a, TenantSpec("beta"))
        assert ra.tenant_ids_strict(admin_a) == ["acme", "beta"]


def _mutations(raw: bytes) -> list[bytes]:
    out = []
    for i in range(len(raw)):
        for bit in range(8):
            b = bytearray(raw)
            b[i] ^= 1 << bit
            out.append(bytes(b))
    out += [raw[:k] for k in range(len(raw))]
    out += [raw + b"\0", raw + raw]
    b = bytearray(raw)
    b[0] = CAPABILITY_VERSION + 1
    out.append(bytes(b))
    b = bytearray(raw)
    b[1] = 1 if raw[1] == 2 else 2
    out.append(bytes(b))
    return out


@pytest.mark.parametrize("kind", ["tenant", "admin"])
def test_forgery_every_bit_refused_and_touches_nothing(kind: str) -> None:
    registry, admin = TenantRegistry.new()
    with registry:
        cap = registry.register_with_capability(admin, TenantSpec("acme"))
        raw = (cap if kind == "tenant" else admin).to_bytes()
        refused = 0
        for forged_raw in _mutations(raw):
            with pytest.raises(TenantIsolationViolation):
                forged = capability_from_bytes(forged_raw)
                if kind == "tenant":
                    registry.consume_bytes_with_capability(forged, 7)  # type: ignore[arg-type]
                else:
                    registry.set_quota(forged, "acme", memory_quota_bytes=1)  # type: ignore[arg-type]
            refused += 1
        snap = registry.get(admin, "acme").quota
        assert snap.bytes_in_use == 0 and snap.cpu_refusals == 0
        assert snap.memory_quota_bytes == 8 << 30
        assert refused == len(_mutations(raw))


def test_threads_consume_while_registering() -> None:
    registry, admin = TenantRegistry.new()
    with registry:
        cap = registry.register_with_capability(admin, TenantSpec("hot").with_memory_quota_bytes(64))
        errors: list[BaseException] = []
        stop = threading.Event()

        def hammer() -> None:
            try:
                while not stop.is_set():
                    try:
                        registry.consume_bytes_with_capability(cap, 8)
                    except MemoryExhausted:
                        continue
                    registry.release_bytes_with_capability(cap, 8)
            except BaseException as exc:  # noqa: BLE001 - a thread's failure, surfaced below
                errors.append(exc)

        threads = [threading.Thread(target=hammer) for _ in range(3)]
        for t in threads:
            t.start()
        for i in range(30):
            registry.register_with_capability(admin, TenantSpec(f"t{i}"))
            registry.unregister(admin, f"t{i}")
        stop.set()
        for t in threads:
            t.join()
        assert not errors
        assert registry.get(admin, "hot").quota.bytes_in_use == 0


def test_close_on_gc_and_exit_without_warnings() -> None:
    code = (
        "from supervisor.store.registry import TenantRegistry\n"
        "from shared.spec import TenantSpec\n"
        "r, a = TenantRegistry.new(segment_prefix='gcexit')\n"
        "r.register_with_capability(a, TenantSpec('x'))\n"
        "r2, a2 = TenantRegistry.new(segment_prefix='gcdel')\n"
        "r2.register_with_capability(a2, TenantSpec('y'))\n"
        "del r2, a2\n"
        "import gc, os; gc.collect()\n"
        "assert not [n for n in os.listdir('/dev/shm') if n.startswith('twt-gcdel')]\n"
    )
    proc = subprocess.run([sys.executable, "-W", "error", "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    assert not [n for n in hygiene.twt_segments() if n.startswith("twt-gc")]


# --------------------------------------------------------------------------
# Two registries, random operations, random capabilities, checked against a model.


@dataclass
class CapRef:
    registry: str  # "a" | "b"
    tenant: str
    generation: int
    cap: TenantCapability


@dataclass
class ModelTenant:
    generation: int
    limit: int
    used: int = 0


class TwoRegistries(RuleBasedStateMachine):
    caps = Bundle("caps")

    def __init__(self) -> None:
        super().__init__()
        ra, aa = TenantRegistry.new()
        rb, ab = TenantRegistry.new()
        self.reg = {"a": ra, "b": rb}
        self.admin = {"a": aa, "b": ab}
        self.model: dict[str, dict[str, ModelTenant]] = {"a": {}, "b": {}}
        self.gens: dict[tuple[str, str], int] = {}

    @rule(target=caps, r=st.sampled_from("ab"), name=st.sampled_from(["t1", "t2"]), limit=st.integers(0, 100))
    def register(self, r: str, name: str, limit: int) -> CapRef | None:
        spec = TenantSpec(name).with_memory_quota_bytes(limit)
        if name in self.model[r]:
            with pytest.raises(AlreadyRegistered):
                self.reg[r].register_with_capability(self.admin[r], spec)
            return None  # type: ignore[return-value]
        cap = self.reg[r].register_with_capability(self.admin[r], spec)
        gen = self.gens.get((r, name), 0) + 1
        self.gens[(r, name)] = gen
        self.model[r][name] = ModelTenant(gen, limit)
        return CapRef(r, name, gen, cap)

    @rule(ref=caps, target_reg=st.sampled_from("ab"), n=st.integers(0, 60), strict=st.booleans(), release=st.booleans())
    def use(self, ref: CapRef | None, target_reg: str, n: int, strict: bool, release: bool) -> None:
        if ref is None:
            return
        reg = self.reg[target_reg]
        if release:
            call = reg.release_bytes_with_capability_strict if strict else reg.release_bytes_with_capability
        else:
            call = reg.consume_bytes_with_capability_strict if strict else reg.consume_bytes_with_capability
        if ref.registry != target_reg:
            with pytest.raises(CapabilityFromForeignRegistry if strict else TenantIsolationViolation):
                call(ref.cap, n)
            return
        tenant = self.model[target_reg].get(ref.tenant)
        if tenant is None or tenant.generation != ref.generation:
            with pytest.raises(CapabilityRevoked):
                call(ref.cap, n)
            return
        if release:
            call(ref.cap, n)
            tenant.used = max(0, tenant.used - n)
        elif tenant.used + n > tenant.limit:
            with pytest.raises(MemoryExhausted):
                call(ref.cap, n)
        else:
            call(ref.cap, n)
            tenant.used += n

    @rule(r=st.sampled_from("ab"), name=st.sampled_from(["t1", "t2"]), admin_from=st.sampled_from("ab"))
    def unregister(self, r: str, name: str, admin_from: str) -> None:
        if admin_from != r:
            with pytest.raises(TenantIsolationViolation):
                self.reg[r].unregister(self.admin[admin_from], name)
            return
        if name not in self.model[r]:
            with pytest.raises(UnknownTenant):
                self.reg[r].unregister(self.admin[r], name)
            return
        self.reg[r].unregister(self.admin[r], name)
        del self.model[r][name]

    @invariant()
    def counters_match_model(self) -> None:
        for r in "ab":
            infos = {i.tenant_id: i for i in self.reg[r].tenants(self.admin[r])}
            assert set(infos) == set(self.model[r])
            for name, tenant in self.model[r].items():
                assert infos[name].quota.bytes_in_use == tenant.used
                assert infos[name].generation == tenant.generation

    def teardown(self) -> None:
        for reg in self.reg.values():
            reg.close()


TestTwoRegistries = TwoRegistries.TestCase
TestTwoRegistries.settings = settings(max_examples=40, stateful_step_count=25, deadline=None)
