"""Process exit codes, each defined once: the CLI's, and the worker's that the supervisor reads.

The CLI follows the BSD ``sysexits`` spirit: 0 done, 1 the operation failed
(a typed error), 2 bad usage, 3 no supervisor, 4 a check failed (``twt chaos``
found a violated invariant), 70 an internal error (a bug: a trace is printed),
130 interrupted.

A worker's exit code tells the supervisor why it ended without being asked to
(:func:`exit_cause` names it in metrics and events). A new worker exit code (the
cuda backend's "sticky CUDA error", say) is added here and to :data:`WORKER_EXIT_CAUSES`.
"""

from __future__ import annotations

from typing import Final

__all__ = [
    "EXIT_CHECK",
    "EXIT_FAILED",
    "EXIT_INTERNAL",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_UNAVAILABLE",
    "EXIT_USAGE",
    "WORKER_CRASHED",
    "WORKER_EXIT_CAUSES",
    "WORKER_PARENT_GONE",
    "WORKER_SUPERVISOR_SILENT",
    "exit_cause",
]

# ------------------------------------------------------------------ the CLI (`twt ...`)
EXIT_OK: Final = 0
EXIT_FAILED: Final = 1
EXIT_USAGE: Final = 2
EXIT_UNAVAILABLE: Final = 3
EXIT_CHECK: Final = 4
EXIT_INTERNAL: Final = 70  # EX_SOFTWARE
EXIT_INTERRUPTED: Final = 130

# ------------------------------------------------------------------ worker processes
#: the serve loop raised (logged as ``worker.crashed``)
WORKER_CRASHED: Final = 1
#: the supervisor stopped sending heartbeats
WORKER_SUPERVISOR_SILENT: Final = 70
#: the parent (supervisor or fork server) is gone
WORKER_PARENT_GONE: Final = 71

#: worker exit code -> the cause the supervisor reports (metrics label, events); others are "exit"
WORKER_EXIT_CAUSES: Final[dict[int, str]] = {
    WORKER_SUPERVISOR_SILENT: "supervisor_silent",
    WORKER_PARENT_GONE: "parent_gone",
}


def exit_cause(code: int | None, sig: int | None) -> str:
    """Why a worker ended on its own: "signal", "exit", or the name of a known worker exit code."""
    if sig:
        return "signal"
    if code is not None and code in WORKER_EXIT_CAUSES:
        return WORKER_EXIT_CAUSES[code]
    return "exit"
