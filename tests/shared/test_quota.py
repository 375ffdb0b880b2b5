"""QuotaBlock on real shared memory with real processes: contention, instance
shares, segment hygiene, stale-segment cleanup, and every bad input."""

from __future__ import annotations

import dataclasses

import gc
import logging
import multiprocessing as mp
import os
import secrets
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared import _atomics, _shm, quota
from shared.errors import GpuMemoryExhausted, MemoryExhausted, SegmentError
from shared.quota import (
    DEFAULT_QUOTA_BYTES,
    GPU_WAIT_BUCKETS_S,
    MAX_INSTANCES,
    QuotaBlock,
    QuotaSnapshot,
    cleanup_stale_segments,
    read_header,
)
from tests.helpers.quota_children import attach_consume_exit, create_and_wait_to_be_killed, hammer, hold_some
from tests.helpers.segments import dead_owner
from tests.helpers.timeouts import scaled

SPAWN = mp.get_context("spawn")
SHM_DIR = "/dev/shm"


def unique_prefix() -> str:
    """A prefix no other test (or test run on this machine) uses."""
    return f"twt-t{secrets.token_hex(5)}-"


def segment_exists(name: str) -> bool:
    return os.path.exists(os.path.join(SHM_DIR, name))


# ------------------------------------------------------------ basic behaviour


def test_create_defaults_and_snapshot() -> None:
    with QuotaBlock.create("acme") as block:
        assert block.name.startswith("twt-")
        assert segment_exists(block.name)
        assert block.is_owner and not block.closed and block.instance is None
        assert block.tenant_id == "acme"
        assert block.memory_quota_bytes == DEFAULT_QUOTA_BYTES == 8 << 30
        assert block.gpu_memory_bytes_cap is None
        assert block.cuda_mem_pool_quota_bytes is None
        assert block.generation == 0
        snap = block.snapshot()
        assert snap == QuotaSnapshot(
            tenant_id="acme",
            name=block.name,
            generation=0,
            bytes_in_use=0,
            memory_quota_bytes=8 << 30,
            cpu_high_water=0,
            cpu_refusals=0,
            cpu_underflows=0,
            gpu_bytes_in_use=0,
            gpu_memory_bytes_cap=None,
            gpu_high_water=0,
            gpu_refusals=0,
            gpu_underflows=0,
            cuda_mem_pool_quota_bytes=None,
            instance_shares=(),
        )
        assert snap.to_dict()["instance_shares"] == []
        # to_dict is the quota answer's hand-written fast path: the same map as the generic encoder,
        # nested tuples included, and every field of the record (a new field cannot be forgotten)
        busy = dataclasses.replace(snap, instance_shares=((0, 10), (1, 20)), gpu_wait_bins=(1, 2, 3))
        assert busy.to_dict() == busy.to_wire()
        assert "owner" in repr(block) and "open" in repr(block)


def test_no_gpu_cap_means_counted_never_refused() -> None:
    with QuotaBlock.create("trust") as block:
        block.consume_gpu_bytes((1 << 63) - 1)
        block.consume_gpu_bytes((1 << 63) - 1)
        assert block.gpu_bytes_in_use == (1 << 64) - 2
        with pytest.raises(GpuMemoryExhausted):  # only an overflow is refused
            block.consume_gpu_bytes(2)


def test_refusals_raise_typed_errors_with_numbers() -> None:
    with QuotaBlock.create("acme", memory_quota_bytes=1000, gpu_memory_bytes_cap=500) as block:
        block.consume_bytes(800)
        with pytest.raises(MemoryExhausted) as info:
            block.consume_bytes(201)
        assert type(info.value) is MemoryExhausted
        assert (info.value.tenant_id, info.value.requested, info.value.limit, info.value.current) == (
            "acme",
            201,
            1000,
            800,
        )
        assert info.value.is_retryable()
        block.consume_gpu_bytes(500)
        with pytest.raises(GpuMemoryExhausted) as ginfo:
            block.consume_gpu_bytes(1)
        assert (ginfo.value.requested, ginfo.value.limit, ginfo.value.current) == (1, 500, 500)
        snap = block.snapshot()
        assert (snap.bytes_in_use, snap.cpu_refusals, snap.gpu_bytes_in_use, snap.gpu_refusals) == (800, 1, 500, 1)


