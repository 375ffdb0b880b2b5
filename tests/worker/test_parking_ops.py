"""The worker's side of parking (worker.parking and the allocator's import): buffers out of one
instance and back into a fresh one under the same handles, on the stub backend and on the cuda
backend against the fake driver (tests/helpers/fake_cuda.py)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from shared import protocol as proto
from shared.errors import GpuMemoryExhausted, InvalidArgument, SegmentError
from shared.quota import QuotaBlock
from tests.helpers.fake_cuda import FakeDriver
from worker import parking
from worker.allocator import MeteredAllocator
from worker.backends.base import Backend
from worker.backends.cuda import CudaBackend
from worker.backends.stub import StubBackend

pytestmark = pytest.mark.timeout(60)

MiB = 1 << 20
CHUNK = 64 << 10


def _stub() -> Backend:
    return StubBackend()


def _cuda() -> Backend:
    fake = FakeDriver(memory_bytes=1 << 30)
    return CudaBackend(driver=fake, nvrtc=fake)  # type: ignore[arg-type]


BACKENDS: dict[str, Callable[[], Backend]] = {"stub": _stub, "cuda": _cuda}


@dataclass
class _Context:
    allocator: MeteredAllocator


class _Server:
    """What the op functions use of a WorkerServer: the bound context."""

    def __init__(self, alloc: MeteredAllocator) -> None:
        self.context = _Context(alloc)

    def require_context(self) -> _Context:
        return self.context


class _Frame:
    """A received body frame (what the op functions read: ``.buffer``)."""

    def __init__(self, data: bytes) -> None:
        self.buffer = memoryview(data)


def _op(fn: Any, alloc: MeteredAllocator, args: dict[str, object], body: bytes | None = None) -> tuple[Any, Any]:
    return fn(_Server(alloc), args, _Frame(body) if body is not None else None)  # type: ignore[no-any-return]


@pytest.fixture
def block() -> Iterator[QuotaBlock]:
    with QuotaBlock.create("acme", gpu_memory_bytes_cap=64 * MiB) as b:
        yield b


def _pattern(n: int, seed: int) -> bytes:
    """Byte ``i`` is ``(i * 7 + seed) & 0xFF``: one 256-byte period, repeated."""
    period = bytes((i * 7 + seed) & 0xFF for i in range(256))
    return (period * (n // 256 + 1))[:n]


def _export(alloc: MeteredAllocator) -> tuple[list[tuple[int, bytes]], int]:
    """What the supervisor does when it parks: the manifest, then every buffer in chunks."""
    manifest, _ = _op(parking.op_export_buffers, alloc, {})
    out = []
    for handle, nbytes in manifest["buffers"]:
        data = bytearray()
        while len(data) < nbytes:
            n = min(CHUNK, nbytes - len(data))
            reply, body = _op(parking.op_export_chunk, alloc, {"handle": handle, "offset": len(data), "nbytes": n})
            assert reply == {"nbytes": n}
            data += body
        out.append((handle, bytes(data)))
    return out, manifest["seq"]


def _import(alloc: MeteredAllocator, buffers: list[tuple[int, bytes]], seq: int) -> None:
    if not buffers:
        _op(parking.op_import_buffer, alloc, {"handle": None, "seq": seq})
    for handle, data in buffers:
        for off in range(0, len(data), CHUNK):
            chunk = data[off:off + CHUNK]
            reply, _ = _op(parking.op_import_buffer, alloc,
                           {"handle": handle, "nbytes": len(data), "offset": off, "seq": seq}, chunk)
            assert reply == {"written": len(chunk)}


@pytest.mark.parametrize("kind", sorted(BACKENDS))
def test_buffers_round_trip_into_a_new_instance_with_the_same_handles(kind: str, block: QuotaBlock) -> None:
    old_backend = BACKENDS[kind]()
    old = MeteredAllocator("acme", block, old_backend, instance=2, incarnation=7)
    sizes = (100, CHUNK * 3 + 17, 4096)
    handles = [old.alloc(n) for n in sizes]
    for k, (h, n) in enumerate(zip(handles, sizes)):
        old.write(h, 0, memoryview(_pattern(n, k)))
    old.free(handles[2])  # a freed handle stays free after the restore
    exported, seq = _export(old)
    assert [h for h, _ in exported] == sorted(handles[:2]) and seq == 3
    old.free_all()
    old_backend.close()
    assert block.gpu_bytes_in_use == 0

    new_backend = BACKENDS[kind]()
    new = MeteredAllocator("acme", block, new_backend, instance=2, incarnation=7)
    try:
        _import(new, exported, seq)
        assert new.handles() == {handles[0]: sizes[0], handles[1]: sizes[1]}
        for k in range(2):
            assert new.read(handles[k], 0, sizes[k]) == _pattern(sizes[k], k)
        assert block.gpu_bytes_in_use == sizes[0] + sizes[1]  # metered like any allocation
        fresh = new.alloc(8)
        assert proto.handle_seq(fresh) == seq + 1 and proto.handle_incarnation(fresh) == 7
        with pytest.raises(InvalidArgument, match="unknown buffer handle"):
            new.read(handles[2], 0, 1)
    finally:
        new.free_all()
        new_backend.close()


def test_an_instance_without_buffers_keeps_its_handle_sequence(block: QuotaBlock) -> None:
    alloc = MeteredAllocator("acme", block, StubBackend(), instance=0, incarnation=1)
    _import(alloc, [], 41)
    assert proto.handle_seq(alloc.alloc(1)) == 42
    alloc.free_all()


def test_an_import_refuses_a_foreign_or_repeated_handle_and_a_bad_size(block: QuotaBlock) -> None:
    alloc = MeteredAllocator("acme", block, StubBackend(), instance=1, incarnation=3)
    try:
        other_incarnation = proto.make_handle(1, 4, 1)
        other_instance = proto.make_handle(0, 3, 1)
        for h in (other_incarnation, other_instance):
            with pytest.raises(InvalidArgument, match="cannot be restored here"):
                alloc.import_buffer(h, 8, 0, memoryview(bytes(8)), 1)
        mine = proto.make_handle(1, 3, 1)
        alloc.import_buffer(mine, 8, 0, memoryview(bytes(4)), 1)
        with pytest.raises(InvalidArgument, match="exists already"):
            alloc.import_buffer(mine, 8, 0, memoryview(bytes(4)), 1)
        with pytest.raises(InvalidArgument, match="holds 8 B"):
            alloc.import_buffer(mine, 16, 4, memoryview(bytes(4)), 1)
        with pytest.raises(InvalidArgument, match="outside"):
            alloc.import_buffer(mine, 8, 6, memoryview(bytes(4)), 1)
        with pytest.raises(InvalidArgument, match="seq"):
            alloc.restore_seq(-1)
    finally:
        alloc.free_all()


def test_an_import_past_the_gpu_cap_is_a_typed_refusal() -> None:
    with QuotaBlock.create("tight", gpu_memory_bytes_cap=MiB) as blk:
        alloc = MeteredAllocator("tight", blk, StubBackend(), instance=0, incarnation=1)
        with pytest.raises(GpuMemoryExhausted):
            alloc.import_buffer(proto.make_handle(0, 1, 1), 2 * MiB, 0, memoryview(bytes(16)), 1)
        assert alloc.handles() == {} and blk.gpu_bytes_in_use == 0


def _parked_file(tmp_path: Path, buffers: list[tuple[int, bytes]]) -> tuple[str, list[list[int]]]:
    """What the supervisor keeps of a parked instance: its buffers end to end in one file of the
    run dir's parked directory (supervisor.store.parked_bytes), and the entries naming them."""
    directory = tmp_path / "parked"
    directory.mkdir(exist_ok=True)
    path = directory / ("p" + os.urandom(16).hex())
    path.write_bytes(b"".join(data for _, data in buffers))
    entries = []
    offset = 0
    for handle, data in buffers:
        entries.append([handle, len(data), offset])
        offset += len(data)
    return str(path), entries


