"""An exact top-k through the best blocks: the same picks as `scoring.topk`, sorting far fewer
scores (issue 16 item 2).

The k best of a row lie inside its k best blocks of 8 by block max, ties ranked by the same
rule (`tie_order`) among blocks as among positions. Why: every block that ranks above the
block of a pick e holds its own maximum, which ranks above e (a larger score, or the same score
at an older position under 'oldest', a newer one under 'newest'), so fewer than k blocks rank
above e's block. The selection therefore runs over the n/8 block maxima, then over the k·8
scores of the k best blocks, and recursively so while the blocks still outnumber k: at the
decode step's sizes (batch 64), the pool's 16,384 slots → 512 become sorts of 2,048 and 4,096
scores, and the block scores' 131,072 → 2,048 two sorts of 16,384, where XLA's `lax.top_k`
sorts every score (`bench.py`, BENCHMARKS.md: at 16,384 scores, the sort is 132 µs of the
pooled top-k's 217 µs).

`tests/test_topk_select.py` checks the picks against `scoring.topk` bit for bit.
"""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Float

from v41jax.ops import pool, scoring
from v41jax.ops.scoring import TopK

BLOCK = 8


def topk(
    scores: Float[Array, "*batch n"],
    k: int,
    *,
    tie_order: str,
    leaf,
    block: int = BLOCK,
) -> TopK:
    """`scoring.topk(scores, k, tie_order=tie_order)` (no mask, −inf picks dropped) through the
    best blocks of `block` (module docstring). `leaf(scores, k, tie_order=...)` selects where the
    blocks would not reduce the work (k ≥ the number of blocks): `scoring.topk` or another
    implementation of the same picks. The arguments are the caller's to check
    (`pallas_kernels.topk.topk` does): 0 ≤ k ≤ n.

    Returns `TopK(indices [..., k] ascending then −1, scores [..., k] float32, −inf at −1)`.
    """
    n = scores.shape[-1]
    n_blocks = -(-n // block)
    if k == 0 or n_blocks <= k:
        return leaf(scores, k, tie_order=tie_order)
    # NaN counts as −inf and −0.0 as +0.0, as in `scoring.topk`: the block maxima rank blocks by
    # the same scores the leaf ranks positions by.
    scores = scoring.ranking_scores(scores)
    pad = [(0, 0)] * (scores.ndim - 1) + [(0, n_blocks * block - n)]
    padded = jnp.pad(scores, pad, constant_values=-jnp.inf)
    block_max = jnp.max(padded.reshape(*scores.shape[:-1], n_blocks, block), axis=-1)
    best = topk(block_max, k, tie_order=tie_order, leaf=leaf, block=block).indices
    # The slots of the best blocks in position order (the ids ascend, −1 blocks last): the
    # leaf's tie rule over slots is its rule over positions.
    slots = pool.pool_positions(best, block)  # −1 in −1 blocks
    slot_scores = jnp.take_along_axis(padded, jnp.maximum(slots, 0), axis=-1)
    picks = leaf(jnp.where(slots >= 0, slot_scores, -jnp.inf), k, tie_order=tie_order)
    positions = jnp.take_along_axis(slots, jnp.maximum(picks.indices, 0), axis=-1)
    return TopK(jnp.where(picks.indices >= 0, positions, -1), picks.scores)
