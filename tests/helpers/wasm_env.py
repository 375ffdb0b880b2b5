"""In-process WASM test environments: a real TenantContext over a real QuotaBlock, the stub backend, a WasmHost.

Shared by the ABI tests (tests/worker/test_wasm_abi.py, test_wasm_tensor_ops.py):
``make_env`` builds the context, ``probe`` opens a session on
``worker/guests/probe.wat`` (every import re-exported one to one), and the
small helpers read and poke guest memory and buffers.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from shared.quota import QuotaBlock
from shared.spec import TenantSpec
from worker.backends.stub import StubBackend
from worker.context import TenantContext
from worker.wasm import WasmHost, WasmSession, guest_source

__all__ = ["PAGE", "PROBE", "Env", "buffer_bytes", "call", "make_env", "mem", "poke", "probe"]

MiB = 1 << 20
PAGE = 65536
PROBE = guest_source("probe")


@dataclass
class Env:
    block: QuotaBlock
    ctx: TenantContext
    host: WasmHost


@contextmanager
def make_env(fast: bool, *, gpu_cap: int | None = 1 * MiB, capacity: int = 16 << 30) -> Iterator[Env]:
    spec = TenantSpec.from_dict({"tenant_id": "abi", "memory_quota_bytes": 64 * MiB,
                                 "gpu_memory_bytes_cap": gpu_cap, "wasm_max_memory_bytes": 1 * MiB})
    with QuotaBlock.create("abi", memory_quota_bytes=64 * MiB, gpu_memory_bytes_cap=gpu_cap) as owner:
        attached = QuotaBlock.attach(owner.name, instance=0)
        ctx = TenantContext(spec, 0, 0, attached, StubBackend(capacity_bytes=capacity))
        host = WasmHost(ctx, fast_imports=fast)
        ctx.extensions[WasmHost.EXTENSION] = host
        try:
            yield Env(owner, ctx, host)
        finally:
            ctx.close()
            assert owner.gpu_bytes_in_use == 0 and owner.bytes_in_use == 0


@contextmanager
def probe(env: Env) -> Iterator[WasmSession]:
    with env.host.session(PROBE, fuel=10**9, timeout_s=10.0) as s:
        yield s


def mem(s: WasmSession) -> bytes:
    return bytes(s.guest_memory())


def poke(s: WasmSession, offset: int, data: bytes) -> None:
    s.guest_memory()[offset : offset + len(data)] = data


def buffer_bytes(s: WasmSession, handle: int) -> bytes:
    buf = s.run.buffers[handle][0]
    return s.host.ctx.backend.read(buf, 0, buf.nbytes)


def call(s: WasmSession, name: str, *args: object) -> int:
    (result,) = s.call(name, list(args))
    assert isinstance(result, int)
    return result