@pytest.mark.parametrize("kind", sorted(BACKENDS))
def test_a_mapped_import_restores_every_buffer_from_the_parked_file(kind: str, block: QuotaBlock,
                                                                    tmp_path: Path) -> None:
    old_backend = BACKENDS[kind]()
    old = MeteredAllocator("acme", block, old_backend, instance=1, incarnation=5)
    sizes = (100, CHUNK * 3 + 17, 1)
    handles = [old.alloc(n) for n in sizes]
    for k, (h, n) in enumerate(zip(handles, sizes)):
        old.write(h, 0, memoryview(_pattern(n, k)))
    exported, seq = _export(old)
    old.free_all()
    old_backend.close()
    path, entries = _parked_file(tmp_path, exported)
    before = Path(path).read_bytes()

    new_backend = BACKENDS[kind]()
    new = MeteredAllocator("acme", block, new_backend, instance=1, incarnation=5)
    try:
        reply, body = _op(parking.op_import_mapped, new, {"path": path, "buffers": entries, "seq": seq})
        assert reply == {"written": sum(sizes)} and body is None
        assert new.handles() == dict(zip(handles, sizes))
        for k in range(3):
            assert new.read(handles[k], 0, sizes[k]) == _pattern(sizes[k], k)
        assert block.gpu_bytes_in_use == sum(sizes)  # metered like any allocation
        assert Path(path).read_bytes() == before  # only read: the supervisor's copy stays whole
        assert proto.handle_seq(new.alloc(8)) == seq + 1
    finally:
        new.free_all()
        new_backend.close()