def test_underflow_clamps_counts_and_warns_once(caplog: pytest.LogCaptureFixture) -> None:
    with QuotaBlock.create("acme", memory_quota_bytes=1000) as block:
        block.consume_bytes(10)
        with caplog.at_level(logging.WARNING, logger="twt.quota"):
            block.release_bytes(25)
        assert block.bytes_in_use == 0
        assert block.snapshot().cpu_underflows == 1
        (rec,) = [r for r in caplog.records if r.name == "twt.quota"]
        assert rec.getMessage() == "quota.underflow"
        fields = rec.twt_fields  # type: ignore[attr-defined]
        assert fields["released"] == 25 and fields["in_use"] == 10
        assert fields["resource"] == "cpu" and fields["tenant"] == "acme" and fields["segment"] == block.name


def test_set_limits_live_and_seen_by_attached() -> None:
    with QuotaBlock.create("acme", memory_quota_bytes=100, gpu_memory_bytes_cap=100) as owner:
        worker = QuotaBlock.attach(owner.name, instance=0)
        try:
            worker.consume_bytes(90)
            owner.set_limits(memory_quota_bytes=50)  # below use: nothing taken away
            assert worker.bytes_in_use == 90
            with pytest.raises(MemoryExhausted) as info:
                worker.consume_bytes(1)
            assert info.value.limit == 50
            owner.set_limits(gpu_memory_bytes_cap=None, recorded_cuda_mem_pool_quota=1 << 20)
            assert worker.gpu_memory_bytes_cap is None
            assert worker.cuda_mem_pool_quota_bytes == 1 << 20
            assert worker.memory_quota_bytes == 50
            worker.consume_gpu_bytes(1 << 40)
            owner.set_limits(recorded_cuda_mem_pool_quota=None)
            assert worker.cuda_mem_pool_quota_bytes is None
            worker.release_bytes(90)
            worker.release_gpu_bytes(1 << 40)
        finally:
            worker.close()


def test_instance_shares_in_process() -> None:
    with QuotaBlock.create("acme", memory_quota_bytes=1 << 20, gpu_memory_bytes_cap=1 << 20) as owner:
        a = QuotaBlock.attach(owner.name, instance=0)
        b = QuotaBlock.attach(owner.name, instance=5)
        try:
            a.consume_bytes(100)
            a.consume_gpu_bytes(40)
            b.consume_bytes(7)
            b.consume_gpu_bytes(3)
            a.release_bytes(30)
            assert owner.snapshot().instance_shares == ((0, 70, 40), (5, 7, 3))
            assert owner.instance_share(5) == (7, 3)
            assert owner.reset_gpu(instance=0) == 40
            assert (owner.gpu_bytes_in_use, owner.instance_share(0)) == (3, (70, 0))
            assert owner.reclaim_instance(0) == (70, 0)
            assert owner.reclaim_instance(0) == (0, 0)
            assert (owner.bytes_in_use, owner.gpu_bytes_in_use) == (7, 3)
            assert owner.reset_gpu() == 3
            assert owner.snapshot().instance_shares == ((5, 7, 0),)
            assert owner.reclaim_instance(5) == (7, 0)
            assert (owner.bytes_in_use, owner.gpu_bytes_in_use) == (0, 0)
        finally:
            a.close()
            b.close()


