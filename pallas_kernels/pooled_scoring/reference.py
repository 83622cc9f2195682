"""Pooled indexer scoring: the XLA reference that defines the op (DESIGN §3 steps 2–3, §6.1).

A Reindex layer scores only the positions inside its query's candidate pool: the blocks that the
candidate source kept (`v41jax.pool.CandidatePool.block_ids`, ascending, −1 padded). For query b
and pool slot i·block_size + j (i-th kept block, j-th position in it) the position is
p = block_ids[b, i]·block_size + j and

    score[b, i·block_size + j] = Σ_h w[b, h]·ReLU(q[b, h]·k[b, p])      (`scoring.index_scores`)

with k[b, p] the MXFP4 row `k_packed[b, p]` dequantized; −inf where the block id is −1, where
p ≥ lengths[b] or where p ≥ S. The scores stay in block order (the compact layout a kernel writes);
`pooled_topk_reference` maps the best ones back to positions.

`full_scan_reference` is what the official reference does instead (and baseline (a) of the
benchmark): dequantize and score all S positions, mask everything outside the pool, top-k over all.
Both select the same positions (the tie rule of `scoring.topk`: lowest position first).
"""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Float, Int, UInt8

from v41jax import quant, scoring
from v41jax.pool import pool_mask_from_block_ids


def _check(k_packed, q, weights, block_ids, lengths, block_size: int, fmt: str) -> None:
    """Shape/dtype checks shared by the references and the kernels (names the bad argument)."""
    for name, x, ndim, layout in (
        ("k_packed", k_packed, 3, "[B, S, row_bytes]"),
        ("q", q, 3, "[B, H, D]"),
        ("weights", weights, 2, "[B, H]"),
        ("block_ids", block_ids, 2, "[B, NB]"),
        ("lengths", lengths, 1, "[B]"),
    ):
        if x.ndim != ndim:
            raise ValueError(f"{name}: expected shape {layout}, got {x.shape}")
    batch, n_heads, dim = q.shape
    if k_packed.dtype != jnp.uint8:
        raise ValueError(f"k_packed: expected uint8 packed rows, got {k_packed.dtype}")
    row_bytes = quant.packed_row_bytes(fmt, dim)
    if k_packed.shape[0] != batch or k_packed.shape[2] != row_bytes:
        raise ValueError(
            f"k_packed: expected shape ({batch}, S, {row_bytes}) (q's batch and "
            f"packed_row_bytes({fmt!r}, {dim})), got {k_packed.shape}"
        )
    if weights.shape != (batch, n_heads):
        raise ValueError(f"weights: expected shape {(batch, n_heads)}, got {weights.shape}")
    if block_ids.shape[0] != batch or not jnp.issubdtype(block_ids.dtype, jnp.integer):
        raise ValueError(f"block_ids: expected integer [{batch}, NB], got {block_ids.dtype}")
    if lengths.shape != (batch,) or not jnp.issubdtype(lengths.dtype, jnp.integer):
        raise ValueError(f"lengths: expected integer [{batch}], got {lengths.dtype}{lengths.shape}")
    if not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_size: expected a positive int, got {block_size!r}")


def pool_positions(
    block_ids: Int[Array, "batch n_blocks"], block_size: int
) -> Int[Array, "batch n_pool"]:
    """Position of every pool slot in block order: block_ids[b, i]·block_size + j; −1 where
    the block id is −1 (or negative). Shape [B, NB·block_size], int32."""
    block_ids = jnp.asarray(block_ids, jnp.int32)
    pos = block_ids[..., None] * block_size + jnp.arange(block_size, dtype=jnp.int32)
    pos = jnp.where(block_ids[..., None] >= 0, pos, -1)
    return pos.reshape(block_ids.shape[0], -1)


