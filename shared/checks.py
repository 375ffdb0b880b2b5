"""Type checks of decoded values that Python's ``isinstance`` gets wrong for our purposes.

``bool`` is a subclass of ``int``: ``isinstance(True, int)`` holds, so a
message or config value ``true`` would pass as the number 1. Every check of a
wire, config or argument value that means "an integer" or "a number" uses
these instead of spelling ``isinstance(x, bool) or not isinstance(x, int)``
out again.

Both narrow the type for mypy in either branch (``TypeIs``): after
``if not is_int(x): raise ...``, ``x`` is an ``int``. ``TypeIs`` is imported
for the type checker only; nothing here needs ``typing_extensions`` at run time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from typing_extensions import TypeIs

__all__ = ["is_int", "is_number"]


def is_int(value: object) -> TypeIs[int]:
    """An ``int`` that is not a ``bool``."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> TypeIs[int | float]:
    """An ``int`` or a ``float``, not a ``bool`` (NaN and infinities included: check finiteness apart)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)
