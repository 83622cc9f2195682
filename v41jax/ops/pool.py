"""The candidate pool: the blocks of compressed positions a Reindex layer may score, and the
scoring of a pool's packed index keys.

DESIGN §3 step 3, `v41_architecture.md` §4. The candidate source (the last Full layer) scores
every visible position; `select_candidate_blocks` groups positions into blocks, scores each
block with a reducer ('max' in V4.1; 'mean' and 'top2' as ablations), always keeps the block
holding the newest visible position, and keeps the best `topk_blocks` reachable blocks. Reindex
layers then restrict their own top-k to the pool (`scoring.topk(..., mask=pool.mask)`); the
candidate source's own top-k is not restricted.

At decode a Reindex layer reads only the pool's packed index-key rows (DESIGN §6.1):
`pooled_scores` is that op's definition (the pooled-scoring kernel is tested against it),
`pooled_topk` its top-k, and `full_scan_topk` what the official reference does instead (score
every position, mask outside the pool), which selects the same positions. The candidate
source's own decode step over its packed keys is `candidate_source_scan` (every position
scored, then `source_selection`: the pool and the source's top-k).

A sequence-sharded cache (issue 15, DESIGN §8) has the same pool and picks, bit for bit:
`sharded_candidate_blocks`, `sharded_topk` (the candidate source's own top-k) and
`sharded_pooled_topk` split the positions over a mesh axis, take a local top-k of (score,
global id) per device and merge the all-gathered pairs.

The numerics switches of `scoring` reach every function here as keywords (defaults: the project's
rules): `score_dtype` the scores, `tie_order` every selection (blocks and positions), and
`neginf_picks` the position top-k inside a pool (a pool's blocks themselves are always chosen
among reachable ones only, in the reference too).

A new block reducer is one function `(scores, valid) -> block_scores` and one line in
`BLOCK_REDUCERS` (`ModelConfig.block_score` and the CLI read their choices from it); or pass the
function itself as `reduce=`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, ArrayLike, Bool, Float, Int, UInt8

from v41jax.ops import formats
from v41jax.ops.checks import (
    as_lengths,
    check_sequence_sharding,
    require_dtype,
    require_min_ndim,
    require_nonnegative_int,
    require_positive_int,
)
from v41jax.ops.scoring import (
    MAX_PADDED_K,
    NEGINF_PICKS,
    SCORE_DTYPES,
    TIE_ORDERS,
    TopK,
    fill_picks,
    gather_rows,
    index_scores,
    index_scores_at,
    indices_to_mask,
    ranked_topk,
    require_option,
    sorted_picks,
    topk,
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

Select = Callable[..., TopK]
"""A top-k selection called as `select(scores, k, tie_order=...)` that returns what
`scoring.topk(scores, k, tie_order=...)` returns (no mask, −inf picks dropped): `topk` itself, or
another implementation of the same picks (`pallas_kernels.topk`) that a kernel route passes to
`pool_topk_from_scores`."""


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


def block_top2_mean(
    scores: Float[Array, "*batch n_blocks block_size"],
    valid: Bool[Array, "*batch n_blocks block_size"],
) -> Float[Array, "*batch n_blocks"]:
    """Ablation, tried by none of the anchors: the mean of the block's two highest valid scores
    (the one score where a single position is valid).

    Why: evidence often spans two adjacent tokens (a marker and its digit, a key and its value),
    and such a block scores high on both, while one stray high score, which `block_max` takes at
    face value, is halved by its neighbour; yet a lone needle still counts half, where
    `block_mean` dilutes it by the block size.
    """
    masked = jnp.where(valid, scores, -jnp.inf)
    if masked.shape[-1] < 2:
        return masked[..., 0]
    first, second = (x[..., 0] for x in jnp.split(lax.top_k(masked, 2)[0], 2, axis=-1))
    # Halves first: exactly (first + second) / 2 in float32, and never overflows. The barrier
    # keeps XLA's simplifier from factoring 0.5·a + 0.5·b into 0.5·(a + b), which overflows
    # at ±3e38 (seen in one compiled program and not in another: the sharded pool then
    # disagreed with the whole-row one).
    half_first, half_second = lax.optimization_barrier((0.5 * first, 0.5 * second))
    both = half_first + half_second
    return jnp.where(jnp.sum(valid, axis=-1) >= 2, both, first)


BLOCK_REDUCERS: Mapping[str, BlockReducer] = MappingProxyType(
    {"max": block_max, "mean": block_mean, "top2": block_top2_mean}
)
"""Block reducers by the name `ModelConfig.block_score` uses (the config and the CLI read their
choices from here). Read-only: add entries here."""


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


def _block_scores(
    scores: Float[Array, "*batch n"],
    lens: Int[Array, "*batch"],
    block_size: int,
    reducer: BlockReducer,
    first_position: int | Int[Array, ""],
) -> Float[Array, "*batch n_blocks"]:
    """Steps 1–3 of `select_candidate_blocks` for the positions first_position … + n − 1 of a
    row (first_position a multiple of block_size; `lens` clipped to the row): each block's
    score, −inf where unreachable, capped below +inf, +inf at the block holding lens − 1.
    The one definition both the whole-row pool and the sharded one use."""
    batch, n = scores.shape[:-1], scores.shape[-1]
    n_blocks = math.ceil(n / block_size)
    padded = jnp.pad(
        scores.astype(jnp.float32),
        [(0, 0)] * len(batch) + [(0, n_blocks * block_size - n)],
        constant_values=-jnp.inf,
    )
    # Padding sits at positions ≥ n_pos ≥ lens, so the visibility test excludes it too.
    position = first_position + jnp.arange(n_blocks * block_size)
    valid = (padded > -jnp.inf) & (position < lens[..., None])
    padded = jnp.where(valid, padded, -jnp.inf)
    blocks = padded.reshape(*batch, n_blocks, block_size)
    valid = valid.reshape(*batch, n_blocks, block_size)
    block_scores = jnp.where(jnp.any(valid, axis=-1), reducer(blocks, valid), -jnp.inf)
    chex.assert_shape(block_scores, (*batch, n_blocks))
    return pin_newest_block(block_scores, lens, block_size, first_position)


def pin_newest_block(
    block_scores: Float[Array, "*batch n_blocks"],
    lens: Int[Array, "*batch"],
    block_size: int,
    first_position: int | Int[Array, ""] = 0,
) -> Float[Array, "*batch n_blocks"]:
    """Step 3 of `select_candidate_blocks` on reduced block scores (of the blocks from
    first_position, a multiple of block_size; `lens` clipped to the row): finite scores capped
    below +inf, +inf at the block holding lens − 1 (none when lens = 0). What a kernel that
    reduces the blocks itself (the source-scan route) applies after it."""
    newest = (lens - 1) // block_size
    block_id = first_position // block_size + jnp.arange(block_scores.shape[-1])
    pinned = (block_id == newest[..., None]) & (lens[..., None] > 0)
    # The pin must win: other blocks are capped below +inf (a +inf score would tie with the pin,
    # and a tie could go either way).
    block_scores = jnp.minimum(block_scores, jnp.finfo(jnp.float32).max)
    return jnp.where(pinned, jnp.inf, block_scores)


def block_scores(
    scores: Float[Array, "*batch n_pos"],
    compress_lens: Int[ArrayLike, "*batch"],
    block_size: int,
    reduce: str | BlockReducer = "max",
) -> Float[Array, "*batch n_blocks"]:
    """The block scores `select_candidate_blocks` ranks (its steps 1–3, same arguments): each
    block's `reduce` over its valid positions, −inf where it has none, finite scores capped
    below +inf, and +inf at the pinned block holding compress_lens − 1."""
    scores = jnp.asarray(scores)
    require_dtype("scores", scores, "floating")
    require_min_ndim("scores", scores, 1, "[..., n_pos]")
    block_size = require_positive_int("block_size", block_size)
    batch, n_pos = scores.shape[:-1], scores.shape[-1]
    lens = jnp.clip(as_lengths("compress_lens", compress_lens, batch), 0, n_pos)
    return _block_scores(scores, lens, block_size, _resolve_reducer(reduce), first_position=0)


def select_candidate_blocks(
    scores: Float[Array, "*batch n_pos"],
    compress_lens: Int[ArrayLike, "*batch"],
    topk_blocks: int,
    block_size: int,
    reduce: str | BlockReducer = "max",
    *,
    tie_order: str = "oldest",
) -> CandidatePool:
    """The candidate pool of DESIGN §3 step 3 (`v41_architecture.md` §4).

    1. Pad the positions with −inf to whole blocks of `block_size`.
    2. Block score = `reduce` over the block's valid positions (visible and scoring > −inf);
       a block without one scores −inf ("not reachable yet").
    3. Pin the block holding position compress_lens − 1 with +inf: it is only partly filled and
       could otherwise lose to an older full block. No pin when compress_lens = 0.
    4. Keep the top `topk_blocks` blocks scoring > −inf (ties: `tie_order`, as `scoring.topk`:
       the lowest block ids by default, the highest with 'newest').
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
      reduce: a name in `BLOCK_REDUCERS` ('max' | 'mean' | 'top2') or a `BlockReducer`.
      tie_order: 'oldest' | 'newest' (`scoring.TIE_ORDERS`): which of equal block scores win.

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

    block_scores = _block_scores(scores, lens, block_size, reducer, first_position=0)
    block_ids = topk_indices(block_scores, topk_blocks, tie_order=tie_order)
    mask = pool_mask_from_block_ids(block_ids, n_pos, block_size, lens)
    return CandidatePool(mask, block_ids)


