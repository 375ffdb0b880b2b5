"""What a spawned worker imports before it serves.

Every tenant instance is a fresh interpreter (``spawn``), so each module on its start path is paid
once per worker - the test suite alone starts hundreds. The op table (``shared.protocol``: the typed
ops, some seventy dataclasses) and the reply records (``shared.records``) are the supervisor's and
the client's; the worker packs and checks its headers with ``shared.frames`` and needs neither.
Supervisor code beyond the entry point the spawn unpickles has no place in a worker at all.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys

import pytest

import worker.main
from tests.helpers.other_user import REPO

pytestmark = pytest.mark.timeout(60)

#: what the worker's start path must not load
HEAVY = ("shared.protocol", "shared.records")
#: the supervisor modules a spawned worker loads: the entry point its Process object names (unpickled)
SUPERVISOR_ALLOWED = {"supervisor", "supervisor.runtime", "supervisor.runtime.entry"}


def _start_modules() -> list[str]:
    """Every module worker/main.py imports, wherever the import stands (``run`` imports most of its
    own on first use): read from the source, so a new import there is checked too."""
    with open(worker.main.__file__, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return sorted(names)


_PROBE = """
import importlib, json, sys
import multiprocessing.spawn          # what a spawned child runs first
import supervisor.runtime.entry       # unpickled with the Process object: the worker's entry point
import shared.worker_link             # unpickled: the boot message
for name in json.loads(sys.argv[1]):
    importlib.import_module(name)
from worker.server import warm_bind_path
warm_bind_path()                      # what run() does before its hello
print(json.dumps(sorted(sys.modules)))
"""


def test_a_worker_starts_without_the_op_table_or_supervisor_code() -> None:
    modules = _start_modules()
    assert "worker.server" in modules and "worker.control" in modules  # the source was read
    out = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(modules)], cwd=REPO, check=True,
                         capture_output=True, text=True, timeout=60).stdout
    loaded = set(json.loads(out))
    assert "worker.server" in loaded and "zmq" in loaded  # the probe ran the start path
    assert not loaded.intersection(HEAVY), f"a worker's start imports {sorted(loaded.intersection(HEAVY))}"
    supervisor_code = {m for m in loaded if m.split(".")[0] == "supervisor"} - SUPERVISOR_ALLOWED
    assert not supervisor_code, f"a worker's start imports supervisor code: {sorted(supervisor_code)}"
