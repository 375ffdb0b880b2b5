"""The event follower and the nemesis that injects the schedule's faults."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import zmq

from shared.errors import (
    RequestTimeout,
    TensorWasmError,
    WorkerLost,
)
from supervisor.tools.chaos.config import PARK_IDLE_S, PARK_WAIT_S, SIGNAL_FAULTS, SUPERVISOR_FAULTS
from supervisor.tools.chaos.schedule import Fault
from supervisor.client.api import SupervisorClient
from supervisor.observe.events import TOPIC_PREFIX, decode_event

__all__ = ["Action"]

# --------------------------------------------------------------------------- events and the nemesis


class _EventLog(threading.Thread):
    """Collects the supervisor's lifecycle events (its own SUB socket, in its own thread)."""

    def __init__(self, run_dir: str) -> None:
        super().__init__(name="chaos-events", daemon=True)
        self.endpoint = "ipc://" + os.path.join(run_dir, "events.ipc")
        self.events: list[dict[str, object]] = []
        self.stop_event = threading.Event()
        self.connected = threading.Event()

    def run(self) -> None:
        sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 100_000)
        sock.setsockopt(zmq.SUBSCRIBE, TOPIC_PREFIX)
        sock.connect(self.endpoint)
        self.connected.set()
        try:
            while not self.stop_event.is_set():
                if sock.poll(100):
                    try:
                        self.events.append(decode_event(sock.recv_multipart()))
                    except (ValueError, TensorWasmError):
                        continue
        finally:
            sock.close(0)


@dataclass
class Action:
    """What the nemesis did for one scheduled fault."""

    fault: Fault
    wall: float  # time.time() just before the fault was delivered
    outcome: str  # armed | exited | signalled | parked | skipped | refused:<code> | lost
    pid: int | None = None
    latency_s: float = 0.0
    detail: str = ""


class _Nemesis(threading.Thread):
    def __init__(
        self,
        run_dir: str,
        schedule: Sequence[Fault],
        names: Mapping[str, str],
        start: threading.Event,
        stop: threading.Event,
        go: Mapping[str, threading.Event] | None = None,
    ) -> None:
        """``go``: per tenant name, set while its clients may send (a ``park`` clears it for a while)."""
        super().__init__(name="chaos-nemesis", daemon=True)
        self.run_dir = run_dir
        self.schedule = schedule
        self.names = names
        self.start_event = start
        self.stop_event = stop
        self.go = go or {}
        self.actions: list[Action] = []
        self.crashed: BaseException | None = None

    def run(self) -> None:
        try:
            with SupervisorClient(self.run_dir, timeout_s=30.0) as client:
                while not self.start_event.wait(0.05):
                    if self.stop_event.is_set():
                        return
                t0 = time.monotonic()
                for fault in self.schedule:
                    if self.stop_event.wait(max(0.0, t0 + fault.at_s - time.monotonic())):
                        return
                    self.actions.append(self._deliver(client, fault))
        except BaseException as exc:  # noqa: BLE001 - reported by the campaign
            self.crashed = exc

    def _deliver(self, client: SupervisorClient, fault: Fault) -> Action:
        name = self.names[fault.tenant]
        wall, t0 = time.time(), time.monotonic()
        action = Action(fault, wall, "skipped")
        try:
            if fault.kind in SUPERVISOR_FAULTS:
                action.outcome = self._park(client, name)
            elif fault.kind in SIGNAL_FAULTS:
                inst = client.tenant_status(None, name).instances[fault.instance]
                if inst.state != "ready" or inst.pid is None:
                    action.detail = f"instance {inst.state}"
                else:
                    action.pid = inst.pid
                    action.wall = time.time()
                    os.kill(action.pid, signal.SIGKILL if fault.kind == "sigkill" else signal.SIGSTOP)
                    action.outcome = "signalled"
            else:
                result = client.inject_fault(None, name, fault.kind, instance=fault.instance, **dict(fault.params))
                action.pid = result.pid
                action.outcome = "exited" if result.exited else "armed"
        except ProcessLookupError:
            action.detail = "process already gone"
        except WorkerLost as exc:
            action.detail = exc.reason or str(exc)
        except RequestTimeout as exc:
            action.outcome, action.detail = "lost", str(exc)
        except TensorWasmError as exc:
            action.outcome, action.detail = f"refused:{exc.code}", str(exc)[:200]
        action.latency_s = time.monotonic() - t0
        return action

    def _park(self, client: SupervisorClient, name: str) -> str:
        """The tenant goes idle: its clients pause after their request in flight, a tiny idle
        timeout parks it, then the timeout is taken off and the clients go on - their next
        request activates it. "parked" when it was seen parked, else "armed"."""
        go = self.go.get(name)
        if go is not None:
            go.clear()
        try:
            client.set_quota(None, name, idle_timeout_s=PARK_IDLE_S)
            try:
                deadline = time.monotonic() + PARK_WAIT_S
                while time.monotonic() < deadline and not self.stop_event.is_set():
                    if client.tenant_status(None, name).state == "parked":
                        return "parked"
                    time.sleep(0.02)
                return "armed"
            finally:
                client.set_quota(None, name, idle_timeout_s=None)
        finally:
            if go is not None:
                go.set()
