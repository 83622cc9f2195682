"""FP4-dequant sparse attention (window + top-k + sink) over packed caches (DESIGN §6, kernel 2).

The op's definition is `v41jax.ops.attention.packed_sparse_attention`; `kernel_mgpu.py` is the
Mosaic GPU kernel (Hopper), `kernel_triton.py` the Triton-backend stepping stone, `api.py` the
entry point (`fp4_sparse_attention(..., implementation=)`, `supports`) with the definition's
gradient, `bench.py` times them against the XLA baselines on the GPU.
"""

from pallas_kernels.sparse_attention.api import BACKENDS, Config, fp4_sparse_attention, supports

__all__ = ["BACKENDS", "Config", "fp4_sparse_attention", "supports"]
