"""In-process WASM test environments: a real TenantContext over a real QuotaBlock, the stub backend, a WasmHost.

Shared by the host and ABI tests (tests/worker/wasm/test_wasm_host.py,
test_wasm_abi.py, test_wasm_tensor_ops.py, test_cuda_tensor_ops.py):
``tenant_env`` builds the context on any backend, ``make_env`` the ABI tests'
stub one, ``probe`` opens a session on ``worker/guests/probe.wat`` (every
import re-exported one to one; compiled once per process, see :func:`compiled_once`), ``mlp_forward`` runs the MLP guest on client
buffers, and the small helpers read and poke guest memory and buffers.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from shared.quota import QuotaBlock
from shared.spec import TenantSpec
from worker.backends.base import Backend
from worker.backends.stub import StubBackend
from worker.context import TenantContext
from worker.wasm import WasmHost, WasmSession, guest_source

__all__ = [
    "MLP", "PAGE", "PROBE", "Env", "MlpRun", "buffer_bytes", "call", "compiled_once", "make_env", "mem", "mlp_forward",
    "mlp_inputs", "poke", "probe", "softmax", "tenant_env",
]

MiB = 1 << 20
PAGE = 65536
PROBE = guest_source("probe")
MLP = guest_source("mlp")


@dataclass
class Env:
    block: QuotaBlock
    ctx: TenantContext
    host: WasmHost

    def counters(self) -> tuple[int, int]:
        return self.block.bytes_in_use, self.block.gpu_bytes_in_use


@contextmanager
def tenant_env(tenant_id: str, backend: Backend, *, fast: bool | None = None, memory_quota: int = 64 * MiB,
               gpu_cap: int | None = 1 * MiB, max_memory: int = 1 * MiB, **spec: Any) -> Iterator[Env]:
    """A TenantContext on ``backend`` over a fresh QuotaBlock, with its WasmHost; every byte must go back.

    ``spec`` adds TenantSpec fields (``wasm_timeout_s=...``). ``fast=None`` is
    the worker's default (the unchecked imports where they load).
    """
    tenant = TenantSpec.from_dict({"tenant_id": tenant_id, "memory_quota_bytes": memory_quota,
                                   "gpu_memory_bytes_cap": gpu_cap, "wasm_max_memory_bytes": max_memory, **spec})
    with QuotaBlock.create(tenant_id, memory_quota_bytes=memory_quota, gpu_memory_bytes_cap=gpu_cap) as owner:
        ctx = TenantContext(tenant, 0, 0, QuotaBlock.attach(owner.name, instance=0), backend)
        host = WasmHost(ctx, fast_imports=fast)
        ctx.extensions[WasmHost.EXTENSION] = host
        try:
            yield Env(owner, ctx, host)
        finally:
            ctx.close()
            assert (owner.bytes_in_use, owner.gpu_bytes_in_use) == (0, 0)


@contextmanager
def make_env(fast: bool, *, gpu_cap: int | None = 1 * MiB, capacity: int = 16 << 30) -> Iterator[Env]:
    """The ABI tests' context: the stub backend (``capacity`` bytes of device), tenant ``abi``."""
    with tenant_env("abi", StubBackend(capacity_bytes=capacity), fast=fast, gpu_cap=gpu_cap) as env:
        yield env


#: digest -> the compiled form (``WasmHost.artifacts``) of a module as the first host of this process
#: that ran it compiled it
_artifacts: dict[str, bytes] = {}


@contextmanager
def compiled_once(env: Env, body: bytes) -> Iterator[None]:
    """Runs of ``body`` (a module's binary, or the probe's text) inside, on ``env``'s host, from the
    compiled form the process's first host of it made (``hold_artifact``, as an activated worker
    loads its tenant's modules) where one did; the first compiles it, and its form is kept on the
    way out. A compile is ~25-150 ms of CPU, the larger part of a run of a small guest, and the
    tests that use this check what the guest's runs do, on the same machine code (each host still
    links the imports itself); compiling stays covered by each process's first run of each module
    and by test_wasm_host and test_wasm_artifacts."""
    digest = hashlib.sha256(body).hexdigest()
    if digest in _artifacts:
        env.host.hold_artifact(body, digest, _artifacts[digest])
    yield
    if digest not in _artifacts:
        _artifacts.update(env.host.artifacts([digest], 1 << 30))


@contextmanager
def probe(env: Env, *, timeout_s: float = 10.0) -> Iterator[WasmSession]:
    """A session on the probe guest, compiled once per process (:func:`compiled_once`): a compile
    is most of an ABI test's cost, and what these tests check is the imports."""
    with compiled_once(env, PROBE), env.host.session(PROBE, fuel=10**9, timeout_s=timeout_s) as s:
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


def softmax(x: Any) -> Any:
    """Row-wise softmax as the ABI defines it: ``exp(x - max) / sum`` per row."""
    with np.errstate(all="ignore"):
        e = np.exp(x - x.max(axis=1, keepdims=True))
        return e / e.sum(axis=1, keepdims=True)


def mlp_inputs(batch: int, d_in: int, hidden: int, d_out: int, seed: int = 3) -> dict[str, Any]:
    """Random float32 inputs and weights of the 2-layer MLP (x, w1, b1, w2, b2), scaled like a trained net's."""
    r = np.random.default_rng(seed)
    return {
        "x": r.standard_normal((batch, d_in), dtype=np.float32),
        "w1": (r.standard_normal((d_in, hidden), dtype=np.float32) / np.sqrt(d_in)).astype(np.float32),
        "b1": r.standard_normal(hidden, dtype=np.float32) * np.float32(0.1),
        "w2": (r.standard_normal((hidden, d_out), dtype=np.float32) / np.sqrt(hidden)).astype(np.float32),
        "b2": r.standard_normal(d_out, dtype=np.float32) * np.float32(0.1),
    }


@dataclass
class MlpRun:
    reply: dict[str, Any]
    out: Any  # the guest's output buffer, float32 (batch, d_out)
    args: list[dict[str, int]]  # the buffer arguments: x, w1, b1, w2, b2, out


@contextmanager
def mlp_forward(host: WasmHost, p: dict[str, Any], batch: int, d_in: int, hidden: int, d_out: int, *,
                timeout_s: float = 10.0) -> Iterator[MlpRun]:
    """``forward`` of ``worker/guests/mlp.wat`` on client buffers holding ``p`` (x, w1, b1, w2, b2).

    The buffers stay alive inside the ``with`` (for a further guest call on
    them) and are freed on the way out, whatever the run did. Used by the
    worker tests and by the GPU check's tensor-ops phase.
    """
    alloc, backend = host.ctx.allocator, host.ctx.backend
    handles: dict[str, int] = {}
    try:
        for name, arr in p.items():
            handles[name] = alloc.alloc(arr.nbytes)
            backend.write(alloc.lookup(handles[name]), 0, memoryview(arr.tobytes()))
        handles["out"] = alloc.alloc(4 * batch * d_out)
        args = [{"handle": handles[k]} for k in ("x", "w1", "b1", "w2", "b2", "out")]
        reply = host.run(MLP, "forward", [*args, batch, d_in, hidden, d_out], fuel=10**7, timeout_s=timeout_s)
        out = np.frombuffer(backend.read(alloc.lookup(handles["out"]), 0, 4 * batch * d_out), np.float32)
        yield MlpRun(reply, out.reshape(batch, d_out), args)
    finally:
        for h in handles.values():
            alloc.free(h)
