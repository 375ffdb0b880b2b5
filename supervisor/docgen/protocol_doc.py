"""Generate the op reference and the error table of docs/PROTOCOL.md, and the JSON Schema, from the code.

    python -m supervisor.docgen.protocol_doc --write     rewrite the generated parts (and shared/protocol.schema.json)
    python -m supervisor.docgen.protocol_doc --check     exit 1 when either is out of date (what the test checks)

The generated parts of PROTOCOL.md sit between ``<!-- generated:NAME -->``
and ``<!-- end generated:NAME -->`` lines; everything else on the page is
written by hand and left alone. Both come from :func:`supervisor.docgen.protocol_schema.build_schema`,
which reads the op table, the error registry and the tenant spec at run time,
so a new op, argument, error class or spec key appears here as soon as it is
declared there (``tests/supervisor/docgen/test_protocol_doc.py`` fails until the files
are regenerated).

Typing: the JSON Schema document is read by key (nested maps and lists); its values stay
dynamically typed here.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from collections.abc import Callable
from typing import Any, Final

import shared
from supervisor.docgen.protocol_schema import SCHEMA_FILE, build_schema, schema_text
from shared.sizes import format_size

__all__ = ["DOC_PATH", "SCHEMA_PATH", "main", "generate", "render_doc", "replace_part", "sections"]

#: the schema is package data of ``shared`` (the contract ships with the client, the generator does not)
SCHEMA_PATH: Final = Path(shared.__file__).resolve().parent / SCHEMA_FILE
#: docs/ beside the packages in a checkout (an installed package has no docs)
DOC_PATH: Final = Path(__file__).resolve().parents[2] / "docs" / "PROTOCOL.md"

_MSGPACK: Final = {"integer": "int", "number": "float or int", "string": "str", "null": "nil",
                   "object": "map", "array": "array", "boolean": "bool"}


def _type_text(schema: dict[str, Any]) -> str:
    """A schema's type as a raw client reads it: msgpack type names."""
    ref = schema.get("$ref")
    if ref == "#/$defs/size":
        return "int or size str"
    if ref == "#/$defs/tenant_spec":
        return "map (tenant spec)"
    if "allOf" in schema:
        return _type_text(schema["allOf"][0])
    if "anyOf" in schema:
        return " or ".join(_type_text(part) for part in schema["anyOf"])
    if "enum" in schema:
        values = [f"`{v}`" for v in schema["enum"]]
        return "str: " + (", ".join(values[:-1]) + " or " + values[-1] if len(values) > 1 else values[0])
    kind = schema.get("type")
    if kind is None:
        return "any"
    names: list[str] = kind if isinstance(kind, list) else [kind]
    text = " or ".join(_MSGPACK.get(n, n) for n in names if n != "null")
    lo, hi = schema.get("minimum"), schema.get("maximum")
    if lo is not None and hi is not None:
        text += f" {lo:,}..{hi:,}" if isinstance(lo, int) and isinstance(hi, int) else f" {lo:g}..{hi:g}"
    if "null" in names:
        text = f"{text} or nil" if text else "nil"
    return text


def _cell(text: str) -> str:
    return text.replace("``", "`").replace("|", "\\|").replace("\n", " ")


