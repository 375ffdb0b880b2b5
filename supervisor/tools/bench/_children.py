"""Where a bench's helper processes (probes, flooders, hammers, scrapers, the relay) come from.

Each helper runs a function of its bench's module in a process of its own. Started with
``spawn``, each was a fresh interpreter importing that module and everything it imports before
its function ran (~0.1 s of CPU a helper, paid again by every run of the bench and by every test
that runs one). From :func:`forked_context` they are forks of multiprocessing's fork server
instead: one interpreter per process (multiprocessing's, started at the first helper) imports the
benches' modules once, and each helper is a fork of it. What a bench measures starts after its
helper is up (the probes wait for a start time, the flooders and hammers for an event or a
barrier), and a forked helper is as much a process of its own as a spawned one, so the figures
mean what they meant.

The fork server is multiprocessing's, one per process and started once; its preload is the
modules asked for so far, so it counts only where a bench's helper is the first to start it (a
module it did not preload is imported by the child, as ``spawn`` did).
"""

from __future__ import annotations

import multiprocessing as mp
from multiprocessing.context import ForkServerContext

__all__ = ["forked_context"]

#: the modules asked for so far, in order (the fork server's preload when it starts)
_PRELOAD: list[str] = []


def forked_context(module: str) -> ForkServerContext:
    """The fork server's context, with ``module`` (the caller's ``__name__``: its helpers' targets
    live there) in the fork server's preload if that has not started yet."""
    ctx = mp.get_context("forkserver")
    if module not in _PRELOAD:
        _PRELOAD.append(module)
    ctx.set_forkserver_preload(list(_PRELOAD))
    return ctx