def _merge_gathered_topk(
    values: Float[Array, "batch n"], ids: Int[Array, "batch n"], k: int, tie_order: str
) -> TopK:
    """The merge of the sequence-sharded selections: every device's (score, global id) pairs,
    all-gathered, ranked by score, then by id in `tie_order` (`topk`'s order); the top `k`
    with a score > −inf and an id >= 0, as `sorted_picks` orders them, padded to `k` with
    (−1, −inf). Dropped local picks (−1, −inf) rank last and stay dropped."""
    id_key = ids if tie_order == "oldest" else -ids
    neg, _, ids = lax.sort((-values, id_key, ids), dimension=-1, num_keys=2)
    n_keep = min(k, ids.shape[-1])
    neg, ids = neg[..., :n_keep], ids[..., :n_keep]
    picks = sorted_picks(ids, -neg, (-neg > -jnp.inf) & (ids >= 0))
    pad = ((0, 0), (0, k - n_keep))
    return TopK(
        jnp.pad(picks.indices, pad, constant_values=-1),
        jnp.pad(picks.scores, pad, constant_values=-jnp.inf),
    )


def sharded_candidate_blocks(
    scores: Float[Array, "batch n_pos"],
    compress_lens: Int[ArrayLike, " batch"],
    topk_blocks: int,
    block_size: int,
    reduce: str | BlockReducer = "max",
    *,
    mesh: jax.sharding.Mesh,
    axis: str,
    batch_axis: str | None = None,
    tie_order: str = "oldest",
) -> CandidatePool:
    """`select_candidate_blocks` with the positions sharded over the mesh axis `axis`: the same
    pool, bit for bit (ids, order and ties), for a sequence-sharded cache (issue 15).

    Each device scores the blocks of its contiguous slice of positions (`_block_scores`, the one
    definition), keeps its own top `topk_blocks` as (score, global block id) pairs, and an
    all-gather over `axis` brings every device's pairs together; the merge ranks them by score,
    then by block id in `tie_order`, and keeps the top `topk_blocks` reachable ones. A block of
    the global top k is in its own device's top k (the device ranks by the same total order),
    so the merge sees every block it needs: per query row, devices exchange 8 bytes × k × the
    number of devices, not the scores.

    Args:
      scores: [B, n_pos] candidate-source scores; n_pos must split into equal slices of whole
        blocks over `axis` (n_pos % (block_size · mesh.shape[axis]) == 0).
      compress_lens, topk_blocks, block_size, reduce, tie_order: as `select_candidate_blocks`.
      mesh: the device mesh; axis: its axis the positions are sharded over; batch_axis: an
        optional mesh axis the rows are sharded over (B divisible by its size).

    Returns:
      `CandidatePool(mask [B, n_pos], block_ids [B, topk_blocks])`, equal to
      `select_candidate_blocks(scores, compress_lens, ...)`.
    """
    scores = jnp.asarray(scores)
    require_dtype("scores", scores, "floating")
    if scores.ndim != 2:
        raise ValueError(f"scores: expected shape [B, n_pos], got {scores.shape}")
    topk_blocks = require_positive_int("topk_blocks", topk_blocks)
    block_size = require_positive_int("block_size", block_size)
    tie_order = require_option("tie_order", tie_order, TIE_ORDERS)
    reducer = _resolve_reducer(reduce)
    batch, n_pos = scores.shape
    n_local = check_sequence_sharding(
        "scores", "n_pos", scores.shape, block_size, mesh, axis, batch_axis
    )
    lens = jnp.clip(as_lengths("compress_lens", compress_lens, (batch,)), 0, n_pos)
    k_local = min(topk_blocks, n_local // block_size)

    def local(scores, lens):
        first = lax.axis_index(axis) * n_local
        block_scores = _block_scores(scores, lens, block_size, reducer, first_position=first)
        # As `topk`: −0.0 ties +0.0 (block scores are never NaN: NaN positions are not valid).
        block_scores = jnp.where(block_scores == 0, 0.0, block_scores)
        values, ids = ranked_topk(block_scores, k_local, tie_order)
        ids = ids + first // block_size
        return (
            lax.all_gather(values, axis, axis=1, tiled=True, to="invarying"),
            lax.all_gather(ids, axis, axis=1, tiled=True, to="invarying"),
        )

    rows = P(batch_axis)
    values, ids = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(P(batch_axis, axis), rows),
        out_specs=(P(batch_axis, None), P(batch_axis, None)),
    )(scores, lens)
    block_ids = _merge_gathered_topk(values, ids, topk_blocks, tie_order).indices
    mask = pool_mask_from_block_ids(block_ids, n_pos, block_size, lens)
    return CandidatePool(mask, block_ids)


