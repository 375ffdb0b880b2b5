"""Code both the supervisor and the workers import: ids, errors, sizes, logging,
the shared-memory quota block and its C atomics helper, data regions.

Nothing here imports :mod:`supervisor` or :mod:`worker`.
"""

from __future__ import annotations

from shared import errors as _errors
from shared.errors import *  # noqa: F403 - the whole error tree is public: shared.errors.__all__
from shared.ids import InstanceId, TenantId
from shared.log import configure_logging, get_logger, log_event
from shared.quota import (
    DEFAULT_QUOTA_BYTES,
    QuotaBlock,
    QuotaSnapshot,
    cleanup_stale_segments,
)
from shared.region import Region
from shared.sizes import format_size, parse_size

__all__ = [
    "DEFAULT_QUOTA_BYTES",
    "InstanceId",
    "QuotaBlock",
    "QuotaSnapshot",
    "Region",
    "TenantId",
    "cleanup_stale_segments",
    "configure_logging",
    "format_size",
    "get_logger",
    "log_event",
    "parse_size",
]
__all__ += _errors.__all__
__all__.sort()  # one sorted face, the error tree included
