"""The ops: pure jnp functions that are the definitions of every mechanism (DESIGN §2–§4).

The lowest layer of the project: it imports jax, numpy, ml_dtypes, chex and jaxtyping only. The
Pallas kernels (`pallas_kernels`) are tested against these functions; the NNX modules
(`v41jax.nn`) call them.

| module       | what it defines                                                                 |
|--------------|---------------------------------------------------------------------------------|
| `formats`    | the FP4/FP8 formats: E2M1 rounding, fake-quant with straight-through gradients, |
|              | packed row layouts, row bytes (DESIGN §4)                                       |
| `scoring`    | indexer scores, top-k with its tie rule, indices → mask (DESIGN §3 step 2)      |
| `pool`       | the candidate pool and its block reducers; scoring inside a pool of packed keys |
|              | (DESIGN §3 step 3, §6.1)                                                        |
| `attention`  | window + top-k + sink attention: over float KV, over packed caches, as a mask   |
|              | (whole sequences), over gathered rows (chunks of long sequences; DESIGN §3.4)  |
| `invariants` | the selection invariants, staged with checkify for debug mode                   |
"""

from v41jax.ops.attention import (
    MaskedAttentionResult,
    SparseAttentionResult,
    chunk_attention,
    masked_attention,
    packed_sparse_attention,
    sharded_packed_sparse_attention,
    sliding_window_rows,
    softmax_with_sink,
    sparse_attention,
)
from v41jax.ops.checks import check_finite
from v41jax.ops.formats import (
    FORMATS,
    Format,
    fake_quant,
    formats_for,
    fp8_window_fake_quant,
    mxfp4_fake_quant,
    nvfp4_fake_quant,
    pack,
    packed_row_bytes,
    unpack,
)
from v41jax.ops.invariants import check_selection
from v41jax.ops.pool import (
    BLOCK_REDUCERS,
    CandidatePool,
    block_scores,
    full_scan_topk,
    pool_mask_from_block_ids,
    pool_positions,
    pool_topk_from_scores,
    pooled_scores,
    pooled_topk,
    select_candidate_blocks,
    sharded_candidate_blocks,
    sharded_pooled_topk,
    slot_positions,
)
from v41jax.ops.scoring import (
    TopK,
    gather_rows,
    index_scores,
    index_scores_at,
    indices_to_mask,
    topk,
    topk_indices,
)

__all__ = [
    "BLOCK_REDUCERS",
    "FORMATS",
    "CandidatePool",
    "Format",
    "MaskedAttentionResult",
    "SparseAttentionResult",
    "TopK",
    "block_scores",
    "check_finite",
    "check_selection",
    "chunk_attention",
    "fake_quant",
    "formats_for",
    "fp8_window_fake_quant",
    "full_scan_topk",
    "gather_rows",
    "index_scores",
    "index_scores_at",
    "indices_to_mask",
    "masked_attention",
    "mxfp4_fake_quant",
    "nvfp4_fake_quant",
    "pack",
    "packed_row_bytes",
    "packed_sparse_attention",
    "pool_mask_from_block_ids",
    "pool_positions",
    "pool_topk_from_scores",
    "pooled_scores",
    "pooled_topk",
    "select_candidate_blocks",
    "sharded_candidate_blocks",
    "sharded_packed_sparse_attention",
    "sharded_pooled_topk",
    "sliding_window_rows",
    "slot_positions",
    "softmax_with_sink",
    "sparse_attention",
    "topk",
    "topk_indices",
    "unpack",
]
