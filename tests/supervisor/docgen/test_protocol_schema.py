"""The JSON Schema (shared/protocol.schema.json) and the supervisor's own argument checks agree.

"The supervisor's checks" are what refuses a request's arguments before an op
runs: :func:`shared.protocol.check_args` (types, required keys), then the
spec (``TenantSpec.from_dict`` for ``register``) and the size parser (the
``set_quota`` sizes). Hypothesis generates arguments, right and wrong, and
both must give the same verdict, except for the gaps the schema declares
(``SCHEMA_GAPS``: where JSON Schema has no words), each recognised by the
supervisor's own refusal, and always with the schema the more lenient side.
"""

from __future__ import annotations

import functools
import math
import string
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared import protocol as proto
from shared.gpu_time import check_gpu_time_cap, check_gpu_time_weight
from shared.errors import InvalidArgument, _BY_CODE
from supervisor.docgen.protocol_schema import SCHEMA_GAPS, build_schema, load_schema, tenant_spec_schema
from shared.sizes import _UNITS, parse_size
from shared.spec import TenantSpec

SCHEMA = build_schema()


def _strict_int(_: Any, value: Any) -> bool:
    """msgpack keeps ints and floats apart: 1.0 is not an int on the wire."""
    return isinstance(value, int) and not isinstance(value, bool)


@functools.cache
def _validator_class() -> Any:
    """Draft 2020-12 with msgpack's integers; jsonschema imported on first use (with referencing,
    attrs and rpds ~0.2 s of imports, which every xdist worker would pay at collection otherwise)."""
    import jsonschema

    return jsonschema.validators.extend(
        jsonschema.Draft202012Validator,
        type_checker=jsonschema.Draft202012Validator.TYPE_CHECKER.redefine("integer", _strict_int),
    )


@functools.cache
def _validator(op: str) -> Any:
    """The schema of ``op``'s arguments (built once per op)."""
    return _validator_class()({**SCHEMA, "$ref": f"#/$defs/args/{op}"})


def schema_accepts(op: str, args: dict[str, Any]) -> bool:
    return bool(_validator(op).is_valid(args))


def supervisor_accepts(op: str, args: dict[str, Any]) -> tuple[bool, str]:
    """The checks the supervisor makes before the op runs; (accepted, why not)."""
    try:
        proto.check_args(op, args)
        if op == "register":
            TenantSpec.from_dict(args["spec"])
        if op == "set_quota":
            for key in proto.QUOTA_KEYS:
                if key == "gpu_time_weight" and key in args:
                    check_gpu_time_weight(args[key])
                elif key == "gpu_time_cap" and args.get(key) is not None:
                    check_gpu_time_cap(args[key])
                elif key == "idle_timeout_s" and args.get(key) is not None:
                    TenantSpec("t", idle_timeout_s=args[key])
                elif args.get(key) is not None:
                    parse_size(args[key], what=key)
    except (InvalidArgument, TypeError, ValueError) as exc:
        return False, str(exc)
    return True, ""


def _gap(why: str) -> bool:
    """A refusal the schema cannot express (SCHEMA_GAPS), recognised by the supervisor's own words."""
    return ("too large" in why or "at least one 64 KiB page" in why or "got nan" in why
            or "bytes_per_s must be at least 1" in why)


def test_set_quota_gpu_time_keys_carry_the_specs_bounds() -> None:
    """Found by the generated cases under load: the schema took ``gpu_time_cap: -1`` (any number),
    the supervisor refuses it; the set_quota keys now have the tenant spec's bounds."""
    for args in ({"tenant": "t", "gpu_time_cap": -1}, {"tenant": "t", "gpu_time_cap": 0}, {"tenant": "t", "gpu_time_cap": 1.5},
                 {"tenant": "t", "gpu_time_weight": 0}, {"tenant": "t", "gpu_time_weight": -2}):
        assert not schema_accepts("set_quota", args) and not supervisor_accepts("set_quota", args)[0], args
    for args in ({"tenant": "t", "gpu_time_cap": 0.25}, {"tenant": "t", "gpu_time_cap": None},
                 {"tenant": "t", "gpu_time_weight": 3}):
        assert schema_accepts("set_quota", args) and supervisor_accepts("set_quota", args)[0], args


def check(op: str, args: dict[str, Any]) -> None:
    by_schema = schema_accepts(op, args)
    by_supervisor, why = supervisor_accepts(op, args)
    if by_schema and not by_supervisor and _gap(why):
        return  # a declared gap: the schema is the lenient side, never the strict one
    assert by_schema == by_supervisor, (op, args, why, list(_validator(op).iter_errors(args))[:2])


# ------------------------------------------------------------------ strategies