def sharded_topk(
    scores: Float[Array, "batch n_pos"],
    k: int,
    *,
    mesh: jax.sharding.Mesh,
    axis: str,
    batch_axis: str | None = None,
    tie_order: str = "oldest",
) -> TopK:
    """`scoring.topk(scores, k, tie_order=...)` (no mask: the candidate source's own top-k over
    every position) with the positions sharded over the mesh axis `axis`: the same picks and
    scores, bit for bit (ties, −inf, NaN and ±0 included), for a sequence-sharded cache
    (issue 15).

    Each device ranks its own positions as `topk` does (NaN and −inf never picked, −0.0 ties
    +0.0, `tie_order` among equal scores) and keeps its best k as (score, global position)
    pairs; an all-gather over `axis` and the merge (`_merge_gathered_topk`) rank them by the
    same total order. A position of the global top k is in its own device's top k, so the merge
    sees every pick it needs: per row, devices exchange 8 bytes × k × the number of devices.

    Args:
      scores: [B, n_pos] float scores; n_pos must split into equal slices over `axis`.
      k: picks per row (as `topk`: may exceed n_pos, up to `MAX_PADDED_K`).
      mesh: the device mesh; axis: its axis the positions are sharded over; batch_axis: an
        optional mesh axis the rows are sharded over (B divisible by its size).
      tie_order: 'oldest' | 'newest' (`TIE_ORDERS`).

    Returns:
      `TopK(indices [B, k] int32 positions ascending then −1, scores [B, k] float32)`, equal to
      `topk(scores, k, tie_order=tie_order)`.
    """
    scores = jnp.asarray(scores)
    require_dtype("scores", scores, "floating")
    if scores.ndim != 2:
        raise ValueError(f"scores: expected shape [B, n_pos], got {scores.shape}")
    k = require_nonnegative_int("k", k)
    tie_order = require_option("tie_order", tie_order, TIE_ORDERS)
    batch, n_pos = scores.shape
    if k > max(n_pos, MAX_PADDED_K):
        raise ValueError(f"k: expected at most max(n_pos={n_pos}, {MAX_PADDED_K}) picks, got {k}")
    n_local = check_sequence_sharding("scores", "n_pos", scores.shape, 1, mesh, axis, batch_axis)
    k_local = min(k, n_local)

    def local(scores):
        scores = scores.astype(jnp.float32)
        # As `topk`: NaN counts as −inf, −0.0 ties +0.0.
        scores = jnp.where(jnp.isnan(scores), -jnp.inf, jnp.where(scores == 0, 0.0, scores))
        values, ids = ranked_topk(scores, k_local, tie_order)
        ids = ids + lax.axis_index(axis) * n_local
        return (
            lax.all_gather(values, axis, axis=1, tiled=True, to="invarying"),
            lax.all_gather(ids, axis, axis=1, tiled=True, to="invarying"),
        )

    if k_local and batch:
        values, ids = jax.shard_map(
            local,
            mesh=mesh,
            in_specs=P(batch_axis, axis),
            out_specs=(P(batch_axis, None), P(batch_axis, None)),
        )(scores)
    else:  # nothing to pick (a zero-size shard_map operand does not compile)
        values = jnp.zeros((batch, 0), jnp.float32)
        ids = jnp.zeros((batch, 0), jnp.int32)
    return _merge_gathered_topk(values, ids, k, tie_order)


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


