"""A loop that lags on demand, for tests only: on PYTHONPATH of a supervisor a test starts.

With ``PYTEST_TWT_STALL_FLAG=PATH`` in its environment, SIGUSR2 makes the main thread (the
supervisor's loop) write ``PATH.stalled`` and then sleep while ``PATH`` exists: the loop reads
nothing, runs no timer and holds no GIL (as a loop that lags on a busy host), while libzmq's I/O
thread and every other thread go on. Nothing of the product reads this variable.
"""

from __future__ import annotations

import os
import signal
import time

_FLAG = os.environ.get("PYTEST_TWT_STALL_FLAG")


def _stall(signum: int, frame: object) -> None:
    assert _FLAG is not None
    with open(_FLAG + ".stalled", "w"):
        pass
    while os.path.exists(_FLAG):
        time.sleep(0.01)


if _FLAG:
    signal.signal(signal.SIGUSR2, _stall)
