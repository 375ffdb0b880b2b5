"""The one encoder/decoder of typed records: dataclasses checked field by field on decode.

A :class:`Record` is a frozen dataclass. :meth:`Record.to_wire` gives a
msgpack/JSON-ready dict; :meth:`Record.from_wire` builds the record from
such a dict and checks every field against its annotation, so what a
record holds is what its type says (an ``int`` field never holds a bool or a
string, a nested record is a record, not a dict). A value of the wrong type
raises :class:`~shared.errors.ProtocolError` naming the record, the field and
both types.

Why dataclasses and a converter table rather than attrs or msgspec: the
records already are dataclasses (the supervisor's JSON Schema generator
reads them), and one converter per field, built
once per class from its annotations, decodes as fast as a hand-written
``cls(**d)`` with checks (docs/PERFORMANCE.md "record decode"), without a
dependency.

Decoding ignores keys a record does not know (an older reader of a newer
peer) and fills fields a message lacks from their defaults; a field without a
default that is missing raises :class:`ProtocolError`.

Converters, by annotation: ``int`` (not bool), ``float`` (an int is widened),
``str``, ``bool``, ``X | None``, unions of those, ``tuple[X, ...]`` and
fixed tuples (from a list or tuple), ``dict[K, V]``, a nested
:class:`Record`, a class with ``from_dict``/``to_dict`` (``TenantSpec``), and
``Any`` - kept only for values that are free-form by protocol (a fault's
parameters, a backend's options, a guest's log lines) and passed through.
"""

from __future__ import annotations

import dataclasses
import sys
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any, Protocol, Self, cast

from shared.errors import ProtocolError

__all__ = ["Record", "WireTypeError"]

#: a field's decoder: the checked (maybe converted) value, or WireTypeError
Decode = Callable[[object], object]
#: a field's encoder: the wire form of a value
Encode = Callable[[object], object]


class _ToDict(Protocol):
    """A value that writes itself as a map (``TenantSpec``)."""

    def to_dict(self) -> Mapping[str, object]: ...


class WireTypeError(Exception):
    """A value of the wrong type inside a record being decoded (becomes ProtocolError at the top)."""

    def __init__(self, expected: str, got: object, path: tuple[str, ...] = ()) -> None:
        super().__init__(expected, got, path)
        self.expected = expected
        self.got = got
        self.path = path

    def within(self, name: str) -> WireTypeError:
        return WireTypeError(self.expected, self.got, (name, *self.path))

    def describe(self, record: str) -> str:
        """The message, after the top record's name: where (``.tenants[0].state``) and what went wrong."""
        path = self.path[:-1] if self.got is _MISSING else self.path
        where = record + "".join(p if p.startswith("[") else "." + p for p in path)
        if self.got is _MISSING:
            return f"{where} lacks {self.path[-1]!r}"
        if self.expected.endswith(" map") and not isinstance(self.got, Mapping):
            return f"{where} must be a map, not {type(self.got).__name__}"
        return f"{where}: expected {self.expected}, got {type(self.got).__name__}"


#: ``got`` of a required field the message lacks
_MISSING = object()


# ------------------------------------------------------------------ scalar converters


def _int(v: object) -> object:
    if type(v) is int:
        return v
    raise WireTypeError("int", v)


def _float(v: object) -> object:
    t = type(v)
    if t is float:
        return v
    if t is int:
        return float(v)  # type: ignore[arg-type]  # t is int
    raise WireTypeError("float", v)


def _str(v: object) -> object:
    if type(v) is str:
        return v
    raise WireTypeError("str", v)


def _bool(v: object) -> object:
    if v is True or v is False:
        return v
    raise WireTypeError("bool", v)


def _none(v: object) -> object:
    if v is None:
        return v
    raise WireTypeError("None", v)


_SCALARS: dict[object, Decode] = {int: _int, float: _float, str: _str, bool: _bool, type(None): _none}


def _name(tp: object) -> str:
    return getattr(tp, "__name__", None) or str(tp)


def _optional(inner: Decode) -> Decode:
    def decode(v: object) -> object:
        return None if v is None else inner(v)
    return decode


def _union(parts: list[Decode], label: str) -> Decode:
    def decode(v: object) -> object:
        for part in parts:
            try:
                return part(v)
            except WireTypeError:
                continue
        raise WireTypeError(label, v)
    return decode


def _one_of(types_: frozenset[object], label: str) -> Decode:
    def decode(v: object) -> object:
        if type(v) in types_:
            return v
        raise WireTypeError(label, v)
    return decode


