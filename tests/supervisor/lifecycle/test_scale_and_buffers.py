"""Scale to zero and client buffers with instance affinity, against real supervisors (library and CLI)."""

from __future__ import annotations

import os
import signal
import struct
from pathlib import Path

import pytest

from shared import protocol as proto
from shared.errors import BufferLost, InvalidArgument, TenantStopped
from shared.spec import TenantSpec
from supervisor.cli import main
from supervisor.tools.demo import guest_path
from tests.helpers.cluster import instance_pid, supervisor, tenant, wait_for

pytestmark = pytest.mark.timeout(120)


def _run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def test_scale_to_zero_answers_at_once_and_scales_back(capsys: pytest.CaptureFixture[str]) -> None:
    with supervisor([{"name": "gamma"}]) as sup:
        c, rd = sup.client, ("--run-dir", sup.run_dir)
        cap = c.tenant_capability(None, "gamma")
        c.ping(cap)
        code, out, _ = _run(capsys, "scale", "gamma", "0", *rd)
        assert code == 0 and "gamma: 0 instance(s), 0 ready (pids -), state stopped" in out
        assert "until `twt scale gamma N`" in out
        with pytest.raises(TenantStopped, match="scaled to 0 instances") as info:
            c.ping(cap)  # answered, not parked (a parked request would end in KernelTimeout)
        assert not info.value.is_retryable() and tenant(c.status(), "gamma").parked == 0
        with pytest.raises(TenantStopped):
            c.run_wasm(cap, guest_path("probe").read_bytes(), "add", [1, 2])
        # the capability and the quota block stay valid
        assert c.quota(cap).tenant_id == "gamma"
        assert c.put_module(cap, guest_path("probe").read_bytes())
        wait_for(lambda: not tenant(c.status(), "gamma").pids, what="the drained worker gone")
        code, out, _ = _run(capsys, "status", *rd)
        row = next(line for line in out.splitlines() if line.startswith("gamma"))
        assert row.split()[1:3] == ["stopped", "0/0"], row
        # back to serving
        code, out, _ = _run(capsys, "scale", "gamma", "1", "--wait", *rd)
        assert code == 0 and "state running" in out
        assert c.ping(cap).tenant == "gamma"
        # a tenant registered with 0 instances is answered at once, stopped
        zero = c.register(None, TenantSpec("idle", instances=0))
        assert tenant(c.status(), "idle").state == "stopped"
        with pytest.raises(TenantStopped):
            c.alloc(zero, 4096)


def _floats(data: bytes) -> list[float]:
    return [v for (v,) in struct.iter_unpack("<f", data)]


def test_buffers_have_instance_affinity_and_die_with_their_instance() -> None:
    axpy = guest_path("axpy_sum").read_bytes()
    with supervisor([{"name": "acme", "instances": 2}]) as sup:
        c = sup.client
        cap = c.tenant_capability(None, "acme")
        n = 1024
        x0 = c.alloc(cap, 4 * n, instance=0)
        x1 = c.alloc(cap, 4 * n, instance=1)
        y1 = c.alloc(cap, 4 * n, instance=1)
        assert [proto.handle_instance(h) for h in (x0, x1, y1)] == [0, 1, 1]
        assert set(c.buffers(cap)) == {x0, x1, y1}  # the listing covers both instances
        for h, v in ((x0, 1.0), (x1, 1.0), (y1, 2.0)):
            c.write(cap, h, struct.pack("<f", v) * n)
        # buffers of one instance: the run goes there
        reply = c.run_wasm(cap, axpy, "run", [{"handle": x1}, {"handle": y1}, n, 3.0])
        assert reply.results == (pytest.approx(5.0 * n), 0)
        assert _floats(c.read(cap, y1, 16)) == [5.0] * 4
        # buffers of two instances: refused, naming both, with the way out
        with pytest.raises(InvalidArgument, match=rf"different instances \({proto.format_handle(x0)} on acme/0; "
                                                  rf"{proto.format_handle(y1)} on acme/1\).*--instance N"):
            c.run_wasm(cap, axpy, "run", [{"handle": x0}, {"handle": y1}, n, 3.0])
        with pytest.raises(InvalidArgument, match="instance 5, which 'acme' does not run"):
            c.alloc(cap, 4096, instance=5)
        # instance 1 restarts: its buffers are lost (typed, not retryable), instance 0's are not
        pid = instance_pid(sup, "acme", 1)
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: (p := instance_pid(sup, "acme", 1)) is not None and p != pid, what="instance 1 restarted")
        with pytest.raises(BufferLost, match=rf"buffer {proto.format_handle(y1)} lived on acme/1, which restarted") as info:
            c.read(cap, y1, 16)
        assert not info.value.is_retryable()
        with pytest.raises(BufferLost):
            c.run_wasm(cap, axpy, "run", [{"handle": x1}, {"handle": y1}, n, 3.0])
        assert _floats(c.read(cap, x0, 8)) == [1.0, 1.0]
        assert set(c.buffers(cap)) == {x0}
        assert c.free(cap, x0) == 4 * n


