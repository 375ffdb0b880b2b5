"""What the supervisor, its client and the workers share: the wire contract (the ops and their
typed arguments and replies, records, errors, capabilities, the run dir's and keys' client
formats, the config file) and the shared-memory primitives (the quota block and its C atomics
helper, the device budget, the GPU-time board, data regions), with ids, sizes and logging.

Nothing here imports :mod:`supervisor` or :mod:`worker` (tests/test_boundaries.py); a module
only the supervisor uses lives under ``supervisor/``.
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
