"""Every interleaving of a tenant's quota counter with kills: is reclaim exact?

``tests/helpers/quota_model.py`` checks one counter line; this explorer checks
what a *tenant* is: several worker instances on one block, any of which may be
SIGKILLed at any atomic step, after which the supervisor reclaims its share.
Two algorithms are modelled, step by step as the C helper performs them:

``"shares"`` (``_atomics.ShareCounter``, the current 8 KiB layout): the tenant's use is the
sum of per-instance share words; an instance writes only its own::

    consume(n): cur = load(mine); CAS(mine, cur -> cur + n)          publish
                total = load(share 0) + load(share 1) + ...          one step per share
                total <= limit ? granted
                : CAS(mine -> mine - n); others = sum again;          withdraw
                  others + n > limit or retries spent ? refused : again
    release(n): cur = load(mine); CAS(mine, cur -> max(cur - n, 0))
    reclaim(i): exchange(share i, 0)

``"two_step"`` (``_atomics.Counter`` with a mirror, the earlier 4 KiB layout): a tenant
counter changed by CAS, then the instance's share changed in a second step;
reclaim subtracts the share from the tenant counter. A kill between the two
steps leaves the reclaim off by one allocation, which the checker reports.

Checked on every transition: nothing is granted beyond the limit (the ghost
sum of what granted consumes hold, dead instances not yet reclaimed
included); for ``shares``, an idle live instance's share equals what it
holds. At the end (every op done or its thread dead, every dead instance
reclaimed): the tenant's use equals exactly what the live instances hold.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass
from typing import Literal

from tests.helpers.quota_model import Op, Violation

__all__ = ["ShareExploreResult", "explore_shares"]

Algorithm = Literal["shares", "two_step"]

# thread tuple: (op index, pc, cur, acc, j, attempt, alive, reclaimed)
_OP, _PC, _CUR, _ACC, _J, _ATT, _ALIVE, _RECL = range(8)
Thread = tuple[int, int, int, int, int, int, bool, bool]
# state: (tenant word (two_step only), shares, threads, ghost held, results)
State = tuple[int, tuple[int, ...], tuple[Thread, ...], tuple[int, ...], tuple[tuple[str, ...], ...]]
#: a transition's label: (format string, its arguments), an argument that is a Label formatted
#: first. Formatted only for a counterexample (_trace): the three-instance check makes ~460,000
#: transitions, and formatting each label (an Op's dataclass repr among them) was most of its time
Label = tuple[object, ...]


def _fmt(label: Label) -> str:
    fmt, *args = label
    return str(fmt).format(*(_fmt(a) if isinstance(a, tuple) else a for a in args))


@dataclass
class ShareExploreResult:
    states: int
    finals: int
    outcomes: set[tuple[tuple[str, ...], ...]]  # op results per thread at the end
    kills: int  # terminal states reached with at least one instance killed


class _Machine:
    def __init__(self, program: tuple[tuple[Op, ...], ...], limit: int, algorithm: Algorithm,
                 killable: frozenset[int], retries: int) -> None:
        self.program = program
        self.limit = limit
        self.algorithm = algorithm
        self.killable = killable
        self.retries = retries
        self.n = len(program)

    def successors(self, st: State) -> list[tuple[Label, State]]:
        tenant, shares, threads, held, results = st
        out: list[tuple[Label, State]] = []
        program = self.program
        for t, th in enumerate(threads):
            if th[_ALIVE]:
                ops = program[t]
                if th[_OP] < len(ops):
                    op = ops[th[_OP]]
                    label, nxt = self._step(t, st, th, op)
                    out.append((("T{} {}: {}", t, op, label), nxt))
                if t in self.killable:
                    dead: Thread = (th[0], th[1], th[2], th[3], th[4], th[5], False, False)
                    out.append((("T{} SIGKILL", t), (tenant, shares, threads[:t] + (dead,) + threads[t + 1:], held,
                                                      results)))
            elif not th[_RECL]:
                x = shares[t]
                t2 = max(tenant - x, 0) if self.algorithm == "two_step" else tenant
                done: Thread = (th[0], th[1], th[2], th[3], th[4], th[5], th[6], True)
                out.append((("reclaim T{}: share {}", t, x),
                            (t2, shares[:t] + (0,) + shares[t + 1:], threads[:t] + (done,) + threads[t + 1:],
                             held[:t] + (0,) + held[t + 1:], results)))
        return out

    def _step(self, t: int, st: State, th: Thread, op: Op) -> tuple[Label, State]:
        """Thread ``t``'s next atomic step in ``st`` (``th`` is its tuple, ``op`` its current op).

        The three-instance check takes ~460,000 of these: a step builds only the tuples that change
        (the thread's, and the shares or ``held`` it writes), through :func:`_moved` and
        :func:`_done`, with no closure or keyword defaults built per call."""
        tenant, shares, threads, held, results = st
        pc, cur, acc, j, att = th[_PC], th[_CUR], th[_ACC], th[_J], th[_ATT]
        n = op.n
        mine = shares[t]
        if self.algorithm == "shares":
            if op.kind == "consume":
                if pc == 0:
                    return ("load mine -> {}", mine), _moved(st, t, th, 1, mine, acc, j, att)
                if pc == 1:  # single writer: the CAS cannot fail
                    return ("CAS mine {}->{}", cur, cur + n), (
                        tenant, shares[:t] + (cur + n,) + shares[t + 1:],
                        threads[:t] + ((th[_OP], 2, cur, 0, 0, att, True, False),) + threads[t + 1:], held, results)
                if pc in (2, 4):  # sum, one share per step
                    share = shares[j]
                    acc2 = acc + share
                    if j + 1 < self.n:
                        return ("load share {} -> {}", j, share), _moved(st, t, th, pc, cur, acc2, j + 1, att)
                    if pc == 2:
                        if acc2 <= self.limit:
                            return ("sum {} <= {}: granted", acc2, self.limit), _done(
                                st, t, th, "ok", shares, held[:t] + (held[t] + n,) + held[t + 1:])
                        return ("sum {} > {}: withdraw", acc2, self.limit), _moved(st, t, th, 3, cur, acc, j, att)
                    if acc2 + n > self.limit or att + 1 >= self.retries:
                        return ("others {}: refused", acc2), _done(st, t, th, "refused", shares, held)
                    return ("others {}: retry", acc2), _moved(st, t, th, 0, cur, acc, j, att + 1)
                if pc == 3:
                    return ("CAS mine {}->{}", mine, mine - n), (
                        tenant, shares[:t] + (mine - n,) + shares[t + 1:],
                        threads[:t] + ((th[_OP], 4, cur, 0, 0, att, True, False),) + threads[t + 1:], held, results)
            else:
                if pc == 0:
                    return ("load mine -> {}", mine), _moved(st, t, th, 1, mine, acc, j, att)
                if pc == 1:
                    left = max(cur - n, 0)
                    return ("CAS mine {}->{}", cur, left), _done(
                        st, t, th, "ok" if n <= cur else "underflow", shares[:t] + (left,) + shares[t + 1:],
                        held[:t] + (max(held[t] - n, 0),) + held[t + 1:])
            raise AssertionError(f"bad pc {pc}")
        # two_step: the tenant word, then the share (the mirror) in a second step
        if op.kind == "consume":
            if pc == 0:
                return ("load tenant -> {}", tenant), _moved(st, t, th, 1, tenant, acc, j, att)
            if pc == 1:
                if cur + n > self.limit:
                    return ("{} + {} > {}: refused", cur, n, self.limit), _done(st, t, th, "refused", shares, held)
                if tenant != cur:
                    return ("CAS tenant failed (tenant={})", tenant), _moved(st, t, th, 1, tenant, acc, j, att)
                return ("CAS tenant {}->{}", cur, cur + n), (
                    cur + n, shares, threads[:t] + ((th[_OP], 2, cur, acc, j, att, True, False),) + threads[t + 1:],
                    held[:t] + (held[t] + n,) + held[t + 1:], results)
            if pc == 2:
                return ("fetch_add mine {}", n), _done(st, t, th, "ok", shares[:t] + (mine + n,) + shares[t + 1:], held)
        else:
            if pc == 0:
                return ("load tenant -> {}", tenant), _moved(st, t, th, 1, tenant, acc, j, att)
            if pc == 1:
                if tenant != cur:
                    return ("CAS tenant failed (tenant={})", tenant), _moved(st, t, th, 1, tenant, acc, j, att)
                return ("CAS tenant {}->{}", cur, max(cur - n, 0)), (
                    max(cur - n, 0), shares,
                    threads[:t] + ((th[_OP], 2, int(n > cur), acc, j, att, True, False),) + threads[t + 1:],
                    held[:t] + (max(held[t] - n, 0),) + held[t + 1:], results)
            if pc == 2:
                return ("sub mine {}", n), _done(st, t, th, "underflow" if cur else "ok",
                                                 shares[:t] + (max(mine - n, 0),) + shares[t + 1:], held)
        raise AssertionError(f"bad pc {pc}")

    def use(self, st: State) -> int:
        return st[0] if self.algorithm == "two_step" else sum(st[1])

    def check(self, st: State) -> str | None:
        _, shares, threads, held, _ = st
        if sum(held) > self.limit:
            return f"above the limit: the granted consumes hold {sum(held)} > {self.limit}"
        if self.algorithm == "shares":
            for t, th in enumerate(threads):
                if th[_ALIVE] and th[_PC] == 0 and shares[t] != held[t]:
                    return f"T{t}'s share {shares[t]} != the {held[t]} bytes it holds"
        return None

    def check_final(self, st: State) -> str | None:
        _, _, threads, held, _ = st
        live = sum(h for h, th in zip(held, threads) if th[_ALIVE])
        use = self.use(st)
        if use != live:
            return (f"reclaim not exact: the tenant's use is {use} after every dead instance was reclaimed, "
                    f"but the live instances hold {live}")
        return None


def _moved(st: State, t: int, th: Thread, pc: int, cur: int, acc: int, j: int, att: int) -> State:
    """``st`` with thread ``t`` (alive, mid-op) at ``pc`` with the registers given; the rest shared."""
    threads = st[2]
    return (st[0], st[1], threads[:t] + ((th[_OP], pc, cur, acc, j, att, True, False),) + threads[t + 1:], st[3],
            st[4])


def _done(st: State, t: int, th: Thread, result: str, shares: tuple[int, ...], held: tuple[int, ...]) -> State:
    """``st`` with thread ``t``'s op finished with ``result`` (next op, registers cleared), and the
    shares and ``held`` given."""
    threads, results = st[2], st[4]
    return (st[0], shares, threads[:t] + ((th[_OP] + 1, 0, 0, 0, 0, 0, True, False),) + threads[t + 1:], held,
            results[:t] + (results[t] + (result,),) + results[t + 1:])


#: a path of labels, newest first: (label, the path before it); None is the empty path
_Path = tuple[Label, "_Path"] | None


def _trace(path: _Path) -> list[str]:
    """The labels of ``path``, oldest first."""
    labels: list[str] = []
    while path is not None:
        labels.append(_fmt(path[0]))
        path = path[1]
    return labels[::-1]


def explore_shares(
    program: list[list[Op]],
    *,
    limit: int,
    algorithm: Algorithm = "shares",
    killable: set[int] | None = None,
    retries: int = 2,
    max_states: int = 3_000_000,
) -> ShareExploreResult:
    """Check every interleaving of ``program`` (one op list per instance), with a
    SIGKILL of each ``killable`` instance at every step; raise :class:`Violation`."""
    prog = tuple(tuple(ops) for ops in program)
    for ops in prog:
        for op in ops:
            if op.kind not in ("consume", "release"):
                raise ValueError(f"unsupported op {op}")
    machine = _Machine(prog, limit, algorithm, frozenset(killable or ()), retries)
    threads = tuple((0, 0, 0, 0, 0, 0, True, False) for _ in prog)
    start: State = (0, tuple(0 for _ in prog), threads, tuple(0 for _ in prog), tuple(() for _ in prog))
    # The cyclic garbage collector is off while it runs: the states and paths are tuples that form
    # no cycle, and its collections, walking the ever larger set of them, took a quarter of the
    # three-instance check's CPU.
    collecting = gc.isenabled()
    gc.disable()
    try:
        return _explore(machine, start, max_states)
    finally:
        if collecting:
            gc.enable()


def _explore(machine: _Machine, start: State, max_states: int) -> ShareExploreResult:
    seen: set[State] = set()
    outcomes: set[tuple[tuple[str, ...], ...]] = set()
    finals = kills = 0
    # Iterative DFS: every state is expanded once. A path is kept for counterexamples as a chain of
    # (label, previous) pairs, so pushing a state costs O(1) instead of a copy of its whole path
    # (the copies were half the time of the three-instance check); _trace() unrolls it on a violation.
    # A popped state is hashed once, to add it (the set's size says whether it was there already):
    # tuple hashes are not cached, and each hash walks the whole nested state.
    stack: list[tuple[State, _Path]] = [(start, None)]
    successors, check, add, push = machine.successors, machine.check, seen.add, stack.append
    while stack:
        state, path = stack.pop()
        known = len(seen)
        add(state)
        if len(seen) == known:
            continue
        if known >= max_states:
            raise RuntimeError(f"more than {max_states} states: shrink the program")
        succ = successors(state)
        if not succ:
            problem = machine.check_final(state)
            if problem:
                raise Violation(problem, _trace(path))
            finals += 1
            outcomes.add(state[4])
            kills += any(not th[_ALIVE] for th in state[2])
            continue
        for label, nxt in succ:
            if nxt in seen:  # checked when it was first reached
                continue
            problem = check(nxt)
            if problem:
                raise Violation(problem, _trace((label, path)))
            push((nxt, (label, path)))
    return ShareExploreResult(states=len(seen), finals=finals, outcomes=outcomes, kills=kills)
