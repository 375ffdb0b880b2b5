"""``twt bench route --flood``: does one client's flood slow another tenant down?

A real supervisor (stub backend) serves two tenants, ``victim`` and
``flooder``. The victim pings one request at a time (the same raw DEALER and
header bytes as ``twt bench route``); quiet first, then while a second process
floods the supervisor as fast as it can, one flood kind at a time:

* ``ping``     - the flooder's own valid pings, never waiting for replies
* ``quota``    - ``quota`` requests (the frontend answers them itself)
* ``garbage``  - bytes that are not a request at all
* ``badcap``   - pings with a forged capability (an HMAC check each, unanswerable cheaply)
* ``write``    - 1 MiB ``write`` requests into the flooder's buffer, on ``frontend.ipc`` (the local
  socket for frames of any size; the others flood the victim's own ``small.ipc``)
* ``tcp-ping`` - the flooder's pings over the CURVE TCP frontend

After the victim's pings, while the same flood goes on, a raw two-hop relay
(:mod:`supervisor.tools.bench._relay`: no supervisor, no admission) is pinged
as many times: its p50/p99 during a flood are this host's own latency under that load -
what a victim's round trip pays before the supervisor does anything (on 2
CPUs, a flood that keeps both busy gives the bare relay a p99 of several ms).
Shown, not a target.

Targets, per kind, against the quiet figures of the same run (b = the quiet
p50, at least 1/3 ms, so the first target is never below 1 ms):

* victim p50 during the flood <= 3 b, victim p99 <= 10 b;
* the flooder keeps a fair share: during the ``ping`` flood, its answered
  pings per second are at least half of what it gets flooding alone (it is
  slowed by admission, not starved).

The flooder never waits for an answer: it sends without blocking and reads
whatever comes back, so the supervisor, not the flooder, sets the pace. It
ignores ``retry_after_s`` too: past the answers to its rate refusals
(``tenant_refusals_per_s``) its requests go unanswered.

Both tenants run with the supervisor's defaults (a share of the host: 4,000
requests/s and 128 MiB/s per CPU, ``shared.config``) unless ``--flooder-rate`` /
``--flooder-bytes`` give the flooder's tenant its own ``requests_per_s`` /
``bytes_per_s``, as an operator sizes a tenant. The fair-share target
compares like with like: the flooder alone and beside the victim, both
under its rate. The TCP flooder past its rate has the TCP frontend paused
(``tcp_drops_per_s``, :mod:`supervisor.admission.pacing`); the admission
table shows how often and for how long.

``--sched`` adds, per flood, where the victim's pings waited: each role's
CPU run and run-queue wait per ping from the kernel's per-thread counters
(:mod:`supervisor.tools.bench.route_sched`), and how busy the whole host was.

Typing: what a flooder process reports is a :class:`FloodResult`; the figures of each flood
a ``dict[str, float]``.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Event
from typing import TypedDict

import zmq

from shared import protocol as proto
from shared.errors import ProtocolError
from shared.spec import TenantSpec
from supervisor.tools.bench import route_sched
from supervisor.tools.bench._relay import RawRelay, local_endpoint
from supervisor.tools.bench._report import (Report, Target, byte_size, count, format_table, per_second, percentile,
                                             socket_rtts_us)
from supervisor.client.launch import SupervisorHandle, launch
from shared.rundir import temp_parent
from supervisor.tools.bench._children import forked_context

__all__ = ["KINDS", "main"]

KINDS = ("ping", "quota", "garbage", "badcap", "write", "tcp-ping")
#: the helpers are forks of a preloaded fork server (supervisor.tools.bench._children)
_CTX = forked_context(__name__)
#: the quiet p50 the targets scale from is at least this (3x it = the 1 ms floor)
_FLOOR_US = 1000.0 / 3
_WRITE_BYTES = 1 << 20


class FloodResult(TypedDict):
    """What a flooder process puts on its queue: requests sent, replies read, replies OK, for how long."""

    sent: int
    answered: int
    ok: int
    seconds: float


def _flood(kind: str, endpoint: str, server_key: str | None, cap: bytes, handle: int,
           seconds: float, out: Queue[FloodResult], started: Event, nice: int = 0) -> None:
    """The flooding process: send ``kind`` as fast as the supervisor takes it, for ``seconds``."""
    if nice:
        os.nice(nice)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 16 if kind == "write" else 1000)
    sock.setsockopt(zmq.RCVHWM, 100_000)
    if server_key is not None:
        sock.curve_serverkey = server_key.encode()
        sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()
    sock.connect(endpoint)
    forged = bytearray(cap)
    forged[-1] ^= 1
    body: bytes | None = None
    if kind in ("ping", "tcp-ping"):
        frames = [proto.encode_request(1, "ping", cap, {})]
    elif kind == "quota":
        frames = [proto.encode_request(1, "quota", cap, {})]
    elif kind == "garbage":
        frames = [b"\xc1not a request" * 4]
    elif kind == "badcap":
        frames = [proto.encode_request(1, "ping", bytes(forged), {})]
    else:
        body = bytes(_WRITE_BYTES)
        frames = [proto.encode_request(1, "write", cap, {"handle": handle, "offset": 0}), body]
    if server_key is not None:  # wait for the handshake: the first ping's answer
        sock.send(proto.encode_request(1, "ping", cap, {}))
        sock.poll(30_000)
        sock.recv_multipart()
    ok = answered = sent = 0
    started.set()
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN | zmq.POLLOUT)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        events = dict(poller.poll(50)).get(sock, 0)
        if events & zmq.POLLOUT:
            for _ in range(64):
                try:
                    sock.send_multipart(frames, zmq.NOBLOCK, copy=body is None)
                    sent += 1
                except zmq.Again:
                    break
        if events & zmq.POLLIN:
            for _ in range(1024):
                try:
                    reply = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                answered += 1
                try:
                    ok += bool(proto.decode_reply(reply[0].bytes)[1])
                except ProtocolError:
                    pass
    out.put({"sent": sent, "answered": answered, "ok": ok, "seconds": seconds})
    sock.close(0)
    ctx.term()


def _both_rtts_us(victim: zmq.Socket[bytes], header: bytes, relay: zmq.Socket[bytes],
                  n: int) -> tuple[list[float], list[float]]:
    """``n`` pings of the victim, then ``n`` of the raw relay. One after the other, not in turn:
    pinged in turn, the victim's quiet p50 rose by ~30 % (each ping found the host just woken
    for the relay's), which would loosen every target scaled from it."""
    return socket_rtts_us(victim, header, n), socket_rtts_us(relay, header, n)


