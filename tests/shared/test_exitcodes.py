"""The exit-code table the worker and the supervisor share (shared/exitcodes.py)."""

from __future__ import annotations

import pytest

from shared.exitcodes import (
    WORKER_CUDA_CONTEXT_LOST,
    WORKER_PARENT_GONE,
    STICKY_CUDA_ERRORS,
    context_lost_error,
    context_lost_exit_code,
    exit_reason,
    is_sticky_cuda_error,
)


@pytest.mark.parametrize("name", STICKY_CUDA_ERRORS)
def test_every_sticky_error_has_its_own_exit_code_that_names_it_again(name: str) -> None:
    code = context_lost_exit_code(name)
    assert 0 < code < 256 and code not in (1, WORKER_PARENT_GONE)
    assert context_lost_error(code) == name
    assert exit_reason(code) == f"CUDA context lost: {name}"
    assert is_sticky_cuda_error(name)


def test_codes_are_distinct_and_an_unlisted_sticky_error_still_reads_as_context_lost() -> None:
    codes = [context_lost_exit_code(n) for n in STICKY_CUDA_ERRORS]
    assert len(set(codes)) == len(codes) and codes[0] == WORKER_CUDA_CONTEXT_LOST
    other = context_lost_exit_code("CUDA_ERROR_FROM_A_NEWER_DRIVER")
    assert exit_reason(other) == "CUDA context lost: a sticky CUDA error"


def test_other_exits_keep_their_wording() -> None:
    assert exit_reason(0) == "exited with code 0"
    assert exit_reason(3) == "exited with code 3"
    assert exit_reason(None, 9) == "killed by signal 9"
    assert context_lost_error(None) is None and context_lost_error(1) is None
    assert not is_sticky_cuda_error("CUDA_ERROR_OUT_OF_MEMORY")
