"""Compiling guest sources for the SDK tests, once per session per distinct input.

``SdkBuilder.build(...)`` runs ``twt build``'s library function and keeps
the module bytes keyed by the sha256 of everything that decides them: each
source's name and bytes, the SDK's bindings, the options. Zig's own cache
(``~/.cache/zig``) makes a rebuild after a change cheap too; the first build
of a fresh machine compiles wasi-libc once (tens of seconds on one core).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from supervisor.cli.build import build_module, sdk_dir

__all__ = ["EXAMPLES", "ROOT", "SdkBuilder"]

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "sdk" / "examples"


class SdkBuilder:
    """Builds C / Zig sources into module bytes, each distinct input once per session."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self._cache: dict[str, bytes] = {}
        self.builds = 0

    def _key(self, sources: list[Path], options: dict[str, Any]) -> str:
        digest = hashlib.sha256()
        for path in [*sources, sdk_dir() / "c" / "tensorwasm.h", sdk_dir() / "zig" / "tensorwasm.zig"]:
            digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
        digest.update(repr(sorted(options.items())).encode())
        return digest.hexdigest()

    def build(self, *sources: Path, **options: Any) -> bytes:
        """The module built from ``sources`` with ``build_module`` ``options`` (cached)."""
        paths = list(sources)
        key = self._key(paths, options)
        found = self._cache.get(key)
        if found is None:
            out = self.workdir / f"{key[:16]}.wasm"
            build_module(paths, out, **options)
            found = self._cache[key] = out.read_bytes()
            self.builds += 1
        return found

    def example(self, lang: str, name: str) -> bytes:
        """``sdk/examples/<lang>/<name>.<c|zig>``, built."""
        return self.build(EXAMPLES / lang / f"{name}.{'c' if lang == 'c' else 'zig'}")

    def source(self, name: str, text: str, **options: Any) -> bytes:
        """A guest written by a test (``name`` ends in .c or .zig), built."""
        path = self.workdir / "src" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
        return self.build(path, **options)
