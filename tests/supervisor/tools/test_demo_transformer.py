"""The demo's C-built guest: built with the SDK where the toolchain is, shown as skipped (not failed)
where it is not."""

from __future__ import annotations

import importlib.util

import pytest

from supervisor.tools import build
from supervisor.tools import demo

pytestmark = pytest.mark.timeout(300)  # a first build compiles wasi-libc


def test_the_transformer_guest_builds_with_the_sdk() -> None:
    row = demo.Outcome("foxtrot", "transformer.c", "ok")
    module = demo._build_transformer(row)
    assert module is not None and module[:4] == b"\0asm" and not row.skipped


def test_without_a_toolchain_the_row_is_skipped_not_failed(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ziglang" else real(name, *a))
    row = demo.Outcome("foxtrot", "transformer.c", "ok")
    assert demo._build_transformer(row) is None
    assert row.ok and row.skipped and "skipped" in row.outcome and "sdk" in row.notes[0]


def test_without_the_sdk_folder_the_row_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing() -> None:
        raise build.BuildError("the guest SDK is not at /nowhere")

    monkeypatch.setattr(build, "sdk_dir", missing)
    row = demo.Outcome("foxtrot", "transformer.c", "ok")
    assert demo._build_transformer(row) is None and row.skipped and "/nowhere" in row.notes[0]


def test_a_compile_error_fails_the_row(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(sources: object, out: object, **kw: object) -> None:
        raise build.BuildError("compiling failed", "transformer.c:1:1: error: boom")

    monkeypatch.setattr(build, "build_module", broken)
    row = demo.Outcome("foxtrot", "transformer.c", "ok")
    assert demo._build_transformer(row) is None
    assert not row.ok and not row.skipped and "twt build failed" in row.outcome and "boom" in row.notes[-1]