_ANY = st.one_of(
    st.integers(min_value=-(1 << 64), max_value=1 << 64), st.floats(allow_nan=False), st.booleans(),
    st.text(max_size=6), st.none(), st.lists(st.integers(), max_size=2),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2), st.binary(max_size=4),
)
_UNIT_NAMES = sorted(u for u in _UNITS if u)


@st.composite
def size_strings(draw: st.DrawFn) -> str:
    """Size strings as operators write them (any case, spaces, fractions), all below 2**63 bytes."""
    number = str(draw(st.integers(0, 999_999)))
    if draw(st.booleans()):
        number += "." + str(draw(st.integers(0, 999)))
    unit = draw(st.sampled_from(["", *_UNIT_NAMES]))
    unit = "".join(c.upper() if draw(st.booleans()) else c for c in unit)
    pad = st.sampled_from(["", " ", "\t"])
    return draw(pad) + number + draw(pad) + unit + draw(pad)


_SIZES = st.one_of(st.integers(min_value=-5, max_value=(1 << 63) + 5), size_strings(),
                   st.text(alphabet=string.digits + "kKmMgGiIbB. x-", max_size=8), _ANY)


_OF_TYPE: dict[type, st.SearchStrategy[Any]] = {
    int: st.integers(-(1 << 64), 1 << 64), float: st.floats(allow_nan=False), str: st.text(max_size=6),
    type(None): st.none(), dict: st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
    list: st.lists(st.integers(), max_size=2),
}


# The strategies below are built once per argument or key (functools.cache; strategies are
# immutable) rather than per draw: built per draw - a regex strategy, unions - they cost much of the
# generated tests' CPU outside hypothesis's engine (1,300 examples).


@functools.cache
def _value_for(arg: proto.Arg, op: str) -> st.SearchStrategy[Any]:
    """Mostly a value of a declared type (so acceptance is tested as much as refusal), else anything."""
    if op == "set_quota" and arg.name in proto.QUOTA_KEYS:
        return _SIZES
    declared = st.one_of(*(_OF_TYPE[t] for t in arg.types))
    return st.one_of(declared, declared, _ANY)


_SPEC_SCHEMA = tenant_spec_schema()["properties"]
_SPEC_KEYS = list(_SPEC_SCHEMA)


def _valid_spec_value(key: str) -> st.SearchStrategy[Any]:
    """A value the key's schema accepts (from its enum, range or size form)."""
    prop = _SPEC_SCHEMA[key]
    if "enum" in prop:
        return st.sampled_from(prop["enum"])
    if "$ref" in prop or "anyOf" in prop:
        return st.one_of(size_strings(), st.integers(0, 1 << 50), st.none())
    if "allOf" in prop:
        return st.integers(65536, 1 << 40)
    kind = prop.get("type")
    if kind in ("number", ["number", "null"]):
        lo = prop.get("minimum", prop.get("exclusiveMinimum"))
        numbers = st.floats(lo, prop["maximum"], exclude_min="exclusiveMinimum" in prop)
        return st.one_of(numbers, st.none()) if kind != "number" else numbers
    if kind in ("integer", ["integer", "null"]):
        return st.integers(prop["minimum"], prop["maximum"])
    return st.from_regex(r"[a-z0-9][a-z0-9._-]{0,62}", fullmatch=True)


@functools.cache
def _spec_value(key: str) -> st.SearchStrategy[Any]:
    valid = _valid_spec_value(key)
    return st.one_of(valid, valid, valid, _any_spec_value(key))


def _any_spec_value(key: str) -> st.SearchStrategy[Any]:
    if key in ("tenant_id", "name"):
        return st.one_of(st.from_regex(r"[a-z0-9][a-z0-9._-]{0,62}", fullmatch=True),
                         st.text(max_size=70), _ANY)
    if key in ("isolation", "restart"):
        return st.one_of(st.sampled_from(["process", "mps", "auto", "always", "on-failure", "never", "PROCESS"]), _ANY)
    if key.endswith(("_bytes", "_cap", "_quota")):
        return st.one_of(_SIZES, st.integers(60_000, 70_000), size_strings(), st.none())
    if key.endswith("_s"):
        return st.one_of(st.floats(allow_nan=False), st.floats(0, 2e7), st.integers(-2, 10**8), _ANY)
    return st.one_of(st.integers(-3, 1 << 64), st.integers(-2, 1100),
                     st.sampled_from([0, 1, 64, 65, 100, 101, 1023, 1024, 10**6, 10**6 + 1, (1 << 63) - 1, 1 << 63]),
                     st.none(), _ANY)


@st.composite
def specs(draw: st.DrawFn) -> dict[str, Any]:
    chosen = draw(st.lists(st.sampled_from(_SPEC_KEYS), unique=True, max_size=6))
    spec = {key: draw(_spec_value(key)) for key in chosen}
    if draw(st.integers(0, 3)):  # mostly a valid name, so the other keys get looked at
        spec.setdefault("tenant_id", "acme")
        if "name" in spec and draw(st.booleans()):
            del spec["name"]
    if not draw(st.integers(0, 9)):
        spec[draw(st.sampled_from(["bogus", "Tenant_id", "gpu"]))] = 1
    return spec


