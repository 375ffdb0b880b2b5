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
        for t, th in enumerate(threads):
            if th[_ALIVE]:
                if th[_OP] < len(self.program[t]):
                    label, nxt = self._step(t, st)
                    out.append((("T{} {}: {}", t, self.program[t][th[_OP]], label), nxt))
                if t in self.killable:
                    dead = (*th[:_ALIVE], False, False)
                    out.append((("T{} SIGKILL", t), (tenant, shares, _put(threads, t, dead), held, results)))
            elif not th[_RECL]:
                s2 = list(shares)
                x = s2[t]
                s2[t] = 0
                t2 = max(tenant - x, 0) if self.algorithm == "two_step" else tenant
                done = (*th[:_RECL], True)
                out.append((("reclaim T{}: share {}", t, x),
                            (t2, tuple(s2), _put(threads, t, done), _put(held, t, 0), results)))
        return out

    def _step(self, t: int, st: State) -> tuple[Label, State]:
        tenant, shares, threads, held, results = st
        th = threads[t]
        op = self.program[t][th[_OP]]
        pc, cur, acc, j, att = th[_PC], th[_CUR], th[_ACC], th[_J], th[_ATT]
        n = op.n

        def go(label: Label, *, pc: int = pc, cur: int = cur, acc: int = acc, j: int = j, att: int = att,
               shares: tuple[int, ...] = shares, tenant: int = tenant, held: tuple[int, ...] = held,
               result: str | None = None) -> tuple[Label, State]:
            res = results
            if result is not None:  # op finished: next op, registers cleared
                new_th: Thread = (th[_OP] + 1, 0, 0, 0, 0, 0, True, False)
                res = _put(results, t, results[t] + (result,))
            else:
                new_th = (th[_OP], pc, cur, acc, j, att, True, False)
            return label, (tenant, shares, _put(threads, t, new_th), held, res)

        mine = shares[t]
        if self.algorithm == "shares":
            if op.kind == "consume":
                if pc == 0:
                    return go(("load mine -> {}", mine), pc=1, cur=mine)
                if pc == 1:  # single writer: the CAS cannot fail
                    return go(("CAS mine {}->{}", cur, cur + n), pc=2, acc=0, j=0, shares=_put(shares, t, cur + n))
                if pc in (2, 4):  # sum, one share per step
                    acc2 = acc + shares[j]
                    if j + 1 < self.n:
                        return go(("load share {} -> {}", j, shares[j]), j=j + 1, acc=acc2)
                    if pc == 2:
                        if acc2 <= self.limit:
                            held2 = _put(held, t, held[t] + n)
                            return go(("sum {} <= {}: granted", acc2, self.limit), held=held2, result="ok")
                        return go(("sum {} > {}: withdraw", acc2, self.limit), pc=3)
                    if acc2 + n > self.limit or att + 1 >= self.retries:
                        return go(("others {}: refused", acc2), result="refused")
                    return go(("others {}: retry", acc2), pc=0, att=att + 1)
                if pc == 3:
                    return go(("CAS mine {}->{}", mine, mine - n), pc=4, acc=0, j=0, shares=_put(shares, t, mine - n))
            else:
                if pc == 0:
                    return go(("load mine -> {}", mine), pc=1, cur=mine)
                if pc == 1:
                    held2 = _put(held, t, max(held[t] - n, 0))
                    return go(("CAS mine {}->{}", cur, max(cur - n, 0)), shares=_put(shares, t, max(cur - n, 0)),
                              held=held2, result="ok" if n <= cur else "underflow")
            raise AssertionError(f"bad pc {pc}")
        # two_step: the tenant word, then the share (the mirror) in a second step
        if op.kind == "consume":
            if pc == 0:
                return go(("load tenant -> {}", tenant), pc=1, cur=tenant)
            if pc == 1:
                if cur + n > self.limit:
                    return go(("{} + {} > {}: refused", cur, n, self.limit), result="refused")
                if tenant != cur:
                    return go(("CAS tenant failed (tenant={})", tenant), pc=1, cur=tenant)
                return go(("CAS tenant {}->{}", cur, cur + n), pc=2, tenant=cur + n, held=_put(held, t, held[t] + n))
            if pc == 2:
                return go(("fetch_add mine {}", n), shares=_put(shares, t, mine + n), result="ok")
        else:
            if pc == 0:
                return go(("load tenant -> {}", tenant), pc=1, cur=tenant)
            if pc == 1:
                if tenant != cur:
                    return go(("CAS tenant failed (tenant={})", tenant), pc=1, cur=tenant)
                return go(("CAS tenant {}->{}", cur, max(cur - n, 0)), pc=2, cur=int(n > cur), tenant=max(cur - n, 0),
                          held=_put(held, t, max(held[t] - n, 0)))
            if pc == 2:
                return go(("sub mine {}", n), shares=_put(shares, t, max(mine - n, 0)),
                          result="underflow" if cur else "ok")
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


def _put(tup: tuple[object, ...] | tuple[int, ...] | tuple[Thread, ...] | tuple[tuple[str, ...], ...],
         i: int, v: object) -> tuple:  # type: ignore[type-arg]
    return (*tup[:i], v, *tup[i + 1:])


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
    seen: set[State] = set()
    outcomes: set[tuple[tuple[str, ...], ...]] = set()
    finals = kills = 0
    # Iterative DFS: every state is expanded once. A path is kept for counterexamples as a chain of
    # (label, previous) pairs, so pushing a state costs O(1) instead of a copy of its whole path
    # (the copies were half the time of the three-instance check); _trace() unrolls it on a violation.
    stack: list[tuple[State, _Path]] = [(start, None)]
    while stack:
        state, path = stack.pop()
        if state in seen:
            continue
        seen.add(state)
        if len(seen) > max_states:
            raise RuntimeError(f"more than {max_states} states: shrink the program")
        succ = machine.successors(state)
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
            problem = machine.check(nxt)
            if problem:
                raise Violation(problem, _trace((label, path)))
            stack.append((nxt, (label, path)))
    return ShareExploreResult(states=len(seen), finals=finals, outcomes=outcomes, kills=kills)