def test_a_tentative_share_never_shows_as_use_past_the_cap() -> None:
    """A consume publishes its share, sums, and withdraws it when refused (``_atomics.c``): a
    reader between the two steps must not report the refused bytes as in use (seen once in
    tests/supervisor/lifecycle/test_pool_instances.py: 9 MiB "in use" under an 8 MiB cap)."""
    cap = 8 << 20
    with QuotaBlock.create("acme", memory_quota_bytes=cap, gpu_memory_bytes_cap=cap) as owner:
        a = QuotaBlock.attach(owner.name, instance=0)
        b = QuotaBlock.attach(owner.name, instance=1)
        try:
            a.consume_gpu_bytes(cap - (1 << 20))
            b.consume_gpu_bytes(1 << 20)
            a.consume_bytes(cap)
            # instance 1 is inside a refused consume of 1 MiB of each: published, not yet withdrawn
            gpu_share = quota._instance_off(1) + 8
            _atomics.fetch_add(owner._buf, gpu_share, 1 << 20)
            _atomics.fetch_add(owner._buf, quota._instance_off(1), 1 << 20)
            assert owner.gpu_bytes_in_use == cap and owner.bytes_in_use == cap
            snap = owner.snapshot()
            assert (snap.gpu_bytes_in_use, snap.bytes_in_use) == (cap, cap)
            assert snap.gpu_high_water == snap.cpu_high_water == cap
            # the refused consume withdraws: the same figures, now exact
            _atomics.fetch_add(owner._buf, gpu_share, -(1 << 20) & ((1 << 64) - 1))
            _atomics.fetch_add(owner._buf, quota._instance_off(1), -(1 << 20) & ((1 << 64) - 1))
            assert (owner.gpu_bytes_in_use, owner.bytes_in_use) == (cap, cap)
            b.release_gpu_bytes(1 << 20)
            a.release_bytes(1 << 20)
            assert (owner.gpu_bytes_in_use, owner.bytes_in_use) == (cap - (1 << 20), cap - (1 << 20))
        finally:
            a.close()
            b.close()


def test_generation_and_label() -> None:
    with QuotaBlock.create("acme.prod-1", generation=7) as block:
        header = read_header(block.name)
        assert (header.kind, header.generation, header.label) == (quota.KIND_TENANT, 7, "acme.prod-1")
        assert header.owner_pid == os.getpid() and header.owner_alive()
        attached = QuotaBlock.attach(block.name)
        try:
            assert attached.tenant_id == "acme.prod-1" and attached.generation == 7
            assert not attached.is_owner
        finally:
            attached.close()


# ---------------------------------------------------------------- contention


@contextmanager
def running(target: Callable[..., None], arg_sets: list[tuple[Any, ...]]) -> Iterator[tuple[list[Any], Any]]:
    """Start spawn children ``target(*args, ready, go, out)``; yield once all are ready, go set.

    Yields (processes, out queue). Children still alive at the end are killed.
    """
    ready, go, out = SPAWN.Queue(), SPAWN.Event(), SPAWN.Queue()
    procs = [SPAWN.Process(target=target, args=(*args, ready, go, out)) for args in arg_sets]
    try:
        for p in procs:
            p.start()
        for _ in procs:
            ready.get(timeout=60)
        go.set()
        yield procs, out
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(10)
        for q in (ready, out):
            q.close()
            q.join_thread()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("line", ["cpu", "gpu"])
def test_contention_never_exceeds_limit(line: str) -> None:
    chunk, limit, iterations = 1000, 3000, 150_000
    kwargs: dict[str, Any] = (
        {"memory_quota_bytes": limit} if line == "cpu" else {"memory_quota_bytes": 10, "gpu_memory_bytes_cap": limit}
    )
    with QuotaBlock.create("contend", **kwargs) as block:
        args = [(block.name, line, i, iterations, chunk, 1234 + i) for i in range(2)]
        with running(hammer, args) as (procs, out):
            # This process is the third: it samples while the two hammer.
            # The use is the sum of the instances' shares, read one by one: a
            # reading is not one instant (a share published for the check of a
            # consume that is then withdrawn is counted too), so the limit is
            # checked where it is enforced: every granting consume raises the
            # high water to the total it was granted against.
            read = (lambda: block.bytes_in_use) if line == "cpu" else (lambda: block.gpu_bytes_in_use)
            high = (lambda: block.snapshot().cpu_high_water) if line == "cpu" else (
                lambda: block.snapshot().gpu_high_water
            )
            samples = nonzero = 0
            deadline = time.monotonic() + scaled(60)  # a hang guard, never a speed bound
            while any(p.is_alive() for p in procs):
                assert time.monotonic() < deadline, "hammering children did not finish"
                for _ in range(200):
                    used = read()
                    assert used <= 2 * limit  # two shares, each within the limit
                    nonzero += used > 0
                assert high() <= limit
                samples += 200
            results = [out.get(timeout=30) for _ in procs]
            for p in procs:
                p.join(30)
                assert p.exitcode == 0
        snap = block.snapshot()
        ok = sum(r[1] for r in results)
        refused = sum(r[2] for r in results)
        assert ok + refused == 2 * iterations
        assert refused > 0, "the limit is tight: some consumes must be refused"
        if line == "cpu":
            assert (snap.bytes_in_use, snap.cpu_refusals, snap.cpu_underflows) == (0, refused, 0)
            assert 0 < snap.cpu_high_water <= limit
            assert (snap.gpu_bytes_in_use, snap.gpu_high_water, snap.gpu_refusals) == (0, 0, 0)
        else:
            assert (snap.gpu_bytes_in_use, snap.gpu_refusals, snap.gpu_underflows) == (0, refused, 0)
            assert 0 < snap.gpu_high_water <= limit
            assert (snap.bytes_in_use, snap.cpu_high_water, snap.cpu_refusals) == (0, 0, 0)
        assert snap.instance_shares == ()  # every instance released all it held
        assert samples > 0 and nonzero > 0


