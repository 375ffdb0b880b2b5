"""What one op's ``twt`` command is: its arguments, its run and its help, registered against the op's definition.

A subclass of :class:`OpCommand` in a module of its own under :mod:`supervisor.cli.commands`
(named as its op) declares:

* ``name``: the wire op it sends; its definition in :data:`shared.protocol.OPS` names the
  command (``OpSpec.cli``), and :func:`~supervisor.cli.commands.commands` refuses a class whose
  command is not the one its definition names;
* ``command``, ``help``, ``description``, ``json_help``, :meth:`OpCommand.arguments` and
  :meth:`OpCommand.run`: ``supervisor.cli.ops`` adds the run-dir options and ``--json``, and
  hands :meth:`OpCommand.run` a way to connect.

The op's server half (its handler and its doc row) is its class under
:mod:`supervisor.control.ops`: the daemon loads that package, never this one, so it loads
neither the client nor argparse.
"""

from __future__ import annotations

import argparse
from typing import ClassVar, Protocol

from shared import protocol as proto
from supervisor.client.api import SupervisorClient

__all__ = ["Connect", "OpCommand"]


class Connect(Protocol):
    """A client of the supervisor the command line names (``--run-dir`` or ``--connect``); the
    read-only commands' timeout unless one is given (the ops that wait for workers give theirs)."""

    def __call__(self, timeout_s: float | None = None) -> SupervisorClient: ...


class OpCommand:
    """One op's ``twt`` command (see the module docstring)."""

    #: the wire op it sends: its row in shared.protocol.OPS
    name: ClassVar[str]
    #: the ``twt`` command (its definition's ``cli``)
    command: ClassVar[str]
    help: ClassVar[str] = ""
    description: ClassVar[str] = ""
    json_help: ClassVar[str] = ""

    @property
    def spec(self) -> proto.OpSpec:
        """The op's definition (arguments, reply, errors, its command)."""
        return proto.OPS[self.name]

    def arguments(self, p: argparse.ArgumentParser) -> None:
        """The command's own arguments (``--json`` and the run-dir options are added for it)."""

    def run(self, args: argparse.Namespace, connect: Connect) -> int:
        """The command: call the supervisor, print the answer; the exit status."""
        raise NotImplementedError(f"op {self.name!r} has no twt command")