class _Sched:
    """The ``--sched`` figures of one flood's victim window (:mod:`supervisor.tools.bench.route_sched`)."""

    def __init__(self, roles: dict[str, list[int]]) -> None:
        self.roles = roles
        self.splits: list[route_sched.RoleSplit] = []
        self.host_cpus: float | None = None

    def victim_pings(self, flooder: int | None, sock: zmq.Socket[bytes], header: bytes, n: int) -> list[float]:
        roles = dict(self.roles, flooder=[flooder] if flooder is not None else [])
        pids = [pid for group in roles.values() for pid in group]
        host0, before = route_sched.host_snapshot(), route_sched.snapshot(pids)
        t0 = time.perf_counter()
        rtts = socket_rtts_us(sock, header, n)
        seconds = time.perf_counter() - t0
        after, host1 = route_sched.snapshot(pids), route_sched.host_snapshot()
        self.splits = route_sched.split(before, after, roles, n, seconds)
        self.host_cpus = route_sched.host_busy_cpus(host0, host1)
        return rtts

    def rows(self, kind: str, data: dict[str, dict[str, float]]) -> list[list[object]]:
        """The last window's table rows (``kind`` on the first), its figures added to ``data``."""
        host = "" if self.host_cpus is None else f"{self.host_cpus:.2f}"
        out: list[list[object]] = []
        for part in self.splits:
            out.append([kind if not out else "", part.role, part.threads, part.run_us, part.wait_us,
                        f"{part.cpu_share:.2f}", host if not out else ""])
            data[f"{kind}/{part.role}"] = {"run_us": part.run_us, "wait_us": part.wait_us, "cpus": part.cpu_share}
        if self.host_cpus is not None:
            data[f"{kind}/host"] = {"cpus": self.host_cpus}
        return out