@pytest.mark.timeout(90)
def test_reclaim_instance_returns_exactly_its_share() -> None:
    with QuotaBlock.create("shares", memory_quota_bytes=64 << 10, gpu_memory_bytes_cap=48 << 10) as block:
        with running(hold_some, [(block.name, 3, 20_000, 1), (block.name, 9, 20_000, 2)]) as (procs, out):
            held = {r[0]: (r[1], r[2]) for r in (out.get(timeout=60) for _ in procs)}
            for p in procs:
                p.join(30)
                assert p.exitcode == 0
        assert held[3] != (0, 0) and held[9] != (0, 0)
        assert block.instance_share(3) == held[3]
        assert block.instance_share(9) == held[9]
        assert block.bytes_in_use == held[3][0] + held[9][0]
        assert block.gpu_bytes_in_use == held[3][1] + held[9][1]
        assert block.reclaim_instance(3) == held[3]  # instance 3 died
        assert (block.bytes_in_use, block.gpu_bytes_in_use) == held[9]  # 9 keeps its share
        assert block.reclaim_instance(9) == held[9]
        snap = block.snapshot()
        assert (snap.bytes_in_use, snap.gpu_bytes_in_use, snap.instance_shares) == (0, 0, ())
        assert snap.cpu_underflows == snap.gpu_underflows == 0
        assert snap.cpu_high_water <= 64 << 10 and snap.gpu_high_water <= 48 << 10


# ------------------------------------------------------------ segment hygiene


def test_close_then_unlink_leaves_nothing() -> None:
    block = QuotaBlock.create("hyg")
    name = block.name
    block.close()
    assert segment_exists(name)  # closed, not unlinked
    block.close()
    block.unlink()
    block.unlink()
    assert not segment_exists(name)
    assert "closed" in repr(block)


def test_unlink_then_close_leaves_nothing_and_mapping_stays_valid() -> None:
    block = QuotaBlock.create("hyg", memory_quota_bytes=100)
    name = block.name
    attached = QuotaBlock.attach(name)
    block.unlink()
    assert not segment_exists(name)
    attached.consume_bytes(40)  # mappings outlive the name
    assert block.bytes_in_use == 40
    with pytest.raises(SegmentError, match="does not exist"):
        QuotaBlock.attach(name)
    attached.close()
    block.close()


def test_context_exit_leaves_nothing() -> None:
    with QuotaBlock.create("hyg") as block:
        name = block.name
    assert block.closed and not segment_exists(name)
    with pytest.raises(ValueError):
        with QuotaBlock.create("hyg") as block:
            name = block.name
            raise ValueError("body failed")
    assert not segment_exists(name)


def test_gc_of_owned_block_leaves_nothing() -> None:
    block = QuotaBlock.create("hyg")
    name = block.name
    del block
    gc.collect()
    assert not segment_exists(name)
    block = QuotaBlock.create("hyg")
    name = block.name
    block.unlink()  # unlinked, never closed: GC still unmaps
    del block
    gc.collect()
    assert not segment_exists(name)


def test_attached_close_and_gc_never_unlink() -> None:
    with QuotaBlock.create("hyg") as owner:
        attached = QuotaBlock.attach(owner.name)
        with pytest.raises(SegmentError, match="only the creating process"):
            attached.unlink()
        with attached:
            pass
        assert attached.closed and segment_exists(owner.name)
        again = QuotaBlock.attach(owner.name)
        del again
        gc.collect()
        assert segment_exists(owner.name)


