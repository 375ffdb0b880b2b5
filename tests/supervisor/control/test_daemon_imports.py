"""What the daemon loads when it builds its op tables: neither the client nor the command line.

The op classes are found by listing :mod:`supervisor.control.ops` (imports by name, which the
static boundaries test does not follow); a fresh interpreter that loads the supervisor and
builds every dispatch table shows what that pulls in.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers.other_user import REPO

_PROBE = """
import json, sys
import supervisor.supervisor, supervisor.wiring
from supervisor.control import ops
ops.op_table(); ops.local_handlers(); ops.either_handlers(); ops.doc_table()
print(json.dumps(sorted(m for m in sys.modules if m == "argparse" or m.startswith(("supervisor.client", "supervisor.cli")))))
"""


@pytest.mark.process
def test_the_op_tables_load_neither_the_client_nor_argparse() -> None:
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.splitlines()[-1]) == []