def _tuple_of(item: Decode | None) -> Decode:
    def decode(v: object) -> object:
        if type(v) is not list and type(v) is not tuple:
            raise WireTypeError("array", v)
        if item is None:
            return tuple(v)
        out = []
        for i, x in enumerate(v):
            try:
                out.append(item(x))
            except WireTypeError as exc:
                raise exc.within(f"[{i}]") from None
        return tuple(out)
    return decode


def _fixed_tuple(items: list[Decode | None]) -> Decode:
    def decode(v: object) -> object:
        if (type(v) is not list and type(v) is not tuple) or len(v) != len(items):
            raise WireTypeError(f"array of {len(items)}", v)
        return tuple(x if d is None else d(x) for d, x in zip(items, v))
    return decode


def _dict_of(key: Decode | None, value: Decode | None) -> Decode:
    def decode(v: object) -> object:
        if not isinstance(v, Mapping):
            raise WireTypeError("map", v)
        if key is None and value is None:
            return dict(v)
        out = {}
        for k, x in v.items():
            try:
                out[k if key is None else key(k)] = x if value is None else value(x)
            except WireTypeError as exc:
                raise exc.within(str(k)) from None
        return out
    return decode


def _nested(cls: type[Record]) -> Decode:
    def decode(v: object) -> object:
        return cls._decode(v)
    return decode


def _from_dict(cls: type) -> Decode:
    """A type that parses itself from a map (``TenantSpec.from_dict``): its own errors are a type error
    here. Keys it does not know are dropped first when it names its fields (``field_names()``): a
    config file's unknown key is a mistake, a newer peer's is a field this reader does not have yet."""
    names = getattr(cls, "field_names", None)
    known = frozenset(names()) if callable(names) else None

    def decode(v: object) -> object:
        if not isinstance(v, Mapping):
            raise WireTypeError(f"{cls.__name__} map", v)
        if known is not None and not known.issuperset(v):
            v = {k: x for k, x in v.items() if k in known}
        try:
            return cls.from_dict(v)  # type: ignore[attr-defined]  # checked in _converter
        except (TypeError, ValueError) as exc:
            raise WireTypeError(f"{cls.__name__} ({exc})", v) from None
    return decode


def _converter(tp: object) -> Decode | None:
    """The decoder of one annotation (None: keep the value as it is)."""
    if tp is Any or tp is object:
        return None
    if tp in _SCALARS:
        return _SCALARS[tp]
    if isinstance(tp, type):
        if issubclass(tp, Record):
            return _nested(tp)
        if callable(getattr(tp, "from_dict", None)):
            return _from_dict(tp)
        raise TypeError(f"no wire converter for {tp!r}")
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1 and len(args) == 2:
            inner = _converter(rest[0])
            return _optional(inner) if inner is not None else None
        if all(a in _SCALARS and a is not float for a in args) or set(args) == {int, float}:
            return _one_of(frozenset(args), " | ".join(_name(a) for a in args))  # exact types, kept as they are
        parts = [_converter(a) for a in args]
        if any(p is None for p in parts):
            return None
        return _union([p for p in parts if p is not None], " | ".join(_name(a) for a in args))
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return _tuple_of(_converter(args[0]))
        return _fixed_tuple([_converter(a) for a in args])
    if origin is dict:
        return _dict_of(_converter(args[0]), _converter(args[1]))
    raise TypeError(f"no wire converter for {tp!r}")


def _encoder(tp: object) -> Encode | None:
    """The encoder of one annotation (None: the value is its own wire form)."""
    if isinstance(tp, type):
        if issubclass(tp, Record):
            return _encode_record
        if callable(getattr(tp, "to_dict", None)):
            return _encode_to_dict
        return None
    args = typing.get_args(tp)
    if typing.get_origin(tp) is tuple:
        return _encode_items  # an array on the wire: a list, as a decoded message has it
    if any(_encoder(a) is not None for a in args):
        return _encode_any
    return None


def _encode_record(v: object) -> object:
    return v.to_wire() if isinstance(v, Record) else v


def _encode_to_dict(v: object) -> object:
    return None if v is None else cast(_ToDict, v).to_dict()


def _encode_items(v: object) -> object:
    return [_encode_any(x) for x in v] if isinstance(v, tuple) else v


