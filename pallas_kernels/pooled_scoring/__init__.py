"""Pooled indexer scoring (DESIGN §6.1): score only the candidate pool's packed MXFP4 rows.

`reference.py` defines the op (and the official full scan it replaces), `kernel_mgpu.py` is the
Mosaic GPU kernel for Hopper, `api.py` dispatches between them (`implementation=`) with the
reference's gradient, `bench.py` times them on the GPU.
"""

from pallas_kernels.pooled_scoring.api import IMPLEMENTATIONS, pooled_scores
from pallas_kernels.pooled_scoring.kernel_mgpu import TuningConfig
from pallas_kernels.pooled_scoring.reference import (
    full_scan_reference,
    pool_positions,
    pool_topk_from_scores,
    pooled_scores_reference,
    pooled_topk_reference,
)

__all__ = [
    "IMPLEMENTATIONS",
    "TuningConfig",
    "full_scan_reference",
    "pool_positions",
    "pool_topk_from_scores",
    "pooled_scores",
    "pooled_scores_reference",
    "pooled_topk_reference",
]
