"""A tenant process for end-to-end tests of the GPU-time lease on the stub with *simulated* device
time: each op runs its real numpy work, then holds the device for a fixed simulated duration
(a sleep while holding the lease: the device is busy, no CPU is needed) and is charged exactly
that. Shares are then asserted from charged device time, not from how fast a loaded host ran.

    heavy    back-to-back ops of ``op_s`` (a GEMM loop's chunks)
    chatty   an op of ``op_s``, then ``gap_s`` of host work (no device op), in a loop
    control  the chatty loop's host work only
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from worker.backends.stub import StubBackend

__all__ = ["SimBackend", "tenant"]


class _SimTimer:
    def __init__(self, op_ns: int) -> None:
        self.op_ns = op_ns

    def time(self, fn: Callable[..., object], *args: object) -> int:
        fn(*args)
        time.sleep(self.op_ns / 1e9)  # the device is busy this long
        return self.op_ns

    def close(self) -> None:
        pass


class SimBackend(StubBackend):
    """The stub whose every launch takes ``op_s`` of simulated device time."""

    def __init__(self, op_s: float) -> None:
        super().__init__(capacity_bytes=64 << 20)
        self.op_ns = round(op_s * 1e9)

    def op_timer(self) -> _SimTimer:
        return _SimTimer(self.op_ns)


def tenant(role: str, board_name: str, slot: int, block_name: str, op_s: float, gap_s: float, start: Any,
           seconds: float, out: Any, tag: int = 0) -> None:
    """One tenant's process (spawned); puts ``{role, board: tag, ops, device_ns, waits_ns}`` or
    ``{role, board, error}``. ``start`` is a ``multiprocessing`` barrier of every tenant process that
    must run side by side: each starts its ``seconds`` once all of them are imported and attached
    (however long a loaded host takes for that), never at a fixed moment."""
    from shared.gpu_time import GpuTimeBoard
    from shared.quota import QuotaBlock
    from worker.device_time import DeviceGate

    try:
        backend = SimBackend(op_s)
        block = QuotaBlock.attach(block_name, instance=0)
        board = GpuTimeBoard.attach(board_name, tenant_slot=slot)
        gate = DeviceGate(block, backend, board)
        buf = backend.alloc(4 * 64)
        try:
            start.wait(120)  # a hang guard only: the others' import and attach
            ns0, ops, waits = block.gpu_time_ns, 0, []
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                if role != "control":
                    w0 = gate.run_wait_ns
                    gate.op("fill_f32", backend.fill_f32, (buf, 1.0, 64))  # 64 floats: one chunk
                    waits.append(gate.run_wait_ns - w0)
                if role != "heavy":
                    time.sleep(gap_s)
                ops += 1
            gate.release()
            out.put({"role": role, "board": tag, "ops": ops, "device_ns": block.gpu_time_ns - ns0,
                     "waits_ns": waits})
        finally:
            gate.close()
            block.close()
            backend.close()
    except Exception as exc:  # noqa: BLE001 - one result either way
        start.abort()  # the others waiting for this one fail at once (BrokenBarrierError), not at the guard
        out.put({"role": role, "board": tag, "error": f"{type(exc).__name__}: {exc}"})
