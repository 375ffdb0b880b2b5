"""``python -m supervisor ...`` is ``twt ...``."""

from __future__ import annotations

from supervisor.cli import console

if __name__ == "__main__":
    console()