def _encode_any(v: object) -> object:
    if isinstance(v, Record):
        return v.to_wire()
    if isinstance(v, tuple):
        return [_encode_any(x) for x in v]
    to_dict = getattr(v, "to_dict", None)
    return to_dict() if callable(to_dict) else v


#: per record class: its compiled decoder and ((field, encode), ...)
_Plan = tuple[Callable[[object], "Record"], tuple[tuple[str, Encode | None], ...]]
_PLANS: dict[type, _Plan] = {}

#: inline checks of exact scalar annotations in the compiled decoders: (condition that fails, label)
_INLINE: dict[object, tuple[str, str]] = {
    int: ("type(v) is not int", "int"),
    str: ("type(v) is not str", "str"),
    bool: ("v is not True and v is not False", "bool"),
}


def _plan(cls: type) -> _Plan:
    plan = _PLANS.get(cls)
    if plan is None:
        hints = typing.get_type_hints(cls, vars(sys.modules[cls.__module__]))
        fields = dataclasses.fields(cls)
        encode = tuple((f.name, _encoder(hints[f.name])) for f in fields)
        plan = _PLANS[cls] = (_compile_decoder(cls, fields, hints), encode)
    return plan


def _compile_decoder(cls: type, fields: tuple[dataclasses.Field[object], ...],
                     hints: Mapping[str, object]) -> Callable[[object], Record]:
    """A decoder written out for ``cls`` (one straight-line function, as attrs and msgspec do):
    no loop over fields, no kwargs dict, exact scalars checked inline, the rest through
    their converters; a missing field gets its default, or WireTypeError when it has none."""
    ns: dict[str, object] = {"Mapping": Mapping, "WireTypeError": WireTypeError, "_MISSING": _MISSING, "cls": cls}
    lines = [
        "def decode(data):",
        "    if not isinstance(data, Mapping):",
        f"        raise WireTypeError({cls.__name__ + ' map'!r}, data)",
        "    get = data.get",
    ]
    for i, f in enumerate(fields):
        tp = hints[f.name]
        name = repr(f.name)
        lines.append(f"    v = get({name}, _MISSING)")
        lines.append("    if v is _MISSING:")
        if f.default is not dataclasses.MISSING:
            ns[f"d{i}"] = f.default
            lines.append(f"        v = d{i}")
        elif f.default_factory is not dataclasses.MISSING:
            ns[f"f{i}"] = f.default_factory
            lines.append(f"        v = f{i}()")
        else:
            lines.append(f"        raise WireTypeError('a value (required)', _MISSING, ({name},))")
        inner = typing.get_args(tp)
        optional = typing.get_origin(tp) in (typing.Union, types.UnionType) and len(inner) == 2 and type(None) in inner
        scalar = next((a for a in inner if a is not type(None)), None) if optional else tp
        if scalar in _INLINE:
            test, label = _INLINE[scalar]
            guard = f"v is not None and ({test})" if optional else test
            lines.append(f"    elif {guard}:")
            lines.append(f"        raise WireTypeError({label!r}, v, ({name},))")
        else:
            convert = _converter(tp)
            if convert is not None:
                ns[f"c{i}"] = convert
                lines += [
                    "    else:",
                    "        try:",
                    f"            v = c{i}(v)",
                    "        except WireTypeError as exc:",
                    f"            raise exc.within({name}) from None",
                ]
        lines.append(f"    a{i} = v")
    lines.append(f"    return cls({', '.join(f'a{i}' for i in range(len(fields)))})")
    exec("\n".join(lines), ns)  # code written above from the class's own field names
    return cast(Callable[[object], Record], ns["decode"])


class Record:
    """Mixin of every wire record (a frozen dataclass): the one encoder and the one checked decoder."""

    __slots__ = ()

    def to_wire(self) -> dict[str, object]:
        """The record as a msgpack/JSON-ready map (nested records as maps, tuples as arrays)."""
        out: dict[str, object] = {}
        for name, encode in _plan(type(self))[1]:
            value = getattr(self, name)
            out[name] = value if encode is None else encode(value)
        return out

    @classmethod
    def from_wire(cls, data: object) -> Self:
        """The record a decoded message holds; ProtocolError when a field is missing or of the wrong type."""
        try:
            return cls._decode(data)
        except WireTypeError as exc:
            raise ProtocolError(exc.describe(cls.__name__)) from None

    @classmethod
    def _decode(cls, data: object) -> Self:
        """:meth:`from_wire` without the ProtocolError (nested records: the outer one reports)."""
        return cast(Self, _plan(cls)[0](data))
