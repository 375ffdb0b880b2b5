"""Clients refuse a run dir, socket or ready file of another user.

The attack: another local user pre-creates the default run dir
(``/tmp/twt-<uid>``), writes a ``supervisor.json`` naming a live pid and
listens on ``frontend.ipc``; a client that trusted it would send its
capability and module there and take a forged answer. A client now checks
ownership and modes before it connects and refuses with ``UntrustedRunDir``.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from shared.errors import UntrustedRunDir
from supervisor.client.api import SupervisorClient
from supervisor.store.rundir import read_admin_capability, verify_run_dir
from tests.helpers import other_user

OTHER_UID = 54321


@pytest.fixture
def squatted(tmp_path: Path) -> Iterator[tuple[Path, zmq.Socket]]:  # type: ignore[type-arg]
    """A run dir as an attacker prepares it: ready file, admin dir, a listening frontend."""
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    (run / "supervisor.json").write_text(json.dumps({"pid": os.getpid(), "version": "1"}))
    (run / "admin").mkdir(mode=0o700)
    (run / "admin" / "admin.cap").write_bytes(b"\x01" * 60)
    os.chmod(run / "admin" / "admin.cap", 0o600)
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind("ipc://" + str(run / "frontend.ipc"))
    try:
        yield run, sock
    finally:
        sock.close(0)


def _nothing_received(sock: zmq.Socket) -> bool:  # type: ignore[type-arg]
    return not sock.poll(200)


def test_client_refuses_a_run_dir_of_another_uid(squatted: tuple[Path, zmq.Socket]) -> None:  # type: ignore[type-arg]
    run, sock = squatted
    # The files are ours; a client that expects the supervisor to run as another uid refuses them.
    with pytest.raises(UntrustedRunDir, match=f"belongs to uid {os.getuid()}, not to the expected uid {OTHER_UID}"):
        SupervisorClient(str(run), expected_uid=OTHER_UID)
    assert _nothing_received(sock)


@pytest.mark.skipif(os.getuid() != 0, reason="chown to another uid needs root")
@pytest.mark.parametrize("part", ["run", "supervisor.json", "frontend.ipc"])
def test_client_refuses_parts_chowned_to_another_uid(squatted: tuple[Path, zmq.Socket], part: str) -> None:  # type: ignore[type-arg]
    run, sock = squatted
    os.chown(run if part == "run" else run / part, OTHER_UID, OTHER_UID, follow_symlinks=False)
    with pytest.raises(UntrustedRunDir) as info:
        c = SupervisorClient(str(run))
        c.ping(b"x" * 60)  # type: ignore[arg-type]
    assert f"uid {OTHER_UID}" in str(info.value) and info.value.path.endswith("run" if part == "run" else part)
    assert _nothing_received(sock)


@pytest.mark.skipif(os.getuid() != 0, reason="chown to another uid needs root")
def test_admin_capability_of_another_uid_is_refused(squatted: tuple[Path, zmq.Socket]) -> None:  # type: ignore[type-arg]
    run, _ = squatted
    os.chown(run / "admin" / "admin.cap", OTHER_UID, OTHER_UID)
    with pytest.raises(UntrustedRunDir, match="admin.cap"):
        read_admin_capability(str(run))


def test_writable_by_others_symlinks_and_wrong_kinds_are_refused(squatted: tuple[Path, zmq.Socket]) -> None:  # type: ignore[type-arg]
    run, sock = squatted
    os.chmod(run, 0o777)
    with pytest.raises(UntrustedRunDir, match="lets other users change it"):
        verify_run_dir(str(run))
    os.chmod(run, 0o700)
    ready = run / "supervisor.json"
    target = run / "elsewhere.json"
    ready.rename(target)
    ready.symlink_to(target)
    with pytest.raises(UntrustedRunDir, match="symlink"):
        SupervisorClient(str(run))
    ready.unlink()
    target.rename(ready)
    os.chmod(run / "admin", 0o755)
    with pytest.raises(UntrustedRunDir, match="read or change"):
        read_admin_capability(str(run))
    os.chmod(run / "admin", 0o700)
    os.chmod(run / "admin" / "admin.cap", 0o644)
    with pytest.raises(UntrustedRunDir, match="read or change"):
        read_admin_capability(str(run))
    os.chmod(run / "admin" / "admin.cap", 0o600)
    assert read_admin_capability(str(run)) == b"\x01" * 60  # all in order again
    assert stat.S_ISSOCK(os.lstat(run / "frontend.ipc").st_mode)
    assert _nothing_received(sock)


_TENANT_ONLY = r"""
import sys
from shared.capability import TenantCapability
from shared.errors import SupervisorUnavailable
from supervisor.client.api import SupervisorClient
c = SupervisorClient(sys.argv[1], expected_uid=int(sys.argv[2]), timeout_s=20)
print("ping", c.ping(TenantCapability.from_bytes(bytes.fromhex(sys.argv[3]))).tenant)
try:
    c.admin
except (PermissionError, SupervisorUnavailable) as exc:
    print("admin refused", type(exc).__name__)
else:
    print("admin READABLE")
"""


@pytest.mark.skipif(other_user.available() is not None, reason=str(other_user.available()))
@pytest.mark.timeout(180)
def test_a_tenant_only_client_in_the_client_group_cannot_reach_the_admin_capability() -> None:
    """A real second user (created here) in the client group uses the documented
    ``SupervisorClient(run_dir, expected_uid=...)`` - the run dir is 0710, so this needs only
    traverse permission (it once raised PermissionError) - and still cannot read
    the admin capability; a user outside the group cannot even connect."""
    from tests.helpers.cluster import supervisor

    with other_user.other_user() as member, other_user.other_user() as outsider:
        with supervisor([{"name": "t"}], client_group=member.group) as sup:
            cap = sup.client.tenant_capability(None, "t")
            assert stat.S_IMODE(os.stat(sup.run_dir).st_mode) == 0o710
            assert stat.S_IMODE(os.stat(os.path.join(sup.run_dir, "admin")).st_mode) == 0o700
            args = (sup.run_dir, str(os.getuid()), cap.to_bytes().hex())
            inside = member.run_python(_TENANT_ONLY, *args)
            assert "ping t" in inside.stdout, inside.stderr[-3000:]
            assert "admin refused" in inside.stdout, inside.stdout
            outside = outsider.run_python(_TENANT_ONLY, *args)
            assert "ping" not in outside.stdout and outside.returncode != 0, outside.stdout


@pytest.mark.timeout(120)
def test_client_group_opens_the_frontend_and_nothing_of_the_admin() -> None:
    from tests.helpers.cluster import supervisor

    gid = os.getgid()  # a group we may chown to without root
    with supervisor([{"name": "t"}], client_group=str(gid)) as sup:
        run = sup.run_dir

        def mode_gid(name: str) -> tuple[int, int]:
            st = os.lstat(os.path.join(run, name)) if name else os.lstat(run)
            return stat.S_IMODE(st.st_mode), st.st_gid

        assert mode_gid("") == (0o710, gid)  # traverse only: no listing
        assert mode_gid("frontend.ipc") == (0o660, gid)
        assert mode_gid("supervisor.json") == (0o640, gid)
        for private in ("backend.ipc", "control.ipc", "events.ipc"):
            assert mode_gid(private)[0] == 0o600
        assert mode_gid("admin")[0] == 0o700 and mode_gid("admin/admin.cap")[0] == 0o600
        assert sup.client.ping(sup.client.tenant_capability(None, "t")).tenant == "t"  # clients accept it
