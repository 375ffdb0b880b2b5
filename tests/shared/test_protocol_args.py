"""The typed accessors handlers read their checked arguments through (shared.protocol.arg_*)."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import pytest

from shared import protocol as proto
from shared.errors import InvalidArgument


def test_accessors_return_what_check_args_let_through() -> None:
    args: dict[str, object] = {"tenant": "t", "instances": 3, "instance": None, "spec": {"name": "t"}}
    assert proto.arg_str(args, "tenant") == "t"
    assert proto.arg_opt_str(args, "tenant") == "t"
    assert proto.arg_opt_str(args, "missing") is None
    assert proto.arg_int(args, "instances") == 3
    assert proto.arg_opt_int(args, "instance") is None
    assert proto.arg_opt_int(args, "missing") is None
    assert proto.arg_opt_int(args, "instances") == 3
    assert proto.arg_map(args, "spec") == {"name": "t"}
    assert proto.arg_opt_map(args, "spec") == {"name": "t"}
    assert proto.arg_opt_map(args, "missing") is None


@pytest.mark.parametrize(("accessor", "value"), [
    (proto.arg_str, 1), (proto.arg_str, None), (proto.arg_str, b"t"), (proto.arg_opt_str, 1),
    (proto.arg_int, True), (proto.arg_int, 1.0), (proto.arg_int, None), (proto.arg_opt_int, False),
    (proto.arg_opt_int, "1"), (proto.arg_map, None), (proto.arg_map, [1]), (proto.arg_opt_map, {1: 2}),
    (proto.arg_opt_map, "x"),
])
def test_a_value_of_the_wrong_type_is_refused_naming_the_argument(accessor: object, value: object) -> None:
    """Unreachable for an argument its op's row declares (check_args refused it first): a bool is
    never an int, and the error names the argument, as check_args's would."""
    assert callable(accessor)
    with pytest.raises(InvalidArgument, match="^invalid argument: arg must be "):
        accessor({"arg": value}, "arg")


def test_every_declared_argument_check_args_accepts_reads_back() -> None:
    """The rows and the accessors agree: a value check_args accepts for a declared str/int argument
    is one the accessor returns (so the accessor's refusal is unreachable for it)."""
    readers: dict[tuple[type, ...], tuple[object, Callable[[Mapping[str, object], str], object]]] = {
        (str,): ("x", proto.arg_str), (int,): (1, proto.arg_int), (int, type(None)): (None, proto.arg_opt_int),
        (str, type(None)): (None, proto.arg_opt_str)}
    seen = 0
    for spec in proto.OPS.values():
        for arg in spec.args:
            if arg.types not in readers or arg.check is not None:
                continue
            value, reader = readers[arg.types]
            proto.check_args(spec.name, {**{a.name: readers[a.types][0] for a in spec.args
                                           if a.required and a.types in readers}, arg.name: value})
            assert reader({arg.name: value}, arg.name) == value
            seen += 1
    assert seen > 10
