"""The stub's device as a core of its own: which CPUs stand in for each stub device.

A GPU is a processor apart: it runs launched work whatever the host's load. The
stub's device is each worker's device thread (``twt-device``, worker.device_time),
which otherwise shares the host's cores with the guests, the supervisor and the
clients, and waits for one of them between and inside its launches (device idle:
docs/GPU-QUOTAS.md, "The stub device"). With ``stub_device_cpus`` set, every stub
worker's device thread runs only on its device's CPU, and the worker's other
threads (and the supervisor's) only on the CPUs left::

    supervisor   resolve(setting, stub devices, its affinity)  ──►  {device: cpu}, the rest
                 the supervisor's threads onto the rest (set_threads_affinity)
                 bind options: device_cpus = [[device, cpu], ...]
    worker       at bind: the process's threads onto the rest; its device thread, when it starts,
                 onto its device's CPU (``os.sched_setaffinity(0, ...)``: Linux keeps affinity per
                 thread, and a new thread starts with its creator's)

The setting (shared.config): ``()`` off (the default: a user who runs the stub
beside other work keeps every CPU for it); ``"last"``: the last CPUs of the
supervisor's affinity set, one a stub device; or CPU numbers, the i-th stub
device (in index order) on the i-th (cycled when fewer). A host with too few
CPUs (none left for the rest) or CPUs the process may not use: a logged
fallback to today's behaviour (:func:`resolve` says why), never a crash.

Owns: nothing (pure functions and the one ``sched_setaffinity`` helper).
Threads: called by the supervisor's start and a worker's bind.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence

__all__ = ["LAST", "parse_device_cpus", "resolve", "set_threads_affinity"]

#: the setting's rule: the last CPUs of the supervisor's affinity set, one a stub device
LAST = "last"


def parse_device_cpus(value: object) -> tuple[int, ...] | str:
    """The setting's value checked: ``()`` (off: ``""``, ``"none"``, ``[]``), ``"last"``, or CPU
    numbers (a list, or a comma-separated string ``"1,3"``). Raises ``ValueError``."""
    if isinstance(value, str):
        text = value.strip().lower()
        if text in ("", "none", "off"):
            return ()
        if text == LAST:
            return LAST
        value = [v.strip() for v in text.split(",") if v.strip()]
    if isinstance(value, (list, tuple)):
        out: list[int] = []
        for v in value:
            if isinstance(v, bool) or not isinstance(v, (int, str)):
                raise ValueError(f"stub_device_cpus must be 'last' or a list of CPU numbers; got {value!r}")
            try:
                cpu = int(v)
            except ValueError:
                raise ValueError(f"stub_device_cpus must be 'last' or a list of CPU numbers; got {value!r}") from None
            if not 0 <= cpu < 65_536:
                raise ValueError(f"stub_device_cpus: a CPU number is 0..65535; got {cpu}")
            out.append(cpu)
        return tuple(dict.fromkeys(out))
    raise ValueError(f"stub_device_cpus must be 'last' or a list of CPU numbers; got {value!r}")


def resolve(setting: tuple[int, ...] | str, devices: Sequence[int],
            allowed: Iterable[int]) -> tuple[dict[int, int], str]:
    """``{device: cpu}`` for the stub ``devices`` under ``setting``, given the CPUs the process may
    use (``allowed``); ``({}, why)`` where the setting cannot apply (off: ``({}, "")``). At least
    one allowed CPU must stay for everything else."""
    if not setting or not devices:
        return {}, ""
    cpus = sorted(set(allowed))
    order = sorted(devices)
    if setting == LAST:
        if len(cpus) <= len(order):
            return {}, (f"'last' needs more CPUs than stub devices ({len(order)}) to leave one for the "
                        f"host's other work; this process may use {len(cpus)}")
        chosen = cpus[-len(order):]
    else:
        assert isinstance(setting, tuple)
        missing = [c for c in setting if c not in cpus]
        if missing:
            return {}, (f"CPU(s) {', '.join(map(str, missing))} are not in this process's affinity set "
                        f"({_ranges(cpus)})")
        if not set(cpus) - set(setting):
            return {}, f"no CPU of this process's affinity set ({_ranges(cpus)}) would be left for the host's work"
        chosen = list(setting)
    return {d: chosen[i % len(chosen)] for i, d in enumerate(order)}, ""


def set_threads_affinity(cpus: Iterable[int], *, skip: Iterable[int] = ()) -> list[tuple[int, OSError]]:
    """Every thread of this process (but ``skip``: native thread ids) onto ``cpus``; the threads
    refused, with why. A thread that ended meanwhile is skipped."""
    mask = set(cpus)
    skipped = set(skip)
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = [0]
    refused = []
    for tid in tids:
        if tid in skipped:
            continue
        try:
            os.sched_setaffinity(tid, mask)
        except ProcessLookupError:
            pass
        except OSError as exc:
            refused.append((tid, exc))
    return refused


def _ranges(cpus: Sequence[int]) -> str:
    return ",".join(map(str, cpus)) or "none"
