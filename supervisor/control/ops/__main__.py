"""Generate docs/PROTOCOL.md's admin and tenant op tables from the op classes (:mod:`supervisor.control.ops`).

    python -m supervisor.control.ops --write     rewrite the generated part
    python -m supervisor.control.ops --check     exit 1 when it is out of date (what the test checks)

The wire parts of the page (the op reference, the errors) come from
``python -m supervisor.docgen.protocol_doc``; these are the ops in words: their arguments,
results and errors as each op's class says them.
"""

from __future__ import annotations

import sys
from pathlib import Path

from supervisor.docgen.protocol_doc import DOC_PATH, generate, replace_part
from supervisor.control.ops import doc_table, either_doc_table, tenant_doc_table

__all__ = ["main"]

#: the generated parts of PROTOCOL.md, by name
PARTS = {"admin-ops": doc_table, "tenant-ops": tenant_doc_table, "either-ops": either_doc_table}


def main(argv: list[str] | None = None) -> int:
    def wanted() -> dict[Path, str]:
        text = DOC_PATH.read_text(encoding="utf-8")
        for part, table in PARTS.items():
            text = replace_part(text, part, table())
        return {DOC_PATH: text}

    return generate(argv, "python -m supervisor.control.ops", __doc__.splitlines()[0], wanted)


if __name__ == "__main__":
    sys.exit(main())
