"""Fixtures of the worker's tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from shared.quota import QuotaBlock


@pytest.fixture
def block() -> Iterator[QuotaBlock]:
    """A fresh tenant quota block as its worker sees it (instance 0's handle; the owner's is closed and
    unlinked after the test). A test module that needs a block with limits defines its own."""
    with QuotaBlock.create("gate") as owner:
        attached = QuotaBlock.attach(owner.name, instance=0)
        try:
            yield attached
        finally:
            attached.close()
