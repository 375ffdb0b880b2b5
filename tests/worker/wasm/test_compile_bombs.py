"""Compile bombs are bounded by the run's deadline; the compile cache by a byte budget."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from shared.errors import KernelTimeout, WorkerLost
from shared.quota import QuotaBlock
from shared.spec import TenantSpec
from tests.helpers.cluster import supervisor, wait_for
from tests.helpers.wasm_bombs import compile_bomb, small_module
from worker.backends.stub import StubBackend
from worker.context import TenantContext
from worker.wasm.compiler import CompileOverrun
from worker.wasm.host import WasmHost

MiB = 1 << 20


@pytest.fixture
def host() -> Iterator[WasmHost]:
    spec = TenantSpec.from_dict({"tenant_id": "bomb", "memory_quota_bytes": 64 * MiB, "wasm_timeout_s": 30.0})
    with QuotaBlock.create("bomb", memory_quota_bytes=64 * MiB) as owner:
        ctx = TenantContext(spec, 0, 0, QuotaBlock.attach(owner.name, instance=0), StubBackend())
        h = WasmHost(ctx, cache_bytes=1000)
        ctx.extensions[WasmHost.EXTENSION] = h
        try:
            yield h
        finally:
            ctx.close()


@pytest.mark.timeout(60)
def test_a_compile_past_the_run_deadline_is_a_kernel_timeout(host: WasmHost) -> None:
    # ~1.5 s of compiling here; a 50 ms run gets a KernelTimeout (CompileOverrun), not a wait.
    with pytest.raises(CompileOverrun) as info:
        host.run(compile_bomb(1, 12_000), "run", [], fuel=10**9, timeout_s=0.05)
    assert isinstance(info.value, KernelTimeout) and info.value.code == "kernel_timeout"
    assert "restarted to stop the compiler" in info.value.message
    assert host.info()["cached_modules"] == 0


def test_the_compile_cache_keeps_within_its_byte_budget(host: WasmHost) -> None:
    modules = [small_module(v) for v in range(40)]
    size = len(modules[0])
    for v, m in enumerate(modules):
        assert host.run(m, "run", [], fuel=10**6, timeout_s=5)["results"] == [v]
        assert host._cache.bytes <= host._cache.max_bytes
    assert host.info()["cached_modules"] == host._cache.max_bytes // size
    big = compile_bomb(1, 200)  # larger than the whole budget: compiled, never cached
    assert len(big) > host._cache.max_bytes
    host.compile(big)
    assert host._cache.bytes <= host._cache.max_bytes


@pytest.mark.timeout(120)
def test_run_wasm_with_a_compile_bomb_is_answered_by_its_run_deadline() -> None:
    """Before: answered only at the 30 s request deadline (the client here gives up at 20 s)."""
    with supervisor([{"name": "bomber", "request_timeout_s": 30.0, "wasm_timeout_s": 10.0},
                     {"name": "bystander"}]) as sup:
        c = sup.client
        cap = c.tenant_capability(None, "bomber")
        with pytest.raises((KernelTimeout, WorkerLost)) as info:
            c.run_wasm(cap, compile_bomb(4, 16_000), "run", timeout_s=1.0, request_timeout_s=20.0)
        assert info.value.code in ("kernel_timeout", "worker_lost")
        # the worker ended itself to stop the compiler; the instance comes back and serves
        def served() -> bool:
            try:
                return bool(c.ping(cap))
            except WorkerLost:  # the ping met the instance on its way out
                return False

        wait_for(served, timeout_s=30, what="bomber served again")
        assert c.ping(c.tenant_capability(None, "bystander"))
        assert c.run_wasm(cap, small_module(7), "run").results == (7,)
