"""shared.frames is the protocol's framing, not a copy of it: shared.protocol re-exports each of its
names as the same object, so a worker (which imports shared.frames alone) and the supervisor (which
reads shared.protocol) pack and check headers with one implementation and one set of limits."""

from __future__ import annotations

import ast

import pytest

from shared import frames, protocol


@pytest.mark.parametrize("name", frames.__all__)
def test_the_protocol_reexports_each_framing_name_as_the_same_object(name: str) -> None:
    assert getattr(protocol, name) is getattr(frames, name)


def test_the_framing_needs_neither_the_op_table_nor_the_records() -> None:
    """Read from the source: shared.frames imports no module that builds the op table or the records."""
    with open(frames.__file__, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    imported |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    assert not imported & {"shared.protocol", "shared.records", "shared.spec", "shared.quota", "shared.wire"}