# --- scoring inside the pool: a Reindex layer's decode step (DESIGN §6.1) ---


def check_pooled_scores_args(
    k_packed: Array,
    q: Array,
    weights: Array,
    block_ids: Array | None,
    lengths: Array,
    block_size: int,
    fmt: str,
) -> None:
    """The argument checks of `pooled_scores`, which every implementation of the op runs (the
    kernels included): each names the bad argument, the expected and the received value.
    `block_ids=None` checks the rest (`candidate_source_scan`, which scores every block)."""
    for name, x, ndim, layout in (
        ("k_packed", k_packed, 3, "[B, S, row_bytes]"),
        ("q", q, 3, "[B, H, D]"),
        ("weights", weights, 2, "[B, H]"),
        ("block_ids", block_ids, 2, "[B, NB]"),
        ("lengths", lengths, 1, "[B]"),
    ):
        if x is not None and x.ndim != ndim:
            raise ValueError(f"{name}: expected shape {layout}, got {x.shape}")
    batch, n_heads, dim = q.shape
    if k_packed.dtype != jnp.uint8:
        raise ValueError(f"k_packed: expected uint8 packed rows, got {k_packed.dtype}")
    row_bytes = formats.packed_row_bytes(fmt, dim)
    if k_packed.shape[0] != batch or k_packed.shape[2] != row_bytes:
        raise ValueError(
            f"k_packed: expected shape ({batch}, S, {row_bytes}) (q's batch and "
            f"packed_row_bytes({fmt!r}, {dim})), got {k_packed.shape}"
        )
    if weights.shape != (batch, n_heads):
        raise ValueError(f"weights: expected shape {(batch, n_heads)}, got {weights.shape}")
    if block_ids is not None and (
        block_ids.shape[0] != batch or not jnp.issubdtype(block_ids.dtype, jnp.integer)
    ):
        raise ValueError(f"block_ids: expected integer [{batch}, NB], got {block_ids.dtype}")
    if lengths.shape != (batch,) or not jnp.issubdtype(lengths.dtype, jnp.integer):
        raise ValueError(f"lengths: expected integer [{batch}], got {lengths.dtype}{lengths.shape}")
    require_positive_int("block_size", block_size)


def pool_positions(
    block_ids: Int[Array, "*batch n_blocks"], block_size: int
) -> Int[Array, "*batch n_pool"]:
    """Position of every pool slot in block order: block_ids[..., i]·block_size + j; −1 where
    the block id is −1 (or negative). Shape [..., NB·block_size], int32."""
    block_ids = jnp.asarray(block_ids, jnp.int32)
    pos = block_ids[..., None] * block_size + jnp.arange(block_size, dtype=jnp.int32)
    pos = jnp.where(block_ids[..., None] >= 0, pos, -1)
    return pos.reshape(*block_ids.shape[:-1], block_ids.shape[-1] * block_size)


