"""The seeded client workload: alloc / free / write / read / run_wasm, every call recorded.

Typing: the reports (and the event maps they are built from) are JSON-shaped dicts,
written here and read back by key to print and check them; their values stay dynamically typed.
"""

from __future__ import annotations

import math
import random
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from shared import protocol as proto
from shared.capability import TenantCapability
from shared.errors import (
    RequestTimeout,
    TensorWasmError,
)
from shared.spec import TenantSpec
from supervisor.tools.chaos.config import _DEATH_CODES, _GONE_CODES, _GONE_DETAILS, MAX_LIVE_BUFFERS
from supervisor.tools.chaos.recorder import Record, Recorder
from supervisor.client.api import SupervisorClient
from supervisor.tools.demo import guest_path

__all__ = []

# --------------------------------------------------------------------------- the workload


@dataclass
class _Buf:
    nbytes: int
    shadow: bytearray | None = None  # what the buffer holds, when known
    doomed: bool = False  # an op on it met its instance's death


@dataclass
class _Modules:
    long_job: bytes
    probe: bytes

    @classmethod
    def load(cls) -> _Modules:
        return cls(guest_path("long_job").read_bytes(), guest_path("probe").read_bytes())


class _Client(threading.Thread):
    """One client thread: a paced, seeded mix of operations on one tenant, all recorded."""

    def __init__(
        self,
        index: int,
        tenant: str,
        healthy: bool,
        spec: TenantSpec,
        cap: TenantCapability,
        run_dir: str,
        seed: int,
        recorder: Recorder,
        stop: threading.Event,
        modules: _Modules,
        warmed: threading.Barrier | None,
        go: threading.Event | None = None,
    ) -> None:
        """``go``: set while the client may send (the nemesis clears it to let the tenant go idle)."""
        super().__init__(name=f"chaos-client-{index}", daemon=True)
        self.tenant = tenant
        self.healthy = healthy
        self.spec = spec
        self.cap = cap
        self.run_dir = run_dir
        self.rng = random.Random(f"twt-chaos-client:{seed}:{index}")
        self.recorder = recorder
        self.stop_event = stop
        self.modules = modules
        self.warmed = warmed
        self.go = go
        self.live: dict[int, _Buf] = {}
        self.stale: list[tuple[int, int]] = []  # (handle, nbytes) dropped: their instance died
        self.client: SupervisorClient | None = None
        self.crashed: BaseException | None = None
        self.last_detail = ""  # the detail of the last call's error
        # the client gives up well after the supervisor must have answered: that is "lost"
        self.timeout_s = 2 * proto.OPS["run_wasm"].deadline_s(spec) + 10.0

    # ------------------------------------------------------------ plumbing

    def _call(
        self, op: str, fn: Callable[[SupervisorClient], Any], wasm_timeout_s: float | None = None
    ) -> tuple[str, Any]:  # the call's result (a handle, bytes, a record) goes back to the op that asked
        assert self.client is not None
        phase = self.recorder.phase
        t0 = time.monotonic()
        detail = ""
        result: object = None
        try:
            result = fn(self.client)
            outcome = "ok"
        except RequestTimeout as exc:
            outcome, detail = "lost", str(exc)
        except TensorWasmError as exc:
            outcome, result, detail = exc.code, exc, str(exc)[:200]
        except Exception as exc:  # noqa: BLE001 - recorded as a violation, never hidden
            outcome, detail = "untyped", repr(exc)[:200]
        latency = time.monotonic() - t0
        self.last_detail = detail
        self.recorder.add(
            Record(
                self.tenant,
                self.healthy,
                op,
                phase,
                t0,
                latency,
                outcome,
                proto.OPS[op].deadline_s(self.spec, wasm_timeout_s),
                detail,
            )
        )
        return outcome, result

    def _wrong(self, op: str, detail: str) -> None:
        self.recorder.add(
            Record(
                self.tenant,
                self.healthy,
                op,
                self.recorder.phase,
                time.monotonic(),
                0.0,
                "wrong_data",
                proto.OPS[op].deadline_s(self.spec),
                detail[:200],
            )
        )

    def _gone(self, outcome: str) -> bool:
        """Did the last call's error say its buffer is gone?"""
        return outcome in _GONE_CODES or (
            outcome == "invalid_argument" and any(d in self.last_detail for d in _GONE_DETAILS))

    def _after_error(self, handle: int, outcome: str, *, mutating: bool) -> None:
        buf = self.live.get(handle)
        if buf is None:
            return
        if self._gone(outcome):
            # the handle names an instance incarnation that is gone: its buffer went with it
            del self.live[handle]
            self.stale.append((handle, buf.nbytes))
        elif outcome in _DEATH_CODES:
            buf.doomed = True
            buf.shadow = None
        elif mutating and outcome not in ("overloaded", "tenant_failed"):
            buf.shadow = None  # may or may not have been applied

    # ------------------------------------------------------------ operations

    def op_alloc(self) -> None:
        nbytes = self.rng.randrange(1, 33) * 4096
        outcome, result = self._call("alloc", lambda c: c.alloc(self.cap, nbytes))
        if outcome != "ok":
            return
        handle = int(result)
        self.live[handle] = _Buf(nbytes)
        data = self.rng.randbytes(nbytes)  # give it a known content
        outcome, _ = self._call("write", lambda c: c.write(self.cap, handle, data))
        if outcome == "ok":
            self.live[handle].shadow = bytearray(data)
        else:
            self._after_error(handle, outcome, mutating=True)

    def _pick(self) -> tuple[int, _Buf]:
        handle = self.rng.choice(sorted(self.live))
        return handle, self.live[handle]

    def op_free(self) -> None:
        handle, buf = self._pick()
        outcome, result = self._call("free", lambda c: c.free(self.cap, handle))
        if outcome == "ok":
            del self.live[handle]
            if int(result) != buf.nbytes:
                self._wrong("free", f"free of {handle:#x} released {result} B, it had {buf.nbytes} B")
        else:
            self._after_error(handle, outcome, mutating=False)

    def op_write(self) -> None:
        handle, buf = self._pick()
        off = self.rng.randrange(buf.nbytes)
        data = self.rng.randbytes(self.rng.randint(1, min(8192, buf.nbytes - off)))
        outcome, _ = self._call("write", lambda c: c.write(self.cap, handle, data, offset=off))
        if outcome == "ok":
            if buf.shadow is not None:
                buf.shadow[off : off + len(data)] = data
        else:
            self._after_error(handle, outcome, mutating=True)

    def op_read(self) -> None:
        handle, buf = self._pick()
        off = self.rng.randrange(buf.nbytes)
        n = self.rng.randint(1, min(16384, buf.nbytes - off))
        outcome, data = self._call("read", lambda c: c.read(self.cap, handle, n, offset=off))
        if outcome == "ok":
            if buf.shadow is not None and bytes(data) != bytes(buf.shadow[off : off + n]):
                self._wrong("read", f"read of {n} B at {off} of {handle:#x} differs from what was written")
        else:
            self._after_error(handle, outcome, mutating=False)

    def op_wasm_job(self) -> None:
        n = self.rng.choice((256, 1024, 4096))
        reps = self.rng.randint(1, 8)
        outcome, result = self._call(
            "run_wasm", lambda c: c.run_wasm(self.cap, self.modules.long_job, "run", [n, reps])
        )
        if outcome != "ok":
            return
        got = list(result.results) or [None]
        want = 0.5 * reps * n
        if isinstance(got[0], float) and math.isnan(got[0]) and not self.healthy:
            return  # an injected OOM: the guest's alloc returned an error code, as documented
        if got[0] != want:
            self._wrong("run_wasm", f"long_job({n}, {reps}) returned {got!r}, expected [{want}]")

    def op_wasm_fill(self) -> None:
        handle, buf = self._pick()
        count = self.rng.randint(1, min(256, buf.nbytes // 4))
        value = self.rng.choice((1.5, -2.0, 0.25, 3.0))
        outcome, result = self._call(
            "run_wasm",
            lambda c: c.run_wasm(self.cap, self.modules.probe, "fill_f32", [{"handle": handle}, value, count]),
        )
        if outcome == "ok":
            if list(result.results) != [0]:
                self._wrong("run_wasm", f"fill_f32 on {handle:#x} returned {list(result.results)!r}")
                buf.shadow = None
            elif buf.shadow is not None:
                buf.shadow[: 4 * count] = struct.pack("<f", value) * count
        else:
            self._after_error(handle, outcome, mutating=True)

    def step(self) -> None:
        ops: list[tuple[Callable[[], None], int]] = [(self.op_wasm_job, 1)]
        if len(self.live) < MAX_LIVE_BUFFERS:
            ops.append((self.op_alloc, 3))
        if self.live:
            ops += [(self.op_free, 2), (self.op_write, 3), (self.op_read, 4), (self.op_wasm_fill, 1)]
        fns, weights = zip(*ops)
        self.rng.choices(fns, weights)[0]()

    def warm_up(self) -> None:
        """Every op once (compiles both guests in the worker) before anything is measured."""
        self.op_wasm_job()
        self.op_alloc()
        for op in (self.op_wasm_fill, self.op_read, self.op_free):
            if self.live:  # an op's error can take the buffer with it (its instance gone)
                op()

    def run(self) -> None:
        try:
            self.client = SupervisorClient(self.run_dir, timeout_s=self.timeout_s)
            self.warm_up()
            if self.warmed is not None:
                try:
                    self.warmed.wait(60)
                except threading.BrokenBarrierError:
                    pass
            while not self.stop_event.is_set():
                self.step()
                self.stop_event.wait(self.rng.uniform(0.005, 0.02))
                while self.go is not None and not self.go.wait(0.05) and not self.stop_event.is_set():
                    pass  # paused: the tenant is meant to be idle
        except BaseException as exc:  # noqa: BLE001 - reported as a violation by the campaign
            self.crashed = exc
        finally:
            if self.client is not None:
                self.client.close()

    def free_all(self, client: SupervisorClient) -> None:
        """Cleanup: free every buffer still held (recorded in phase "cleanup")."""
        self.client = client
        for handle in sorted(self.live):
            buf = self.live[handle]
            outcome, _ = self._call("free", lambda c: c.free(self.cap, handle))
            if outcome == "ok":
                del self.live[handle]
            elif self._gone(outcome) or buf.doomed or outcome in _DEATH_CODES:
                del self.live[handle]
                self.stale.append((handle, buf.nbytes))
