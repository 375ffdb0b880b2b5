"""The hardware check's "residual_full" phase: the residual-data probe with the reader taking most of the device.

    tests/gpu/check_gpu.py      runs it as the phase "residual_full" (in the orchestrator: its steps are
                                child processes, ``check_children.child_residual_writer`` and
                                ``child_residual_reader_most``)

The "residual" phase's reader looks at a few of the pages A gave back; the driver could still hand
B some of A's old pages elsewhere. Here A fills a large buffer (8 GiB on hardware, 2 GiB quick) with
a mark and gives it back (freed and trimmed; then, in a second round, SIGKILLed holding it), and B
allocates 90 % of the device's free memory - wherever A's pages went, B's buffers cover them - then
reads every byte back without writing it first. Rows, per round:

    B's marks found in most of the free memory       check: 0 (never A's bytes)
    how much B covered and how long the scan took    timing: >= 80 % of the device's memory,
                                                     reported

On the fake driver each process has its own fake device (A's bytes can never reach B there): the
steps and rows are proven, with a 64 MiB fake device for B.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.gpu.phase_kit import MiB, Result, TableRow  # noqa: E402

__all__ = ["COVER_BOUND", "FRACTION", "run", "table_rows"]

FRACTION = 0.9
COVER_BOUND = 0.8
FAKE_DEVICE_BYTES = 64 * MiB


def _reader(fake: bool, timeout_s: float) -> Result:
    """``check_gpu.py --child residual_reader_most`` in a fresh process (a 64 MiB fake device on the fake)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    if fake:
        env["FAKE_CUDA_MEMORY"] = str(FAKE_DEVICE_BYTES)
    chunk = "4" if fake else "256"
    try:
        proc = subprocess.run([sys.executable, str(ROOT / "tests" / "gpu" / "check_gpu.py"), "--child",
                               "residual_reader_most", str(FRACTION), chunk,
                               "0" if fake else "1"], capture_output=True, text=True,
                              timeout=timeout_s, env=env, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"error": f"the reader did not finish within {timeout_s:.0f} s (killed)"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode or not lines:
        return {"error": f"reader exit {proc.returncode}: {(proc.stderr or proc.stdout).strip()[-200:]}"}
    result: Result = json.loads(lines[-1])
    return result


def run(*, quick: bool, fake: bool, timeout_s: float = 150) -> Result:
    """Both rounds (free+trim, kill); each: A's figures and B's."""
    from tests.gpu.check_gpu import Held

    mib = 16 if fake else (2048 if quick else 8192)
    out: Result = {"writer_mib": mib, "fraction": FRACTION}
    for how in ("free_trim", "kill"):
        try:
            writer = Held("residual_writer", str(mib))
        except RuntimeError as exc:
            out[how] = {"error": str(exc)}
            continue
        round_: dict[str, Any] = {"writer": writer.first}
        if how == "free_trim":
            round_["writer_freed"] = writer.step()
            round_["reader"] = _reader(fake, timeout_s)
            writer.release()
        else:
            writer.proc.kill()
            writer.release(timeout_s=10)
            round_["reader"] = _reader(fake, timeout_s)
        out[how] = round_
    return out


def table_rows(result: Result) -> list[TableRow]:
    """(name, got, want, ok, kind) rows (see the module docstring)."""
    if "error" in result:
        return [("residual_full: the reader takes most of the device", str(result["error"])[:160], "run", False,
                 "check")]
    rows: list[TableRow] = []
    for how in ("free_trim", "kill"):
        r = result.get(how, {})
        reader = r.get("reader", r)
        label = how.replace("_", "+")
        if "error" in reader:
            rows.append((f"residual_full: after A's {label}, B reads most of the device", str(reader["error"])[:160],
                         "0 of A's marks", False, "check"))
            continue
        rows.append((f"residual_full: after A's {label}, A's marks in B's {reader['mib']} MiB",
                     f"{reader['mark_floats_found']} ({reader['nonzero_floats']} non-zero floats)",
                     "0 (never A's bytes)", reader["mark_floats_found"] == 0, "check"))
        cover = reader["mib"] * MiB / max(reader["total"], 1)
        rows.append((f"residual_full: after A's {label}, B covered of the device",
                     f"{cover:.1%} of {reader['total'] / MiB:.0f} MiB in {reader['seconds']:.1f} s",
                     f">= {COVER_BOUND:.0%}", cover >= COVER_BOUND, "timing"))
    return rows
