"""Value invariants of the selections, checked across `jit` with checkify (debug mode).

Shapes and dtypes are asserted at trace time everywhere (chex and ValueErrors). Values cannot be
inspected under `jit`; these checks are staged into the computation with `checkify.check` and
reported when the caller runs it under `checkify.checkify` (what `prefill(..., debug=True)` and
`decode_step(..., debug=True)` do). They cost a few reductions per layer, so they are off by
default.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax.experimental import checkify
from jaxtyping import Array, Float, Int

from v41jax.ops.pool import CandidatePool


def check_selection(
    layer: int,
    topk: Int[Array, "*rows k"],
    compress_lens: Int[Array, "*rows"],
    pool: CandidatePool | None,
    *,
    block_size: int,
    restricted: bool,
    publishes_pool: bool,
    neginf_picks: str = "drop",
) -> None:
    """Stages the selection invariants of one index-source layer (DESIGN §3).

    - every pick is −1 or a visible position (< compress_lens);
    - picks are distinct (ascending, then −1 padding);
    - when `publishes_pool`: the pool holds visible positions only, and the block holding the
      newest visible position is in it (pinned) whenever something is visible;
    - when `restricted` (a Reindex layer after the candidate source): every pick is in the pool;
      with `neginf_picks='keep'` a pick may lie outside it only once every pool position is
      picked (`scoring.topk`).
    """
    valid = topk >= 0
    lens = compress_lens[..., None]
    checkify.check(
        jnp.all((topk >= -1) & (~valid | (topk < lens))),
        f"layer {layer}: a selected index is not < the visible length (compress_lens)",
    )
    ordered = (topk[..., 1:] > topk[..., :-1]) | ~valid[..., 1:]
    checkify.check(
        jnp.all(ordered & (valid[..., :-1] | ~valid[..., 1:])),
        f"layer {layer}: selected indices are not ascending and distinct with −1 padding last",
    )
    if pool is None:
        return
    mask = pool.mask
    n_pos = mask.shape[-1]
    if publishes_pool:
        visible = jnp.arange(n_pos) < lens
        checkify.check(
            jnp.all(~mask | visible),
            f"layer {layer}: the candidate pool holds a position the query cannot see",
        )
        newest = (compress_lens - 1) // block_size
        pinned = jnp.any(pool.block_ids == newest[..., None], axis=-1) | (compress_lens == 0)
        checkify.check(
            jnp.all(pinned), f"layer {layer}: the newest block is missing from the candidate pool"
        )
    if restricted:
        in_pool = jnp.take_along_axis(mask, jnp.maximum(topk, 0), axis=-1) & valid
        ok = jnp.all(in_pool | ~valid, axis=-1)
        if neginf_picks == "keep":
            ok |= jnp.sum(in_pool, axis=-1) == jnp.sum(mask, axis=-1)
        checkify.check(
            jnp.all(ok),
            f"layer {layer}: a Reindex pick lies outside the pool"
            + (" while a pool position is left out" if neginf_picks == "keep" else ""),
        )


def check_scores(layer: int, scores: Float[Array, "*rows n_pos"]) -> None:
    """Stages a check that index scores hold no NaN (−inf marks invisible positions; a NaN
    would be silently unpickable, `scoring.topk`)."""
    checkify.check(~jnp.any(jnp.isnan(scores)), f"layer {layer}: the index scores hold NaN")
