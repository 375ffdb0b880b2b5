"""The compiled-module artifacts on disk (supervisor.store.artifacts, ModuleStore's artifact half):
sealed for one tenant, generation, module and engine fingerprint; anything else is removed."""

from __future__ import annotations

import hashlib
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
import shutil
import tempfile
from collections.abc import Iterator

import pytest

from supervisor.lifecycle.module_artifacts import ModuleArtifacts
from supervisor.store.artifacts import ARTIFACT_KEY_FILE, load_or_create_key, seal, unseal
from supervisor.store.modules import ModuleStore
from tests.helpers.tmp import short_temp_dir

pytestmark = pytest.mark.timeout(60)

MODULE = b"\0asm\1\0\0\0"
DIGEST = hashlib.sha256(MODULE).hexdigest()
FP = "ab" * 16
KEY = bytes(range(32))


@pytest.fixture
def state() -> Iterator[str]:
    d = tempfile.mkdtemp(prefix="twt-art-", dir=short_temp_dir())
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _store(state: str) -> ModuleStore:
    return ModuleStore(os.path.join(state, "modules"))


def test_a_sealed_artifact_opens_only_for_its_own_tenant_generation_module_and_fingerprint() -> None:
    raw = seal(KEY, "a", 1, DIGEST, FP, b"native code")
    assert unseal(KEY, "a", 1, DIGEST, FP, raw) == b"native code"
    other_digest = hashlib.sha256(b"x").hexdigest()
    for args in (("b", 1, DIGEST, FP), ("a", 2, DIGEST, FP), ("a", 1, other_digest, FP), ("a", 1, DIGEST, "cd" * 16)):
        assert unseal(KEY, *args, raw) is None
    assert unseal(bytes(32), "a", 1, DIGEST, FP, raw) is None  # another supervisor's key
    assert unseal(KEY, "a", 1, DIGEST, FP, raw[:-1]) is None  # truncated
    assert unseal(KEY, "a", 1, DIGEST, FP, raw[:-1] + bytes([raw[-1] ^ 1])) is None  # one bit changed
    assert unseal(KEY, "a", 1, DIGEST, FP, raw[:10]) is None


def test_the_key_is_created_0600_and_kept(state: str) -> None:
    path = os.path.join(state, ARTIFACT_KEY_FILE)
    key = load_or_create_key(path)
    assert len(key) == 32 and os.stat(path).st_mode & 0o777 == 0o600
    assert load_or_create_key(path) == key
    os.chmod(path, 0o644)  # readable by others: not trusted, replaced
    assert load_or_create_key(path) != key and os.stat(path).st_mode & 0o777 == 0o600


def test_artifacts_round_trip_and_are_found_before_they_reach_the_disk(state: str) -> None:
    store = _store(state)
    try:
        store.save("t", 1, DIGEST, MODULE)
        assert store.save_artifact("t", 1, DIGEST, FP, b"compiled")
        found = store.load_artifacts("t", 1, {DIGEST})  # queued or written: found either way
        assert [(a.digest, a.fingerprint, a.data) for a in found] == [(DIGEST, FP, b"compiled")]
        assert store.flush(30)
        path = os.path.join(state, "modules", "t", "g1", f"{DIGEST}.{FP}.cwasm")
        assert os.stat(path).st_mode & 0o777 == 0o600
        assert [a.data for a in store.load_artifacts("t", 1, {DIGEST})] == [b"compiled"]
        assert store.load_artifacts("u", 1, {DIGEST}) == [] and store.load_artifacts("t", 2, {DIGEST}) == []
        # the module still loads beside its artifact (the artifact is not taken for a bad module)
        assert [m.digest for m in store.load("t", 1)] == [DIGEST] and os.path.exists(path)
        # another supervisor instance on the same state (a restart) opens it with the kept key
        again = _store(state)
        assert [a.data for a in again.load_artifacts("t", 1, {DIGEST})] == [b"compiled"]
        again.close()
    finally:
        store.close()


