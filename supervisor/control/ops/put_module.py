"""``put_module``: keep a tenant's WASM module, so its runs name it by digest instead of resending it.

Kept per tenant in a bounded LRU (:data:`MAX_MODULES_PER_TENANT`,
:data:`MAX_MODULE_BYTES_PER_TENANT`), and counted in the held-bytes budgets
(``HeldBytesLimit`` past them).
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

import zmq

from shared.errors import InvalidArgument
from shared.sizes import MAX_MODULE_BYTES
from supervisor.control.ops._base import Args, FrontendOp

if TYPE_CHECKING:
    from supervisor.admission.frontend import Frontend
    from supervisor.runtime.tenants import TenantRuntime

__all__ = ["MAX_MODULES_PER_TENANT", "MAX_MODULE_BYTES_PER_TENANT", "PutModule"]

MAX_MODULES_PER_TENANT = 32
MAX_MODULE_BYTES_PER_TENANT = 256 << 20


class PutModule(FrontendOp):
    name = "put_module"
    body_in_doc = "module bytes (wasm or WAT text)"
    result_doc = "`{digest}` (sha256 hex; kept per tenant, LRU of 32 modules / 256 MiB)"
    errors_doc = "`InvalidArgument` (empty, > 32 MiB)"

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
        while rt.modules and (
            len(rt.modules) >= MAX_MODULES_PER_TENANT
            or sum(map(len, rt.modules.values())) + len(data) > MAX_MODULE_BYTES_PER_TENANT
        ):
            _, old = rt.modules.popitem(last=False)
            held.release(rt.tenant_id, "modules", len(old))
        held.reserve(rt.tenant_id, "modules", len(data), in_flight=rt.in_flight + len(rt.parked),
                     max_in_flight=rt.spec.max_in_flight)
        rt.modules[digest] = data
        return digest
