"""Compiled modules survive parking: a parking tenant's worker hands its compiled stored modules
to the supervisor (wasmtime artifacts, kept in that tenant's own directory of the state), and the
activating worker loads them, so the first ``run_wasm`` after activation does not compile.

Real supervisors on the stub backend; every wait is for an event or a file, never a duration.
``cached`` in the run's reply says the module came from the worker's cache (no compile in that
run); the ``activate`` event counts the artifacts loaded.
"""

from __future__ import annotations

import glob
import os

import pytest

from shared.capability import TenantCapability
from supervisor.client.api import SupervisorClient
from supervisor.client.launch import SupervisorHandle
from supervisor.store.artifacts import ARTIFACT_KEY_FILE, parse_artifact_name, seal, unseal
from supervisor.tools.demo import guest_path
from tests.helpers.cluster import supervisor, wait_for
from tests.helpers.events import event_cursor, wait_event

pytestmark = pytest.mark.timeout(180)

IDLE = 0.3
PROBE = guest_path("probe").read_bytes()






def _park(c: SupervisorClient, tid: str) -> None:
    mark = event_cursor(c)
    c.set_quota(None, tid, idle_timeout_s=IDLE)
    wait_event(c, "park", tid, mark)
    c.set_quota(None, tid, idle_timeout_s=3600.0)  # parked now; it stays so until a request


def _artifacts(sup: SupervisorHandle, tid: str) -> list[str]:
    return sorted(glob.glob(os.path.join(sup.run_dir, "state", "modules", tid, "g*", "*.cwasm")))


def _run_after_activation(c: SupervisorClient, cap: TenantCapability, tid: str, digest: str) -> tuple[bool, int]:
    """The first run of a parked tenant: (its ``cached``, the artifacts its activation loaded)."""
    mark = event_cursor(c)
    result = c.run_wasm(cap, digest, "add", [20, 22])
    assert result.results == (42,)
    return result.cached, int(wait_event(c, "activate", tid, mark)["artifacts"])


def test_the_first_run_after_activation_loads_the_artifact_and_another_tenant_never_does() -> None:
    with supervisor([{"name": "owner"}, {"name": "other"}], log_level="warning") as sup:
        c = sup.client
        owner, other = c.tenant_capability(None, "owner"), c.tenant_capability(None, "other")
        digest = c.put_module(owner, PROBE)
        assert c.put_module(other, PROBE) == digest  # the same module, stored by both
        assert c.run_wasm(owner, digest, "add", [1, 2]).cached is False  # compiled once
        _park(c, "owner")
        stored = wait_for(lambda: _artifacts(sup, "owner"), what="the owner's artifact on disk")
        assert len(stored) == 1 and os.path.basename(stored[0]).startswith(digest + ".")
        assert os.stat(stored[0]).st_mode & 0o777 == 0o600
        # activation puts the compiled module back: the first run does not compile
        assert _run_after_activation(c, owner, "owner", digest) == (True, 1)

        # another tenant with the same module never loads it, even copied into its own directory
        # (the MAC names the tenant): its first run compiles, and the copy is removed
        assert c.run_wasm(other, digest, "add", [0, 0]).cached is False
        _park(c, "other")
        wait_for(lambda: _artifacts(sup, "other"), what="the other tenant's own artifact")
        mine = _artifacts(sup, "other")[0]
        with open(stored[0], "rb") as f:
            owners = f.read()
        with open(mine, "wb") as f:  # the owner's bytes under the other tenant's name
            f.write(owners)
        assert _run_after_activation(c, other, "other", digest) == (False, 0)
        wait_for(lambda: not os.path.exists(mine) or open(mine, "rb").read() != owners,
                 what="the copied artifact removed")
        # the owner's artifact is untouched and still loads for the owner
        _park(c, "owner")
        assert _run_after_activation(c, owner, "owner", digest) == (True, 1)


def test_a_truncated_artifact_falls_back_to_compiling_and_is_replaced() -> None:
    with supervisor([{"name": "t"}], log_level="warning") as sup:
        c = sup.client
        cap = c.tenant_capability(None, "t")
        digest = c.put_module(cap, PROBE)
        c.run_wasm(cap, digest, "add", [1, 1])
        _park(c, "t")
        path = wait_for(lambda: _artifacts(sup, "t"), what="the artifact on disk")[0]
        size = os.path.getsize(path)
        with open(path, "r+b") as f:
            f.truncate(size // 2)
        assert _run_after_activation(c, cap, "t", digest) == (False, 0)  # compiled, not deserialized
        # the next park stores a fresh artifact under the same name, and it loads
        _park(c, "t")
        wait_for(lambda: os.path.exists(path) and os.path.getsize(path) == size, what="the artifact replaced")
        assert _run_after_activation(c, cap, "t", digest) == (True, 1)


def test_an_artifact_of_another_wasmtime_is_stale_and_compiled_again() -> None:
    """An artifact stored under another engine fingerprint (another wasmtime release, other
    engine settings; sealed properly, so only the fingerprint differs) is not deserialized: the
    worker names it stale, the supervisor removes it, the run compiles, the next park stores one
    under the current fingerprint."""
    with supervisor([{"name": "t"}], log_level="warning") as sup:
        c = sup.client
        cap = c.tenant_capability(None, "t")
        digest = c.put_module(cap, PROBE)
        c.run_wasm(cap, digest, "add", [1, 1])
        _park(c, "t")
        path = wait_for(lambda: _artifacts(sup, "t"), what="the artifact on disk")[0]
        parsed = parse_artifact_name(os.path.basename(path))
        assert parsed is not None and parsed[0] == digest
        current = parsed[1]
        generation = int(os.path.basename(os.path.dirname(path))[1:])
        with open(os.path.join(sup.run_dir, "state", ARTIFACT_KEY_FILE), "rb") as f:
            key = f.read()
        with open(path, "rb") as f:
            data = unseal(key, "t", generation, digest, current, f.read())
        assert data is not None
        old = "0" * len(current)
        old_path = os.path.join(os.path.dirname(path), f"{digest}.{old}.cwasm")
        with open(old_path, "wb") as f:
            f.write(seal(key, "t", generation, digest, old, data))
        os.unlink(path)
        assert _run_after_activation(c, cap, "t", digest) == (False, 0)
        wait_for(lambda: not os.path.exists(old_path), what="the stale artifact removed")
        _park(c, "t")
        wait_for(lambda: os.path.exists(path), what="an artifact under the current fingerprint")
        assert _run_after_activation(c, cap, "t", digest) == (True, 1)