def test_an_artifact_being_written_is_found(state: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Between leaving the writer's queue and reaching the disk an artifact is still found (an
    activation in that moment once missed it and compiled again)."""
    store = _store(state)
    writing, release = threading.Event(), threading.Event()
    real = store._save_artifact

    def slow_save(*args: object) -> None:
        writing.set()
        assert release.wait(30)
        real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(store, "_save_artifact", slow_save)
    try:
        store.save("t", 1, DIGEST, MODULE)
        assert store.save_artifact("t", 1, DIGEST, FP, b"compiled")
        assert writing.wait(30)  # off the queue, not on disk
        assert [a.data for a in store.load_artifacts("t", 1, {DIGEST})] == [b"compiled"]
    finally:
        release.set()
        store.close()


def test_a_bad_or_orphaned_artifact_is_removed_and_a_removed_module_takes_its_artifacts(state: str) -> None:
    store = _store(state)
    try:
        store.save("t", 1, DIGEST, MODULE)
        store.save_artifact("t", 1, DIGEST, FP, b"compiled")
        assert store.flush(30)
        path = os.path.join(state, "modules", "t", "g1", f"{DIGEST}.{FP}.cwasm")
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) - 1)
        assert store.load_artifacts("t", 1, {DIGEST}) == [] and not os.path.exists(path)
        assert store.artifacts_dropped == 1
        # an artifact whose module is no longer the tenant's is removed when looked at
        store.save_artifact("t", 1, DIGEST, FP, b"compiled")
        assert store.flush(30) and os.path.exists(path)
        assert store.load_artifacts("t", 1, set()) == [] and not os.path.exists(path)
        # the module leaving the LRU takes its artifacts with it
        store.save_artifact("t", 1, DIGEST, FP, b"compiled")
        store.remove("t", 1, DIGEST)
        assert store.flush(30) and not os.path.exists(path)
        # an artifact of a module not on disk is not written (nothing would ever load it)
        store.save_artifact("t", 1, DIGEST, FP, b"compiled")
        assert store.flush(30) and not os.path.exists(path)
        # names that are not hex are refused
        assert not store.save_artifact("t", 1, "../x", FP, b"c") and not store.save_artifact("t", 1, DIGEST, "../", b"c")
    finally:
        store.close()


def test_an_eviction_drops_the_artifacts_with_the_modules(state: str) -> None:
    store = _store(state)
    try:
        store.save("t", 1, DIGEST, MODULE)
        store.save_artifact("t", 1, DIGEST, FP, b"compiled")
        store.drop("t", 1)
        assert store.flush(30)
        assert not os.path.exists(os.path.join(state, "modules", "t"))
        assert store.load_artifacts("t", 1, {DIGEST}) == []
    finally:
        store.close()


@dataclass
class _Tenant:
    """What ModuleArtifacts reads of a tenant's runtime."""

    tenant_id: str
    generation: int
    modules: OrderedDict[str, bytes] = field(default_factory=OrderedDict)


def test_what_a_worker_exports_is_kept_for_its_own_tenant_and_stored_modules_only(state: str) -> None:
    store = _store(state)
    try:
        art = ModuleArtifacts(store)
        t = _Tenant("t", 1, OrderedDict([(DIGEST, MODULE)]))
        assert art.export_args(_Tenant("u", 1)) is None  # no stored module: nothing to ask
        assert art.export_args(t) == {"digests": [DIGEST], "max_bytes": art.max_bytes}
        store.save("t", 1, DIGEST, MODULE)
        other = hashlib.sha256(b"not the tenant's").hexdigest()
        payload = {"fingerprint": FP, "artifacts": [[DIGEST, 3], [other, 2]]}
        assert art.keep(t, payload, b"abcde") == 1  # the digest the tenant does not hold is dropped
        for bad, body in (({"fingerprint": FP, "artifacts": [[DIGEST, 4]]}, b"abc"),  # sizes do not add up
                          ({"fingerprint": 1, "artifacts": []}, b""), ({"artifacts": [[DIGEST, True]]}, b"a"), (None, b"")):
            assert art.keep(t, bad, body) == 0
        assert store.flush(30)
        message = art.message(t)
        assert message is not None
        args, body, sent = message
        assert args == {"modules": [[DIGEST, FP, len(MODULE), 3]]} and bytes(body) == MODULE + b"abc"
        assert sent == {DIGEST: FP}
        assert art.message(_Tenant("u", 1, OrderedDict([(DIGEST, MODULE)]))) is None  # another tenant: none
        assert ModuleArtifacts(store, max_bytes=len(MODULE) + 2).message(t) is None  # does not fit one message
        # the worker found it stale: removed, so the next park stores a fresh one
        assert art.settle(t, {"loaded": [], "stale": [DIGEST], "refused": []}, sent) == 0
        assert store.flush(30) and art.message(t) is None
    finally:
        store.close()


def test_an_activation_gets_the_newest_artifacts_within_the_budget_and_reads_no_more(
        state: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import supervisor.store.modules as modules_mod

    store = _store(state)
    try:
        other = b"\0asm\1\0\0\0" + b"\0" * 8
        other_digest = hashlib.sha256(other).hexdigest()
        store.save("t", 1, DIGEST, MODULE)
        store.save("t", 1, other_digest, other)
        store.save_artifact("t", 1, DIGEST, FP, b"a" * 100)
        assert store.flush(30)
        old = os.path.join(state, "modules", "t", "g1", f"{DIGEST}.{FP}.cwasm")
        os.utime(old, (1, 1))  # the older one
        store.save_artifact("t", 1, other_digest, FP, b"b" * 100)
        assert store.flush(30)
        monkeypatch.setattr(modules_mod, "MAX_LOADED_ARTIFACT_BYTES", 150)
        found = store.load_artifacts("t", 1, {DIGEST, other_digest})
        assert [a.digest for a in found] == [other_digest]  # the newest; the other does not fit
        assert os.path.exists(old)  # not read, not removed: a later activation with room loads it
        monkeypatch.setattr(modules_mod, "MAX_LOADED_ARTIFACT_BYTES", 1000)
        assert {a.digest for a in store.load_artifacts("t", 1, {DIGEST, other_digest})} == {DIGEST, other_digest}
    finally:
        store.close()
