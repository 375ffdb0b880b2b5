"""An exhaustive interleaving explorer for the quota counter algorithm.

The Rust crate checked its CAS quota with loom; this is the Python rendering.
``shared/_atomics.c`` implements, on one counter line (used, limit,
high_water, refusals, underflows)::

    consume(n):                          release(n):
      cur = load(used)                     cur = load(used)
      loop:                                loop:
        lim = load(limit)                    next = n > cur ? 0 : cur - n
        next = cur + n                       if CAS(used, cur -> next): break
        if overflow or next > lim:         if n > cur: fetch_add(underflows, 1)
          fetch_add(refusals, 1); refuse
        if CAS(used, cur -> next): break
      hw = load(high_water)
      while next > hw and not CAS(high_water, hw -> next): pass

Each line above that touches shared memory is one *atomic step* here. The
explorer runs a small program (a list of ops per thread; a ``set_limit`` op
is an administrator storing a new limit) through **every** interleaving of
those steps: a depth-first search over states (shared memory + every
thread's registers + a ghost of the sequential specification), memoised so
that each distinct state is expanded once. Every transition is checked
against the specification:

* no lost update: ``used`` always equals the ghost's sequential value, which
  is updated at each operation's linearisation point (its successful CAS);
* never above the limit: nothing granted beyond the limit in force (with a
  concurrent limit change: beyond the largest limit in force while the
  operation ran);
* at the end: used == granted - released (clamping counted), refusals and
  underflows counted exactly, high water == the largest ``used`` ever and
  <= the limit.

``variant`` swaps in deliberately broken algorithms so the tests can show
that the checker fails when it should. :func:`run_sequential` runs ops one
after another through the same step machine: the sequential semantics the
C helper is differentially tested against.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

__all__ = [
    "VARIANTS",
    "ExploreResult",
    "LineState",
    "Op",
    "Violation",
    "consume",
    "explore",
    "release",
    "run_sequential",
    "set_limit",
]

Kind = Literal["consume", "release", "set_limit"]
Variant = Literal["correct", "store_consume", "wrapping_release", "hw_store"]
#: "correct" is the C algorithm; the others are broken on purpose.
VARIANTS: tuple[Variant, ...] = ("correct", "store_consume", "wrapping_release", "hw_store")

#: An op's outcome: ("ok",) | ("refused", used_seen, limit_seen) | ("underflow", used_seen)
Result = tuple[object, ...]
OK: Result = ("ok",)


@dataclass(frozen=True)
class Op:
    kind: Kind
    n: int

    def __str__(self) -> str:
        return f"{self.kind}({self.n})"


def consume(n: int) -> Op:
    return Op("consume", n)


def release(n: int) -> Op:
    return Op("release", n)


def set_limit(value: int) -> Op:
    return Op("set_limit", value)


class Violation(AssertionError):
    """The specification failed in some interleaving; ``trace`` shows which."""

    def __init__(self, message: str, trace: list[str]) -> None:
        self.message = message
        self.trace = trace
        steps = "\n".join(f"  {i:3d}. {s}" for i, s in enumerate(trace, 1))
        super().__init__(f"{message}\ninterleaving:\n{steps}")


@dataclass
class ExploreResult:
    states: int  # distinct states expanded
    interleavings: int | None  # complete executions (None when spurious CAS failures make cycles)
    outcomes: set[tuple[object, ...]] = field(default_factory=set)  # distinct final (shared, results)


# pcs
_START = 0
_C_LIMIT, _C_CAS, _C_HW_LOAD, _C_HW_CAS, _C_REFUSE = 1, 2, 3, 4, 5
_R_CAS, _R_UNDER = 1, 2

# shared = (used, limit, hw, refusals, underflows)
_USED, _LIMIT, _HW, _REF, _UND = range(5)
# ghost = (spec_used, granted, released, n_refused, n_underflow, max_used, max_limit)
_G_USED, _G_GRANTED, _G_RELEASED, _G_REF, _G_UND, _G_MAXUSED, _G_MAXLIM = range(7)
# thread local = (op index, pc, cur, nxt, lim, hwl, bound)
_IDLE = (0, 0, 0, 0, 0, 0)  # everything after the op index

Shared = tuple[int, int, int, int, int]
Ghost = tuple[int, int, int, int, int, int, int]
Local = tuple[int, int, int, int, int, int, int]
State = tuple[Shared, Ghost, tuple[Local, ...], tuple[tuple[Result, ...], ...]]


class _Model:
    def __init__(
        self,
        threads: tuple[tuple[Op, ...], ...],
        variant: Variant,
        bits: int,
        spurious_cas: bool,
    ) -> None:
        if variant not in VARIANTS:
            raise ValueError(f"unknown variant {variant!r}")
        self.threads = threads
        self.variant = variant
        self.mask = (1 << bits) - 1
        self.spurious = spurious_cas
        self.limit_changes = any(op.kind == "set_limit" for ops in threads for op in ops)

    # ---------------------------------------------------------------- steps

    def successors(self, state: State) -> list[tuple[str, State]]:
        out: list[tuple[str, State]] = []
        shared, ghost, locals_, results = state
        for t, local in enumerate(locals_):
            if local[0] >= len(self.threads[t]):
                continue
            for label, s2, g2, l2, res in self._step(t, shared, ghost, local):
                new_locals = list(locals_)
                new_results = results
                if res is not None:  # op finished: next op, registers cleared
                    l2 = (local[0] + 1, *_IDLE)
                    new_results = results[:t] + (results[t] + (res,),) + results[t + 1 :]
                # A limit store widens the bound of every op in flight.
                if s2[_LIMIT] != shared[_LIMIT]:
                    for u, other in enumerate(new_locals):
                        if u != t and other[1] != _START:
                            new_locals[u] = (*other[:6], max(other[6], s2[_LIMIT]))
                new_locals[t] = l2
                out.append((f"T{t} {self.threads[t][local[0]]}: {label}", (s2, g2, tuple(new_locals), new_results)))
        return out

    def _step(
        self, t: int, s: Shared, g: Ghost, local: Local
    ) -> list[tuple[str, Shared, Ghost, Local, Result | None]]:
        op = self.threads[t][local[0]]
        idx, pc, cur, nxt, lim, hwl, bound = local
        mask = self.mask
        used, limit, hw, refusals, underflows = s
        if op.kind == "set_limit":
            g2 = _g(g, _G_MAXLIM, max(g[_G_MAXLIM], op.n))
            return [(f"store limit={op.n}", (used, op.n, hw, refusals, underflows), g2, local, OK)]
        if op.kind == "consume":
            n = op.n
            if pc == _START:
                return [(f"load used -> {used}", s, g, (idx, _C_LIMIT, used, 0, 0, 0, limit), None)]
            if pc == _C_LIMIT:
                nxt = cur + n
                if nxt > mask or nxt > limit:
                    return [(f"load limit -> {limit}: refuse", s, g, (idx, _C_REFUSE, cur, 0, limit, 0, bound), None)]
                return [(f"load limit -> {limit}: fits", s, g, (idx, _C_CAS, cur, nxt, limit, 0, bound), None)]
            if pc == _C_CAS:
                if self.variant == "store_consume":  # broken: plain store, no CAS
                    g2 = self._grant(g, n, nxt)
                    s2 = (nxt, limit, hw, refusals, underflows)
                    return [(f"store used={nxt}", s2, g2, (idx, _C_HW_LOAD, cur, nxt, lim, 0, bound), None)]
                outs: list[tuple[str, Shared, Ghost, Local, Result | None]] = []
                if used == cur:
                    g2 = self._grant(g, n, nxt)
                    s2 = (nxt, limit, hw, refusals, underflows)
                    outs.append((f"CAS used {cur}->{nxt} ok", s2, g2, (idx, _C_HW_LOAD, cur, nxt, lim, 0, bound), None))
                    if self.spurious:
                        outs.append(("CAS spurious failure", s, g, (idx, _C_LIMIT, used, 0, 0, 0, bound), None))
                else:
                    outs.append((f"CAS used {cur}->{nxt} failed (used={used})", s, g, (idx, _C_LIMIT, used, 0, 0, 0, bound), None))
                return outs
            if pc == _C_HW_LOAD:
                if nxt > hw:
                    return [(f"load hw -> {hw}", s, g, (idx, _C_HW_CAS, cur, nxt, lim, hw, bound), None)]
                return [(f"load hw -> {hw}: done", s, g, local, OK)]
            if pc == _C_HW_CAS:
                if self.variant == "hw_store":  # broken: plain store may lower the mark
                    return [(f"store hw={nxt}", (used, limit, nxt, refusals, underflows), g, local, OK)]
                outs = []
                if hw == hwl:
                    outs.append((f"CAS hw {hwl}->{nxt} ok", (used, limit, nxt, refusals, underflows), g, local, OK))
                    if self.spurious:
                        outs.append(("CAS hw spurious failure", s, g, local, None))
                elif nxt > hw:
                    outs.append((f"CAS hw failed (hw={hw}), retry", s, g, (idx, pc, cur, nxt, lim, hw, bound), None))
                else:
                    outs.append((f"CAS hw failed (hw={hw}): done", s, g, local, OK))
                return outs
            if pc == _C_REFUSE:
                s2 = (used, limit, hw, refusals + 1, underflows)
                g2 = _g(g, _G_REF, g[_G_REF] + 1)
                return [("fetch_add refusals", s2, g2, local, ("refused", cur, lim))]
            raise AssertionError(f"bad pc {pc}")
        # release
        n = op.n
        if pc == _START:
            return [(f"load used -> {used}", s, g, (idx, _R_CAS, used, 0, 0, 0, 0), None)]
        if pc == _R_CAS:
            if self.variant == "wrapping_release":  # broken: no clamp at zero
                nxt = (cur - n) & mask
            else:
                nxt = 0 if n > cur else cur - n
            outs = []
            if used == cur:
                spec = g[_G_USED]
                g2 = _g(g, _G_USED, max(spec - n, 0))
                g2 = _g(g2, _G_RELEASED, g2[_G_RELEASED] + min(n, spec))
                s2 = (nxt, limit, hw, refusals, underflows)
                if n > cur:
                    g2 = _g(g2, _G_UND, g2[_G_UND] + 1)
                    outs.append((f"CAS used {cur}->{nxt} ok (underflow)", s2, g2, (idx, _R_UNDER, cur, nxt, 0, 0, 0), None))
                else:
                    outs.append((f"CAS used {cur}->{nxt} ok", s2, g2, local, OK))
                if self.spurious:
                    outs.append(("CAS spurious failure", s, g, local, None))
            else:
                outs.append((f"CAS used {cur}->{nxt} failed (used={used})", s, g, (idx, pc, used, 0, 0, 0, 0), None))
            return outs
        if pc == _R_UNDER:
            return [("fetch_add underflows", (used, limit, hw, refusals, underflows + 1), g, local, ("underflow", cur))]
        raise AssertionError(f"bad pc {pc}")

    def _grant(self, g: Ghost, n: int, nxt: int) -> Ghost:
        spec = g[_G_USED] + n
        g2 = _g(g, _G_USED, spec)
        g2 = _g(g2, _G_GRANTED, g2[_G_GRANTED] + n)
        return _g(g2, _G_MAXUSED, max(g2[_G_MAXUSED], spec))

    # --------------------------------------------------------------- checks

    def check(self, before: State, label: str, after: State) -> str | None:
        """The specification on one transition; a message when it fails."""
        s, g, locals_, _ = after
        if s[_USED] != g[_G_USED]:
            return f"lost update: used={s[_USED]} but the sequential value is {g[_G_USED]}"
        if not self.limit_changes:
            if g[_G_USED] > s[_LIMIT] or s[_USED] > s[_LIMIT]:
                return f"above the limit: used={s[_USED]} granted={g[_G_USED]} limit={s[_LIMIT]}"
            if s[_HW] > s[_LIMIT]:
                return f"high water {s[_HW]} above the limit {s[_LIMIT]}"
        else:
            # A consume that just linearised must fit a limit in force while it ran.
            b_locals = before[2]
            for t, (old, new) in enumerate(zip(b_locals, locals_)):
                if old[1] == _C_CAS and new[1] == _C_HW_LOAD and new[3] > old[6]:
                    return f"above the limit: T{t} made used={new[3]} above every limit in force (max {old[6]})"
            if s[_USED] > g[_G_MAXLIM]:
                return f"above the limit: used={s[_USED]} above every limit ever set (max {g[_G_MAXLIM]})"
        if s[_HW] > g[_G_MAXUSED]:
            return f"high water {s[_HW]} above the largest value used ever reached ({g[_G_MAXUSED]})"
        return None

    def check_final(self, state: State) -> str | None:
        s, g, _, results = state
        if s[_USED] != g[_G_GRANTED] - g[_G_RELEASED]:
            return f"final used={s[_USED]} != granted {g[_G_GRANTED]} - released {g[_G_RELEASED]}"
        if s[_REF] != g[_G_REF]:
            return f"refusals={s[_REF]}, but {g[_G_REF]} consumes were refused"
        if s[_UND] != g[_G_UND]:
            return f"underflows={s[_UND]}, but {g[_G_UND]} releases clamped"
        if s[_HW] != g[_G_MAXUSED]:
            return f"high water {s[_HW]} != the largest value used reached ({g[_G_MAXUSED]})"
        if s[_HW] > g[_G_MAXLIM]:
            return f"high water {s[_HW]} above every limit ever set"
        n_refused = sum(1 for rs in results for r in rs if r[0] == "refused")
        n_under = sum(1 for rs in results for r in rs if r[0] == "underflow")
        if (n_refused, n_under) != (s[_REF], s[_UND]):
            return "op results disagree with the counters"
        return None


def _g(g: Ghost, i: int, v: int) -> Ghost:
    return g[:i] + (v,) + g[i + 1 :]  # type: ignore[return-value]


def _initial(threads: tuple[tuple[Op, ...], ...], limit: int, used: int, hw: int) -> State:
    shared: Shared = (used, limit, hw, 0, 0)
    ghost: Ghost = (used, used, 0, 0, 0, max(used, hw), limit)
    locals_ = tuple((0, *_IDLE) for _ in threads)
    return shared, ghost, locals_, tuple(() for _ in threads)


def explore(
    threads: list[list[Op]] | tuple[tuple[Op, ...], ...],
    *,
    limit: int,
    used: int = 0,
    variant: Variant = "correct",
    bits: int = 64,
    spurious_cas: bool = False,
    max_states: int = 2_000_000,
) -> ExploreResult:
    """Check every interleaving of ``threads``; raise :class:`Violation` with a trace.

    ``bits`` is the word size (a small one exercises the overflow check).
    ``spurious_cas`` also lets every CAS fail spuriously (the C code uses the
    weak CAS); that adds cycles, so interleavings are not counted then.
    """
    prog = tuple(tuple(ops) for ops in threads)
    if used > limit:
        raise ValueError("initial used must not exceed the limit")
    model = _Model(prog, variant, bits, spurious_cas)
    start = _initial(prog, limit, used, used)
    counts: dict[State, int] = {}
    on_stack: set[State] = set()
    outcomes: set[tuple[object, ...]] = set()
    path: list[str] = []
    cyclic = False

    def visit(state: State) -> int:
        nonlocal cyclic
        known = counts.get(state)
        if known is not None:
            return known
        if len(counts) >= max_states:
            raise RuntimeError(f"more than {max_states} states: shrink the program")
        on_stack.add(state)
        succ = model.successors(state)
        if not succ:
            problem = model.check_final(state)
            if problem:
                raise Violation(problem, list(path))
            outcomes.add((state[0], state[3]))
            total = 1
        else:
            total = 0
            for label, nxt in succ:
                path.append(label)
                problem = model.check(state, label, nxt)
                if problem:
                    raise Violation(problem, list(path))
                if nxt in on_stack:
                    cyclic = True  # a spurious CAS failure returned to a state on this path
                else:
                    total += visit(nxt)
                path.pop()
        on_stack.discard(state)
        counts[state] = total
        return total

    total = visit(start)
    return ExploreResult(states=len(counts), interleavings=None if cyclic else total, outcomes=outcomes)


@dataclass
class LineState:
    """One counter line, as the C helper keeps it."""

    used: int = 0
    limit: int = (1 << 64) - 1
    high_water: int = 0
    refusals: int = 0
    underflows: int = 0


def run_sequential(line: LineState, op: Op, *, bits: int = 64) -> Result:
    """Apply one op to ``line`` (in place) through the model's step machine; its result.

    With one thread the machine takes exactly one path: this *is* the
    sequential semantics of the modelled algorithm.
    """
    model = _Model(((op,),), "correct", bits, False)
    shared: Shared = (line.used, line.limit, line.high_water, line.refusals, line.underflows)
    ghost: Ghost = (line.used, line.used, 0, 0, 0, line.high_water, line.limit)
    local: Local = (0, *_IDLE)
    while True:
        steps = model._step(0, shared, ghost, local)
        assert len(steps) == 1, "a single thread is deterministic"
        _, shared, ghost, local, result = steps[0]
        if result is not None:
            break
    line.used, line.limit, line.high_water, line.refusals, line.underflows = shared
    return result
