"""The candidate pool: the blocks of compressed positions a Reindex layer may score.

DESIGN §3 step 3, `v41_architecture.md` §4. The candidate source (the last Full layer) scores
every visible position; `select_candidate_blocks` groups positions into blocks, scores each block
with a reducer ('max' in V4.1, 'mean' as an ablation), always keeps the block holding the newest
visible position, and keeps the best `topk_blocks` reachable blocks. Reindex layers then restrict
their own top-k to the pool (`scoring.topk(..., mask=pool.mask)`); the candidate source's own
top-k is not restricted.

A new block reducer is one function `(scores, valid) -> block_scores` and one line in
`BLOCK_REDUCERS`; or pass the function itself as `reduce=`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import NamedTuple

import chex
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Bool, Float, Int

from v41jax._checks import (
    as_lengths,
    require_dtype,
    require_min_ndim,
    require_nonnegative_int,
    require_positive_int,
)
from v41jax.scoring import (
    indices_to_mask,
    topk_indices,
)

BlockReducer = Callable[
    [Float[Array, "*batch n_blocks block_size"], Bool[Array, "*batch n_blocks block_size"]],
    Float[Array, "*batch n_blocks"],
]
"""Scores one block from its positions' scores and validity.

`valid` is False at padding, at invisible positions and at positions scoring −inf; those carry −inf
in `scores`. The reducer only needs to be right for blocks with at least one valid position: a
block with none scores −inf whatever the reducer returns (`select_candidate_blocks` enforces it).
"""


def block_max(
    scores: Float[Array, "*batch n_blocks block_size"],
    valid: Bool[Array, "*batch n_blocks block_size"],
) -> Float[Array, "*batch n_blocks"]:
    """V4.1's block score: the maximum over the block's valid positions."""
    return jnp.max(jnp.where(valid, scores, -jnp.inf), axis=-1)


def block_mean(
    scores: Float[Array, "*batch n_blocks block_size"],
    valid: Bool[Array, "*batch n_blocks block_size"],
) -> Float[Array, "*batch n_blocks"]:
    """Ablation: the mean over the block's valid (finite-score) positions only.

    Averaging over the valid entries, not the whole block, keeps a partly filled or partly
    reachable block comparable with a full one.
    """
    count = jnp.sum(valid, axis=-1)
    total = jnp.sum(jnp.where(valid, scores, 0.0), axis=-1)
    return total / jnp.maximum(count, 1)


BLOCK_REDUCERS: Mapping[str, BlockReducer] = MappingProxyType(
    {"max": block_max, "mean": block_mean}
)
"""Block reducers by the name `ModelConfig.block_score` uses. Read-only: add entries here."""


class CandidatePool(NamedTuple):
    """A per-query candidate pool, in the two forms consumers use.

    Attributes:
      mask: [..., n_pos] bool, True at the visible positions (< compress_lens) of the kept blocks;
        what the jnp reference of a Reindex layer applies.
      block_ids: [..., topk_blocks] int32 ids of the kept blocks in ascending order, then −1;
        what a pooled-scoring kernel reads.
    """

    mask: Bool[Array, "*batch n_pos"]
    block_ids: Int[Array, "*batch topk_blocks"]


def _resolve_reducer(reduce: str | BlockReducer) -> BlockReducer:
    if isinstance(reduce, str):
        if reduce not in BLOCK_REDUCERS:
            raise ValueError(f"reduce: expected one of {sorted(BLOCK_REDUCERS)}, got {reduce!r}")
        return BLOCK_REDUCERS[reduce]
    if callable(reduce):
        return reduce
    raise ValueError(
        f"reduce: expected a name in {sorted(BLOCK_REDUCERS)} or a BlockReducer, got {reduce!r}"
    )


def select_candidate_blocks(
    scores: Float[Array, "*batch n_pos"],
    compress_lens: Int[ArrayLike, "*batch"],
    topk_blocks: int,
    block_size: int,
    reduce: str | BlockReducer = "max",
) -> CandidatePool:
    """The candidate pool of DESIGN §3 step 3 (`v41_architecture.md` §4).

    1. Pad the positions with −inf to whole blocks of `block_size`.
    2. Block score = `reduce` over the block's valid positions (visible and scoring > −inf);
       a block without one scores −inf ("not reachable yet").
    3. Pin the block holding position compress_lens − 1 with +inf: it is only partly filled and
       could otherwise lose to an older full block. No pin when compress_lens = 0.
    4. Keep the top `topk_blocks` blocks scoring > −inf (ties: lowest block id, as `scoring.topk`).
    5. Expand to a mask of the kept blocks' visible positions.

    Positions ≥ compress_lens are treated as −inf whatever their score, so the pool never depends
    on scores a query cannot see. compress_lens = 0 gives an empty pool (mask all False, ids −1).

    Args:
      scores: [..., n_pos] float scores of the candidate source, −inf at invisible positions.
      compress_lens: integer, broadcastable to [...] (scores.shape[:-1]): visible positions per
        query row. Values are clipped to [0, n_pos].
      topk_blocks: number of blocks to keep (positive int); the pool holds at most
        topk_blocks·block_size positions.
      block_size: positions per block (positive int; 8 in V4.1).
      reduce: a name in `BLOCK_REDUCERS` ('max' | 'mean') or a `BlockReducer`.

    Returns:
      `CandidatePool(mask [..., n_pos] bool, block_ids [..., topk_blocks] int32)`.
    """
    scores = jnp.asarray(scores)
    require_dtype("scores", scores, "floating")
    require_min_ndim("scores", scores, 1, "[..., n_pos]")
    topk_blocks = require_positive_int("topk_blocks", topk_blocks)
    block_size = require_positive_int("block_size", block_size)
    reducer = _resolve_reducer(reduce)
    batch, n_pos = scores.shape[:-1], scores.shape[-1]
    lens = jnp.clip(as_lengths("compress_lens", compress_lens, batch), 0, n_pos)

    n_blocks = math.ceil(n_pos / block_size)
    padded = jnp.pad(
        scores.astype(jnp.float32),
        [(0, 0)] * len(batch) + [(0, n_blocks * block_size - n_pos)],
        constant_values=-jnp.inf,
    )
    # Padding sits at positions ≥ n_pos ≥ lens, so the visibility test excludes it too.
    valid = (padded > -jnp.inf) & (jnp.arange(n_blocks * block_size) < lens[..., None])
    padded = jnp.where(valid, padded, -jnp.inf)
    blocks = padded.reshape(*batch, n_blocks, block_size)
    valid = valid.reshape(*batch, n_blocks, block_size)
    block_scores = jnp.where(jnp.any(valid, axis=-1), reducer(blocks, valid), -jnp.inf)
    chex.assert_shape(block_scores, (*batch, n_blocks))

    newest = (lens - 1) // block_size
    pinned = (jnp.arange(n_blocks) == newest[..., None]) & (lens[..., None] > 0)
    block_scores = jnp.where(pinned, jnp.inf, block_scores)

    block_ids = topk_indices(block_scores, topk_blocks)
    mask = pool_mask_from_block_ids(block_ids, n_pos, block_size, lens)
    return CandidatePool(mask, block_ids)


def pool_mask_from_block_ids(
    block_ids: Int[Array, "*batch topk_blocks"],
    n_pos: int,
    block_size: int,
    compress_lens: Int[ArrayLike, "*batch"],
) -> Bool[Array, "*batch n_pos"]:
    """Expand compact block ids (−1 padded) to the per-position pool mask.

    Args:
      block_ids: [..., topk_blocks] integer block ids; entries outside [0, ceil(n_pos/block_size))
        (−1 padding in particular) are ignored, order and duplicates do not matter.
      n_pos: number of positions of the mask (Python int ≥ 0).
      block_size: positions per block (positive int).
      compress_lens: integer, broadcastable to [...] (block_ids.shape[:-1]); positions at or
        beyond it are False even inside a listed block.

    Returns:
      [..., n_pos] bool.
    """
    block_ids = jnp.asarray(block_ids)
    require_dtype("block_ids", block_ids, "integer")
    require_min_ndim("block_ids", block_ids, 1, "[..., topk_blocks]")
    n_pos = require_nonnegative_int("n_pos", n_pos)
    block_size = require_positive_int("block_size", block_size)
    lens = as_lengths("compress_lens", compress_lens, block_ids.shape[:-1])

    block_mask = indices_to_mask(block_ids, math.ceil(n_pos / block_size))
    mask = jnp.repeat(block_mask, block_size, axis=-1)[..., :n_pos]
    return mask & (jnp.arange(n_pos) < lens[..., None])
