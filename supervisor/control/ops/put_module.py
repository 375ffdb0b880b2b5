"""``put_module``: keep a tenant's WASM module, so its runs name it by digest instead of resending it.

Kept per tenant in a bounded LRU (:data:`MAX_MODULES_PER_TENANT`,
:data:`MAX_MODULE_BYTES_PER_TENANT`), and counted in the held-bytes budgets
(``HeldBytesLimit`` past them). With a state directory the same modules are
on disk too (:mod:`supervisor.store.modules`: per tenant and generation,
content-addressed): a restarted supervisor serves a run by digest without the
module being sent again (:func:`restore_modules`).
"""

from __future__ import annotations

import hashlib
import logging
from typing import TYPE_CHECKING

import zmq

from shared.errors import InvalidArgument
from shared.sizes import MAX_MODULE_BYTES
from shared.errors import HeldBytesLimit
from shared.log import get_logger, log_event
from supervisor.control.ops._base import Args, FrontendOp

if TYPE_CHECKING:
    from collections.abc import Mapping

    from supervisor.admission.frontend import Frontend
    from supervisor.runtime.tenants import TenantRuntime
    from supervisor.store.modules import ModuleStore

__all__ = ["MAX_MODULES_PER_TENANT", "MAX_MODULE_BYTES_PER_TENANT", "PutModule", "restore_modules"]

_log = get_logger("supervisor")

MAX_MODULES_PER_TENANT = 32
MAX_MODULE_BYTES_PER_TENANT = 256 << 20


class PutModule(FrontendOp):
    name = "put_module"
    body_in_doc = "module bytes (wasm or WAT text)"
    result_doc = "`{digest}` (sha256 hex; kept per tenant, LRU of 32 modules / 256 MiB)"
    error_notes = {
        "InvalidArgument": "empty, > 32 MiB",
    }

    def serve(self, frontend: Frontend, rt: TenantRuntime, args: Args, body: object) -> object:
        return {"digest": self.keep(frontend, rt, body)}

    def keep(self, frontend: Frontend, rt: TenantRuntime, body: object) -> str:
        """Keep a tenant's module (bounded LRU) so runs can name it by digest."""
        if not isinstance(body, (zmq.Frame, bytes, bytearray, memoryview)):
            raise InvalidArgument("put_module needs the module bytes as the body frame")
        if len(body) > MAX_MODULE_BYTES:
            raise InvalidArgument(f"module of {len(body):,} B exceeds the {MAX_MODULE_BYTES:,}-byte limit")
        data = body.bytes if isinstance(body, zmq.Frame) else bytes(body)
        if not data:
            raise InvalidArgument("put_module: empty module")
        digest = hashlib.sha256(data).hexdigest()
        if digest in rt.modules:
            rt.modules.move_to_end(digest)
            return digest
        # Room first among the tenant's own modules (LRU), then the held-bytes budgets
        # (per tenant and for all tenants together): HeldBytesLimit beyond them.
        held = frontend.guard.held
        store = frontend.module_store
        while rt.modules and (
            len(rt.modules) >= MAX_MODULES_PER_TENANT
            or sum(map(len, rt.modules.values())) + len(data) > MAX_MODULE_BYTES_PER_TENANT
        ):
            gone, old = rt.modules.popitem(last=False)
            held.release(rt.tenant_id, "modules", len(old))
            if store is not None:
                store.remove(rt.tenant_id, rt.generation, gone)
        held.reserve(rt.tenant_id, "modules", len(data), in_flight=rt.in_flight + rt.waiting,
                     max_in_flight=rt.spec.max_in_flight)
        rt.modules[digest] = data
        if store is not None:
            store.save(rt.tenant_id, rt.generation, digest, data)  # on the store's thread: never waited for
        return digest


def restore_modules(store: ModuleStore, frontend: Frontend, tenants: Mapping[str, TenantRuntime],
                    stored: Mapping[str, int] | None = None) -> int:
    """At start, after the tenants are restored: each one's stored modules back in its LRU, oldest
    first, within the same bounds as :meth:`PutModule.keep` (what does not fit is removed); the
    directories of tenants or generations neither running nor in ``stored`` (tenant id ->
    generation in the state: one not restored this time keeps its modules) are removed.
    Returns how many came back."""
    store.prune({**(stored or {}), **{tid: rt.generation for tid, rt in tenants.items()}})
    held = frontend.guard.held
    loaded = 0
    for tid, rt in tenants.items():
        modules = store.load(tid, rt.generation)
        total = 0
        for n, module in enumerate(reversed(modules)):  # the newest first: those are kept when over
            fits = n < MAX_MODULES_PER_TENANT and total + len(module.data) <= MAX_MODULE_BYTES_PER_TENANT
            if fits:
                try:
                    held.reserve(tid, "modules", len(module.data), in_flight=0, max_in_flight=rt.spec.max_in_flight)
                except HeldBytesLimit:
                    fits = False
            if not fits:
                log_event(_log, logging.WARNING, "modules.over_bound", tenant=tid, digest=module.digest)
                store.remove(tid, rt.generation, module.digest)
                continue
            total += len(module.data)
            rt.modules[module.digest] = module.data
            rt.modules.move_to_end(module.digest, last=False)  # oldest at the front (the LRU's end)
            loaded += 1
    return loaded
