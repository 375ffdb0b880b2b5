"""The child processes of tests/shared/test_quota.py (``multiprocessing`` spawn targets).

A spawned child imports the module its target lives in: here that is this module (``shared.quota``
and the standard library), not the test module, which imports pytest and hypothesis (~0.25 s more
CPU in each of the module's children).
"""

from __future__ import annotations

import os
import random
import threading
from multiprocessing import resource_tracker
from typing import Any

from shared.errors import MemoryExhausted
from shared.quota import QuotaBlock

__all__ = ["attach_consume_exit", "create_and_wait_to_be_killed", "hammer", "hold_some"]


def hammer(name: str, line: str, instance: int, iterations: int, chunk: int, seed: int, ready: Any, go: Any, out: Any) -> None:
    block = QuotaBlock.attach(name, instance=instance)
    try:
        consume = block.consume_bytes if line == "cpu" else block.consume_gpu_bytes
        release = block.release_bytes if line == "cpu" else block.release_gpu_bytes
        rng = random.Random(seed)
        held: list[int] = []
        ok = refused = 0
        ready.put(os.getpid())
        if not go.wait(30):
            raise SystemExit(3)
        for _ in range(iterations):
            n = rng.randint(1, chunk)
            try:
                consume(n)
            except MemoryExhausted:  # GpuMemoryExhausted is one too
                refused += 1
            else:
                ok += 1
                held.append(n)
            if held and (len(held) > 3 or rng.random() < 0.5):
                release(held.pop(rng.randrange(len(held))))
        for n in held:
            release(n)
        out.put((instance, ok, refused))
    finally:
        block.close()


def hold_some(name: str, instance: int, iterations: int, seed: int, ready: Any, go: Any, out: Any) -> None:
    block = QuotaBlock.attach(name, instance=instance)
    try:
        rng = random.Random(seed)
        held_cpu: list[int] = []
        held_gpu: list[int] = []
        ready.put(os.getpid())
        if not go.wait(30):
            raise SystemExit(3)
        for _ in range(iterations):
            for held, consume, release in (
                (held_cpu, block.consume_bytes, block.release_bytes),
                (held_gpu, block.consume_gpu_bytes, block.release_gpu_bytes),
            ):
                n = rng.randint(1, 4096)
                try:
                    consume(n)
                    held.append(n)
                except MemoryExhausted:
                    pass
                if len(held) > 8:
                    release(held.pop(rng.randrange(len(held))))
        out.put((instance, sum(held_cpu), sum(held_gpu)))  # exits still holding these
    finally:
        block.close()


def attach_consume_exit(name: str) -> None:
    block = QuotaBlock.attach(name, instance=4)
    block.consume_bytes(100)
    block.consume_gpu_bytes(7)
    block.close()


def create_and_wait_to_be_killed(name: str, ready: Any, go: Any, out: Any) -> None:
    block = QuotaBlock.create("killed", name=name)  # kept referenced: GC would unlink it
    # The test SIGKILLs this process: take the segment off the resource
    # tracker's books, so only cleanup_stale_segments can remove it (the
    # tracker may be shared with the parent and would otherwise unlink and
    # warn at an unpredictable time).
    resource_tracker.unregister("/" + name, "shared_memory")
    ready.put(os.getpid())
    threading.Event().wait()
    block.close()  # not reached
