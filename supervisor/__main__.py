"""``python -m supervisor ...`` is ``twt ...``."""

from __future__ import annotations

import sys

from supervisor.cli import main

if __name__ == "__main__":
    sys.exit(main())
