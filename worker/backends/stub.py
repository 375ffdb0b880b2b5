"""The stub backend: a simulated device in host memory, with a configurable capacity.

What CI runs and the default without a usable GPU. Buffers are ``bytearray``s;
tensor ops use numpy views on them (numpy is imported on first use, so an
idle worker does not pay for it). The capacity is per worker process, like a
device's memory seen by one context; the cross-tenant device budget lives in
shared memory (see :mod:`shared.device_budget` when present).
"""

from __future__ import annotations

from typing import Any

from worker.backends.base import Backend, DeviceBuffer, DeviceOutOfMemory

__all__ = ["StubBackend", "StubBuffer"]


class StubBuffer(DeviceBuffer):
    __slots__ = ("data",)

    def __init__(self, nbytes: int) -> None:
        super().__init__(nbytes)
        self.data = bytearray(nbytes)


class StubBackend(Backend):
    """Host-memory simulation of one device context with ``capacity_bytes`` of memory."""

    name = "stub"

    def __init__(self, capacity_bytes: int = 16 << 30, device_index: int = 0) -> None:
        self.capacity_bytes = capacity_bytes
        self.device_index = device_index
        self.in_use = 0
        self._live: set[int] = set()

    def alloc(self, nbytes: int) -> StubBuffer:
        if self.in_use + nbytes > self.capacity_bytes:
            raise DeviceOutOfMemory(nbytes, self.capacity_bytes, self.in_use, "stub device out of memory")
        try:
            buf = StubBuffer(nbytes)
        except MemoryError:
            raise DeviceOutOfMemory(nbytes, self.capacity_bytes, self.in_use, "host memory exhausted") from None
        self.in_use += nbytes
        self._live.add(id(buf))
        return buf

    def free(self, buf: DeviceBuffer) -> None:
        assert isinstance(buf, StubBuffer)
        if id(buf) in self._live:
            self._live.discard(id(buf))
            self.in_use -= buf.nbytes
            buf.data = bytearray()

    def write(self, buf: DeviceBuffer, offset: int, data: memoryview) -> None:
        assert isinstance(buf, StubBuffer)
        # through a memoryview: ``bytearray[a:b] = view`` copies the view into a temporary
        # bytearray first (CPython), one whole extra copy per write
        memoryview(buf.data)[offset : offset + len(data)] = data

    def read(self, buf: DeviceBuffer, offset: int, nbytes: int) -> bytes:
        assert isinstance(buf, StubBuffer)
        return bytes(buf.data[offset : offset + nbytes])

    def read_into(self, buf: DeviceBuffer, offset: int, dest: memoryview) -> None:
        assert isinstance(buf, StubBuffer)
        dest[:] = memoryview(buf.data)[offset : offset + len(dest)]

    @staticmethod
    def _f32(buf: DeviceBuffer, count: int) -> Any:
        import numpy as np

        assert isinstance(buf, StubBuffer)
        return np.frombuffer(buf.data, dtype=np.float32, count=count)

    def fill_f32(self, buf: DeviceBuffer, value: float, count: int) -> None:
        self._f32(buf, count).fill(value)

    def axpy_f32(self, n: int, a: float, x: DeviceBuffer, y: DeviceBuffer) -> None:
        import numpy as np

        xv = self._f32(x, n)
        yv = self._f32(y, n)
        if x is y:
            np.multiply(yv, np.float32(a + 1.0), out=yv)
            return
        # y += a*x without a temporary of n floats: in chunks that stay in cache
        step = 1 << 16
        scratch = np.empty(min(n, step), dtype=np.float32)
        a32 = np.float32(a)
        for start in range(0, n, step):
            stop = min(n, start + step)
            t = scratch[: stop - start]
            np.multiply(xv[start:stop], a32, out=t)
            np.add(yv[start:stop], t, out=yv[start:stop])

    def sum_f32(self, buf: DeviceBuffer, count: int) -> float:
        import numpy as np

        return float(np.add.reduce(self._f32(buf, count), dtype=np.float32))

    def info(self) -> dict[str, Any]:
        return {
            "backend": self.name,
            "device": self.device_index,
            "device_name": "stub (host memory)",
            "capacity_bytes": self.capacity_bytes,
            "in_use_bytes": self.in_use,
        }

    def close(self) -> None:
        self._live.clear()
        self.in_use = 0
