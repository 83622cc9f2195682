"""Pooled indexer scoring (DESIGN §6.1): score only the candidate pool's packed MXFP4 rows.

The op's definition is `v41jax.ops.pool.pooled_scores`; `kernel_mgpu.py` is the Mosaic GPU
kernel for Hopper, `api.py` the entry point (`implementation=`, `supports`) with the definition's
gradient, `bench.py` times them on the GPU.
"""

from pallas_kernels.pooled_scoring.api import pooled_scores, supports
from pallas_kernels.pooled_scoring.kernel_mgpu import IN_PLACE_ROWS, TuningConfig

__all__ = ["IN_PLACE_ROWS", "TuningConfig", "pooled_scores", "supports"]