def pooled_scores_reference(
    k_packed: UInt8[Array, "batch seq row_bytes"],
    q: Float[Array, "batch heads dim"],
    weights: Float[Array, "batch heads"],
    block_ids: Int[Array, "batch n_blocks"],
    lengths: Int[Array, " batch"],
    *,
    block_size: int = 8,
    fmt: str = "mxfp4",
) -> Float[Array, "batch n_pool"]:
    """Scores of every pool slot, in block order (see the module docstring).

    Args:
      k_packed: [B, S, row_bytes] uint8 packed index keys of each sequence (`quant.pack`).
      q: [B, H, D] indexer queries (already fake-quantized), any float dtype.
      weights: [B, H] head weights (already scaled).
      block_ids: [B, NB] int candidate blocks, −1 padded (`CandidatePool.block_ids`).
      lengths: [B] int visible positions per query.
      block_size: positions per block (8 in V4.1).
      fmt: packed format of `k_packed` ('mxfp4' for the index keys).

    Returns:
      [B, NB·block_size] float32: slot i·block_size + j scores position block_ids[b, i]·
      block_size + j; −inf for −1 blocks and positions ≥ lengths[b] or ≥ S.
    """
    k_packed, q, weights = jnp.asarray(k_packed), jnp.asarray(q), jnp.asarray(weights)
    block_ids, lengths = jnp.asarray(block_ids), jnp.asarray(lengths)
    _check(k_packed, q, weights, block_ids, lengths, block_size, fmt)
    n_pos = k_packed.shape[1]
    pos = pool_positions(block_ids, block_size)
    valid = (pos >= 0) & (pos < lengths[:, None]) & (pos < n_pos)
    # Gather only the pool's rows, then dequantize them: what a kernel reads.
    rows = jnp.take_along_axis(k_packed, jnp.clip(pos, 0, n_pos - 1)[..., None], axis=1)
    k = quant.unpack(rows, fmt, q.shape[-1])
    scores = scoring.index_scores(q[:, None], weights[:, None], k, pos.shape[-1])[:, 0]
    return jnp.where(valid, scores, -jnp.inf)


def pool_topk_from_scores(
    scores: Float[Array, "batch n_pool"],
    block_ids: Int[Array, "batch n_blocks"],
    k: int,
    *,
    block_size: int = 8,
) -> scoring.TopK:
    """The k best pool slots as positions, sorted ascending, −1 padded (`scoring.topk`'s rule).

    Ties go to the lowest slot, which is the lowest position when `block_ids` is ascending (as
    `CandidatePool` gives it). Returns `TopK(indices [B, k] int32 positions, scores [B, k])`.
    """
    picks = scoring.topk(scores, k)
    pos = pool_positions(block_ids, block_size)
    positions = jnp.take_along_axis(pos, jnp.maximum(picks.indices, 0), axis=-1)
    positions = jnp.where(picks.indices >= 0, positions, -1)
    # Unsorted block ids would leave the positions unsorted: sort them, dropped picks last.
    big = jnp.iinfo(jnp.int32).max
    keys, values = jnp.where(positions >= 0, positions, big), picks.scores
    order = jnp.argsort(keys, axis=-1, stable=True)
    keys = jnp.take_along_axis(keys, order, axis=-1)
    values = jnp.take_along_axis(values, order, axis=-1)
    return scoring.TopK(jnp.where(keys < big, keys, -1), values)


def pooled_topk_reference(
    k_packed: UInt8[Array, "batch seq row_bytes"],
    q: Float[Array, "batch heads dim"],
    weights: Float[Array, "batch heads"],
    block_ids: Int[Array, "batch n_blocks"],
    lengths: Int[Array, " batch"],
    k: int,
    *,
    block_size: int = 8,
    fmt: str = "mxfp4",
) -> scoring.TopK:
    """Top-k positions of the pool (XLA gather of the pool + einsum + top-k over the pool).

    Returns `TopK(indices [B, k] int32 positions ascending then −1, scores [B, k] float32)`.
    """
    scores = pooled_scores_reference(
        k_packed, q, weights, block_ids, lengths, block_size=block_size, fmt=fmt
    )
    return pool_topk_from_scores(scores, block_ids, k, block_size=block_size)


def full_scan_reference(
    k_packed: UInt8[Array, "batch seq row_bytes"],
    q: Float[Array, "batch heads dim"],
    weights: Float[Array, "batch heads"],
    block_ids: Int[Array, "batch n_blocks"],
    lengths: Int[Array, " batch"],
    k: int,
    *,
    block_size: int = 8,
    fmt: str = "mxfp4",
) -> scoring.TopK:
    """The official approach: dequantize all S rows, score every position, mask outside the
    pool, top-k over all S (`scoring.topk`). Same result as `pooled_topk_reference`.

    Returns `TopK(indices [B, k] int32 positions ascending then −1, scores [B, k] float32)`.
    """
    k_packed, q, weights = jnp.asarray(k_packed), jnp.asarray(q), jnp.asarray(weights)
    block_ids, lengths = jnp.asarray(block_ids), jnp.asarray(lengths)
    _check(k_packed, q, weights, block_ids, lengths, block_size, fmt)
    n_pos = k_packed.shape[1]
    keys = quant.unpack(k_packed, fmt, q.shape[-1])
    scores = scoring.index_scores(q[:, None], weights[:, None], keys, lengths[:, None])[:, 0]
    mask = pool_mask_from_block_ids(block_ids, n_pos, block_size, lengths)
    return scoring.topk(scores, k, mask)
