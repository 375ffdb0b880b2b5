"""A pool worker warms its first bind's tenant-free parts before it says hello (worker.server)."""

from __future__ import annotations

import os

import pytest

import shared._shm
import shared.quota
from worker.server import warm_bind_path

pytestmark = pytest.mark.timeout(30)


def test_the_warm_up_caches_the_start_time_and_touches_no_segment(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_segment(*args: object, **kwargs: object) -> None:
        raise AssertionError("the warm-up touched a shared-memory segment")

    monkeypatch.setattr(shared._shm, "attach", no_segment)
    monkeypatch.setattr(shared._shm, "create", no_segment)
    monkeypatch.setattr(shared.quota, "_own_start", None)
    warm_bind_path()
    found = shared.quota._proc_stat(os.getpid())
    assert found is not None
    assert shared.quota._own_start == (os.getpid(), found[1])  # a slot claim reads no /proc at bind