@st.composite
def op_args(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    op = draw(st.sampled_from(sorted(proto.OPS)))
    args: dict[str, Any] = {}
    for arg in proto.OPS[op].args:
        choice = draw(st.integers(0, 4))
        if choice == 0 and not (arg.required and draw(st.integers(0, 3))):
            continue  # absent (a required one mostly present, so the others get looked at)
        if op == "register" and arg.name == "spec" and choice > 1:
            args[arg.name] = draw(specs())
        else:
            args[arg.name] = draw(_value_for(arg, op))
    if draw(st.booleans()):
        args[draw(st.sampled_from(["zz_unknown", "extra"]))] = draw(_ANY)  # unknown keys: both ignore them
    return op, args


# ------------------------------------------------------------------ the tests


def test_the_schema_is_a_valid_json_schema_and_the_shipped_file_is_current() -> None:
    import jsonschema

    jsonschema.Draft202012Validator.check_schema(SCHEMA)
    assert load_schema() == SCHEMA, "run: python -m supervisor.docgen.protocol_doc --write"


def test_every_op_error_and_spec_key_is_in_the_schema() -> None:
    assert set(SCHEMA["$defs"]["args"]) == set(proto.OPS)
    assert set(SCHEMA["x-twt"]["errors"]) == set(_BY_CODE)
    spec_keys = set(SCHEMA["$defs"]["tenant_spec"]["properties"])
    assert spec_keys == {*TenantSpec.field_names(), "name"}
    for name, op in proto.OPS.items():
        declared = SCHEMA["$defs"]["args"][name]
        assert list(declared["properties"]) == [a.name for a in op.args]
        assert set(declared.get("required", ())) == {a.name for a in op.args if a.required}


@pytest.mark.slow  # 800 generated cases: make test runs it, make test-fast not
@settings(max_examples=800, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(op_args())
def test_schema_and_supervisor_agree_on_generated_args(case: tuple[str, dict[str, Any]]) -> None:
    check(*case)


@pytest.mark.slow  # 500 generated specs: make test runs it, make test-fast not
@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(specs())
def test_schema_and_supervisor_agree_on_generated_tenant_specs(spec: dict[str, Any]) -> None:
    check("register", {"spec": spec})


@pytest.mark.parametrize("spec", [
    {"tenant_id": "acme"},
    {"name": "acme", "memory_quota_bytes": "2GiB", "gpu_memory_bytes_cap": None, "isolation": "mps"},
    {"tenant_id": "a.b-c_9", "wasm_max_memory_bytes": 65536, "instances": 0, "restart": "on-failure"},
    TenantSpec("full").to_dict(),
])
def test_specs_a_client_sends_pass_both(spec: dict[str, Any]) -> None:
    assert schema_accepts("register", {"spec": spec}) and supervisor_accepts("register", {"spec": spec})[0]


@pytest.mark.parametrize(("op", "args"), [
    ("alloc", {"nbytes": 1.0}),  # a float is no int on the wire, even an integral one
    ("alloc", {"nbytes": True}),
    ("register", {"spec": {"tenant_id": "acme", "name": "acme"}}),
    ("register", {"spec": {"tenant_id": "acme\n"}}),
    ("register", {"spec": {"tenant_id": "acme", "instances": 65}}),
    ("register", {"spec": {"tenant_id": "acme", "memory_quota_bytes": "12 parsecs"}}),
    ("register", {"spec": {"tenant_id": "acme", "wasm_max_memory_bytes": 4096}}),
    ("set_quota", {"tenant": "acme", "memory_quota_bytes": None}),
    ("run_wasm", {"export": b"run"}),  # bin where a str is due
])
def test_refusals_both_sides_name(op: str, args: dict[str, Any]) -> None:
    assert not schema_accepts(op, args) and not supervisor_accepts(op, args)[0]


@pytest.mark.parametrize("spec", [
    {"tenant_id": "acme", "request_timeout_s": math.nan},
    {"tenant_id": "acme", "memory_quota_bytes": "9999999TiB"},
    {"tenant_id": "acme", "wasm_max_memory_bytes": "1KiB"},
])
def test_the_declared_gaps_are_exactly_where_the_schema_is_lenient(spec: dict[str, Any]) -> None:
    """SCHEMA_GAPS, one case each: the schema passes them, the supervisor refuses them."""
    assert len(SCHEMA_GAPS) == 2
    accepted, why = supervisor_accepts("register", {"spec": spec})
    assert schema_accepts("register", {"spec": spec}) and not accepted and _gap(why), why
