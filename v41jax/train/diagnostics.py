"""Selection-quality metrics of the hierarchical indexer (DESIGN §7 "Metrics").

- `candidate_pool_recall`: the fraction of a Reindex layer's *unrestricted* top-k inside the
  candidate pool, over the queries that see more positions than the pool can hold.
- `within_pool_recall`: |S ∩ U| / |U|, a selection S against a reference top-k U.
- `attention_mass_covered`: Σ_{s∈S} A[t, s], the dense attention mass a selection keeps.
- `recall_by_distance`: any per-pick hit rate split into distance buckets (t − s).

Recalls come back as a `Fraction(value, count)` so results of several batches, layers or devices
can be merged exactly: Σ value·count / Σ count. When nothing is counted, value is 0 and count 0
(no NaN); a consumer must look at count.

Index arguments follow `v41jax.ops.scoring.topk`: [..., k] integer positions, −1 (anything outside
[0, n_pos)) for no pick.
"""

from __future__ import annotations

import itertools
from typing import NamedTuple

import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Bool, Float, Int

from v41jax.ops.checks import (
    as_lengths,
    require_broadcast,
    require_dtype,
    require_min_ndim,
    require_nonnegative_int,
)
from v41jax.ops.scoring import indices_to_mask

DEFAULT_DISTANCE_EDGES = (64, 512)
"""Bucket edges of `recall_by_distance`: distance < 64, 64 ≤ distance < 512, ≥ 512."""


class Fraction(NamedTuple):
    """A mean over counted items, mergeable across batches.

    Attributes:
      value: float32 mean over the counted items; 0 where count is 0.
      count: int32 number of items counted (queries or picks, as each function says).
    """

    value: Float[Array, "*bucket"]
    count: Int[Array, "*bucket"]


def _fraction(total: Float[Array, "*b"], count: Int[Array, "*b"]) -> Fraction:
    count = count.astype(jnp.int32)
    return Fraction(total.astype(jnp.float32) / jnp.maximum(count, 1), count)


def _indices(name: str, indices: ArrayLike) -> Int[Array, "*batch k"]:
    indices = jnp.asarray(indices)
    require_dtype(name, indices, "integer")
    require_min_ndim(name, indices, 1, "[..., k]")
    return indices


def in_mask(
    indices: Int[Array, "*batch k"], mask: Bool[Array, "*batch n_pos"]
) -> Bool[Array, "*batch k"]:
    """Whether each pick lies inside a per-query position mask; False for −1 picks.

    Args:
      indices: [..., k] integer picks.
      mask: [..., n_pos] bool (e.g. `CandidatePool.mask`), same leading dims as indices.
    """
    return _in_mask(indices, mask, "indices", "mask")


def in_selection(
    indices: Int[Array, "*batch k"], selected: Int[Array, "*batch k_sel"]
) -> Bool[Array, "*batch k"]:
    """Whether each pick of `indices` also appears in `selected`; False for −1 picks.

    Args:
      indices: [..., k] integer picks (the reference set).
      selected: [..., k_sel] integer picks, same leading dims; −1 entries match nothing.
    """
    return _in_selection(indices, selected, "indices", "selected")


def _in_mask(
    indices: ArrayLike, mask: ArrayLike, indices_name: str, mask_name: str
) -> Bool[Array, "*batch k"]:
    indices = _indices(indices_name, indices)
    mask = jnp.asarray(mask)
    require_dtype(mask_name, mask, "bool")
    require_min_ndim(mask_name, mask, 1, "[..., n_pos]")
    if mask.shape[:-1] != indices.shape[:-1]:
        raise ValueError(
            f"{mask_name}: expected leading dims {indices.shape[:-1]} ({indices_name}'s), "
            f"got shape {mask.shape}"
        )
    valid = (indices >= 0) & (indices < mask.shape[-1])
    hit = jnp.take_along_axis(mask, jnp.where(valid, indices, 0), axis=-1)
    return hit & valid


