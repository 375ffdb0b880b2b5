"""A bench's counts are checked when its arguments are parsed: zero, negative or not a number is a usage
error naming the option, before anything runs (``twt bench route --kills 0`` used to run every other part
and then end in "no median for empty data")."""

from __future__ import annotations

import importlib

import pytest

pytestmark = pytest.mark.timeout(60)

BAD = [
    ("route", ["--kills", "0"], "--kills: must be a whole number >= 1, got '0'"),
    ("route", ["--rounds", "-1"], "--rounds: must be a whole number >= 1"),
    ("route", ["--per-round", "x"], "--per-round: must be a whole number >= 1, got 'x'"),
    ("route", ["--profile", "--requests", "0"], "--requests: must be a whole number >= 1"),
    ("route", ["--profile", "--depth", "x"], "--depth: must be a whole number >= 1"),
    ("flood", ["--pings", "0"], "--pings: must be a whole number >= 1"),
    ("flood", ["--flooder-rate", "0"], "--flooder-rate: must be a number per second > 0, got '0'"),
    ("flood", ["--flooder-bytes", "12xb"], "--flooder-bytes: invalid size '12xb'"),
    ("host", ["--seconds", "0"], "--seconds: must be a number of seconds > 0, got '0'"),
    ("scale", ["--samples", "0"], "--samples"),
    ("scale", ["--tenants", "63"], "--tenants: must be a whole number >= 64"),
    ("data", ["--rounds", "0"], "--rounds"),
    ("data", ["--sizes", "16,0"], "--sizes: each size must be a whole number >= 1, got '0'"),
    ("data", ["--sizes", ","], "--sizes: at least one size"),
    ("registry", ["--repeat", "0"], "--repeat"),
    ("registry", ["--registrations", "-1"], "--registrations: must be a whole number >= 0"),
    ("restore", ["--tenants", "0"], "--tenants"),
    ("quota", ["--duration", "0"], "--duration: must be a number of seconds > 0"),
    ("share", ["--seconds", "nan"], "--seconds: must be a number of seconds > 0"),
    ("share", ["--reps", "0"], "--reps"),
    ("wasm", ["--calls", "0"], "--calls"),
    ("cluster", ["--per-round", "0"], "--per-round"),
    ("density", ["--tenants", "0"], "--tenants: must be a whole number >= 1"),
    ("density", ["--clients", "x"], "--clients"),
    ("density", ["--requests", "0"], "--requests"),
    ("density", ["--rounds", "0"], "--rounds"),
]


@pytest.mark.parametrize(("bench", "argv", "message"), BAD, ids=[f"{b} {' '.join(a)}" for b, a, _ in BAD])
def test_a_bad_count_is_a_usage_error_naming_the_option(bench: str, argv: list[str], message: str,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    main = importlib.import_module(f"supervisor.tools.bench.{bench}").main
    try:
        code = main(argv)  # some benches return the usage status, the others exit with it
    except SystemExit as exc:
        code = exc.code
    assert code == 2
    assert message in capsys.readouterr().err
