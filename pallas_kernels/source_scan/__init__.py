"""The candidate source's scan at decode (issue 16 item 1): score every visible position of the
packed MXFP4 index keys, keep the pool's blocks and the source's own top-k.

The op's definition is `v41jax.ops.pool.candidate_source_scan`; `api.py` is the entry point
(`implementation=`, `supports`). Its kernel route today runs the pooled-scoring kernel over every
block of the cache (`pallas_kernels.pooled_scoring`) and the definition's selections on the
scores it writes; a fused kernel that writes only block scores is the issue's next step.
"""

from pallas_kernels.source_scan.api import candidate_source, supports

__all__ = ["candidate_source", "supports"]
