"""Generate docs/PROTOCOL.md's admin op table and frontend op rows from the op classes (:mod:`supervisor.control.ops`).

    python -m supervisor.control.ops --write     rewrite the generated part
    python -m supervisor.control.ops --check     exit 1 when it is out of date (what the test checks)

The wire parts of the page (the op reference, the errors) come from
``python -m shared.protocol_doc``; these are the ops in words: their arguments,
results and errors as each op's class says them (the admin op table whole, and
the rows of the tenant ops the frontend answers itself).
"""

from __future__ import annotations

import sys
from pathlib import Path

from shared.protocol_doc import DOC_PATH, generate, replace_part
from supervisor.control.ops import doc_table, with_doc_rows

__all__ = ["main"]

#: the generated part's name in PROTOCOL.md
PART = "admin-ops"


def main(argv: list[str] | None = None) -> int:
    def wanted() -> dict[Path, str]:
        return {DOC_PATH: with_doc_rows(replace_part(DOC_PATH.read_text(encoding="utf-8"), PART, doc_table()))}

    return generate(argv, "python -m supervisor.control.ops", __doc__.splitlines()[0], wanted)


if __name__ == "__main__":
    sys.exit(main())
