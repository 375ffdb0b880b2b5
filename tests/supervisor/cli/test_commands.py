"""One op command, one class: each registers against its op's definition (``OpSpec.cli``), and the
``twt`` command, its help and OPERATIONS.md's section come from it; the daemon's op classes hold
no command half."""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import ClassVar

import pytest

from shared import protocol as proto
from supervisor.cli import build_parser
from supervisor.cli import commands as commands_pkg
from supervisor.cli.commands import OpCommand, commands
from supervisor.control.ops import op_table

DOCS = Path(__file__).resolve().parents[3] / "docs"


def _commands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    raise AssertionError("twt has no sub-commands")


def test_each_command_is_one_class_named_as_its_op() -> None:
    found = commands()
    assert [c.name for c in found] == [n for n in proto.OPS if n in {c.name for c in found}]  # the wire order
    for c in found:
        assert type(c).__module__ == f"supervisor.cli.commands.{c.name}"
        assert c.spec is proto.OPS[c.name] and c.command == c.spec.cli
    # every op whose definition names a command of its own has its class (hello, status and
    # tenant_status are sent by twt status, a command of supervisor.cli)
    assert {c.name for c in found} == {op.name for op in op_table() if op.spec.cli is not None
                                       and op.spec.cli != "status"}
    # the daemon's op classes hold nothing of the command line
    for op in op_table():
        assert not any(hasattr(op, a) for a in ("command", "arguments", "run", "json_help")), op.name


def test_a_command_its_definition_does_not_name_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    import supervisor.cli.commands.alloc as alloc_module

    class Stray(OpCommand):
        name = "alloc"
        command: ClassVar[str] = "allocate"  # its definition names "alloc"

    Stray.__module__ = alloc_module.__name__
    monkeypatch.setattr(alloc_module, "Stray", Stray, raising=False)
    commands.cache_clear()
    try:
        with pytest.raises(RuntimeError, match="Stray"):
            commands()
    finally:
        monkeypatch.undo()
        commands.cache_clear()
    assert commands_pkg.commands()


def test_each_command_and_its_help_come_from_its_class() -> None:
    parsers = _commands(build_parser())
    for op in commands():
        assert op.command == op.spec.cli
        p = parsers[op.command]
        assert p.description == op.description
        assert "--json" in p._option_string_actions and "--run-dir" in p._option_string_actions
        assert p._option_string_actions["--json"].help == op.json_help
    help_of = {a.dest: a.help for a in build_parser()._subparsers._group_actions[0]._choices_actions}  # type: ignore[union-attr]
    assert {op.command: op.help for op in commands()} == {op.command: help_of[op.command] for op in commands()}
    # an op without a command of its own is sent by another (hello, status, tenant_status: twt status)
    for op in op_table():
        assert op.spec.cli is None or op.spec.cli in parsers, op.name


def test_operations_md_has_a_section_per_op_command() -> None:
    text = (DOCS / "OPERATIONS.md").read_text()
    for op in commands():
        assert re.search(rf"^### .*`twt {re.escape(str(op.command))}`", text, re.M), op.command
