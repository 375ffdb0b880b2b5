"""The frontend's parts: its handler tables are checked against the op table when they are grouped."""

from __future__ import annotations

import pytest

from shared import protocol as proto
from supervisor.admission.frontend import Handlers
from supervisor.control import ops


def test_handler_tables_that_miss_an_op_are_refused_at_construction() -> None:
    admin = {name: (lambda client, rid, args: None) for name, spec in proto.OPS.items() if spec.admin}
    handlers = Handlers(admin, ops.local_handlers(), ops.either_handlers())
    assert set(handlers.admin) == proto.ADMIN_OPS
    with pytest.raises(RuntimeError, match="admin ops"):
        Handlers({k: v for k, v in admin.items() if k != "evict"}, ops.local_handlers(), ops.either_handlers())
    with pytest.raises(RuntimeError, match="either-capability ops"):
        Handlers(admin, ops.local_handlers(), {})
