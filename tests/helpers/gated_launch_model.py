"""An exhaustive interleaving explorer for the gated launch: a grantee's first chunk started by its
device (the stub's executor, ``worker/_stubexec.c``) the moment the lease board's owner word names it.

The owner word (``shared.gpu_time``): free, or a worker and a busy bit. Four actors, each step one
atomic action on shared memory (or, for the executor and the driver, on the executor's mutex):

* **G**, the holder: its chunk ends; ``finish`` (busy -> idle); the hand-over to any waiting worker
  (every pick the policy could make is explored) or the device freed.
* **B's driver** (its device thread): arms the gated chunk (under the executor's mutex), looks at
  the owner word, takes its own grant with a CAS (idle -> busy) or finds it already busy and its own;
  or gives up (a refused wait, at any look) - either way it *resolves* the gate under the mutex:
  the chunk runs, or is cancelled unless the executor already took the lease for it.
* **B's executor**: under its mutex, reads the owner word; when it names B idle, CASes it busy and
  marks the chunk taken; when B's and busy (the driver's CAS won), taken; else it sleeps (lock
  released) and looks again. A taken chunk starts, then ends.
* **C**, another waiter: steals an idle lease from whoever holds it (a grant not started within the
  quantum: every such moment is explored), takes a free device or a grant to it, runs a chunk,
  passes the device to B if B waits.

With ``small`` (a stretch's small op gated in the executor: a run's fill, the chatty tenant's fill)
the executor also *passes the lease back* at the op's end when another worker waits and the driver
has not resolved the gate yet: under its mutex it marks the gate handed, then ``finish`` (its CAS,
busy -> idle) and a hand-over to any waiting worker (every pick explored; a lost CAS - a waiter stole
the idle lease first - passes nothing). The driver, whenever it looks (or resolves), finds the gate
handed: its op ran, and it holds only what its own CAS won since (a later grant), which it releases.

Sleeps and wake-ups (``shared.gpu_time._wake``): a waiting driver (B's, C) reads the board's wake
sequence, looks at the owner word, and - with nothing to take - sleeps on the sequence (a futex: only
while it still holds the value read). Every hand-over that wins its CAS then bumps the sequence and
wakes *only the worker it names* (its driver and its executor), one more step of the giver's; the
executor that passes a small op's lease back wakes its own driver too. B's executor sleeps on the
owner word (a futex on the value it read) and is woken by a grant to B or by its driver's resolve. A
sleeper wakes only when woken, except C at a steal deadline (its timed sleep: the lease idle and
another worker's) - a lost wake-up is never masked by a timeout. B's death
may fall between a hand-over's CAS and its wake: the supervisor's reclaim then wakes the worker an idle
owner word names. At every end state no driver sleeps while the owner word is free or names it, no
executor sleeps (but on a cancelled gate: the cancel's wake can come before its futex, the owner
word unchanged, and its poll ends that sleep), and B's driver never sleeps through its op passed back.

B's process may be SIGKILLed at any step (driver and executor gone, a running kernel with them);
the supervisor's reclaim then passes a lease that names B on. Checked in every state: a chunk runs
only while the owner word names its worker busy, at most one at a time; B's chunk runs at most once;
never after a refused wait; never after B's death. At every end state: B's driver holds the lease
busy and its chunk ran once, or its wait was refused (or it died) and the chunk never ran.

``variant`` swaps in broken algorithms so the tests show the checker fails when it should:
``run_on_grant`` (the executor starts on reading its grant, no CAS), ``run_after_lost_cas``,
``cancel_unlocked`` (the driver's cancel does not wait for the executor's mutex); with ``small``:
``handback_after_resolve`` (the executor passes the lease on even when the driver resolved the gate
first and holds it), ``handback_at_start`` (passed on when the op starts, not when it ends),
``handback_blind`` (the hand-over's second step a store, not a CAS from its own idle word),
``handed_keeps_grant`` (the driver, its op passed back, leaves a grant that reached it while it still
waited - the device then idles with it until a steal). Of the wake rule: ``wake_none_at_release``
(a hand-over wakes nobody), ``wake_others`` (it wakes every waiter but the one it names),
``reclaim_wakes_nobody`` (the reclaim of a B that died between a hand-over's CAS and its wake leaves
the grantee asleep); ``wake_all``
(every waiter at each change of hands, the rule before one wake per change of hands) is correct too.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

__all__ = ["SMALL_VARIANTS", "VARIANTS", "WAKE_VARIANTS", "Explored", "State", "Violation", "explore"]

Variant = Literal["correct", "run_on_grant", "run_after_lost_cas", "cancel_unlocked", "handback_after_resolve",
                  "handback_at_start", "handback_blind", "handed_keeps_grant", "wake_none_at_release", "wake_others",
                  "reclaim_wakes_nobody", "wake_all"]
VARIANTS: tuple[Variant, ...] = ("correct", "run_on_grant", "run_after_lost_cas", "cancel_unlocked")
#: the broken variants of the small op's hand-back (``explore(..., small=True)``)
SMALL_VARIANTS: tuple[Variant, ...] = ("correct", "handback_after_resolve", "handback_at_start", "handback_blind",
                                       "handed_keeps_grant")
#: the broken variants of the wake rule (with and without ``small``)
WAKE_VARIANTS: tuple[Variant, ...] = ("wake_none_at_release", "wake_others", "reclaim_wakes_nobody")

G, B, C = 0, 1, 2
#: whom a wake names: B's driver, C (its driver), B's executor (a bit each, as the board's wake bits)
WB, WC, WE = 1, 2, 4
W_ALL = WB | WC | WE
#: the owner word: None (free) or (worker, busy)
Owner = tuple[int, bool] | None


@dataclass(frozen=True, slots=True)
class State:
    owner: Owner = (G, True)
    running: frozenset[int] = frozenset({G})
    lock: bool = False  # the executor's mutex, held by the executor (the driver's sections are one step)
    gate: str = "none"  # none | armed | taken | plain | cancelled | handed
    b_waiting: bool = True
    c_waiting: bool = True
    b_alive: bool = True
    reclaimed: bool = False
    ran_b: int = 0
    ran_b_at_kill: int = -1
    d_cas: bool = False  # B's driver's own CAS won a grant (with the gate handed: a later grant, its own)
    e_won: bool = False  # B's executor's own CAS took the lease for the gated op
    g_pc: str = "run"
    d_pc: str = "arm"  # arm | look | cas | ok | cancel | hold | refused | released | hback | handed | dead
    e_pc: str = "idle"  # idle | locked | read | taken | run | end | back | finish | hand | done | dead
    e_reg: Owner = None
    c_pc: str = "look"  # look | peek | sleep | asleep | cas | run | end | finish | done
    c_reg: Owner = None
    seq: int = 0  # the board's wake sequence
    d_seq: int = -1  # the sequence as B's driver last read it (its futex's value)
    c_seq: int = -1
    # a wake each actor owes (WB | WC | WE: whom it names; 0 none) - the step after its hand-over's CAS
    g_wk: int = 0
    d_wk: int = 0
    e_wk: int = 0
    c_wk: int = 0


class Violation(AssertionError):
    def __init__(self, message: str, trace: list[str]) -> None:
        super().__init__(message + "\ninterleaving:\n  " + "\n  ".join(trace))
        self.trace = trace


@dataclass(frozen=True)
class Explored:
    states: int
    end_states: int
    #: how the driver's wait ended in some end state (hold / released / dead) and the gate's state then
    outcomes: frozenset[tuple[str, str]]
    #: every step taken in some interleaving (the races the exploration reached)
    steps: frozenset[str]


_KILL = "B: SIGKILL"


def _check(s: State) -> str | None:
    if len(s.running) > 1:
        return f"two workers' chunks run at once: {sorted(s.running)}"
    for w in s.running:
        if s.owner != (w, True):
            return f"worker {w}'s chunk runs while the owner word is {s.owner}"
    if s.ran_b > 1:
        return "B's chunk ran twice"
    if s.d_pc in ("refused", "released") and s.ran_b:
        return "B's wait was refused but its chunk ran"
    if s.d_pc == "hold" and s.gate != "handed" and s.e_pc in ("done", "dead") and s.owner != (B, True):
        return f"B's driver holds the lease, its executor done, but the owner word is {s.owner}"
    if s.ran_b_at_kill >= 0 and s.ran_b != s.ran_b_at_kill:
        return "B's chunk started after B was killed"
    return None


def _check_end(s: State) -> str | None:
    if s.d_pc == "asleep" and (s.owner is None or s.owner[0] == B):
        return f"lost wake-up: B's driver asleep while the owner word is {s.owner}"
    if s.d_pc == "asleep" and s.gate == "handed":
        return "lost wake-up: B's driver asleep though its executor passed its op's lease back"
    if s.c_pc == "asleep" and (s.owner is None or s.owner[0] == C):
        return f"lost wake-up: C asleep while the owner word is {s.owner}"
    if s.e_pc == "asleep":
        return f"lost wake-up: B's executor asleep with its gate {s.gate}, the owner word {s.owner}"
    if s.d_pc == "hold" and (s.ran_b != 1 or s.running):
        return f"B's driver holds the lease but its chunk ran {s.ran_b} times (running {sorted(s.running)})"
    if s.d_pc == "hold" and s.owner != (B, True):
        return f"B's driver holds the lease but the owner word is {s.owner}"
    if s.d_pc == "released" and s.owner is not None and s.owner[0] == B:
        return f"B's wait was refused but the owner word names it: {s.owner}"
    if s.d_pc == "handed" and (s.ran_b != 1 or s.running or (s.owner is not None and s.owner[0] == B)):
        return f"B's op was passed back but it ran {s.ran_b} times, the owner word {s.owner}"
    return None


def _hand(s: State, frm: Owner, targets: list[int]) -> list[tuple[str, State]]:
    """CAS the owner word from ``frm`` to each possible pick (idle), or free it when none waits."""
    if s.owner != frm:
        return [("cas lost", s)]
    if not targets:
        return [("freed", replace(s, owner=None))]
    return [(f"to {t}", replace(s, owner=(t, False))) for t in targets]


def _names(t: int) -> int:
    """Whom a grant to worker ``t`` wakes: its driver and, for B, its executor."""
    return WB | WE if t == B else WC if t == C else 0


def _wakes(variant: Variant, what: str, s: State) -> int:
    """The wake a hand-over owes after its CAS (``what``: ``to <t>``, ``freed``, ``cas lost``)."""
    if not what.startswith("to "):
        return 0  # (a device freed wakes every waiter: none waits then, in this model)
    named = _names(int(what[3:]))
    if variant == "wake_none_at_release":
        return 0
    if variant == "wake_others":
        return W_ALL & ~named
    if variant == "wake_all":
        return W_ALL
    return named


def _wake(s: State, bits: int) -> State:
    """The wake step: the sequence bumped, the sleepers ``bits`` names woken."""
    t = replace(s, seq=s.seq + 1)
    if bits & WB and t.d_pc == "asleep":
        t = replace(t, d_pc="look")
    if bits & WC and t.c_pc == "asleep":
        t = replace(t, c_pc="look")
    if bits & WE and t.e_pc == "asleep":
        t = replace(t, e_pc="idle")
    return t


def _waiters(s: State) -> list[int]:
    out = []
    if s.b_waiting:  # (a dead B still waits on the board until the reclaim clears its slot)
        out.append(B)
    if s.c_waiting:
        out.append(C)
    return out


def _steps(s: State, variant: Variant, small: bool = False) -> list[tuple[str, State]]:
    out: list[tuple[str, State]] = []
    # --- G, the holder
    if s.g_wk:
        out.append((f"G: wake {s.g_wk}", replace(_wake(s, s.g_wk), g_wk=0)))
    elif s.g_pc == "run":
        out.append(("G: chunk ends", replace(s, running=s.running - {G}, g_pc="finish")))
    elif s.g_pc == "finish":
        assert s.owner == (G, True)
        out.append(("G: finish (idle)", replace(s, owner=(G, False), g_pc="hand")))
    elif s.g_pc == "hand":
        for what, t in _hand(s, (G, False), _waiters(s)):
            out.append((f"G: hand over {what}", replace(t, g_pc="done", g_wk=_wakes(variant, what, t))))
    # --- B's driver
    if s.b_alive:
        if s.d_wk:
            out.append((f"B driver: wake {s.d_wk}", replace(_wake(s, s.d_wk), d_wk=0)))
        elif s.d_pc == "arm" and not s.lock:
            out.append(("B driver: arm", replace(s, gate="armed", d_pc="look")))
        elif s.d_pc == "look":
            # the wake sequence first: a wake-up after this read cuts its sleep short
            out.append(("B driver: reads the wake sequence", replace(s, d_pc="peek", d_seq=s.seq)))
        elif s.d_pc == "sleep":
            if s.seq == s.d_seq:
                out.append(("B driver: sleeps", replace(s, d_pc="asleep")))
            else:
                out.append(("B driver: woken before it slept", replace(s, d_pc="look")))
        elif s.d_pc == "peek":
            if s.owner is not None and s.owner[0] != B and s.gate != "handed":
                out.append(("B driver: nothing to take", replace(s, d_pc="sleep")))
            if s.owner is None and s.gate != "handed":
                out.append(("B driver: sees the device free", replace(s, d_pc="cas")))
            if s.gate == "handed":
                out.append(("B driver: sees its op passed back", replace(s, d_pc="hback", b_waiting=False)))
            if s.owner == (B, False):
                out.append(("B driver: sees its grant", replace(s, d_pc="cas")))
            elif s.owner == (B, True):
                out.append(("B driver: sees it busy, its own", replace(s, d_pc="ok")))
            out.append(("B driver: refused (deadline)", replace(s, d_pc="cancel")))
        elif s.d_pc == "cas":
            if s.owner == (B, False) or s.owner is None:  # its grant, or a free device (its own pick)
                out.append(("B driver: CAS won", replace(s, owner=(B, True), d_pc="ok", d_cas=True)))
            else:
                out.append(("B driver: CAS lost", replace(s, d_pc="look")))
        elif s.d_pc == "ok" and not s.lock:
            if s.gate == "handed":  # its op ran and was passed on by the executor
                out.append(("B driver: resolve (passed back)", replace(s, d_pc="hback", b_waiting=False)))
            else:
                gate = "plain" if s.gate == "armed" else s.gate
                # (gate_resolve wakes its executor, asleep on the owner word, with its own bit)
                out.append(("B driver: resolve (runs)",
                            replace(s, gate=gate, d_pc="hold", b_waiting=False,
                                    e_pc="idle" if s.e_pc == "asleep" else s.e_pc)))
        elif s.d_pc == "hback":
            # the op ran and its lease was passed on: the driver holds only what its own CAS won since
            # (a later grant), and passes on a grant that reached it while it still waited
            targets = [C] if s.c_waiting else []
            if variant == "handed_keeps_grant" and s.owner != (B, True):
                out.append(("B driver: holds nothing (not looked)", replace(s, d_pc="handed")))
            elif s.owner == (B, True) and s.d_cas:
                for what, t in _hand(replace(s, owner=(B, False)), (B, False), targets):
                    out.append((f"B driver: release the later grant {what}",
                                replace(t, d_pc="handed", d_wk=_wakes(variant, what, t))))
            elif s.owner == (B, False):
                for what, t in _hand(s, (B, False), targets):
                    out.append((f"B driver: pass a grant on {what}",
                                replace(t, d_pc="handed", d_wk=_wakes(variant, what, t))))
            else:
                out.append(("B driver: holds nothing", replace(s, d_pc="handed")))
        elif s.d_pc == "cancel" and (not s.lock or variant == "cancel_unlocked"):
            if s.gate == "handed":
                out.append(("B driver: resolve (cancel: passed back)", replace(s, d_pc="hback", b_waiting=False)))
            elif s.gate == "armed":
                out.append(("B driver: resolve (cancelled)",
                            replace(s, gate="cancelled", d_pc="refused", b_waiting=False,
                                    e_pc="idle" if s.e_pc == "asleep" else s.e_pc)))
            else:  # the executor took the lease first: the driver holds it after all
                out.append(("B driver: resolve (taken first)", replace(s, d_pc="ok")))
        elif s.d_pc == "refused":
            # the run ends (the gate's release): a grant that reached it meanwhile is passed on
            if s.owner == (B, False):
                for what, t in _hand(s, (B, False), [C] if s.c_waiting else []):
                    out.append((f"B driver: release {what}",
                                replace(t, d_pc="released", d_wk=_wakes(variant, what, t))))
            else:
                out.append(("B driver: release (holds nothing)", replace(s, d_pc="released")))
    # --- B's executor
    if s.b_alive:
        if s.e_wk:
            out.append((f"B exec: wake {s.e_wk}", replace(_wake(s, s.e_wk), e_wk=0)))
        elif s.e_pc == "fsleep":
            # the futex on the owner word: asleep only while it still holds the value read
            if s.owner == s.e_reg:
                out.append(("B exec: asleep on the owner word", replace(s, e_pc="asleep")))
            else:
                out.append(("B exec: the word moved, looks again", replace(s, e_pc="idle")))
        elif s.e_pc == "asleep" and s.gate == "cancelled":
            # a cancel's wake can come between the executor's unlock and its futex (the owner word
            # unchanged): its poll ends that sleep - nothing of the lease's waits on it then
            out.append(("B exec: poll (its gate cancelled)", replace(s, e_pc="idle")))
        elif s.e_pc == "idle" and s.gate != "none" and not s.lock:
            out.append(("B exec: lock", replace(s, lock=True, e_pc="locked")))
        elif s.e_pc == "locked":
            if s.gate == "cancelled":
                out.append(("B exec: cancelled, unlock", replace(s, lock=False, e_pc="done")))
            elif s.gate in ("plain", "taken"):
                out.append(("B exec: resolved, unlock", replace(s, lock=False, e_pc="run")))
            else:
                out.append((f"B exec: reads {s.owner}", replace(s, e_reg=s.owner, e_pc="read")))
        elif s.e_pc == "read":
            if s.e_reg == (B, False):
                if variant == "run_on_grant":
                    out.append(("B exec: grant seen, taken (no CAS)", replace(s, gate="taken", e_pc="taken")))
                elif s.owner == (B, False):
                    out.append(("B exec: CAS won", replace(s, owner=(B, True), gate="taken", e_pc="taken",
                                                          e_won=True)))
                elif variant == "run_after_lost_cas":
                    out.append(("B exec: CAS lost, runs anyway", replace(s, gate="taken", e_pc="taken")))
                elif s.owner == (B, True):  # (the CAS reads the word back: the driver's CAS won)
                    out.append(("B exec: CAS lost, busy its own", replace(s, gate="taken", e_pc="taken")))
                else:
                    out.append(("B exec: CAS lost, sleeps", replace(s, lock=False, e_pc="fsleep", e_reg=s.owner)))
            elif s.e_reg == (B, True):
                out.append(("B exec: busy, its own", replace(s, gate="taken", e_pc="taken")))
            else:
                out.append(("B exec: not its own, sleeps", replace(s, lock=False, e_pc="fsleep")))
        elif s.e_pc == "taken":
            out.append(("B exec: unlock", replace(s, lock=False, e_pc="run")))
        elif s.e_pc == "run":
            t = replace(s, running=s.running | {B}, ran_b=s.ran_b + 1, e_pc="end")
            if (small and variant == "handback_at_start" and s.gate == "taken" and s.e_won and s.d_pc != "hold"
                    and s.c_waiting):
                t = replace(t, owner=(C, False), gate="handed", e_pc="end")
            out.append(("B exec: chunk starts", t))
        elif s.e_pc == "end":
            out.append(("B exec: chunk ends", replace(s, running=s.running - {B}, e_pc="back" if small else "done")))
        elif s.e_pc == "back" and not s.lock:
            # under its mutex: the driver has not resolved the gate (it sleeps) and another waits -
            # the op's lease is passed back by the executor, not by the driver once it woke
            # (only a lease its own CAS took: one the driver's CAS took is the driver's, awake, to pass on)
            unresolved = s.gate == "taken" and s.e_won and (
                s.d_pc != "hold" or variant == "handback_after_resolve")
            if unresolved and s.c_waiting:
                out.append(("B exec: passes the lease back", replace(s, gate="handed", e_pc="finish")))
            else:
                out.append(("B exec: keeps the lease (resolved, or none waits)", replace(s, e_pc="done")))
        elif s.e_pc == "finish":
            if s.owner == (B, True):
                out.append(("B exec: finish (idle)", replace(s, owner=(B, False), e_pc="hand")))
            else:  # (a broken variant passed it on already)
                out.append(("B exec: finish, not its own", replace(s, e_pc="done")))
        elif s.e_pc == "hand":
            # the hand-back wakes the grantee and, whatever the CAS, its own driver: its op ran
            targets = [C] if s.c_waiting else []
            own = 0 if variant == "wake_none_at_release" else WB
            if variant == "handback_blind":
                stores: list[Owner] = [(t_, False) for t_ in targets] or [None]
                for owner in stores:
                    what = f"to {owner[0]}" if owner else "freed"
                    out.append((f"B exec: hand over (store) {owner}",
                                replace(s, owner=owner, e_pc="done", e_wk=_wakes(variant, what, s) | own)))
            else:
                for what, t in _hand(s, (B, False), targets):
                    out.append((f"B exec: hand over {what}",
                                replace(t, e_pc="done", e_wk=(_wakes(variant, what, t) & ~WE) | own)))
        out.append((_KILL, replace(s, b_alive=False, running=s.running - {B}, lock=False, d_pc="dead",
                                          e_pc="dead", ran_b_at_kill=s.ran_b)))
    elif not s.reclaimed:
        # the supervisor saw the death: the slot stops waiting; a lease naming B passes on
        t = replace(s, reclaimed=True, b_waiting=False)
        if s.owner is not None and s.owner[0] == B:
            for what, u in _hand(t, s.owner, [C] if s.c_waiting else []):
                # (the supervisor's CAS and its wake as one step: it races no waiter of its own)
                out.append((f"reclaim: {what}", _wake(u, _wakes(variant, what, u)) if _wakes(variant, what, u) else u))
        elif s.owner is not None and not s.owner[0] == B and not s.owner[1]:
            # B may have died between a hand-over's CAS and its wake: the grantee the word names is woken
            out.append(("reclaim: B held nothing, the grantee woken",
                        _wake(t, 0 if variant in ("wake_none_at_release", "reclaim_wakes_nobody")
                              else _names(s.owner[0]))))
        else:
            out.append(("reclaim: B held nothing", t))
    # --- C, another waiter
    o = s.owner
    if s.c_wk:
        out.append((f"C: wake {s.c_wk}", replace(_wake(s, s.c_wk), c_wk=0)))
    elif s.c_pc == "look":
        out.append(("C: reads the wake sequence", replace(s, c_pc="peek", c_seq=s.seq)))
    elif s.c_pc == "peek":
        if o is None or o == (C, False) or (not o[1] and o[0] != C):
            out.append((f"C: reads {o} (may take it)", replace(s, c_reg=o, c_pc="cas")))
        if o is not None and o != (C, False):  # busy, or idle before its steal deadline
            out.append(("C: nothing to take yet", replace(s, c_pc="sleep")))
    elif s.c_pc == "sleep":
        if s.seq == s.c_seq:
            out.append(("C: sleeps", replace(s, c_pc="asleep")))
        else:
            out.append(("C: woken before it slept", replace(s, c_pc="look")))
    elif s.c_pc == "asleep":
        if o is not None and not o[1] and o[0] != C:  # its timed sleep: the steal deadline
            out.append(("C: steal deadline", replace(s, c_pc="look")))
    elif s.c_pc == "cas":
        if s.owner == s.c_reg:
            out.append(("C: CAS won", replace(s, owner=(C, True), c_waiting=False, c_pc="run")))
        else:
            out.append(("C: CAS lost", replace(s, c_pc="look")))
    elif s.c_pc == "run":
        out.append(("C: chunk starts", replace(s, running=s.running | {C}, c_pc="end")))
    elif s.c_pc == "end":
        out.append(("C: chunk ends, finish", replace(s, running=s.running - {C}, owner=(C, False), c_pc="finish")))
    elif s.c_pc == "finish":
        for what, t in _hand(s, (C, False), [B] if s.b_waiting else []):
            out.append((f"C: release {what}", replace(t, c_pc="done", c_wk=_wakes(variant, what, t))))
    return out


def explore(variant: Variant = "correct", *, small: bool = False) -> Explored:
    """Every interleaving from the start state (G holding busy, B and C waiting); raises
    :class:`Violation` with the interleaving that broke a property."""
    start = State()
    seen: set[State] = {start}
    stack: list[tuple[State, list[str]]] = [(start, [])]
    ends = 0
    outcomes: set[tuple[str, str]] = set()
    labels: set[str] = set()
    while stack:
        s, trace = stack.pop()
        steps = _steps(s, variant, small)
        if all(label == _KILL for label, _ in steps):
            # nothing left to do but die: an end state (a kill from it is explored too)
            ends += 1
            bad = _check_end(s)
            if bad:
                raise Violation(bad, trace)
            outcomes.add((s.d_pc, s.gate))
        for label, t in steps:
            labels.add(label)
            if t in seen:
                continue
            bad = _check(t)
            if bad:
                raise Violation(bad, [*trace, label])
            seen.add(t)
            stack.append((t, [*trace, label]))
    return Explored(len(seen), ends, frozenset(outcomes), frozenset(labels))
