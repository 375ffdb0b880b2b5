"""The ``shared`` package's face is lazy: importing one module of it loads that module only.

Every process that touches ``shared`` (a ``twt`` command, a check child, a tool, a worker started
afresh) imports the package first; an eager face made each of them load the quota block's
``multiprocessing.shared_memory``, the error tree, logging and the region code.
"""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

import shared
import shared.errors
from tests.helpers import timeouts

#: what a process that imports only ``shared.ids`` must not load
_HEAVY = ("shared.errors", "shared.log", "shared.quota", "shared.region", "multiprocessing.shared_memory", "logging")


def test_importing_one_module_of_the_package_loads_none_of_the_face() -> None:
    code = ("import sys, shared.ids\n"
            f"print(','.join(m for m in {_HEAVY!r} if m in sys.modules))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=timeouts.scaled(60))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "", f"import shared.ids loaded {proc.stdout.strip()}"


def test_every_public_error_is_on_the_face_and_resolves_to_its_home() -> None:
    assert set(shared.errors.__all__) <= set(shared.__all__)
    assert set(shared._HOMES) == set(shared.__all__)
    for name, home in shared._HOMES.items():
        assert getattr(shared, name) is getattr(importlib.import_module(home), name), name


def test_a_name_not_on_the_face_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="NoSuchName"):
        shared.NoSuchName  # noqa: B018
    assert "TenantId" in dir(shared) and "QuotaBlock" in dir(shared)


def test_from_shared_import_still_works() -> None:
    code = "from shared import QuotaBlock, TenantId, CudaError, parse_size; print(parse_size('1KiB'))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=timeouts.scaled(60))
    assert proc.returncode == 0 and proc.stdout.strip() == "1024", proc.stderr
