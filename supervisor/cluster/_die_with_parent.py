"""``python -m supervisor.cluster._die_with_parent PPID CMD...``: exec CMD, to die when PPID does.

Sets ``PR_SET_PDEATHSIG(SIGTERM)`` (kept across ``execve``), checks that the
parent is still ``PPID`` (it may have died before the prctl), then becomes
CMD. The node actor starts its supervisor through this instead of a
``preexec_fn``, which is unsafe in a process with threads (a Ray worker has
many). SIGTERM, not SIGKILL: the supervisor stops its workers and unlinks
its segments on the way out.
"""

from __future__ import annotations

import os
import signal
import sys

from shared.prctl import set_parent_death_signal

__all__: list[str] = []


def main(argv: list[str]) -> None:
    if len(argv) < 2 or not argv[0].isdigit():
        sys.exit("usage: python -m supervisor.cluster._die_with_parent PPID CMD...")
    set_parent_death_signal(signal.SIGTERM)
    if os.getppid() != int(argv[0]):
        sys.exit(71)  # the parent died before the prctl took effect
    os.execv(argv[1], argv[1:])


if __name__ == "__main__":
    main(sys.argv[1:])
