"""Count the ``/proc`` reads of the liveness check (``shared.quota._proc_stat``): a reclaim by pid must
read only that pid's entry, where a full scan reads one per live owner."""

from __future__ import annotations

import pytest

from shared import quota

__all__ = ["count_proc_reads"]


def count_proc_reads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """From now on (until the test ends), every pid whose ``/proc`` entry the liveness check reads is
    appended to the returned list."""
    seen: list[int] = []
    real = quota._proc_stat

    def counting(pid: int) -> tuple[bytes, int] | None:
        seen.append(pid)
        return real(pid)

    monkeypatch.setattr(quota, "_proc_stat", counting)
    return seen
