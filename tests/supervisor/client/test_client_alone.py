"""The client package stands alone: ``supervisor.client`` imports only ``shared`` and itself.

A program that only talks to a running supervisor (an embedder, a monitoring job) loads the
client, never the daemon's parts (admission, store, control, ...): the run dir's and the CURVE
keys' formats it needs live in ``shared`` (``shared.rundir``, ``shared.curve_keys``).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers.other_user import REPO

_PROBE = """
import json, sys
import supervisor.client.api, supervisor.client.bulk, supervisor.client.cli_args
import supervisor.client.event_follow, supervisor.client.launch, supervisor.client.outage
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in ("supervisor", "worker"))))
"""


@pytest.mark.process
def test_the_client_imports_nothing_of_the_server() -> None:
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    loaded = json.loads(out.stdout.splitlines()[-1])
    foreign = [m for m in loaded if m != "supervisor" and not m.startswith("supervisor.client")]
    assert not foreign, f"the client loaded server modules: {foreign}"
