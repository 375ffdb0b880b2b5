"""The cuda backend's fixed scratch: one ``cuMemAlloc`` made at set-up, outside the tenant's pool.

    [ sum partials | op scratch | cuBLAS fallback workspace ]
      SUM_SCRATCH    OPS_SCRATCH  CUBLAS_FALLBACK_WORKSPACE

The backend (:mod:`worker.backends.cuda`) allocates and frees it and reduces sums in its first
slice; the tensor ops (:mod:`worker.backends.cuda_ops`) reduce and gather through the second and
hand the third to cuBLAS. Both read the layout from here, so neither imports the other for it.
It is charged to the device budget as fixed overhead, so a tenant exactly at its cap can still
reduce.
"""

from __future__ import annotations

from typing import Final

__all__ = ["CUBLAS_FALLBACK_WORKSPACE_BYTES", "FIXED_SCRATCH_BYTES", "OPS_SCRATCH_BYTES", "SUM_SCRATCH_BYTES"]

#: sum partials: MAX_SUM_BLOCKS doubles
SUM_SCRATCH_BYTES: Final = 8 << 10
#: max partials (1024 blocks of floats) and argmax / gather rows
OPS_SCRATCH_BYTES: Final = 64 << 10
#: cuBLAS's workspace when the metered one could not be had: >= 16 KiB, which cuBLAS documents as
#: enough that no routine fails with CUBLAS_STATUS_ALLOC_FAILED for want of one
CUBLAS_FALLBACK_WORKSPACE_BYTES: Final = 64 << 10
FIXED_SCRATCH_BYTES: Final = SUM_SCRATCH_BYTES + OPS_SCRATCH_BYTES + CUBLAS_FALLBACK_WORKSPACE_BYTES
