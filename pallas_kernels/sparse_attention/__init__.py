"""FP4-dequant sparse attention (window + top-k + sink) over packed caches (DESIGN §6, kernel 2).

`fp4_sparse_attention(..., implementation='xla' | 'pallas' | 'pallas_mgpu' | 'pallas_triton')`
is the entry point; `fp4_sparse_attention_reference` is the op's definition.
"""

from pallas_kernels.sparse_attention.api import IMPLEMENTATIONS, Config, fp4_sparse_attention
from pallas_kernels.sparse_attention.reference import (
    bf16_cache_attention,
    fp4_sparse_attention_reference,
)

__all__ = [
    "IMPLEMENTATIONS",
    "Config",
    "bf16_cache_attention",
    "fp4_sparse_attention",
    "fp4_sparse_attention_reference",
]
