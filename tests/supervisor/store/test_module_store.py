"""The stored modules on disk (supervisor.store.modules): per tenant and generation, checked, bounded."""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path

import pytest

from supervisor.store.modules import ModuleStore

A = b"\x00asm module a"
B = b"\x00asm module b, longer"


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_saved_modules_load_back_oldest_first_private_and_per_generation(tmp_path: Path) -> None:
    store = ModuleStore(str(tmp_path / "modules"))
    store.save("acme", 1, _digest(A), A)
    assert store.flush(30)
    os.utime(tmp_path / "modules" / "acme" / "g1" / f"{_digest(A)}.wasm", (1, 1))  # the older one
    store.save("acme", 1, _digest(B), B)
    store.save("beta", 1, _digest(B), B)
    store.close()
    assert [m.data for m in store.load("acme", 1)] == [A, B]
    assert store.load("acme", 2) == [] and [m.digest for m in store.load("beta", 1)] == [_digest(B)]
    for path in (tmp_path / "modules").rglob("*.wasm"):
        assert path.stat().st_mode & 0o077 == 0
    assert not list((tmp_path / "modules").rglob("*.tmp"))


def test_what_is_not_a_module_we_wrote_is_dropped_on_load(tmp_path: Path) -> None:
    store = ModuleStore(str(tmp_path / "modules"))
    store.save("acme", 1, _digest(A), A)
    store.close()
    gen = tmp_path / "modules" / "acme" / "g1"
    (gen / f"{_digest(B)}.wasm").write_bytes(A)  # content not its name
    (gen / "notes.txt").write_bytes(b"x")
    (tmp_path / "secret").write_bytes(B)
    (gen / f"{_digest(B)[:-1]}0.wasm").symlink_to(tmp_path / "secret")  # never followed
    assert [m.data for m in store.load("acme", 1)] == [A]
    assert sorted(p.name for p in gen.iterdir()) == [f"{_digest(A)}.wasm"]
    assert (tmp_path / "secret").exists()


def test_an_eviction_forgets_its_waiting_saves_and_removes_its_directory(tmp_path: Path) -> None:
    store = ModuleStore(str(tmp_path / "modules"))
    gate = threading.Event()
    started = threading.Event()
    real_save = store._save

    def slow_save(tenant_id: str, generation: int, digest: str, data: bytes) -> None:
        started.set()
        assert gate.wait(30)
        real_save(tenant_id, generation, digest, data)

    store._save = slow_save  # type: ignore[method-assign]
    store.save("acme", 1, _digest(A), A)
    assert started.wait(30)  # the first one is being written; the next one waits in the queue
    store.save("acme", 1, _digest(B), B)
    store.save("beta", 1, _digest(B), B)
    assert store._queued_bytes == len(A) + 2 * len(B)
    store.drop("acme", 1)
    assert store._queued_bytes == len(A) + len(B)  # acme's waiting save (and its bytes) gone at once
    gate.set()
    store.close()
    assert not (tmp_path / "modules" / "acme").exists()
    assert [m.data for m in store.load("beta", 1)] == [B] and store._queued_bytes == 0


def test_saves_past_the_queued_bound_are_skipped_not_queued(tmp_path: Path) -> None:
    store = ModuleStore(str(tmp_path / "modules"), max_queued_bytes=len(A))
    store.save("acme", 1, _digest(B), B)
    store.close()
    assert store.skipped_saves == 1 and store.load("acme", 1) == []


@pytest.mark.parametrize("keep", [{"acme": 2}, {}])
def test_prune_keeps_only_the_current_generation_of_stored_tenants(tmp_path: Path, keep: dict[str, int]) -> None:
    store = ModuleStore(str(tmp_path / "modules"))
    for tid, gen in (("acme", 1), ("acme", 2), ("gone", 1)):
        store.save(tid, gen, _digest(A), A)
    store.close()
    (tmp_path / "modules" / "stray").write_bytes(b"x")
    store.prune(keep)
    left = sorted(str(p.relative_to(tmp_path / "modules")) for p in (tmp_path / "modules").rglob("*.wasm"))
    assert left == ([f"acme/g2/{_digest(A)}.wasm"] if keep else [])
    assert not (tmp_path / "modules" / "stray").exists()
