"""docs/PROTOCOL.md's generated parts and shared/protocol.schema.json are what the code declares now."""

from __future__ import annotations

import re

import pytest

from shared import protocol as proto
from shared.errors import _BY_CODE
from supervisor.docgen.protocol_doc import DOC_PATH, SCHEMA_PATH, main, render_doc, sections
from supervisor.docgen.protocol_schema import schema_text


def test_the_generated_parts_of_protocol_md_are_current() -> None:
    text = DOC_PATH.read_text(encoding="utf-8")
    assert render_doc(text) == text, "run: python -m supervisor.docgen.protocol_doc --write"
    assert SCHEMA_PATH.read_text(encoding="utf-8") == schema_text(), "run: python -m supervisor.docgen.protocol_doc --write"
    assert main(["--check"]) == 0


def test_every_op_arg_and_error_code_is_on_the_page() -> None:
    text = DOC_PATH.read_text(encoding="utf-8")
    for name, op in proto.OPS.items():
        for arg in op.args:
            assert re.search(rf"^\| `{name}` \| `{arg.name}` \|", text, re.M), (name, arg.name)
    for code, cls in _BY_CODE.items():
        row = re.search(rf"^\| `{code}` \| (.*)$", text, re.M)
        assert row, code
        for field in cls._fields:
            assert f"`{field}`" in row.group(1), (code, field)


def test_a_page_without_a_generated_part_is_refused_by_name() -> None:
    with pytest.raises(KeyError, match="'errors'"):
        render_doc("<!-- generated:ops x -->\n<!-- end generated:ops -->\n"
                   "<!-- generated:tenant-spec x -->\n<!-- end generated:tenant-spec -->\n")


def test_rendering_replaces_only_between_the_markers() -> None:
    page = "".join(f"before {n}\n<!-- generated:{n} (x) -->\nstale\n<!-- end generated:{n} -->\nafter {n}\n"
                   for n in sections())
    out = render_doc(page)
    assert "stale" not in out and all(f"before {n}" in out and f"after {n}" in out for n in sections())
    assert render_doc(out) == out


def test_the_quota_reply_table_names_every_snapshot_field() -> None:
    """PROTOCOL.md describes each field of the ``quota`` reply: a new counter without a line fails."""
    import re
    from dataclasses import fields

    from shared.quota import QuotaSnapshot

    text = DOC_PATH.read_text(encoding="utf-8")
    section = text.split("The **`quota` reply**", 1)[1].split("\n\n", 2)[1]
    documented = {name for row in section.splitlines() if row.startswith("| `")
                  for name in re.findall(r"`(\w+)`", row.split("|")[1])}
    assert documented == {f.name for f in fields(QuotaSnapshot)}