def test_spawned_child_attach_then_exit_keeps_segment(capfd: pytest.CaptureFixture[str]) -> None:
    with QuotaBlock.create("hyg") as block:
        for _ in range(2):  # twice: a second child must find it too
            p = SPAWN.Process(target=attach_consume_exit, args=(block.name,))
            p.start()
            p.join(60)
            assert p.exitcode == 0
            assert segment_exists(block.name)
        assert block.instance_share(4) == (200, 14)
        assert (block.bytes_in_use, block.gpu_bytes_in_use) == (200, 14)
        again = QuotaBlock.attach(block.name)
        again.close()
    out, err = capfd.readouterr()
    assert "resource_tracker" not in err and "leaked" not in err, err
    assert "resource_tracker" not in out


def _run_python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)


@pytest.mark.timeout(90)
def test_unrelated_process_attach_then_exit_keeps_segment_and_is_silent() -> None:
    # A process with its own resource tracker: the gh-82300 situation.
    with QuotaBlock.create("hyg") as block:
        r = _run_python(
            "from shared.quota import QuotaBlock\n"
            f"b = QuotaBlock.attach({block.name!r}, instance=2)\n"
            "b.consume_bytes(5)\n"
            "b.close()\n"
            f"QuotaBlock.attach({block.name!r})  # never closed: exit must still be clean\n"
        )
        assert r.returncode == 0, r.stderr
        assert r.stderr == ""
        assert segment_exists(block.name)
        assert block.instance_share(2) == (5, 0)


@pytest.mark.timeout(90)
def test_the_naive_attach_would_have_unlinked() -> None:
    # Control for the test above: a plain SharedMemory(name=...) attach in a
    # process with its own tracker unlinks the owner's segment at exit.
    block = QuotaBlock.create("hyg")
    try:
        r = _run_python(
            "from multiprocessing.shared_memory import SharedMemory\n"
            f"s = SharedMemory({block.name!r})\n"
            "s.close()\n"
        )
        assert r.returncode == 0
        if sys.version_info < (3, 13):
            assert "leaked shared_memory" in r.stderr
            assert not segment_exists(block.name)
    finally:
        block.close()
        block.unlink()  # already gone: must not raise, and the tracker forgets it


@pytest.mark.timeout(90)
def test_owner_exiting_without_cleanup_unlinks() -> None:
    name = unique_prefix() + "exit"
    r = _run_python(
        "from shared.quota import QuotaBlock\n"
        f"b = QuotaBlock.create('exiting', name={name!r})\n"
        "b.consume_bytes(1)\n"
    )
    assert r.returncode == 0 and r.stderr == ""
    assert not segment_exists(name)


@pytest.mark.timeout(90)
def test_a_forked_child_leaves_its_parents_segments() -> None:
    # A child that inherited an owner through fork() and exits as an interpreter does (atexit runs
    # the owners' finalizers), or collects its copy: the segment is its parent's, named and tracked.
    name = unique_prefix() + "fork"
    r = _run_python(
        "import gc, os, sys\n"
        "from shared.quota import QuotaBlock\n"
        f"b = QuotaBlock.create('parent', name={name!r})\n"
        "for collect in (False, True):\n"
        "    pid = os.fork()\n"
        "    if pid == 0:\n"
        "        if collect:\n"
        "            del b\n"
        "            gc.collect()\n"
        "            os._exit(0)\n"
        "        sys.exit(0)\n"
        "    assert os.waitpid(pid, 0)[1] == 0\n"
        f"    assert os.path.exists('/dev/shm/{name}'), ('removed by a child', collect)\n"
        "b.consume_bytes(7)\n"
        "assert b.bytes_in_use == 7\n"
        "b.unlink()\n"
        "b.close()\n"
    )
    assert r.returncode == 0 and r.stderr == "", r.stderr  # stderr: no tracker complaint either
    assert not segment_exists(name)