def _in_selection(
    indices: ArrayLike, selected: ArrayLike, indices_name: str, selected_name: str
) -> Bool[Array, "*batch k"]:
    indices = _indices(indices_name, indices)
    selected = _indices(selected_name, selected)
    if selected.shape[:-1] != indices.shape[:-1]:
        raise ValueError(
            f"{selected_name}: expected leading dims {indices.shape[:-1]} ({indices_name}'s), "
            f"got shape {selected.shape}"
        )
    # k·k_sel comparisons per query (512² at V4.1 size): cheap next to the scores themselves.
    same = indices[..., :, None] == selected[..., None, :]
    return jnp.any(same, axis=-1) & (indices >= 0)


def candidate_pool_recall(
    unrestricted_topk: Int[Array, "*batch k"],
    pool_mask: Bool[Array, "*batch n_pos"],
    query_lens: Int[ArrayLike, "*batch"],
    pool_size: int,
) -> Fraction:
    """Candidate-pool recall: the share of a Reindex layer's unrestricted top-k inside the pool.

    Per query, recall = |U ∩ pool| / |U| with U the valid (≠ −1) picks of the Reindex layer's
    top-k taken over *all* visible positions. Only queries whose visible length exceeds
    `pool_size` count (below it, the pool holds every reachable block and recall is 1 by
    construction), and only those with at least one valid pick.

    Args:
      unrestricted_topk: [..., k] the Reindex layer's top-k without the pool restriction.
      pool_mask: [..., n_pos] bool, `CandidatePool.mask` of the same queries.
      query_lens: integer, broadcastable to [...]: visible compressed positions per query.
      pool_size: positions the pool can hold (topk_blocks·block_size).

    Returns:
      `Fraction` of scalars: value = mean per-query recall over the counted queries, count = the
      number of counted queries (0 and 0 when none qualifies).
    """
    hit = _in_mask(unrestricted_topk, pool_mask, "unrestricted_topk", "pool_mask")
    lens = as_lengths("query_lens", query_lens, hit.shape[:-1])
    pool_size = require_nonnegative_int("pool_size", pool_size)
    return _mean_recall(hit, jnp.asarray(unrestricted_topk) >= 0, lens > pool_size)


def within_pool_recall(
    selected: Int[Array, "*batch k_sel"],
    reference_topk: Int[Array, "*batch k"],
    query_mask: Bool[ArrayLike, "*batch"] | None = None,
) -> Fraction:
    """Within-pool recall |S ∩ U| / |U|: how much of a reference top-k U a selection S keeps.

    Typically S is a Reindex layer's pool-restricted top-k and U its unrestricted top-k or the
    top-k of the dense attention. Queries with no valid reference pick are not counted.

    Args:
      selected: [..., k_sel] integer picks S (−1 padded).
      reference_topk: [..., k] integer picks U (−1 padded), same leading dims.
      query_mask: optional bool, broadcastable to [...]: only these queries are counted.

    Returns:
      `Fraction` of scalars: value = mean per-query recall, count = number of counted queries.
    """
    hit = _in_selection(reference_topk, selected, "reference_topk", "selected")
    if query_mask is None:
        query_mask = jnp.ones(hit.shape[:-1], jnp.bool_)
    query_mask = jnp.asarray(query_mask)
    require_dtype("query_mask", query_mask, "bool")
    require_broadcast("query_mask", query_mask.shape, hit.shape[:-1])
    return _mean_recall(hit, jnp.asarray(reference_topk) >= 0, query_mask)


def _mean_recall(
    hit: Bool[Array, "*batch k"], valid: Bool[Array, "*batch k"], counted: Bool[Array, "*batch"]
) -> Fraction:
    n_valid = jnp.sum(valid, axis=-1)
    counted = counted & (n_valid > 0)
    per_query = jnp.sum(hit, axis=-1) / jnp.maximum(n_valid, 1)
    return _fraction(jnp.sum(jnp.where(counted, per_query, 0.0)), jnp.sum(counted))


