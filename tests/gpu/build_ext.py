"""Build the C atomics helper in place with the C compiler alone (no setuptools needed).

    python3 tests/gpu/build_ext.py          # -> shared/_atomics<EXT_SUFFIX>

The GPU host's setuptools may be older than the one pyproject.toml's
metadata needs (PEP 639 license strings: setuptools >= 77), so the hardware
check builds the one extension the way setup.py would, from ``sysconfig``:
the interpreter's include directory and extension suffix, the same flags.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: setup.py's flags less ``-Werror``: on a GPU host's compiler (another gcc than CI's) a new warning is
#: printed, not a reason to lose the hardware run (CI builds with -Werror through setup.py)
FLAGS = ["-O2", "-std=c11", "-Wall", "-Wextra", "-fPIC", "-shared"]


def main() -> int:
    src = ROOT / "shared" / "_atomics.c"
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    out = ROOT / "shared" / f"_atomics{suffix}"
    if out.exists() and out.stat().st_mtime >= src.stat().st_mtime:
        print(f"{out.relative_to(ROOT)} is up to date")
        return 0
    cc = shlex.split(os.environ.get("CC") or sysconfig.get_config_var("CC") or "gcc")[:1] or ["gcc"]
    if shutil.which(cc[0]) is None:
        cc = ["gcc"]  # the interpreter was built elsewhere (its recorded compiler is not here)
    include = sysconfig.get_paths()["include"]
    if not (Path(include) / "Python.h").exists():
        print(f"build_ext: {include}/Python.h is missing: install the Python headers of this interpreter "
              f"(e.g. python{sys.version_info.major}.{sys.version_info.minor}-dev), or carry a prebuilt "
              f"shared/_atomics{suffix}", file=sys.stderr)
        return 2
    cmd = [*cc, *FLAGS, f"-I{include}", str(src), "-o", str(out)]
    print(" ".join(cmd))
    return subprocess.call(cmd)


if __name__ == "__main__":
    sys.exit(main())