def test_an_owner_never_removes_a_newer_segment_of_its_name() -> None:
    # Someone else (a stale-segment cleanup, an operator) removed an owner's segment and a new one took
    # the name (a registry's numbered slots, a test's fixed name): the old owner's unlink - explicit or
    # at garbage collection - leaves the new segment alone.
    explicit, collected = unique_prefix() + "a", unique_prefix() + "b"
    old = QuotaBlock.create("old", name=explicit)
    gone = QuotaBlock.create("gone", name=collected)
    _shm.unlink(explicit)
    _shm.unlink(collected)
    with QuotaBlock.create("new", name=explicit) as new, QuotaBlock.create("new", name=collected) as other:
        old.unlink()
        old.close()
        del gone
        gc.collect()
        assert segment_exists(explicit) and segment_exists(collected)
        new.consume_bytes(5)
        other.consume_bytes(6)
        assert (new.bytes_in_use, other.bytes_in_use) == (5, 6)
    assert not segment_exists(explicit) and not segment_exists(collected)


# ------------------------------------------------------ stale-segment cleanup


def layout_bytes(
    *,
    magic: int = quota.MAGIC,
    version: int = quota.LAYOUT_VERSION,
    kind: int = quota.KIND_TENANT,
    pid: int = 0,
    start: int = 0,
    label: bytes = b"ghost",
    size: int = quota.SEGMENT_BYTES,
) -> bytes:
    data = bytearray(size)
    struct.pack_into("<8Q", data, 0, magic, version, kind, pid, start, 0, size, MAX_INSTANCES)
    data[64 : 64 + len(label)] = label
    return bytes(data)