def _ops_section(schema: dict[str, Any]) -> str:
    ops = schema["x-twt"]["ops"]
    args = schema["$defs"]["args"]
    lines = [
        "| op | capability | args (`?`: optional) | body in | reply | body out | errors of its own |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, op in ops.items():
        props = args[name].get("properties", {})
        required = set(args[name].get("required", ()))
        arg_text = ", ".join(f"`{a}`" + ("" if a in required else "?") for a in props) or "none"
        who = op["capability"] + (" (or none: liveness)" if op["without_capability"] else "")
        errors = ", ".join(f"`{c}`" for c in op["errors"]) or "-"
        lines.append(f"| `{name}` | {who} | {arg_text} | {'yes' if op['body_in'] else ''} | "
                     f"`{_cell(op['reply_text'])}` | {'yes' if op['body_out'] else ''} | {errors} |")
    lines += ["", "Every argument, by op (types as msgpack types; a size string is described under "
              "[The tenant spec](#the-tenant-spec)):", "",
              "| op | arg | type | required | meaning |", "|---|---|---|---|---|"]
    for name in ops:
        props = args[name].get("properties", {})
        required = set(args[name].get("required", ()))
        for arg, arg_schema in props.items():
            lines.append(f"| `{name}` | `{arg}` | {_cell(_type_text(arg_schema))} | "
                         f"{'yes' if arg in required else 'no'} | {_cell(arg_schema.get('description', ''))} |")
    return "\n".join(lines)


def _spec_section(schema: dict[str, Any]) -> str:
    spec = schema["$defs"]["tenant_spec"]["properties"]
    lines = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for key, prop in spec.items():
        default = prop.get("default", "required" if key == "tenant_id" else "")
        default_text = "nil" if default is None else "" if default == "" else \
            "required (or `name`)" if default == "required" else f"`{default}`"
        if _type_text(prop).startswith("int or size str") and isinstance(default, int) and default:
            default_text += f" ({format_size(default)})"
        lines.append(f"| `{key}` | {_cell(_type_text(prop))} | {default_text} | {_cell(prop.get('description', ''))} |")
    return "\n".join(lines)


def _errors_section(schema: dict[str, Any]) -> str:
    info = schema["x-twt"]["errors"]
    defs = schema["$defs"]["errors"]
    lines = ["| code | Python class | fields | meaning | retryable | parent code (never on the wire) |",
             "|---|---|---|---|---|---|"]
    for code, meta in info.items():
        props = defs[code]["properties"]["fields"]["properties"]
        fields = ", ".join(f"`{f}`: {_type_text(s)}" + (f" ({s['description']})" if "description" in s else "")
                           for f, s in props.items()) or "none"
        meaning = meta["meaning"]
        if meta["local_only"]:
            meaning += f" **Never sent by the supervisor:** {meta['local_only']}."
        retry = "yes" if meta["retryable"] else "no"
        if meta["retryable_rule"]:
            retry += " (not when `requested` > `limit`)"
        parent = f"`{meta['parent']}`" if meta["parent"] is not None else ""
        for cause, sub in meta["causes"].items():  # Overloaded: one class per cause, the code shared
            own = ", ".join(f"`{f}`" for f in sub["fields"]) or "no more fields"
            meaning += f" Cause `{cause}`: `{sub['class']}` ({own}): {sub['meaning']}"
        lines.append(f"| `{code}` | `{meta['class']}` | {_cell(fields)} | {_cell(meaning)} | {retry} | {parent} |")
    return "\n".join(lines)


def sections(schema: dict[str, Any] | None = None) -> dict[str, str]:
    """The generated parts of PROTOCOL.md, by name."""
    schema = build_schema() if schema is None else schema
    return {"ops": _ops_section(schema), "tenant-spec": _spec_section(schema), "errors": _errors_section(schema)}


def render_doc(text: str, schema: dict[str, Any] | None = None) -> str:
    """``text`` (PROTOCOL.md) with every generated part replaced; KeyError for a part it lacks."""
    for name, body in sections(schema).items():
        text = replace_part(text, name, body)
    return text


def replace_part(text: str, name: str, body: str) -> str:
    """``text`` with the generated part ``name`` (between its marker lines) replaced by ``body``;
    KeyError when it has no such part. The supervisor's own generated parts use it too
    (``python -m supervisor.control.ops``: the admin op table)."""
    key = re.escape(name)
    pattern = re.compile(rf"(<!-- generated:{key} [^\n]*-->\n)(?:.*?\n)?(<!-- end generated:{key} -->)", re.S)
    if not pattern.search(text):
        raise KeyError(f"PROTOCOL.md has no generated part {name!r} (<!-- generated:{name} ... -->)")
    return pattern.sub(lambda m: m.group(1) + body + "\n" + m.group(2), text)


def main(argv: list[str] | None = None) -> int:
    def wanted() -> dict[Path, str]:
        schema = build_schema()
        return {SCHEMA_PATH: schema_text(schema), DOC_PATH: render_doc(DOC_PATH.read_text(encoding="utf-8"), schema)}

    return generate(argv, "python -m supervisor.docgen.protocol_doc", __doc__.splitlines()[0], wanted)


def generate(argv: list[str] | None, prog: str, description: str, wanted: Callable[[], dict[Path, str]]) -> int:
    """A generator's command line: ``--write`` the files ``wanted`` returns (path -> text), or
    ``--check`` them (exit 1, naming each one out of date). The supervisor's generators use it too."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true", help="rewrite the generated files and parts")
    mode.add_argument("--check", action="store_true", help="exit 1 when any is out of date")
    args = parser.parse_args(argv)
    want = wanted()
    stale = [path for path, text in want.items() if (path.read_text(encoding="utf-8") if path.exists() else "") != text]
    if args.check:
        for path in stale:
            print(f"{path} is out of date: run {prog} --write", file=sys.stderr)
        return 1 if stale else 0
    for path in stale:
        path.write_text(want[path], encoding="utf-8")
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
