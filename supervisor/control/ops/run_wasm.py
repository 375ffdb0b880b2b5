"""``run_wasm`` / ``twt run TENANT FILE.wasm|FILE.wat --invoke NAME [--arg V ...]``: run one export in a tenant's worker.

Registers nothing: it talks to the running supervisor of ``--run-dir`` with
the tenant's capability, obtained with the admin capability in the run
directory (or read from ``--capability FILE`` by a tenant that holds its
own). Prints the results, or the typed error and exits 1; a guest that called
``exit(n)`` (WASI ``proc_exit``) prints its exit code and exits 1 unless n is 0.
"""

from __future__ import annotations

from supervisor.control.ops._base import WorkerOp

__all__ = ["RunWasm"]


class RunWasm(WorkerOp):
    name = "run_wasm"
    args_doc = "`{export, args: [int, float or {handle}], fuel?, timeout_s?, digest?}`"
    body_in_doc = "module bytes, or none with a `digest` from `put_module`"
    result_doc = ("`{results, fuel_used, elapsed_s, cached, gpu_peak_bytes, memory_bytes, logs, logs_dropped, "
                  "exit_code, gpu_time_s, gpu_wait_s, fuel_limit, timeout_s}` (`gpu_time_s`: device time the run's "
                  "ops were charged; `gpu_wait_s`: how long they waited for the device lease; `fuel_limit`, "
                  "`timeout_s`: the budget and deadline the run had, the request's capped by the tenant's spec)")
    error_notes = {
        "WasmTrap": "`trap_code`",
        "InvalidArgument": "also: buffers on different instances",
    }
