"""The fault schedule: a pure function of the seed (:func:`build_schedule`), and its hash."""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Sequence
from dataclasses import dataclass

from supervisor.tools.chaos.config import LEAK_BIG, LEAK_SMALL

__all__ = ["Fault", "build_schedule", "schedule_hash"]

# --------------------------------------------------------------------------- the schedule


@dataclass(frozen=True)
class Fault:
    """One scheduled fault: ``at_s`` seconds into the fault phase."""

    at_s: float
    tenant: str  # role name ("faulty-0")
    kind: str
    instance: int
    params: tuple[tuple[str, int], ...] = ()
    heal: bool = False  # the end of a ``slow`` fault (``slow`` with ms=0)

    def to_dict(self) -> dict[str, object]:
        return {
            "at_s": self.at_s,
            "tenant": self.tenant,
            "kind": self.kind,
            "instance": self.instance,
            "params": dict(self.params),
            "heal": self.heal,
        }


def _params(kind: str, rng: random.Random) -> tuple[tuple[str, int], ...]:
    if kind == "exit":
        return (("code", rng.choice((0, 1, 2, 3, 42, 255))),)
    if kind == "slow":
        return (("ms", rng.choice((20, 50, 100, 200))),)
    if kind == "oom":
        return (("count", rng.randint(1, 3)),)
    if kind == "leak":
        return (("bytes", LEAK_BIG if rng.random() < 0.5 else LEAK_SMALL),)
    return ()


def build_schedule(
    seed: int, kinds: Sequence[str], rate: float, span_s: float, targets: Sequence[tuple[str, int]]
) -> tuple[Fault, ...]:
    """Poisson arrivals at ``rate`` over ``span_s``; each picks a target, an instance, a kind, parameters.

    ``targets`` are (role name, instances). A ``slow`` fault is healed (``ms=0``)
    0.5-3 s later. Deterministic: the same arguments give the same schedule.
    """
    if not targets or not kinds or rate <= 0 or span_s <= 0:
        return ()
    rng = random.Random(f"twt-chaos-schedule:{seed}")
    out: list[Fault] = []
    t = 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= span_s:
            break
        name, instances = targets[rng.randrange(len(targets))]
        kind = kinds[rng.randrange(len(kinds))]
        instance = rng.randrange(instances)
        params = _params(kind, rng)
        out.append(Fault(round(t, 3), name, kind, instance, params))
        if kind == "slow":
            heal_at = round(t + rng.uniform(0.5, 3.0), 3)
            if heal_at < span_s:
                out.append(Fault(heal_at, name, "slow", instance, (("ms", 0),), heal=True))
    out.sort(key=lambda f: f.at_s)
    return tuple(out)


def schedule_hash(schedule: Sequence[Fault]) -> str:
    """sha256 of the schedule's canonical JSON (first 16 hex digits)."""
    doc = json.dumps([f.to_dict() for f in schedule], sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(doc.encode()).hexdigest()[:16]