def slot_positions(
    block_ids: Int[Array, "*batch n_blocks"], slots: Int[Array, "*batch k"], block_size: int
) -> Int[Array, "*batch k"]:
    """`pool_positions(block_ids, block_size)` at the given pool slots (−1 slots give −1):
    each slot's block id gathered, then offset, so the [..., NB·block_size] positions are never
    formed (on the GPU the gather reads the ids as they are, and XLA need not materialise the
    pool's positions before it)."""
    block_ids = jnp.asarray(block_ids, jnp.int32)
    safe = jnp.maximum(slots, 0)
    block = jnp.take_along_axis(block_ids, safe // block_size, axis=-1)
    return jnp.where((slots >= 0) & (block >= 0), block * block_size + safe % block_size, -1)


def pooled_scores(
    k_packed: UInt8[Array, "batch seq row_bytes"],
    q: Float[Array, "batch heads dim"],
    weights: Float[Array, "batch heads"],
    block_ids: Int[Array, "batch n_blocks"],
    lengths: Int[Array, " batch"],
    *,
    block_size: int = 8,
    fmt: str = "mxfp4",
    score_dtype: str = "float32",
) -> Float[Array, "batch n_pool"]:
    """Index scores of every slot of each query's candidate pool, in block order (DESIGN §6.1).

    For query b and pool slot i·block_size + j (the i-th kept block, the j-th position in it) the
    position is p = block_ids[b, i]·block_size + j and

        score[b, i·block_size + j] = Σ_h w[b, h]·ReLU(q[b, h]·k[b, p])      (`index_scores`)

    with k[b, p] the packed row `k_packed[b, p]` unpacked. Only the pool's rows are gathered and
    unpacked: what a kernel reads. The scores stay in block order (the compact layout a kernel
    writes); `pool_topk_from_scores` maps the best ones back to positions.

    Args:
      k_packed: [B, S, row_bytes] uint8 packed index keys of each sequence (`formats.pack`).
      q: [B, H, D] indexer queries (already fake-quantized), any float dtype.
      weights: [B, H] head weights (already scaled).
      block_ids: [B, NB] int candidate blocks, −1 padded (`CandidatePool.block_ids`).
      lengths: [B] int visible positions per query.
      block_size: positions per block (8 in V4.1).
      fmt: packed format of `k_packed` ('mxfp4' for the index keys).
      score_dtype: 'float32' | 'bfloat16' (`scoring.index_scores`).

    Returns:
      [B, NB·block_size] float32: slot i·block_size + j scores position block_ids[b, i]·
      block_size + j; −inf for −1 blocks and positions ≥ lengths[b] or ≥ S.
    """
    k_packed, q, weights = jnp.asarray(k_packed), jnp.asarray(q), jnp.asarray(weights)
    block_ids, lengths = jnp.asarray(block_ids), jnp.asarray(lengths)
    check_pooled_scores_args(k_packed, q, weights, block_ids, lengths, block_size, fmt)
    pos = pool_positions(block_ids, block_size)
    return _slot_scores(k_packed, q, weights, pos, lengths, fmt, score_dtype, first_position=0)


def _slot_scores(
    k_packed: UInt8[Array, "batch rows row_bytes"],
    q: Float[Array, "batch heads dim"],
    weights: Float[Array, "batch heads"],
    pos: Int[Array, "batch n_pool"],
    lengths: Int[Array, " batch"],
    fmt: str,
    score_dtype: str,
    first_position: int | Int[Array, ""],
) -> Float[Array, "batch n_pool"]:
    """`pooled_scores` of the pool slots at positions `pos` held by `k_packed`, the rows of
    positions first_position … + rows − 1; −inf at every other slot (−1, invisible, or held
    elsewhere). The one definition the whole cache and a device's slice of it use."""
    local = pos - first_position
    here = (pos >= 0) & (local < k_packed.shape[1]) & (local >= 0)
    k = formats.unpack(gather_rows(k_packed, jnp.where(here, local, -1)), fmt, q.shape[-1])
    pos = jnp.where(here, pos, -1)
    return index_scores_at(q, weights, k, pos, lengths, score_dtype=score_dtype)


def _out_of_pool_positions(
    block_ids: Int[Array, "*batch n_blocks"],
    lengths: Int[ArrayLike, "*batch"],
    n: int,
    block_size: int,
    tie_order: str,
) -> Int[Array, "*batch n_candidates"]:
    """Visible positions (< lengths) outside the pool's blocks, in `tie_order` (ascending from 0
    for 'oldest', descending from lengths − 1 for 'newest'), −1 in holes and beyond: at least the
    first n of them when that many exist. O(NB·log NB + n) per query, no scan of the positions.

    In the tie order's direction, the j-th block id missing from the sorted distinct pool ids
    b_0 < b_1 < … is j + #{i : b_i − i ≤ j}."""
    block_ids = jnp.asarray(block_ids, jnp.int32)
    lens = as_lengths("lengths", lengths, block_ids.shape[:-1])
    n_visible = -(-lens // block_size)[..., None]
    ids = block_ids if tie_order == "oldest" else n_visible - 1 - block_ids
    big = jnp.iinfo(jnp.int32).max // 2
    ids = jnp.sort(jnp.where((block_ids >= 0) & (block_ids < n_visible), ids, big), axis=-1)
    repeated = jnp.concatenate(
        [jnp.zeros_like(ids[..., :1], bool), ids[..., 1:] == ids[..., :-1]], axis=-1
    )
    ids = jnp.sort(jnp.where(repeated, big, ids), axis=-1)
    gaps = jnp.where(ids < big, ids - jnp.arange(ids.shape[-1], dtype=jnp.int32), big)
    wanted = jnp.arange(-(-n // block_size) + 1, dtype=jnp.int32)
    count = jnp.vectorize(
        lambda g: jnp.searchsorted(g, wanted, side="right"), signature="(m)->(j)"
    )(gaps)
    missing = wanted + count.astype(jnp.int32)
    ok = missing < n_visible
    blocks = missing if tie_order == "oldest" else n_visible - 1 - missing
    offsets = jnp.arange(block_size, dtype=jnp.int32)
    if tie_order == "newest":
        offsets = block_size - 1 - offsets
    pos = blocks[..., None] * block_size + offsets
    ok = ok[..., None] & (pos < lens[..., None, None])
    pos = jnp.where(ok, pos, -1)
    return pos.reshape(*pos.shape[:-2], pos.shape[-2] * block_size)


def pool_topk_from_scores(
    scores: Float[Array, "*batch n_pool"],
    block_ids: Int[Array, "*batch n_blocks"],
    k: int,
    *,
    block_size: int = 8,
    lengths: Int[ArrayLike, "*batch"] | None = None,
    tie_order: str = "oldest",
    neginf_picks: str = "drop",
    select: Select = topk,
    ascending_ids: bool = False,
) -> TopK:
    """The k best pool slots as positions, sorted ascending, −1 padded (`scoring.topk`'s rules).

    The same picks as `scoring.topk(scores over every position, k, pool mask, ...)`:
    - ties (`tie_order`) go to the lowest slot ('oldest') or the highest ('newest'), which is the
      lowest (highest) position when `block_ids` is ascending (as `CandidatePool` gives it);
    - with `neginf_picks='keep'`, when fewer than k slots score > −inf, the selection is completed
      with visible positions (< `lengths`, required then) outside the pool's blocks, in the tie
      order (the lowest positions first, or the highest), scores −inf: the reference's rule.

    `select` is the top-k of the slots: `scoring.topk`, or an implementation of the same picks
    (`Select`; the kernel routes pass `pallas_kernels.topk`'s).

    `ascending_ids=True` is the caller's promise that each row's valid block ids ascend (a
    `CandidatePool`'s do, and a `TopK`'s indices): the slot picks, ascending, are then in
    position order, and their sort by position is skipped (a sort of k per row: 6.3 µs of the
    pooled top-k at batch 64 on the H200, BENCHMARKS.md). Unsorted ids under that promise would
    leave the positions unsorted, which the debug mode's `invariants.check_selection` reports.

    Returns `TopK(indices [..., k] int32 positions, scores [..., k])`.
    """
    tie_order = require_option("tie_order", tie_order, TIE_ORDERS)
    picks = select(scores, k, tie_order=tie_order)
    return _slot_picks_to_positions(
        picks, block_ids, k, block_size, lengths, tie_order, neginf_picks, ascending_ids
    )


def _slot_picks_to_positions(
    picks: TopK,
    block_ids: Int[Array, "*batch n_blocks"],
    k: int,
    block_size: int,
    lengths: Int[ArrayLike, "*batch"] | None,
    tie_order: str,
    neginf_picks: str,
    ascending_ids: bool = False,
) -> TopK:
    """The second half of `pool_topk_from_scores`: `topk`'s picks of pool slots (−1 padded) as
    positions sorted ascending, completed with out-of-pool positions under 'keep'."""
    positions = slot_positions(block_ids, picks.indices, block_size)
    if ascending_ids:  # ascending slots in ascending blocks: position order already
        picks = TopK(positions, picks.scores)
    else:  # unsorted block ids would leave the positions unsorted: sort, dropped picks last
        picks = sorted_picks(positions, picks.scores, positions >= 0)
    if require_option("neginf_picks", neginf_picks, NEGINF_PICKS) == "keep":
        if lengths is None:
            raise ValueError(
                "lengths: expected the visible positions of each query with "
                "neginf_picks='keep' (out-of-pool picks must be visible), got None"
            )
        if k:
            extra = _out_of_pool_positions(block_ids, lengths, k, block_size, tie_order)
            picks = fill_picks(picks, extra, k)
    return picks


def pooled_topk(
    k_packed: UInt8[Array, "batch seq row_bytes"],
    q: Float[Array, "batch heads dim"],
    weights: Float[Array, "batch heads"],
    block_ids: Int[Array, "batch n_blocks"],
    lengths: Int[Array, " batch"],
    k: int,
    *,
    block_size: int = 8,
    fmt: str = "mxfp4",
    score_dtype: str = "float32",
    tie_order: str = "oldest",
    neginf_picks: str = "drop",
) -> TopK:
    """Top-k positions of the pool: `pooled_scores`, then `pool_topk_from_scores` (the switches
    `score_dtype`, `tie_order`, `neginf_picks` as there).

    Returns `TopK(indices [B, k] int32 positions ascending then −1, scores [B, k] float32)`.
    """
    scores = pooled_scores(
        k_packed,
        q,
        weights,
        block_ids,
        lengths,
        block_size=block_size,
        fmt=fmt,
        score_dtype=score_dtype,
    )
    return pool_topk_from_scores(
        scores,
        block_ids,
        k,
        block_size=block_size,
        lengths=jnp.minimum(jnp.asarray(lengths), jnp.shape(k_packed)[1]),
        tie_order=tie_order,
        neginf_picks=neginf_picks,
    )


def sharded_pooled_topk(
    k_packed: UInt8[Array, "batch seq row_bytes"],
    q: Float[Array, "batch heads dim"],
    weights: Float[Array, "batch heads"],
    block_ids: Int[Array, "batch n_blocks"],
    lengths: Int[Array, " batch"],
    k: int,
    *,
    mesh: jax.sharding.Mesh,
    axis: str,
    batch_axis: str | None = None,
    block_size: int = 8,
    fmt: str = "mxfp4",
    score_dtype: str = "float32",
    tie_order: str = "oldest",
    neginf_picks: str = "drop",
) -> TopK:
    """`pooled_topk` with the packed index keys sharded by position over the mesh axis `axis`:
    the same picks and scores, bit for bit (ties, −inf and NaN included), for a
    sequence-sharded cache (issue 15).

    Each device scores the pool slots whose rows it holds (`_slot_scores`, the one definition;
    the other slots −inf) and takes its own `topk` of them, as (score, global slot) pairs; an
    all-gather over `axis` brings every device's pairs together and the merge ranks them by
    score, then by slot in `tie_order`: `topk`'s order over the whole pool. A slot of the global
    top k is in its own device's top k, so the merge sees every pick it needs; only a pick that
    scores > −inf is kept, and each such slot is scored by one device only. The slots then
    become positions as in `pool_topk_from_scores` (with its `neginf_picks='keep'` completion,
    which reads no keys). Per query row, devices exchange 8 bytes × k × the number of devices.

    Args:
      k_packed: [B, S, row_bytes] uint8 packed index keys; S must split into equal slices of
        whole blocks over `axis` (S % (block_size · mesh.shape[axis]) == 0).
      q, weights, block_ids, lengths, k, block_size, fmt, score_dtype, tie_order, neginf_picks:
        as `pooled_topk`; `block_ids` holds global block ids (−1 padded), the same on every
        device of `axis`.
      mesh: the device mesh; axis: its axis the positions are sharded over; batch_axis: an
        optional mesh axis the rows are sharded over (B divisible by its size).

    Returns:
      `TopK(indices [B, k] int32 positions ascending then −1, scores [B, k] float32)`, equal to
      `pooled_topk(k_packed, q, weights, block_ids, lengths, k, ...)`.
    """
    k_packed, q, weights = jnp.asarray(k_packed), jnp.asarray(q), jnp.asarray(weights)
    block_ids, lengths = jnp.asarray(block_ids), jnp.asarray(lengths)
    check_pooled_scores_args(k_packed, q, weights, block_ids, lengths, block_size, fmt)
    k = require_nonnegative_int("k", k)
    tie_order = require_option("tie_order", tie_order, TIE_ORDERS)
    neginf_picks = require_option("neginf_picks", neginf_picks, NEGINF_PICKS)
    require_option("score_dtype", score_dtype, SCORE_DTYPES)
    n_local = check_sequence_sharding(
        "k_packed", "S", k_packed.shape, block_size, mesh, axis, batch_axis
    )
    n_pool = block_ids.shape[-1] * block_size
    if k > max(n_pool, MAX_PADDED_K):
        raise ValueError(f"k: expected at most max(n_pool={n_pool}, {MAX_PADDED_K}) picks, got {k}")
    lengths = jnp.minimum(lengths, k_packed.shape[1])
    k_local = min(k, n_pool)

    def local(k_packed, q, weights, block_ids, lengths):
        first = lax.axis_index(axis) * n_local
        pos = pool_positions(block_ids, block_size)
        scores = _slot_scores(k_packed, q, weights, pos, lengths, fmt, score_dtype, first)
        picks = topk(scores, k_local, tie_order=tie_order)
        return (
            lax.all_gather(picks.scores, axis, axis=1, tiled=True, to="invarying"),
            lax.all_gather(picks.indices, axis, axis=1, tiled=True, to="invarying"),
        )

    rows = P(batch_axis)
    if k_local and k_packed.shape[0] and k_packed.shape[1]:
        values, slots = jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(P(batch_axis, axis), rows, rows, rows, rows),
            out_specs=(P(batch_axis, None), P(batch_axis, None)),
        )(k_packed, q, weights, block_ids, lengths)
    else:  # no slot, pick, row or key: nothing to score (and a zero-size shard_map operand
        # does not compile: XLA's CPU compiler crashes, or the all-gather is refused)
        values = jnp.zeros((q.shape[0], 0), jnp.float32)
        slots = jnp.zeros((q.shape[0], 0), jnp.int32)
    picks = _merge_gathered_topk(values, slots, k, tie_order)
    return _slot_picks_to_positions(
        picks, block_ids, k, block_size, lengths, tie_order, neginf_picks
    )


def full_scan_topk(
    k_packed: UInt8[Array, "batch seq row_bytes"],
    q: Float[Array, "batch heads dim"],
    weights: Float[Array, "batch heads"],
    block_ids: Int[Array, "batch n_blocks"],
    lengths: Int[Array, " batch"],
    k: int,
    *,
    block_size: int = 8,
    fmt: str = "mxfp4",
    score_dtype: str = "float32",
    tie_order: str = "oldest",
    neginf_picks: str = "drop",
) -> TopK:
    """What the official reference does instead of `pooled_topk`: unpack all S rows, score every
    position, mask outside the pool, top-k over all S. Selects the same positions (with the
    same switches).

    Returns `TopK(indices [B, k] int32 positions ascending then −1, scores [B, k] float32)`.
    """
    k_packed, q, weights = jnp.asarray(k_packed), jnp.asarray(q), jnp.asarray(weights)
    block_ids, lengths = jnp.asarray(block_ids), jnp.asarray(lengths)
    check_pooled_scores_args(k_packed, q, weights, block_ids, lengths, block_size, fmt)
    n_pos = k_packed.shape[1]
    keys = formats.unpack(k_packed, fmt, q.shape[-1])
    scores = index_scores(
        q[:, None], weights[:, None], keys, lengths[:, None], score_dtype=score_dtype
    )[:, 0]
    mask = pool_mask_from_block_ids(block_ids, n_pos, block_size, lengths)
    return topk(scores, k, mask, tie_order=tie_order, neginf_picks=neginf_picks)


class SourceSelection(NamedTuple):
    """What the candidate source selects for one decode query per sequence.

    Attributes:
      block_ids: [B, topk_blocks] int32 its candidate pool's blocks, ascending, then −1
        (`CandidatePool.block_ids`).
      topk: its own top-k over every visible position (unrestricted): `TopK(indices
        [B, index_topk] positions ascending then −1, scores [B, index_topk])`.
    """

    block_ids: Int[Array, "batch topk_blocks"]
    topk: TopK


def source_selection(
    scores: Float[Array, "batch n_pos"],
    lengths: Int[Array, " batch"],
    *,
    topk_blocks: int,
    index_topk: int,
    block_size: int = 8,
    reduce: str | BlockReducer = "max",
    tie_order: str = "oldest",
) -> SourceSelection:
    """The candidate source's two selections from its scores of every position: the pool
    (`select_candidate_blocks`' rule, without building its mask) and its own top-k
    (`scoring.topk`, no mask: −inf picks are dropped). Scores ≥ lengths are ignored."""
    blocks = block_scores(scores, lengths, block_size, reduce)
    block_ids = topk_indices(blocks, topk_blocks, tie_order=tie_order)
    position = jnp.arange(scores.shape[-1])
    visible = jnp.where(position < jnp.asarray(lengths)[..., None], scores, -jnp.inf)
    return SourceSelection(block_ids, topk(visible, index_topk, tie_order=tie_order))


def candidate_source_scan(
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
    score_dtype: str = "float32",
    tie_order: str = "oldest",
) -> SourceSelection:
    """The candidate source at decode, from its packed index keys: score every visible
    position (unpack all S rows, `index_scores`), then `source_selection`. The definition the
    source-scan route (`pallas_kernels.source_scan`) is checked against; `full_scan_topk` is
    the same scan for a Reindex layer's pool.

    Args:
      k_packed: [B, S, row_bytes] uint8 packed index keys per sequence (`formats.pack`).
      q: [B, H, D] indexer queries (already fake-quantized); weights: [B, H] head weights.
      lengths: [B] int visible positions per query (clipped to [0, S]).
      topk_blocks: blocks the pool keeps; index_topk: the source's own picks.
      block_size, fmt, reduce, score_dtype, tie_order: as `select_candidate_blocks`,
        `index_scores` and `scoring.topk`.
    """
    k_packed, q, weights = jnp.asarray(k_packed), jnp.asarray(q), jnp.asarray(weights)
    lengths = jnp.asarray(lengths)
    check_pooled_scores_args(k_packed, q, weights, None, lengths, block_size, fmt)
    lengths = jnp.clip(lengths, 0, k_packed.shape[1])
    keys = formats.unpack(k_packed, fmt, q.shape[-1])
    scores = index_scores(
        q[:, None], weights[:, None], keys, lengths[:, None], score_dtype=score_dtype
    )[:, 0]
    return source_selection(
        scores,
        lengths,
        topk_blocks=topk_blocks,
        index_topk=index_topk,
        block_size=block_size,
        reduce=reduce,
        tie_order=tie_order,
    )