def test_a_mapped_import_of_no_buffers_keeps_the_handle_sequence(block: QuotaBlock, tmp_path: Path) -> None:
    alloc = MeteredAllocator("acme", block, StubBackend(), instance=0, incarnation=1)
    path, _ = _parked_file(tmp_path, [])
    assert _op(parking.op_import_mapped, alloc, {"path": path, "buffers": [], "seq": 9})[0] == {"written": 0}
    assert proto.handle_seq(alloc.alloc(1)) == 10
    alloc.free_all()


def test_a_mapped_import_refuses_other_paths_bad_entries_and_a_missing_file(block: QuotaBlock,
                                                                           tmp_path: Path) -> None:
    alloc = MeteredAllocator("acme", block, StubBackend(), instance=0, incarnation=1)
    handle = proto.make_handle(0, 1, 1)
    path, entries = _parked_file(tmp_path, [(handle, bytes(64))])
    try:
        for bad_path in ("/etc/passwd", str(tmp_path / "parked" / "x"), "parked/p" + "0" * 32, 7,
                         str(tmp_path / "other" / os.path.basename(path))):
            with pytest.raises(InvalidArgument, match="path must name a parked file"):
                _op(parking.op_import_mapped, alloc, {"path": bad_path, "buffers": entries, "seq": 1})
        for bad in ("x", [[handle, 0, 0]], [[handle, 8]], [[handle, -1, 0]], [[True, 8, 0]]):
            with pytest.raises(InvalidArgument, match="buffers"):
                _op(parking.op_import_mapped, alloc, {"path": path, "buffers": bad, "seq": 1})
        with pytest.raises(InvalidArgument, match="past the parked file"):
            _op(parking.op_import_mapped, alloc, {"path": path, "buffers": [[handle, 64, 1]], "seq": 1})
        missing = str(tmp_path / "parked" / ("p" + "0" * 32))
        with pytest.raises(SegmentError, match="cannot open the parked file"):
            _op(parking.op_import_mapped, alloc, {"path": missing, "buffers": entries, "seq": 1})
        assert alloc.handles() == {}
    finally:
        alloc.free_all()