def _run_flood(kind: str, sup: SupervisorHandle, cap: bytes, handle: int,
               victim: tuple[zmq.Socket[bytes], zmq.Socket[bytes]] | None, header: bytes, n: int, seconds: float,
               nice: int = 0, sched: _Sched | None = None) -> tuple[tuple[list[float], list[float]], FloodResult]:
    """Flood with ``kind`` while the victim (and the relay beside it) pings ``n`` times
    (none: the flooder alone); ``sched``: the kernel's per-thread figures over the victim's pings."""
    tcp = kind == "tcp-ping"
    # a 1 MiB write goes where frames of any size do (frontend.ipc); the other kinds share the
    # victim's socket (small.ipc, the local client's path for small requests)
    endpoint = (sup.info["listen"][0] if tcp else f"ipc://{sup.run_dir}/frontend.ipc" if kind == "write"
                else local_endpoint(sup))
    out, started = _CTX.Queue(), _CTX.Event()
    proc = _CTX.Process(target=_flood, daemon=True, args=(
        kind, endpoint, sup.info["server_public_key"] if tcp else None, cap, handle, seconds, out, started,
        nice))
    proc.start()
    try:
        if not started.wait(60):
            raise RuntimeError(f"the {kind} flooder did not start")
        time.sleep(min(0.3, seconds / 4))  # let the flood fill the queues
        if victim is None:
            rtts: tuple[list[float], list[float]] = ([], [])
        elif sched is not None and proc.pid is not None:
            rtts = sched.victim_pings(proc.pid, victim[0], header, n), socket_rtts_us(victim[1], header, n)
        else:
            rtts = _both_rtts_us(victim[0], header, victim[1], n)
        result: FloodResult = out.get(timeout=seconds + 60)
    finally:
        proc.join(10)
        if proc.exitcode is None:
            proc.kill()
            proc.join()
    return rtts, result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="twt bench route --flood", description=__doc__.split("\n\n")[0])
    parser.add_argument("--flood", action="store_true", help="(this benchmark)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--pings", type=count, default=600, help="victim pings quiet and per flood kind")
    parser.add_argument("--victim", choices=("ipc", "frontend", "tcp"), default="ipc",
                        help="the victim's frontend: ipc (local, the default: small.ipc, where SupervisorClient "
                        "sends small requests), frontend (frontend.ipc, as a client that does not know small.ipc) "
                        "or the CURVE TCP one - beside a tcp-ping flooder it shares the socket the pacer pauses "
                        "(tcp_drops_per_s)")
    parser.add_argument("--kinds", default=",".join(KINDS), help="flood kinds, comma-separated")
    parser.add_argument("--nice", type=int, default=0,
                        help="the flooder's nice value (a remote flooder does not compete for this host's CPUs)")
    parser.add_argument("--flooder-rate", type=per_second, default=None, metavar="N",
                        help="the flooder tenant's requests_per_s (default: the supervisor's tenant_requests_per_s)")
    parser.add_argument("--flooder-bytes", type=byte_size, default=None,
                        metavar="SIZE", help="the flooder tenant's bytes_per_s, e.g. 256MiB (default: "
                        "the supervisor's tenant_bytes_per_s)")
    parser.add_argument("--sched", action="store_true",
                        help="per flood, each role's CPU run and run-queue wait per victim ping (the kernel's "
                        "per-thread schedstat) and how busy the host was")
    args = parser.parse_args(argv)
    kinds = [k for k in args.kinds.split(",") if k]
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        parser.error(f"unknown flood kind(s) {unknown}; choose from {', '.join(KINDS)}")

    report = Report("route --flood")
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    rows: list[list[object]] = []
    targets: list[Target] = []
    data: dict[str, dict[str, float]] = {}
    sched_rows: list[list[object]] = []
    sched_data: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="twt-bench-", dir=temp_parent()) as tmp, launch(
        {"supervisor": {"pool_size": 0, "log_level": "error", "listen": ["tcp://127.0.0.1:0"]}, "tenant": []},
        backend="stub",
    ) as sup:
        client = sup.client
        victim_cap = client.register(sup.admin_capability, TenantSpec("victim"))
        flooder = client.register(sup.admin_capability, TenantSpec(
            "flooder", requests_per_s=args.flooder_rate, bytes_per_s=args.flooder_bytes))
        handle = client.alloc(flooder, _WRITE_BYTES)
        flood_cap = flooder.to_bytes()
        sched: _Sched | None = None
        if args.sched:
            pids = {t.tenant_id: list(t.pids) for t in client.status().tenants}
            sched = _Sched({"victim client": [os.getpid()], "supervisor": [sup.pid],
                            "victim worker": pids.get("victim", []), "flood worker": pids.get("flooder", [])})
        header = proto.encode_request(1, "ping", victim_cap.to_bytes(), {})
        victim = ctx.socket(zmq.DEALER)
        victim.setsockopt(zmq.LINGER, 0)
        if args.victim == "tcp":
            victim.curve_serverkey = sup.info["server_public_key"].encode()
            victim.curve_publickey, victim.curve_secretkey = zmq.curve_keypair()
            victim.connect(sup.info["listen"][0])
        elif args.victim == "frontend":
            victim.connect(f"ipc://{sup.run_dir}/frontend.ipc")
        else:
            victim.connect(local_endpoint(sup))
        relay = RawRelay(tmp)
        raw = ctx.socket(zmq.DEALER)
        raw.setsockopt(zmq.LINGER, 0)
        raw.connect(relay.frontend)
        pair = (victim, raw)
        try:
            _both_rtts_us(victim, header, raw, 300)  # warm up
            if sched is not None:
                quiet = sched.victim_pings(None, victim, header, args.pings)
                quiet_raw = socket_rtts_us(raw, header, args.pings)
                sched_rows += sched.rows("quiet", sched_data)
            else:
                quiet, quiet_raw = _both_rtts_us(victim, header, raw, args.pings)
            q50, q99 = percentile(quiet, 0.5), percentile(quiet, 0.99)
            base = max(q50, _FLOOR_US)
            rows.append(["quiet", q50, q99, percentile(quiet_raw, 0.5), percentile(quiet_raw, 0.99), "", ""])
            seconds = max(2.0, args.pings * 0.006)  # the victim, then the relay, all within the flood
            solo: FloodResult | None = None
            if "ping" in kinds:
                _, solo = _run_flood("ping", sup, flood_cap, handle, None, header, 0, 2.0, args.nice)
            for kind in kinds:
                (rtts, raw_rtts), res = _run_flood(kind, sup, flood_cap, handle, pair, header, args.pings,
                                                   seconds, args.nice, sched)
                if sched is not None:
                    sched_rows += sched.rows(kind, sched_data)
                p50, p99 = percentile(rtts, 0.5), percentile(rtts, 0.99)
                r50, r99 = percentile(raw_rtts, 0.5), percentile(raw_rtts, 0.99)
                rate = res["ok"] / res["seconds"]
                rows.append([kind, p50, p99, r50, r99, res["sent"] / res["seconds"], rate])
                data[kind] = {"p50_us": p50, "p99_us": p99, "relay_p50_us": r50, "relay_p99_us": r99,
                              "sent_per_s": res["sent"] / res["seconds"], "ok_per_s": rate}
                targets.append(Target(f"victim p50 during a {kind} flood vs quiet (b = max(p50, 1/3 ms))",
                                      p50 / base, 3.0, higher_is_better=False))
                targets.append(Target(f"victim p99 during a {kind} flood vs quiet b", p99 / base, 10.0,
                                      higher_is_better=False))
                if kind == "ping" and solo is not None and solo["ok"]:
                    share = rate / (solo["ok"] / solo["seconds"])
                    data["ping"]["solo_ok_per_s"] = solo["ok"] / solo["seconds"]
                    targets.append(Target("flooder's answered pings/s while the victim pings vs flooding alone",
                                          share, 0.5))
            stats = client.status().supervisor
        finally:
            relay.close(raw)
            raw.close(0)
            victim.close(0)
    limits = ", ".join(f"{k} {v:,.0f}" for k, v in (("requests_per_s", args.flooder_rate),
                                                       ("bytes_per_s", args.flooder_bytes)) if v is not None)
    report.sections.append((
        f"victim ping round trip (us) over {args.victim} during each flood, then the raw relay's during the same "
        "flood (the host's own latency under the same load); the flooder's requests/s sent and answered OK "
        f"(the flooder's tenant: {limits or 'the supervisor defaults'})",
        format_table(["flood", "p50", "p99", "relay p50", "relay p99", "flood sent/s", "flood ok/s"], rows),
    ))
    if sched_rows:
        report.sections.append((
            "where the victim's pings waited (--sched): each role's threads over the victim's pings, per ping: CPU "
            "run and run-queue wait (us; the supervisor's and the flooder's include the flood's own work), the CPUs "
            "it used, and the CPUs the whole host used (every session)",
            format_table(["flood", "role", "threads", "run us", "rq-wait us", "CPUs", "host CPUs"], sched_rows)))
    report.sections.append(("admission", format_table(["counter", "value"], [
        ["unauthenticated_dropped", stats.unauthenticated_dropped], ["admission_refused", stats.admission_refused],
        ["admission_unanswered", stats.admission_unanswered], ["tcp_pauses", stats.tcp_pauses],
        ["tcp_paused_s", stats.tcp_paused_s], ["yield_holds", stats.yield_holds],
        ["yield_full_holds", stats.yield_full_holds], ["yield_budget_holds", stats.yield_budget_holds],
        ["rate_pauses", stats.rate_pauses]])))
    report.targets += targets
    report.data.update(quiet_us={"p50": q50, "p99": q99, "relay_p50": percentile(quiet_raw, 0.5),
                                 "relay_p99": percentile(quiet_raw, 0.99)}, floods=data,
                       flooder_spec={"requests_per_s": args.flooder_rate, "bytes_per_s": args.flooder_bytes},
                       victim=args.victim)
    if sched_data:
        report.data["sched"] = sched_data
    return report.emit(as_json=args.json)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
