"""The test suite's bytecode, compiled once by the xdist controller before its workers start.

Every xdist worker imports every test module at collection. On a checkout without the suite's
``__pycache__`` (a fresh clone: ``make install`` compiles the packages, not ``tests/``) each of the
six workers, started together, finds no cached bytecode and compiles all ~170 test modules itself -
pytest's assertion rewriting (a parse, an AST rewrite and a compile of each module) and the helpers'
plain compile: ~3 s of CPU a worker, the same work six times. Compiled here once, before the workers
exist, each of them reads the caches instead.

The caches written are exactly those the importers would write and then read: for a module pytest
rewrites (test files, conftest files, modules marked for rewriting), pytest's own rewritten pyc
(``__pycache__/<name>.<tag>-pytest-<version>.pyc``, checked against its source's hash); for the
rest, the interpreter's ordinary pyc (``compileall``'s, checked against the source's mtime and
size). A cache that is missing or stale is rewritten; a valid one is left alone.

This uses pytest's private rewrite functions (``_rewrite_test``, ``_write_pyc``, ``_read_pyc``). If a
pytest release moves them, the rewritten modules are not warmed and each worker compiles them as
before - slower, never wrong: a worker always checks a cache against its source before using it.
"""

from __future__ import annotations

import compileall
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

import pytest


def python_sources(root: Path) -> list[Path]:
    """Every ``.py`` file below ``root``, sorted; caches and hidden folders skipped."""
    found: list[Path] = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__" and not d.startswith("."))
        found += [Path(folder, name) for name in sorted(files) if name.endswith(".py")]
    return found


def _module_name(path: Path, top: Path) -> str:
    """The dotted name a file below the folder ``top`` imports as (what pytest's rewrite marks
    match), ``top`` itself the top package (the checkout holds ``tests/``)."""
    parts = list(path.relative_to(top.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _rewriter(config: pytest.Config) -> tuple[Any, Any, Any] | None:
    """pytest's rewrite module, its assertion state and its import hook, or None when this run does
    not rewrite (``--assert=plain``) or this pytest's internals are not the ones known here."""
    try:
        from _pytest.assertion import rewrite

        state = config.stash[rewrite.assertstate_key]
        hook = state.hook
        for name in ("_rewrite_test", "_write_pyc", "_read_pyc", "get_cache_dir", "try_makedirs", "PYC_TAIL"):
            getattr(rewrite, name)
        hook._should_rewrite  # noqa: B018 - the one method of the hook used: present, or no warm-up
    except (ImportError, AttributeError, KeyError):
        return None
    if hook is None:
        return None
    return rewrite, state, hook


def warm(config: pytest.Config, root: Path) -> tuple[int, int]:
    """Write every missing or stale bytecode cache of the modules below ``root`` (the suite's
    folder): pytest's rewritten pyc where pytest rewrites the module, the ordinary pyc otherwise.

    Returns (rewritten, compiled): how many caches of each kind were written. A file that cannot be
    compiled here (a syntax error, an unwritable folder) is skipped: its importer reports it.
    """
    if sys.dont_write_bytecode:
        return 0, 0
    rewriter = _rewriter(config)
    rewritten = compiled = 0
    for path in python_sources(root):
        try:
            if rewriter is not None:
                rewrite, state, hook = rewriter
                if hook._should_rewrite(_module_name(path, root), str(path), state):
                    cache_dir = rewrite.get_cache_dir(path)
                    pyc = cache_dir / (path.name[:-3] + rewrite.PYC_TAIL)
                    if rewrite._read_pyc(path, pyc) is None and rewrite.try_makedirs(cache_dir):
                        source_hash, code = rewrite._rewrite_test(path, config)
                        rewritten += bool(rewrite._write_pyc(state, code, source_hash, pyc))
                    continue
            before = _cache_mtime(path)
            if compileall.compile_file(str(path), quiet=2) and _cache_mtime(path) != before:
                compiled += 1
        except Exception:  # noqa: BLE001 - a warm-up: whatever it skips, the importing worker compiles
            continue
    return rewritten, compiled


def _cache_mtime(path: Path) -> int | None:
    """The modification time (ns) of ``path``'s ordinary cached bytecode, or None when it has none."""
    try:
        return os.stat(importlib.util.cache_from_source(str(path))).st_mtime_ns
    except (OSError, NotImplementedError, ValueError):
        return None
