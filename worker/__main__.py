"""Workers are started by a supervisor, never by hand."""

from __future__ import annotations

import sys

if __name__ == "__main__":
    sys.exit("worker processes are started by `twt supervise`; see `twt --help`")
