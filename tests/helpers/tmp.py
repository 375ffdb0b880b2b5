"""Short temporary directories for tests: inside this run's temp root (``$TMPDIR``, set per run by
``make test``), never a hard-coded ``/tmp``, so a leftover there can never hide a missing step."""

from __future__ import annotations

from shared.rundir import temp_parent


def short_temp_dir() -> str:
    """A temp parent short enough for unix socket paths below it (Ray's, MPS pipes, run dirs)."""
    return temp_parent()
