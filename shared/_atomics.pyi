"""Type stub for the C extension ``shared._atomics`` (see ``_atomics.c``)."""

from collections.abc import Callable
from typing import Any

from typing_extensions import Buffer

COUNTER_SPAN: int
F_USED: int
F_LIMIT: int
F_HIGH_WATER: int
F_REFUSALS: int
F_UNDERFLOWS: int
SHARE_RETRIES: int

def consume(buffer: Buffer, offset: int, n: int, /) -> tuple[int, int] | None: ...
def release(buffer: Buffer, offset: int, n: int, /) -> int | None: ...
def load(buffer: Buffer, offset: int, /) -> int: ...
def store(buffer: Buffer, offset: int, value: int, /) -> None: ...
def fetch_add(buffer: Buffer, offset: int, n: int, /) -> int: ...
def exchange(buffer: Buffer, offset: int, value: int, /) -> int: ...
def noop(buffer: Any, offset: Any, n: Any, /) -> None: ...

class Counter:
    closed: bool
    def __init__(
        self,
        buffer: Buffer,
        offset: int,
        on_refuse: Callable[[int, int, int], BaseException],
        on_underflow: Callable[[int, int], object],
        on_closed: Callable[[], BaseException],
        mirror_offset: int | None = None,
    ) -> None: ...
    def consume(self, n: int, /) -> None: ...
    def release(self, n: int, /) -> None: ...
    def load(self) -> int: ...
    def close(self) -> None: ...

class ShareCounter:
    closed: bool
    def __init__(
        self,
        buffer: Buffer,
        line_offset: int,
        shares_offset: int,
        stride: int,
        nslots_offset: int,
        slot: int,
        extra_slot: int,
        on_refuse: Callable[[int, int, int], BaseException],
        on_underflow: Callable[[int, int], object],
        on_closed: Callable[[], BaseException],
    ) -> None: ...
    def consume(self, n: int, /) -> None: ...
    def release(self, n: int, /) -> None: ...
    def load(self) -> int: ...
    def close(self) -> None: ...