def test_buffer_commands_end_to_end(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    with supervisor([{"name": "acme", "instances": 2}, {"name": "beta"}]) as sup:
        rd = ("--run-dir", sup.run_dir)
        code, out, err = _run(capsys, "alloc", "acme", "4KiB", "--instance", "1", *rd)
        assert code == 0, err
        text = out.split()[0]
        assert text.startswith("1:") and "4KiB on instance 1" in out
        code, out, _ = _run(capsys, "alloc", "acme", "4KiB", "--instance", "1", *rd)
        second = out.split()[0]
        code, out, _ = _run(capsys, "buffers", "acme", *rd)
        assert code == 0 and text in out and second in out and "2 buffer(s), 8KiB" in out
        # write and read back: a fill, then a file at an offset
        code, out, _ = _run(capsys, "write", "acme", text, "--fill", "1.5", *rd)
        assert code == 0 and "wrote 4,096 B" in out
        src = tmp_path / "in.bin"
        src.write_bytes(struct.pack("<2f", 7.0, 8.0))
        code, out, _ = _run(capsys, "write", "acme", text, "--from", str(src), "--offset", "8", *rd)
        assert code == 0 and "wrote 8 B" in out
        code, out, _ = _run(capsys, "read", "acme", text, *rd)
        assert code == 0 and "as float32: [1.5, 1.5, 7, 8, 1.5, 1.5, 1.5, 1.5, ... (1024 values)]" in out
        dest = tmp_path / "out.bin"
        code, out, _ = _run(capsys, "read", "acme", text, "--out", str(dest), "--nbytes", "16", *rd)
        assert code == 0 and _floats(dest.read_bytes()) == [1.5, 1.5, 7.0, 8.0]
        # a handle that is not held: one clear error listing those that are, nothing sent
        code, _, err = _run(capsys, "read", "acme", "1:999", *rd)
        assert code == 1 and "buffer 1:999 is not held by 'acme'" in err and f"it holds: {text} (4KiB)" in err
        code, _, err = _run(capsys, "free", "acme", "nonsense", *rd)
        assert code == 2 and "INSTANCE:SEQ" in err
        # run with --arg handle=I:S: the buffer's instance runs it; one not held is named
        wat = tmp_path / "probe.wat"
        wat.write_bytes(guest_path("probe").read_bytes())
        code, out, err = _run(capsys, "run", "acme", str(wat), "--invoke", "sum_f32", "--arg", f"handle={text}",
                              "--arg", "4", "--arg", "0", *rd)
        assert code == 0 and "results: [0]" in out, err
        code, _, err = _run(capsys, "run", "acme", str(wat), "--invoke", "sum_f32", "--arg", "handle=0:1",
                            "--arg", "4", "--arg", "0", *rd)
        assert code == 1 and "buffer 0:1 is not held by 'acme'" in err and second in err
        # a tenant's own capability file works; another tenant's is refused, naming both
        cap_file = tmp_path / "acme.cap"
        assert _run(capsys, "capability", "acme", "--cap-out", str(cap_file), *rd)[0] == 0
        code, out, _ = _run(capsys, "buffers", "acme", "--capability", str(cap_file), *rd)
        assert code == 0 and text in out
        code, _, err = _run(capsys, "buffers", "beta", "--capability", str(cap_file), *rd)
        assert code == 2 and "is the capability of tenant 'acme', not of 'beta'" in err
        for handle in (text, second):
            code, out, _ = _run(capsys, "free", "acme", handle, *rd)
            assert code == 0 and f"freed {handle}" in out
        code, out, _ = _run(capsys, "buffers", "acme", *rd)
        assert out.strip() == "acme: no buffers"
        assert tenant(sup.client.status(), "acme").gpu_bytes_in_use == 0
