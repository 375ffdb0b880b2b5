"""ClusterCapability: what a tenant of a cluster holds - where it runs, how to reach it, its token.

    twtc1.<base64url(msgpack [cluster, tenant, node, endpoint, server key, capability, ticket, epoch])>

* ``endpoint`` / ``server_public_key``: the node supervisor's CURVE TCP
  frontend; calls go there directly, never through Ray.
* ``capability``: the tenant capability minted by that node's supervisor.
* ``ticket``: 16 random bytes drawn at registration. The cluster's directory
  keeps only their SHA-256 and hands the tenant's *current* placement to
  whoever shows the ticket, which is how a client holding an old cluster
  capability finds its tenant again after a node loss.
* ``epoch``: the placement number; each re-placement adds one.

The text form is a secret, as a tenant capability is: anyone holding it can
act as the tenant.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass, replace
from collections.abc import Mapping

import msgpack

from shared.capability import TenantCapability
from shared.checks import is_int
from shared.errors import InvalidArgument

__all__ = ["ClusterCapability"]

_PREFIX = "twtc1."
_MAX_TEXT = 4096


@dataclass(frozen=True)
class ClusterCapability:
    """A tenant's placement in a cluster plus its capabilities (see the module docstring)."""

    cluster: str
    tenant_id: str
    node_id: str
    endpoint: str
    server_public_key: str
    capability: bytes
    ticket: bytes
    epoch: int = 0

    def __repr__(self) -> str:  # the tokens are secrets: never in logs or tracebacks
        return (
            f"ClusterCapability(cluster={self.cluster!r}, tenant_id={self.tenant_id!r}, "
            f"node_id={self.node_id[:12]!r}, endpoint={self.endpoint!r}, epoch={self.epoch})"
        )

    def tenant_capability(self) -> TenantCapability:
        """The node supervisor's token for this tenant (what its frontend checks)."""
        return TenantCapability.from_bytes(self.capability)

    def moved(self, placement: Mapping[str, object]) -> ClusterCapability:
        """The same tenant and ticket at a new placement (a directory ``lookup`` record)."""
        return replace(
            self,
            node_id=str(placement["node_id"]),
            endpoint=str(placement["endpoint"]),
            server_public_key=str(placement["server_public_key"]),
            capability=_bytes_field(placement, "capability"),
            epoch=_int_field(placement, "epoch"),
        )

    def to_text(self) -> str:
        packed = msgpack.packb(
            [self.cluster, self.tenant_id, self.node_id, self.endpoint, self.server_public_key,
             self.capability, self.ticket, self.epoch],
            use_bin_type=True,
        )
        return _PREFIX + base64.urlsafe_b64encode(packed).decode("ascii").rstrip("=")

    __str__ = to_text

    @classmethod
    def from_text(cls, text: str) -> ClusterCapability:
        """Parse :meth:`to_text` output; :class:`InvalidArgument` for anything else."""
        if not isinstance(text, str) or not text.startswith(_PREFIX) or len(text) > _MAX_TEXT:
            raise InvalidArgument(f"not a cluster capability (expected text starting with {_PREFIX!r})")
        body = text[len(_PREFIX):].strip()
        try:
            raw = base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))
            items = msgpack.unpackb(raw, raw=False, max_str_len=1024, max_bin_len=1024, max_array_len=16,
                                    max_map_len=0, max_ext_len=0)
        except (binascii.Error, ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
            raise InvalidArgument(f"malformed cluster capability ({exc})") from None
        if not isinstance(items, list) or len(items) != 8:
            raise InvalidArgument("malformed cluster capability (wrong shape)")
        cluster, tenant, node, endpoint, key, cap, ticket, epoch = items
        if not all(isinstance(v, str) for v in (cluster, tenant, node, endpoint, key)) or not all(
            isinstance(v, bytes) for v in (cap, ticket)
        ) or not is_int(epoch):
            raise InvalidArgument("malformed cluster capability (wrong field types)")
        try:
            TenantCapability.from_bytes(cap)
        except Exception as exc:  # noqa: BLE001 - any parse failure of untrusted bytes is "malformed"
            raise InvalidArgument(f"malformed cluster capability (its tenant capability: {exc})") from None
        return cls(cluster, tenant, node, endpoint, key, cap, ticket, epoch)


def _bytes_field(record: Mapping[str, object], name: str) -> bytes:
    value = record[name]
    if not isinstance(value, bytes):
        raise InvalidArgument(f"directory record: {name} must be bytes, not {type(value).__name__}")
    return value


def _int_field(record: Mapping[str, object], name: str) -> int:
    value = record[name]
    if not is_int(value):
        raise InvalidArgument(f"directory record: {name} must be an int, not {type(value).__name__}")
    return value
