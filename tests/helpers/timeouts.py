"""The suite's timeout scale, for hang guards written inside tests.

A hang guard (a deadline after which a test fails instead of waiting forever) is sized on a quiet
machine; a loaded one runs the same work several times slower. :data:`TIMEOUT_SCALE` is the factor
tests/conftest.py applies to every test's own timeout; :func:`scaled` applies it to a deadline in a
test's code, so that no test needs an amount of work done within a fixed wall-clock time.
"""

from __future__ import annotations

import os

__all__ = ["TIMEOUT_SCALE", "scaled"]

#: every test's timeout (pytest-timeout: the ini default or its own mark) and every scaled() guard
#: times this (``PYTEST_TWT_TIMEOUT_SCALE``, default 3)
TIMEOUT_SCALE = float(os.environ.get("PYTEST_TWT_TIMEOUT_SCALE", "3"))


def scaled(seconds: float) -> float:
    """``seconds`` of a quiet machine's hang guard, as long as this run's scale makes it."""
    return seconds * TIMEOUT_SCALE
