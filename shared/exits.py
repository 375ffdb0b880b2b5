"""Worker exit codes, and what the supervisor says about each: the one table both sides read.

A worker ends with a code that tells the supervisor *why*, without any message
having to get through first:

    0                    stopped when asked
    1                    crashed (an uncaught exception; the traceback is in its log)
    70  EXIT_SUPERVISOR_SILENT   no heartbeat from the supervisor for too long
    71  EXIT_PARENT_GONE         its parent (the supervisor) died
    72  EXIT_COMPILE_OVERRUN     a WASM compile ran past its run's deadline (the compiler
                                 cannot be stopped otherwise; the run got KernelTimeout)
    80+i EXIT_CUDA_CONTEXT_LOST  the CUDA context hit sticky error number i of
                                 ``STICKY_CUDA_ERRORS`` (80 + len: a sticky code not
                                 in the table)

Sticky errors are the driver codes that its documentation describes as
leaving the context unusable: "the process must be terminated and relaunched"
(an illegal address, a launch failure, a trap, an ECC error ...). After one,
*every* later call in that process's context returns the same error, so a
worker that kept serving would answer heartbeats and fail every operation
forever. The worker answers the request that hit it with the ``CudaError``,
then exits with ``EXIT_CUDA_CONTEXT_LOST + index``; the supervisor words the
exit as ``"CUDA context lost: <error name>"`` (:func:`exit_reason`) for the
event, the ``WorkerLost`` of every other request in flight on that worker and
the restart policy, which counts it as a failure.
"""

from __future__ import annotations

__all__ = [
    "EXIT_COMPILE_OVERRUN",
    "EXIT_CRASHED",
    "EXIT_CUDA_CONTEXT_LOST",
    "EXIT_OK",
    "EXIT_PARENT_GONE",
    "EXIT_SUPERVISOR_SILENT",
    "STICKY_CUDA_ERRORS",
    "context_lost_error",
    "context_lost_exit_code",
    "exit_reason",
    "is_sticky_cuda_error",
]

EXIT_OK = 0
EXIT_CRASHED = 1
EXIT_SUPERVISOR_SILENT = 70
EXIT_PARENT_GONE = 71
EXIT_COMPILE_OVERRUN = 72
EXIT_CUDA_CONTEXT_LOST = 80

#: The driver's sticky error names (cuda.h: "the process must be terminated and relaunched"),
#: in a fixed order: an error's index here is its offset from EXIT_CUDA_CONTEXT_LOST.
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
        return EXIT_CUDA_CONTEXT_LOST + STICKY_CUDA_ERRORS.index(name)
    except ValueError:
        return EXIT_CUDA_CONTEXT_LOST + _UNLISTED


def context_lost_error(code: int | None) -> str | None:
    """The sticky error name an exit code stands for, or None when it is not a context-lost exit."""
    if code is None or not EXIT_CUDA_CONTEXT_LOST <= code <= EXIT_CUDA_CONTEXT_LOST + _UNLISTED:
        return None
    index = code - EXIT_CUDA_CONTEXT_LOST
    return STICKY_CUDA_ERRORS[index] if index < _UNLISTED else "a sticky CUDA error"


def exit_reason(code: int | None, signal: int | None = None) -> str:
    """How the supervisor words a worker's end in events, ``WorkerLost`` and ``status``."""
    if signal:
        return f"killed by signal {signal}"
    lost = context_lost_error(code)
    if lost is not None:
        return f"CUDA context lost: {lost}"
    if code == EXIT_COMPILE_OVERRUN:
        return "a WASM compile ran past its run's deadline (worker ended to stop it)"
    return f"exited with code {code}"
