"""The candidate source's scan at decode: one entry point over the project's `implementation=`
switch (`pallas_kernels.dispatch`).

    picks = candidate_source(k_packed, q, weights, lengths, topk_blocks=2048, index_topk=512)
    picks.block_ids   # [B, topk_blocks] the candidate pool
    picks.topk        # TopK [B, index_topk]: the source's own selection

- 'xla': `v41jax.ops.pool.candidate_source_scan`, the op's definition (unpack all S rows, score,
  select); any format, block size, head dim and score dtype.
- 'pallas' / 'pallas_interpret': every block of the cache that a query can see goes through the
  pooled-scoring Mosaic GPU kernel as one pool (`every_block`'s: block ids 0, 1, ... up to the
  query's last visible block, −1 after it, so a short row fetches nothing past its length; the
  kernel's `block_ids=None` mode, which computes them instead of reading them). The kernel reads
  the 68-byte rows once and never materializes the unpacked keys, which is what the XLA scan
  does (issue 16: 70.8 ms at 1 M x batch 64). Then, by the block reducer:
  - 'max' (V4.1's): the kernel reduces each block itself and writes only the block maxima
    (`kernel_mgpu.pooled_block_max_mgpu`: 4 B per 8 rows of 68 B); the pool is the top
    `topk_blocks` of them once pinned (`ops.pool.pin_newest_block`), and the source's own top-k
    lies inside its best `index_topk` blocks by max (found among the pool's blocks, which hold
    them: `_best_blocks`), which the kernel scores again position by position (`index_topk`·8
    rows per query) for `ops.pool.pool_topk_from_scores`;
  - any other reducer: the kernel writes one f32 score per position and `selections` makes both
    picks from them.
  Every top-k is `pallas_kernels.topk`'s (the same picks as the definition's sort, which it
  runs over the best blocks by max only). What the route takes is the pooled kernel's
  `supports`.

Selections: the same rules in every implementation (`tie_order`; the pool pins the block of the
newest visible position; the source's own top-k drops −inf picks). The kernel's scores differ
from the definition's in the last bits (f16 products, wgmma's summation order), so picks whose
scores tie within that rounding may differ; exactly equal scores (equal rows) resolve by the tie
rule in both. Decode only: no gradient.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float, Int, UInt8

from pallas_kernels import dispatch
from pallas_kernels.pooled_scoring import kernel_mgpu
from pallas_kernels.topk import api as topk_api
from v41jax.ops import pool
from v41jax.ops.pool import BlockReducer, SourceSelection


def supports(
    implementation: str,
    *,
    fmt: str,
    dim: int,
    block_size: int,
    n_heads: int,
    score_dtype: str = "float32",
) -> dispatch.Support:
    """Whether `implementation` takes the source scan of `n_heads` queries of `dim` over packed
    `fmt` keys in blocks of `block_size` with `score_dtype` scores ('xla' takes everything; the
    kernel route: the pooled-scoring kernel's `supports`). Every block reducer and tie order is
    taken: the selections run after the scores."""
    dispatch.check_implementation(implementation)
    if implementation == "xla":
        return dispatch.Support("xla")
    return kernel_mgpu.supports(
        fmt=fmt, dim=dim, block_size=block_size, n_heads=n_heads, score_dtype=score_dtype
    )


def every_block(lengths: Int[Array, " batch"], n_pos: int, block_size: int) -> Int[Array, "b nb"]:
    """Block ids 0 … ceil(S / block_size) − 1 for each query, −1 from the first block holding
    no visible position (≥ ceil(lengths / block_size)): the whole cache as one pool."""
    n_blocks = -(-n_pos // block_size)
    ids = jnp.arange(n_blocks, dtype=jnp.int32)
    visible_blocks = -(-jnp.clip(jnp.asarray(lengths, jnp.int32), 0, n_pos) // block_size)
    return jnp.where(ids < visible_blocks[:, None], ids, -1)


# The route's tuning of the pooled-scoring kernel. Over every block, 32 tiles × 2 stages beat that
# kernel's default (32 × 4) by 2.5–2.8 % at 64 K, 256 K and 1 M keys × batch 64 on the H200
# (`bench --tune --skip-ablations`, results/tune_source_scan_h200_2026-12-04_contexts_*.json);
# 16 × 4 was 1.7 % faster still at 64 K only.
SCAN_CONFIG = kernel_mgpu.TuningConfig(tiles_per_cta=32, num_stages=2)


def candidate_source(
    k_packed: UInt8[Array, "batch seq row_bytes"],
    q: Float[Array, "batch heads dim"],
    weights: Float[Array, "batch heads"],
    lengths: Int[Array, " batch"],
    *,
    topk_blocks: int,
    index_topk: int,
    block_size: int = 8,
    fmt: str = "mxfp4",
    reduce: str | BlockReducer = "max",
    implementation: str = "xla",
    config: kernel_mgpu.TuningConfig | None = None,
    score_dtype: str = "float32",
    tie_order: str = "oldest",
) -> SourceSelection:
    """The candidate source's pool and own top-k for one decode query per sequence.

    Args:
      k_packed: [B, S, row_bytes] uint8 packed index keys per sequence (`ops.formats.pack`).
      q: [B, H, D] indexer queries (already fake-quantized); weights: [B, H] head weights.
      lengths: [B] int visible positions per query.
      topk_blocks: blocks the pool keeps (`candidate_topk_blocks`); index_topk: the source's
        own picks.
      block_size: positions per block; fmt: packed format of `k_packed`.
      reduce: the block reducer ('max' | 'mean' | 'top2', or a `ops.pool.BlockReducer`).
      implementation: 'xla' | 'pallas' | 'pallas_interpret' (`pallas_kernels.dispatch`).
      config: tuning of the pooled-scoring kernel (default `SCAN_CONFIG`).
      score_dtype: 'float32' | 'bfloat16' (the kernel route: float32, `supports`).
      tie_order: 'oldest' | 'newest', for the blocks and the positions.

    Returns:
      `ops.pool.SourceSelection(block_ids, topk)`, as `ops.pool.candidate_source_scan`.
    """
    dispatch.check_implementation(implementation)
    k_packed, q, weights = jnp.asarray(k_packed), jnp.asarray(q), jnp.asarray(weights)
    lengths = jnp.asarray(lengths)
    selection = dict(
        topk_blocks=topk_blocks,
        index_topk=index_topk,
        block_size=block_size,
        reduce=reduce,
        tie_order=tie_order,
    )
    if implementation == "xla" or q.shape[0] == 0 or k_packed.shape[1] == 0:
        return pool.candidate_source_scan(
            k_packed, q, weights, lengths, fmt=fmt, score_dtype=score_dtype, **selection
        )
    pool.check_pooled_scores_args(k_packed, q, weights, None, lengths, block_size, fmt)
    supported = supports(
        implementation,
        fmt=fmt,
        dim=q.shape[-1],
        block_size=block_size,
        n_heads=q.shape[1],
        score_dtype=score_dtype,
    )
    if not supported:
        raise supported.error()
    n_pos = k_packed.shape[1]
    lengths = jnp.clip(lengths, 0, n_pos)
    words = kernel_mgpu.packed_words(k_packed)  # once: it copies a cache of S % 8 != 0
    kernel = dict(
        n_pos=n_pos,
        config=config or SCAN_CONFIG,
        interpret=dispatch.interpret(implementation),
    )
    # block_ids=None: every block of the cache, `every_block`'s pool without its ids.
    if not (reduce == "max" or reduce is pool.block_max):
        scores = kernel_mgpu.pooled_scores_mgpu(words, q, weights, None, lengths, **kernel)
        return selections(scores[:, :n_pos], lengths, implementation=implementation, **selection)

    select = functools.partial(topk_api.topk, implementation=implementation)
    maxima = kernel_mgpu.pooled_block_max_mgpu(words, q, weights, None, lengths, **kernel)
    block_ids = _pool_blocks(maxima, lengths, topk_blocks, block_size, tie_order, select, pin=True)
    best = _best_blocks(maxima, block_ids, min(index_topk, maxima.shape[1]), tie_order, select)
    slot_scores = kernel_mgpu.pooled_scores_mgpu(words, q, weights, best, lengths, **kernel)
    own = pool.pool_topk_from_scores(
        slot_scores,
        best,
        index_topk,
        block_size=block_size,
        tie_order=tie_order,
        select=select,
        ascending_ids=True,  # `_best_blocks`' ids ascend
    )
    return SourceSelection(block_ids, own)


def selections(
    scores: Float[Array, "batch n_pos"],
    lengths: Int[Array, " batch"],
    *,
    topk_blocks: int,
    index_topk: int,
    block_size: int = 8,
    reduce: str | BlockReducer = "max",
    tie_order: str = "oldest",
    implementation: str = "xla",
) -> SourceSelection:
    """The candidate source's two selections from its scores of every position (< lengths).

    'xla': the definition's, `ops.pool.source_selection` (two sort-based top-k, one over every
    position). The kernel implementations: both by `pallas_kernels.topk` (through the best
    blocks by max, never a sort of every position). The same picks from the same scores."""
    dispatch.check_implementation(implementation)
    rule = dict(block_size=block_size, reduce=reduce, tie_order=tie_order)
    if implementation == "xla":
        return pool.source_selection(
            scores, lengths, topk_blocks=topk_blocks, index_topk=index_topk, **rule
        )
    select = functools.partial(topk_api.topk, implementation=implementation)
    if topk_blocks:
        blocks = pool.block_scores(scores, lengths, block_size, reduce)
    else:  # no pool (a Full layer that is not the candidate source): no block scores to make
        blocks = jnp.zeros((scores.shape[0], 0), jnp.float32)
    block_ids = _pool_blocks(blocks, lengths, topk_blocks, block_size, tie_order, select)
    visible = jnp.arange(scores.shape[-1]) < jnp.asarray(lengths)[:, None]
    own = select(jnp.where(visible, scores, -jnp.inf), index_topk, tie_order=tie_order)
    return SourceSelection(block_ids, own)


def _best_blocks(maxima, pool_ids, k, tie_order, select):
    """The top k blocks by raw block max (`select(maxima, k).indices`), taken from the pool's
    blocks when that gives the same picks: a top-k of its topk_blocks maxima instead of all
    S / 8 (at 1 M tokens, 2,048 scores instead of 131,072 per query).

    Why the pool holds them: it is the pinned block plus the best topk_blocks − 1 others by the
    capped maxima (`ops.pool.pin_newest_block`), which rank the unpinned blocks as the raw
    maxima do unless one of them is +inf (the cap to float32's largest changes only +inf; a NaN
    maximum ranks as −inf in both). Then a block among the best k ≤ topk_blocks − 1 by raw max
    ranks at most k among the unpinned blocks, so the pool holds it; and the pool's ids are
    ascending, so ties between its slots resolve as between the blocks.

    The check is made on the pool's own maxima: an unpinned +inf block caps to float32's
    largest, the top capped rank after the pin, so the pool then holds a block whose raw max is
    at least that (itself, or one it ties with). Where any pool block's raw max reaches float32's
    largest, or k ≥ topk_blocks, every block is ranked again.

    The ids ascend, then −1, either way: a top-k's picks, or the ascending pool's at ascending
    slots."""

    def every_block():
        return select(maxima, k, tie_order=tie_order).indices

    if k == 0 or k >= pool_ids.shape[-1]:
        return every_block()

    in_pool = pool_ids >= 0
    pool_maxima = jnp.take_along_axis(maxima, jnp.maximum(pool_ids, 0), axis=-1)
    pool_maxima = jnp.where(in_pool, pool_maxima, -jnp.inf)

    def from_pool():
        slots = select(pool_maxima, k, tie_order=tie_order)
        chosen = jnp.take_along_axis(pool_ids, jnp.maximum(slots.indices, 0), axis=-1)
        return jnp.where(slots.indices >= 0, chosen, -1)

    capped = jnp.any(pool_maxima >= jnp.finfo(jnp.float32).max)
    return lax.cond(capped, every_block, from_pool)


def _pool_blocks(blocks, lengths, topk_blocks, block_size, tie_order, select, *, pin=False):
    """The pool: the top `topk_blocks` of the block scores (`pin`: reduced block maxima, to be
    capped and pinned first, `ops.pool.pin_newest_block`); none without a pool."""
    if not topk_blocks:
        return jnp.zeros((blocks.shape[0], 0), jnp.int32)
    if pin:
        blocks = pool.pin_newest_block(blocks, lengths, block_size)
    return select(blocks, topk_blocks, tie_order=tie_order).indices
