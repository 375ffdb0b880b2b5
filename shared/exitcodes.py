"""Process exit codes, each defined once: the CLI's, and the worker's that the supervisor reads.

The CLI follows the BSD ``sysexits`` spirit: 0 done, 1 the operation failed
(a typed error), 2 bad usage, 3 no supervisor, 4 a check failed (``twt chaos``
found a violated invariant), 70 an internal error (a bug: a trace is printed),
130 interrupted.

A worker ends with a code that tells the supervisor *why*, without any message
having to get through first (:func:`exit_cause` names it in metrics, :func:`exit_reason`
words it in events, ``WorkerLost`` and ``status``):

    0                      stopped when asked
    1   WORKER_CRASHED     an uncaught exception; the traceback is in its log
    70  WORKER_SUPERVISOR_SILENT   the supervisor fell silent and its process is gone
                                   (a silent but living supervisor is waited for)
    71  WORKER_PARENT_GONE         its parent (the supervisor) died
    72  WORKER_COMPILE_OVERRUN     a WASM compile ran past its run's deadline (the compiler
                                   cannot be stopped otherwise; the run got KernelTimeout)
    73  WORKER_GPU_QUEUE_OVERRUN   a WASM run's queued GPU work outlived its deadline plus a grace
                                   period (only destroying the CUDA context cancels queued work;
                                   the run got KernelTimeout)
    80+i WORKER_CUDA_CONTEXT_LOST  the CUDA context hit sticky error number i of
                                   ``STICKY_CUDA_ERRORS`` (80 + len: a sticky code not
                                   in the table)

Sticky errors are the driver codes that its documentation describes as
leaving the context unusable: "the process must be terminated and relaunched"
(an illegal address, a launch failure, a trap, an ECC error ...). After one,
*every* later call in that process's context returns the same error, so a
worker that kept serving would answer heartbeats and fail every operation
forever. The worker answers the request that hit it with the ``CudaError``,
then exits with ``WORKER_CUDA_CONTEXT_LOST + index``; the supervisor words the
exit as ``"CUDA context lost: <error name>"`` for the event, the ``WorkerLost``
of every other request in flight on that worker and the restart policy, which
counts it as a failure.
"""


from __future__ import annotations

from typing import Final

__all__ = [
    "STICKY_CUDA_ERRORS",
    "EXIT_CHECK",
    "EXIT_FAILED",
    "EXIT_INTERNAL",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_UNAVAILABLE",
    "EXIT_USAGE",
    "WORKER_COMPILE_OVERRUN",
    "WORKER_GPU_QUEUE_OVERRUN",
    "WORKER_CRASHED",
    "WORKER_CUDA_CONTEXT_LOST",
    "WORKER_EXIT_CAUSES",
    "WORKER_PARENT_GONE",
    "WORKER_SUPERVISOR_SILENT",
    "context_lost_error",
    "context_lost_exit_code",
    "exit_cause",
    "exit_reason",
    "is_sticky_cuda_error",
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
#: the supervisor fell silent and its process is gone (silence alone is waited out: worker.control)
WORKER_SUPERVISOR_SILENT: Final = 70
#: the parent (supervisor or fork server) is gone
WORKER_PARENT_GONE: Final = 71
#: a WASM compile ran past its run's deadline: the worker ends to stop the compiler thread
WORKER_COMPILE_OVERRUN: Final = 72
#: a WASM run's queued GPU work ran past its deadline + grace: exiting destroys the context, which cancels it
WORKER_GPU_QUEUE_OVERRUN: Final = 73
#: the CUDA context hit a sticky error: 80 + its index in STICKY_CUDA_ERRORS
WORKER_CUDA_CONTEXT_LOST: Final = 80

#: The driver's sticky error names (cuda.h: "the process must be terminated and relaunched"),
#: in a fixed order: an error's index here is its offset from WORKER_CUDA_CONTEXT_LOST.
#: Append only - the order is part of the exit-code contract.
STICKY_CUDA_ERRORS: tuple[str, ...] = (
    "CUDA_ERROR_ILLEGAL_ADDRESS",  # 700
    "CUDA_ERROR_LAUNCH_FAILED",  # 719
    "CUDA_ERROR_MISALIGNED_ADDRESS",  # 716
    "CUDA_ERROR_ILLEGAL_INSTRUCTION",  # 715
    "CUDA_ERROR_HARDWARE_STACK_ERROR",  # 714
    "CUDA_ERROR_INVALID_PC",  # 718
    "CUDA_ERROR_INVALID_ADDRESS_SPACE",  # 717
    "CUDA_ERROR_ASSERT",  # 710
    "CUDA_ERROR_LAUNCH_TIMEOUT",  # 702
    "CUDA_ERROR_ECC_UNCORRECTABLE",  # 214
    "CUDA_ERROR_TENSOR_MEMORY_LEAK",  # 721 (CUDA 12.8+)
    "CUDA_ERROR_CONTAINED",  # 226
    "CUDA_ERROR_MPS_CLIENT_TERMINATED",  # 810
    "CUDA_ERROR_EXTERNAL_DEVICE",  # 911
)
_STICKY = frozenset(STICKY_CUDA_ERRORS)
_UNLISTED = len(STICKY_CUDA_ERRORS)


def is_sticky_cuda_error(name: str) -> bool:
    """Whether the driver error ``name`` leaves the context unusable for the rest of the process."""
    return name in _STICKY


def context_lost_exit_code(name: str) -> int:
    """The exit code a worker uses after the sticky error ``name``."""
    try:
        return WORKER_CUDA_CONTEXT_LOST + STICKY_CUDA_ERRORS.index(name)
    except ValueError:
        return WORKER_CUDA_CONTEXT_LOST + _UNLISTED


#: worker exit code -> the cause the supervisor reports (metrics label, events); others are "exit"
WORKER_EXIT_CAUSES: Final[dict[int, str]] = {
    WORKER_SUPERVISOR_SILENT: "supervisor_silent",
    WORKER_PARENT_GONE: "parent_gone",
    WORKER_COMPILE_OVERRUN: "compile_overrun",
    WORKER_GPU_QUEUE_OVERRUN: "gpu_queue_overrun",
}


def context_lost_error(code: int | None) -> str | None:
    """The sticky error name an exit code stands for, or None when it is not a context-lost exit."""
    if code is None or not WORKER_CUDA_CONTEXT_LOST <= code <= WORKER_CUDA_CONTEXT_LOST + _UNLISTED:
        return None
    index = code - WORKER_CUDA_CONTEXT_LOST
    return STICKY_CUDA_ERRORS[index] if index < _UNLISTED else "a sticky CUDA error"


def exit_cause(code: int | None, sig: int | None) -> str:
    """Why a worker ended on its own: "signal", "exit", or the name of a known worker exit code."""
    if sig:
        return "signal"
    if code is not None and code in WORKER_EXIT_CAUSES:
        return WORKER_EXIT_CAUSES[code]
    if context_lost_error(code) is not None:
        return "cuda"
    return "exit"


def exit_reason(code: int | None, signal: int | None = None) -> str:
    """How the supervisor words a worker's end in events, ``WorkerLost`` and ``status``."""
    if signal:
        return f"killed by signal {signal}"
    lost = context_lost_error(code)
    if lost is not None:
        return f"CUDA context lost: {lost}"
    if code == WORKER_COMPILE_OVERRUN:
        return "a WASM compile ran past its run's deadline (worker ended to stop it)"
    if code == WORKER_GPU_QUEUE_OVERRUN:
        return "a WASM run's queued GPU work ran past its deadline (worker ended to cancel it)"
    return f"exited with code {code}"
