"""``launch()`` is told when its supervisor is ready (``READY=1`` on a socket of the run dir) and
reads the ready file then, instead of reading it every 20 ms until it appears."""

from __future__ import annotations

import os
import time
from types import SimpleNamespace

import pytest

import supervisor.client.launch as launcher
from tests.helpers.cluster import supervisor, tenant

pytestmark = pytest.mark.timeout(120)


def test_launch_waits_for_the_ready_notification_not_a_duration(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_sleep(seconds: float) -> None:
        raise AssertionError(f"launch() slept {seconds} s to poll the ready file")

    monkeypatch.setattr(launcher, "time", SimpleNamespace(monotonic=time.monotonic, sleep=no_sleep))
    with supervisor([{"name": "acme"}]) as sup:
        assert tenant(sup.client.status(), "acme").pids  # ready: its one tenant is up
        # the socket is gone once the supervisor is ready; its later notifications go nowhere
        assert not os.path.exists(os.path.join(sup.run_dir, "launch-notify.sock"))
        assert sup.info["pid"] == sup.pid


def test_a_supervisor_that_exits_before_it_is_ready_is_still_noticed(tmp_path: os.PathLike[str]) -> None:
    """No notification comes from a child that dies: the wait looks at the child every 100 ms."""
    from shared.errors import SupervisorUnavailable

    with pytest.raises(SupervisorUnavailable, match="exited with code"):
        with supervisor([{"name": "acme"}], state_dir="/dev/null/not-a-directory"):
            pass
