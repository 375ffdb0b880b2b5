"""The child of the SIGKILL hammer (tests/shared/test_quota_reclaim.py): consume/release until killed.

A module of its own, with nothing but :mod:`shared.quota` to import, which the hammer's fork server
preloads: each of the hammer's hundred-odd children then starts in a fork and an unpickle. (As a
function of the test module, every child first imported that module - pytest with it - while the
other instance spun in its loop: most of the test's CPU.)
"""

from __future__ import annotations

import random

from shared.quota import QuotaBlock

__all__ = ["hammer_child"]


def hammer_child(name: str, instance: int, seed: int) -> None:
    """Consume and release random amounts on ``name`` as ``instance`` until SIGKILLed."""
    block = QuotaBlock.attach(name, instance=instance)
    rng = random.Random(seed)
    held: list[tuple[int, int]] = []
    while True:  # until SIGKILL
        n = rng.randrange(1, 5000)
        try:
            if rng.random() < 0.5:
                block.consume_gpu_bytes(n)
                held.append((1, n))
            else:
                block.consume_bytes(n)
                held.append((0, n))
        except Exception:  # noqa: BLE001 - MemoryExhausted or GpuMemoryExhausted: refused, free something
            pass
        if held and (len(held) > 8 or rng.random() < 0.5):
            kind, m = held.pop(rng.randrange(len(held)))
            (block.release_gpu_bytes if kind else block.release_bytes)(m)
