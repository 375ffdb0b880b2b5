"""A loop that lags on demand, for tests only: on PYTHONPATH of a supervisor a test starts.

With ``PYTEST_TWT_STALL_FLAG=PATH`` in its environment when the signal comes, SIGUSR2 makes the main thread (the
supervisor's loop) write ``PATH.stalled`` and then sleep while ``PATH`` exists: the loop reads
nothing, runs no timer and holds no GIL (as a loop that lags on a busy host), while libzmq's I/O
thread and every other thread go on. Nothing of the product reads this variable.
"""

from __future__ import annotations

import os
import signal
import time

def _stall(signum: int, frame: object) -> None:
    # the flag read when the signal comes, not at import: a process forked from the suite's zygote
    # imported this module in the zygote, whose environment is not the test's
    flag = os.environ.get("PYTEST_TWT_STALL_FLAG")
    if not flag:  # not a test's stalling process: SIGUSR2's own action
        signal.signal(signal.SIGUSR2, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGUSR2)
        return
    with open(flag + ".stalled", "w"):
        pass
    while os.path.exists(flag):
        time.sleep(0.01)


signal.signal(signal.SIGUSR2, _stall)
