"""Live progress for long commands (``twt chaos``, ``twt bench``), on a terminal only.

A person watching a 60 s campaign wants to see it move; a script piping the
output, or reading ``--json``, wants nothing but the result. So progress is
written only when stdout is a terminal (and never with ``--json``), to
stderr, as one line rewritten in place (``\\r`` + erase to end of line) and
closed with a newline when the work is done.
"""

from __future__ import annotations

import sys
from typing import TextIO

__all__ = ["LiveLine", "progress_stream"]


def progress_stream(as_json: bool, stdout: TextIO | None = None, stderr: TextIO | None = None) -> TextIO | None:
    """stderr when progress is wanted (stdout is a terminal, no ``--json``), else None."""
    out = sys.stdout if stdout is None else stdout
    if as_json:
        return None
    try:
        interactive = out.isatty()
    except (AttributeError, ValueError):  # a closed or fake stream
        return None
    return (sys.stderr if stderr is None else stderr) if interactive else None


class LiveLine:
    """One status line rewritten in place; :meth:`done` ends it (idempotent). A None stream does nothing."""

    def __init__(self, stream: TextIO | None) -> None:
        self.stream = stream
        self._open = False

    def update(self, text: str) -> None:
        if self.stream is None:
            return
        self.stream.write(f"\r{text}\x1b[K")
        self.stream.flush()
        self._open = True

    def done(self, text: str | None = None) -> None:
        if self.stream is None:
            return
        if text is not None:
            self.update(text)
        if self._open:
            self.stream.write("\n")
            self.stream.flush()
            self._open = False