def write_segment(name: str, data: bytes) -> None:
    fd = os.open(os.path.join(SHM_DIR, name), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def read_segment_file(name: str) -> bytes:
    with open(os.path.join(SHM_DIR, name), "rb") as f:
        return f.read()


@pytest.mark.timeout(90)
def test_cleanup_removes_only_dead_owners_segments() -> None:
    prefix = unique_prefix()
    dead_pid, dead_start = dead_owner()
    my_start = quota._process_start_ms(os.getpid())
    stale = {
        "dead": layout_bytes(pid=dead_pid, start=dead_start),
        "reused-pid": layout_bytes(pid=os.getpid(), start=my_start + 1),  # our pid, another start time
        "device-kind": layout_bytes(kind=quota.KIND_DEVICE, pid=dead_pid, start=dead_start),
        "no-pid": layout_bytes(pid=0, start=0),
    }
    foreign = {
        "garbage": os.urandom(8192),
        "zeros": bytes(quota.SEGMENT_BYTES),
        "wrong-magic": layout_bytes(magic=int.from_bytes(b"NOTQUOTA", "little"), pid=dead_pid, start=dead_start),
        "wrong-version": layout_bytes(version=99, pid=dead_pid, start=dead_start),
        "too-small": layout_bytes(pid=dead_pid, start=dead_start)[:200],
        "empty": b"",
    }
    created: list[str] = []
    try:
        for suffix, data in {**stale, **foreign}.items():
            write_segment(prefix + suffix, data)
            created.append(prefix + suffix)
        live = QuotaBlock.create("live", name=prefix + "live")
        with live, running(create_and_wait_to_be_killed, [(prefix + "killed",)]) as (procs, _):
            created.append(prefix + "killed")
            procs[0].kill()
            procs[0].join(30)
            assert procs[0].exitcode == -9
            removed = cleanup_stale_segments(prefix)
            # Exactly the stale ones go. Another supervisor starting on this machine meanwhile may
            # have removed some of them first (it applies the same rule), so: at most these, and
            # afterwards none of them is left.
            assert set(removed) <= {prefix + s for s in [*stale, "killed"]}
            left = set(_shm.list_segments(prefix))
            assert left == {prefix + s for s in foreign} | {live.name}
            assert cleanup_stale_segments(prefix) == []  # idempotent
            live.consume_bytes(1)  # the live owner's block is untouched
    finally:
        for name in created:
            try:
                os.unlink(os.path.join(SHM_DIR, name))
            except FileNotFoundError:
                pass


def test_cleanup_prefix_must_be_ours() -> None:
    with pytest.raises(ValueError, match="twt-"):
        cleanup_stale_segments("psm_")
    assert cleanup_stale_segments(unique_prefix()) == []


# ------------------------------------------------------------------ bad input

BAD_AMOUNTS: list[tuple[Any, type[Exception]]] = [
    ("1", TypeError),
    (1.0, TypeError),
    (None, TypeError),
    (True, TypeError),
    (b"\x01", TypeError),
    (-1, ValueError),
    (1 << 63, ValueError),
    (1 << 64, ValueError),
]


@pytest.mark.parametrize("method", ["consume_bytes", "release_bytes", "consume_gpu_bytes", "release_gpu_bytes"])
@pytest.mark.parametrize(("n", "exc"), BAD_AMOUNTS, ids=repr)
def test_bad_amounts_change_nothing(method: str, n: Any, exc: type[Exception]) -> None:
    with QuotaBlock.create("bad", memory_quota_bytes=100, gpu_memory_bytes_cap=100) as block:
        block.consume_bytes(5)
        block.consume_gpu_bytes(5)
        before = block.snapshot()
        with pytest.raises(exc):
            getattr(block, method)(n)
        assert block.snapshot() == before


@pytest.mark.parametrize(
    ("kwargs", "exc"),
    [
        ({"memory_quota_bytes": "1GiB"}, TypeError),
        ({"memory_quota_bytes": 1.0}, TypeError),
        ({"memory_quota_bytes": True}, TypeError),
        ({"memory_quota_bytes": None}, TypeError),
        ({"memory_quota_bytes": -1}, ValueError),
        ({"memory_quota_bytes": 1 << 63}, ValueError),
        ({"gpu_memory_bytes_cap": -1}, ValueError),
        ({"gpu_memory_bytes_cap": 1 << 63}, ValueError),
        ({"gpu_memory_bytes_cap": False}, TypeError),
        ({"recorded_cuda_mem_pool_quota": -5}, ValueError),
        ({"recorded_cuda_mem_pool_quota": "x"}, TypeError),
        ({"generation": -1}, ValueError),
        ({"generation": 1.5}, TypeError),
        ({"name": "psm_foo"}, ValueError),
    ],
    ids=repr,
)
def test_create_rejects_bad_arguments_and_leaves_nothing(kwargs: dict[str, Any], exc: type[Exception]) -> None:
    # (the autouse hygiene fixture fails the test if a segment was left behind)
    with pytest.raises(exc):
        QuotaBlock.create("acme", **kwargs)


@pytest.mark.parametrize("tenant", ["", "Acme", "a" * 64, "-x", "a/b"])
def test_create_rejects_bad_tenant_ids(tenant: str) -> None:
    with pytest.raises(ValueError, match="invalid tenant id"):
        QuotaBlock.create(tenant)


def test_create_refuses_an_existing_name() -> None:
    with QuotaBlock.create("one") as block:
        with pytest.raises(FileExistsError):
            QuotaBlock.create("two", name=block.name)
        assert read_header(block.name).label == "one"  # the first one is untouched


@pytest.mark.parametrize("name", ["psm_abc", "twt-a/b", "", "twt-does-not-exist-" + "0" * 8, 5, None])
def test_attach_missing_or_badly_named(name: Any) -> None:
    with pytest.raises(SegmentError):
        QuotaBlock.attach(name)


@pytest.mark.parametrize(
    ("instance", "exc"), [(-1, ValueError), (MAX_INSTANCES, ValueError), (True, TypeError), ("0", TypeError), (1.0, TypeError)]
)
def test_attach_rejects_bad_instance(instance: Any, exc: type[Exception]) -> None:
    with QuotaBlock.create("acme") as block:
        with pytest.raises(exc):
            QuotaBlock.attach(block.name, instance=instance)


FOREIGN_LAYOUTS: dict[str, tuple[bytes, str]] = {
    "garbage": (b"\xa5" * 8192, "bad magic"),
    "zeros": (bytes(quota.SEGMENT_BYTES), "bad magic"),
    "wrong-magic": (layout_bytes(magic=1), "bad magic"),
    "wrong-version": (layout_bytes(version=2), "layout version 2"),
    "wrong-kind": (layout_bytes(kind=quota.KIND_DEVICE), "kind"),
    "too-small": (layout_bytes()[:1000], "too small"),
    "one-byte": (b"\x00", "too small"),
    "empty": (b"", "cannot be mapped"),
    "bad-label": (layout_bytes(label=b"NOT VALID!"), "no valid tenant"),
}


@pytest.mark.parametrize("case", sorted(FOREIGN_LAYOUTS))
def test_attach_refuses_foreign_layouts(case: str) -> None:
    data, detail = FOREIGN_LAYOUTS[case]
    name = unique_prefix() + case
    write_segment(name, data)
    try:
        before = read_segment_file(name)
        with pytest.raises(SegmentError, match=detail):
            QuotaBlock.attach(name)
        if case not in ("wrong-kind", "bad-label"):  # read_header accepts any of our kinds and labels
            with pytest.raises(SegmentError):
                read_header(name)
        assert read_segment_file(name) == before  # nothing written
    finally:
        os.unlink(os.path.join(SHM_DIR, name))


def test_closed_block_raises_segment_error() -> None:
    block = QuotaBlock.create("closed", memory_quota_bytes=100)
    attached = QuotaBlock.attach(block.name, instance=1)
    attached.consume_bytes(3)
    name = block.name
    block.close()
    attached.close()
    calls: list[Callable[[], object]] = [
        lambda: block.consume_bytes(1),
        lambda: block.release_bytes(1),
        lambda: block.consume_gpu_bytes(1),
        lambda: block.release_gpu_bytes(1),
        lambda: block.bytes_in_use,
        lambda: block.gpu_bytes_in_use,
        lambda: block.memory_quota_bytes,
        lambda: block.gpu_memory_bytes_cap,
        lambda: block.cuda_mem_pool_quota_bytes,
        lambda: block.generation,
        block.snapshot,
        lambda: block.set_limits(memory_quota_bytes=5),
        lambda: block.reclaim_instance(1),
        lambda: block.reclaim_instance_gpu(1),
        lambda: block.reset_gpu(),
        lambda: block.instance_share(1),
        lambda: attached.consume_bytes(1),
        lambda: attached.snapshot(),
    ]
    for call in calls:
        with pytest.raises(SegmentError, match="closed"):
            call()
    block.unlink()  # still allowed after close
    assert not segment_exists(name)


def test_set_limits_validates_everything_before_writing() -> None:
    with QuotaBlock.create("limits", memory_quota_bytes=100, gpu_memory_bytes_cap=50) as block:
        before = block.snapshot()
        for kwargs in (
            {"memory_quota_bytes": 5, "gpu_memory_bytes_cap": -1},
            {"memory_quota_bytes": 5, "recorded_cuda_mem_pool_quota": 1 << 63},
            {"gpu_memory_bytes_cap": 5, "memory_quota_bytes": None},
            {"memory_quota_bytes": True},
            {"gpu_memory_bytes_cap": "1GiB"},
        ):
            with pytest.raises((TypeError, ValueError)):
                block.set_limits(**kwargs)
            assert block.snapshot() == before
        block.set_limits()  # nothing given: nothing changes
        assert block.snapshot() == before


@pytest.mark.parametrize("index", [-1, MAX_INSTANCES, 1 << 40])
def test_instance_indexes_out_of_range(index: int) -> None:
    with QuotaBlock.create("idx") as block:
        for call in (block.instance_share, block.reclaim_instance, block.reclaim_instance_gpu):
            with pytest.raises(ValueError, match="out of range"):
                call(index)


def test_read_header_of_missing_segment() -> None:
    with pytest.raises(SegmentError, match="does not exist"):
        read_header(unique_prefix() + "missing")


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from(sorted({0, 1, *(b + d for b in (round(s * 1e9) for s in GPU_WAIT_BUCKETS_S)
                                          for d in (-1, 0, 1)), 10**12})) | st.integers(0, 10**11),
                max_size=80))
def test_waits_observed_at_once_count_as_one_by_one(waits: list[int]) -> None:
    """A batch of small ops records its waits at once: the counters and every histogram bin (the
    bounds themselves and one ns either side included) equal one observation per wait."""
    with QuotaBlock.create("waits-bulk") as one, QuotaBlock.create("waits-each") as each:
        one.observe_gpu_waits(waits)
        for ns in waits:
            each.observe_gpu_wait(ns)
        a, b = one.snapshot(), each.snapshot()
        assert (a.gpu_waits, a.gpu_wait_ns, a.gpu_wait_bins) == (b.gpu_waits, b.gpu_wait_ns, b.gpu_wait_bins)