def attention_mass_covered(
    attn_probs_dense: Float[Array, "*batch n_pos"], selected: Int[Array, "*batch k"]
) -> Float[Array, "*batch"]:
    """Σ_{s∈S} A[t, s]: the dense attention mass over compressed positions that S keeps.

    Args:
      attn_probs_dense: [..., n_pos] dense attention probabilities over compressed positions
        (e.g. summed over heads and renormalised; the caller decides).
      selected: [..., k] integer picks S, same leading dims; −1 ignored; a position picked twice
        counts once (S is a set).

    Returns:
      [...] float32 covered mass per query (0 for an empty selection).
    """
    probs = jnp.asarray(attn_probs_dense)
    require_dtype("attn_probs_dense", probs, "floating")
    require_min_ndim("attn_probs_dense", probs, 1, "[..., n_pos]")
    selected = _indices("selected", selected)
    if selected.shape[:-1] != probs.shape[:-1]:
        raise ValueError(
            f"selected: expected leading dims {probs.shape[:-1]} (attn_probs_dense's), "
            f"got shape {selected.shape}"
        )
    keep = indices_to_mask(selected, probs.shape[-1])
    return jnp.sum(jnp.where(keep, probs.astype(jnp.float32), 0.0), axis=-1)


def distance_buckets(
    indices: Int[Array, "*batch k"],
    query_positions: Int[ArrayLike, "*batch"],
    edges: tuple[int, ...] = DEFAULT_DISTANCE_EDGES,
) -> Int[Array, "*batch k"]:
    """The distance bucket of each pick: b such that edges[b−1] ≤ t − s < edges[b].

    Distances are in the units of the positions given (compressed entries; equal to tokens
    at ratio 1, the candidate source's ratio in V4.1). Take t = compress_lens − 1, the query's
    newest visible position.

    Args:
      indices: [..., k] integer picks s (−1 padded).
      query_positions: integer, broadcastable to [...]: the query position t.
      edges: increasing bucket edges; len(edges) + 1 buckets.

    Returns:
      [..., k] int32 bucket id in [0, len(edges)], −1 for −1 picks.
    """
    indices = _indices("indices", indices)
    t = as_lengths("query_positions", query_positions, indices.shape[:-1])
    if not all(isinstance(e, int) for e in edges) or any(
        b <= a for a, b in itertools.pairwise(edges)
    ):
        raise ValueError(f"edges: expected strictly increasing ints, got {edges!r}")
    distance = t[..., None] - indices
    bucket = jnp.searchsorted(jnp.asarray(edges), distance, side="right").astype(jnp.int32)
    return jnp.where(indices >= 0, bucket, -1)


def recall_by_distance(
    hit: Bool[Array, "*batch k"],
    indices: Int[Array, "*batch k"],
    query_positions: Int[ArrayLike, "*batch"],
    edges: tuple[int, ...] = DEFAULT_DISTANCE_EDGES,
    query_mask: Bool[ArrayLike, "*batch"] | None = None,
) -> Fraction:
    """A per-pick hit rate split by distance bucket (t − s): e.g. candidate-pool recall per bucket.

    Pass `hit = in_mask(unrestricted_topk, pool.mask)` (pool recall) or
    `hit = in_selection(reference_topk, selected)` (within-pool recall), with `indices` the same
    reference picks. Counts picks, not queries: value[b] = hits / valid picks in bucket b.

    Args:
      hit: [..., k] bool, whether each reference pick was recovered.
      indices: [..., k] integer reference picks (−1 padded), the picks `hit` describes.
      query_positions: integer, broadcastable to [...]: the query position t.
      edges: increasing bucket edges (default < 64, 64–512, ≥ 512).
      query_mask: optional bool, broadcastable to [...]: only these queries are counted (e.g.
        query_lens > pool_size for pool recall).

    Returns:
      `Fraction` with value and count shaped [len(edges) + 1]; count = valid picks per bucket.
    """
    hit = jnp.asarray(hit)
    require_dtype("hit", hit, "bool")
    indices = _indices("indices", indices)
    if hit.shape != indices.shape:
        raise ValueError(f"hit: expected shape {indices.shape} (indices'), got {hit.shape}")
    bucket = distance_buckets(indices, query_positions, edges)
    if query_mask is not None:
        query_mask = jnp.asarray(query_mask)
        require_dtype("query_mask", query_mask, "bool")
        require_broadcast("query_mask", query_mask.shape, indices.shape[:-1])
        bucket = jnp.where(query_mask[..., None], bucket, -1)
    in_bucket = bucket[..., None] == jnp.arange(len(edges) + 1)
    counted = in_bucket.reshape(-1, len(edges) + 1)
    hits = (in_bucket & hit[..., None]).reshape(-1, len(edges) + 1)
    return _fraction(jnp.sum(hits, axis=0), jnp.sum(counted, axis=0))
