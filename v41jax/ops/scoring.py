"""Indexer scores and top-k selection (DESIGN §3 step 2 and step 3's Reindex restriction).

The pure jnp definitions that the indexer modules, the pooled-scoring kernel and the tests call:

- `index_scores`: I[t, s] = Σ_h w[t, h]·ReLU(q[t, h]·k[s]), −inf at positions a query cannot see
  (`v41_architecture.md` §3 steps 5–6).
- `index_scores_at`: the same scores of each query at its own few positions, from their gathered
  key rows (`gather_rows`): a pool's slots, or a selection's picks (long sequences, decode).
- `topk` / `topk_indices`: the top-k over positions, optionally restricted to a boolean mask (a
  Reindex layer's candidate pool), sorted ascending by position. **Project decision (DESIGN §3):**
  a pick whose score is −inf is dropped (index −1), unlike the official reference, which keeps
  out-of-pool picks when the pool holds fewer than k positions (`v41_architecture.md` §3 step 11).
- `indices_to_mask`: the inverse of a selection, a boolean mask from −1 padded indices.

Three numerics switches (`ModelConfig.index_score_dtype`, `tie_order`, `neginf_picks`; the
defaults are the project's rules, the alternatives what the official inference code does):

- `score_dtype` ('float32' | 'bfloat16', `SCORE_DTYPES`): 'bfloat16' rounds where the reference's
  bf16 tensors round (its einsum and products run on bf16 operands with float32 accumulation):
  q, k and the head weights to bf16; each head's q·k (accumulated in float32) to bf16; each term
  w·ReLU(q·k) to bf16; the sum over heads (float32) to bf16. Rounding is `formats.fake_quant(·,
  'bf16')` (integer RNE, not a cast round trip that XLA may delete on the GPU; identity
  gradient). The result is still float32 (holding bf16 values, −inf where invisible).
- `tie_order` ('oldest' | 'newest', `TIE_ORDERS`): which of equal scores a selection keeps, the
  lowest position (oldest) or the highest (newest). Both are deterministic.
- `neginf_picks` ('drop' | 'keep', `NEGINF_PICKS`): 'keep' is the reference's rule for picks
  excluded by `mask` only (`topk`).

Argument checks come from `v41jax.ops.checks`, shared with `pool`, `sparse_attention` and
`diagnostics`.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import chex
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, ArrayLike, Bool, Float, Int

from v41jax.ops import formats
from v41jax.ops.checks import (
    as_lengths,
    require_broadcast,
    require_dtype,
    require_min_ndim,
    require_nonnegative_int,
)

# A reference, not a fast path: full float32 products even where the backend would default to a
# lower-precision matmul (TF32 or bf16 passes on GPU).
_PRECISION = lax.Precision.HIGHEST

SCORE_DTYPES = ("float32", "bfloat16")
"""Values of `score_dtype` (`ModelConfig.index_score_dtype`): float32 (the project's default) or
bf16 rounding where the official reference computes in bf16 (module docstring)."""
TIE_ORDERS = ("oldest", "newest")
"""Values of `tie_order` (`ModelConfig.tie_order`): among equal scores the lowest position (block)
id wins ('oldest', the default) or the highest ('newest')."""
NEGINF_PICKS = ("drop", "keep")
"""Values of `neginf_picks` (`ModelConfig.neginf_picks`): picks scoring −inf become −1 ('drop',
the default), or those excluded only by the mask are kept ('keep', the reference; `topk`)."""


def require_option(name: str, value: object, options: tuple[str, ...]) -> str:
    """Raise ValueError unless `value` is one of `options` (names the argument)."""
    if not isinstance(value, str) or value not in options:
        raise ValueError(f"{name}: expected one of {options}, got {value!r}")
    return value


def _bf16(x: Float[Array, "*s"]) -> Float[Array, "*s"]:
    """float32 `x` rounded to nearest even to bf16 values (still float32)."""
    return formats.fake_quant(x.astype(jnp.float32), "bf16")


# --- scores ---


def index_scores(
    q: Float[Array, "*batch query head index_dim"],
    weights: Float[Array, "*batch query head"],
    k: Float[Array, "*batch key index_dim"],
    compress_lens: Int[ArrayLike, "*batch query"],
    *,
    score_dtype: str = "float32",
) -> Float[Array, "*batch query key"]:
    """Indexer scores I[t, s] = Σ_h w[t, h]·ReLU(q[t, h]·k[s]), −inf where s ≥ compress_lens[t].

    DESIGN §3 step 2, `v41_architecture.md` §3 steps 5–6. Inputs are the (already fake-quantized)
    indexer queries, head weights and index keys; everything is computed in float32, or with the
    official reference's bf16 roundings when `score_dtype='bfloat16'` (module docstring).

    Args:
      q: [..., T, H, Dk] indexer queries, any float dtype.
      weights: [..., T, H] per-query head weights (already scaled by (Dk·H)^-0.5).
      k: [..., S, Dk] index keys (the compressed positions).
      compress_lens: integer, broadcastable to [..., T]: how many leading positions each query
        sees (a Python int for decode, a [T] column for prefill). Values ≥ S mean all positions.
        The leading dims of q, weights and k must be equal.
      score_dtype: 'float32' or 'bfloat16' (`SCORE_DTYPES`).

    Returns:
      [..., T, S] float32 scores (bf16 values with 'bfloat16'); −inf at positions s ≥
      compress_lens[t].
    """
    score_dtype = require_option("score_dtype", score_dtype, SCORE_DTYPES)
    q, weights, k = jnp.asarray(q), jnp.asarray(weights), jnp.asarray(k)
    for name, x, ndim, layout in (
        ("q", q, 3, "[..., T, H, Dk]"),
        ("weights", weights, 2, "[..., T, H]"),
        ("k", k, 2, "[..., S, Dk]"),
    ):
        require_dtype(name, x, "floating")
        require_min_ndim(name, x, ndim, layout)
    if weights.shape != q.shape[:-1]:
        raise ValueError(
            f"weights: expected shape {q.shape[:-1]} (q's [..., T, H]), got {weights.shape}"
        )
    if k.shape[:-2] != q.shape[:-3] or k.shape[-1] != q.shape[-1]:
        expected = (*q.shape[:-3], "S", q.shape[-1])
        raise ValueError(f"k: expected shape {expected} (q's batch dims and Dk), got {k.shape}")
    rows = q.shape[:-2]
    lens = as_lengths("compress_lens", compress_lens, rows)

    q, weights, k = q.astype(jnp.float32), weights.astype(jnp.float32), k.astype(jnp.float32)
    if score_dtype == "bfloat16":
        q, weights, k = _bf16(q), _bf16(weights), _bf16(k)
    logits = jnp.einsum("...thd,...sd->...ths", q, k, precision=_PRECISION)
    if score_dtype == "float32":
        scores = jnp.einsum(
            "...th,...ths->...ts", weights, jnp.maximum(logits, 0.0), precision=_PRECISION
        )
    else:
        terms = _bf16(weights[..., None] * jnp.maximum(_bf16(logits), 0.0))
        scores = _bf16(jnp.sum(terms, axis=-2))
    visible = jnp.arange(k.shape[-2]) < lens[..., None]
    scores = jnp.where(visible, scores, -jnp.inf)
    chex.assert_shape(scores, (*rows, k.shape[-2]))
    return scores


def gather_rows(
    x: Float[Array, "batch n_rows dim"], positions: Int[Array, "batch ..."]
) -> Float[Array, "batch ... dim"]:
    """The rows of each sequence's `x` at `positions`: out[b, ..., :] = x[b, positions[b, ...]].

    Positions outside [0, n_rows) (−1 padding) read row 0, or zeros when there is no row: the
    caller masks them. A gather of the rows a query needs, never a [T, S] product."""
    x, positions = jnp.asarray(x), jnp.asarray(positions)
    require_min_ndim("x", x, 3, "[B, N, D]")
    require_dtype("positions", positions, "integer")
    if positions.ndim < 1 or positions.shape[0] != x.shape[0]:
        raise ValueError(
            f"positions: expected shape [{x.shape[0]}, ...] (x's B), got {positions.shape}"
        )
    batch, n_rows, dim = x.shape[0], x.shape[1], x.shape[2:]
    if n_rows == 0:
        return jnp.zeros((*positions.shape, *dim), x.dtype)
    # An explicit width, not -1: an empty batch cannot infer it.
    flat = jnp.clip(positions, 0, n_rows - 1).reshape(batch, math.prod(positions.shape[1:]))
    rows = x[jnp.arange(batch)[:, None], flat]
    return rows.reshape(*positions.shape, *dim)


def index_scores_at(
    q: Float[Array, "*batch head index_dim"],
    weights: Float[Array, "*batch head"],
    k_rows: Float[Array, "*batch n index_dim"],
    positions: Int[Array, "*batch n"],
    compress_lens: Int[ArrayLike, "*batch"],
    *,
    score_dtype: str = "float32",
) -> Float[Array, "*batch n"]:
    """`index_scores` of each query at its own n positions, from the key rows gathered there.

    score[..., i] = Σ_h w[..., h]·ReLU(q[..., h]·k_rows[..., i]) where 0 <= positions[..., i] <
    compress_lens[...], −inf elsewhere (−1 padding, invisible positions). What a Reindex layer
    computes inside its pool (`pool.pooled_scores` on packed rows) and what the indexer KL loss
    reads at a selection's picks: O(n) per query instead of a scan of every position.

    Args:
      q: [..., H, Dk] one indexer query per leading index; weights: [..., H] its head weights.
      k_rows: [..., n, Dk] the key rows at `positions` (`gather_rows`).
      positions: [..., n] integer positions of those rows, −1 for none.
      compress_lens: integer, broadcastable to [...]: visible positions of each query.
      score_dtype: 'float32' or 'bfloat16', as `index_scores`.

    Returns:
      [..., n] float32.
    """
    q, positions = jnp.asarray(q), jnp.asarray(positions)
    require_dtype("positions", positions, "integer")
    if positions.shape != jnp.shape(k_rows)[:-1]:
        raise ValueError(
            f"positions: expected shape {jnp.shape(k_rows)[:-1]} (k_rows' [..., n]), "
            f"got {positions.shape}"
        )
    lens = as_lengths("compress_lens", compress_lens, q.shape[:-2])
    scores = index_scores(
        q[..., None, :, :],
        jnp.asarray(weights)[..., None, :],
        k_rows,
        positions.shape[-1],
        score_dtype=score_dtype,
    )[..., 0, :]
    visible = (positions >= 0) & (positions < lens[..., None])
    return jnp.where(visible, scores, -jnp.inf)


# --- top-k ---

MAX_PADDED_K = 65_536
"""The largest k `topk` pads beyond the positions it is given (V4.1's top-k is 512)."""


class TopK(NamedTuple):
    """A top-k selection, sorted ascending by position, −1 padded at the end.

    Attributes:
      indices: [..., k] int32 positions in ascending order, then −1 for every missing pick.
      scores: [..., k] float32 score of each pick, −inf where the index is −1.
    """

    indices: Int[Array, "*batch k"]
    scores: Float[Array, "*batch k"]


def ranked_topk(
    scores: Float[Array, "*batch n"], k: int, tie_order: str = "oldest"
) -> tuple[Float[Array, "*batch k"], Int[Array, "*batch k"]]:
    """`lax.top_k` (k ≤ n, best first) with `tie_order` among equal scores: 'oldest' keeps the
    lowest indices (a stable top-k), 'newest' the highest (a stable top-k of the reversed axis,
    its indices mapped back). Returns (values, indices int32)."""
    tie_order = require_option("tie_order", tie_order, TIE_ORDERS)
    if tie_order == "oldest":
        values, indices = lax.top_k(scores, k, is_stable=True)
    else:
        values, indices = lax.top_k(jnp.flip(scores, -1), k, is_stable=True)
        indices = scores.shape[-1] - 1 - indices
    return values, indices.astype(jnp.int32)


def sorted_picks(
    indices: Int[Array, "*batch m"], values: Float[Array, "*batch m"], keep: Bool[Array, "*batch m"]
) -> TopK:
    """Picks where `keep` sorted ascending by index, then the others as −1 (score −inf)."""
    big = jnp.iinfo(jnp.int32).max
    keys = jnp.where(keep, indices, big).astype(jnp.int32)
    values = jnp.where(keep, values, -jnp.inf).astype(jnp.float32)
    keys, values = lax.sort((keys, values), dimension=-1, num_keys=1)
    return TopK(jnp.where(keys < big, keys, -1), values)


def fill_picks(picks: TopK, extra: Int[Array, "*batch n"], k: int) -> TopK:
    """`picks`' valid entries, then `extra`'s (≥ 0, in their order, score −inf) up to k picks in
    all; sorted ascending, −1 padded to k. `extra` must not repeat a valid pick.

    How `neginf_picks='keep'` completes a selection with positions excluded only by a mask."""
    n = extra.shape[-1]
    big = jnp.iinfo(jnp.int32).max
    indices = jnp.concatenate([picks.indices, extra.astype(jnp.int32)], axis=-1)
    values = jnp.concatenate([picks.scores, jnp.full(extra.shape, -jnp.inf, jnp.float32)], -1)
    rank = jnp.concatenate(
        [
            jnp.where(picks.indices >= 0, 0, big),
            jnp.where(extra >= 0, 1 + jnp.arange(n, dtype=jnp.int32), big),
        ],
        axis=-1,
    )
    n_out = min(k, indices.shape[-1])
    neg_rank, slot = lax.top_k(-rank, n_out)
    indices = jnp.take_along_axis(indices, slot, axis=-1)
    values = jnp.take_along_axis(values, slot, axis=-1)
    out = sorted_picks(indices, values, neg_rank > -big)
    pad = [(0, 0)] * (indices.ndim - 1) + [(0, k - n_out)]
    return TopK(
        jnp.pad(out.indices, pad, constant_values=-1),
        jnp.pad(out.scores, pad, constant_values=-jnp.inf),
    )


def ranking_scores(scores: Float[Array, "*s"]) -> Float[Array, "*s"]:
    """The scores as `topk` ranks them: float32, NaN as −inf, −0.0 as +0.0. The two zeros are
    equal scores and must tie (`lax.top_k` orders −0.0 below +0.0; a sum of zero terms has
    either sign depending on the summation, e.g. prefill against decode)."""
    scores = scores.astype(jnp.float32)
    return jnp.where(jnp.isnan(scores), -jnp.inf, jnp.where(scores == 0, 0.0, scores))


def check_topk_args(
    scores: Float[ArrayLike, "*batch n_pos"],
    k: int,
    mask: Bool[ArrayLike, "*batch n_pos"] | None,
    tie_order: str,
    neginf_picks: str,
) -> tuple[Float[Array, "*batch n_pos"], int, Bool[Array, "*batch n_pos"] | None, str, str]:
    """`topk`'s argument checks (ValueError naming the argument), for every implementation of
    it: returns (scores, k, mask) as arrays and ints, and the two options."""
    scores = jnp.asarray(scores)
    require_dtype("scores", scores, "floating")
    require_min_ndim("scores", scores, 1, "[..., n_pos]")
    k = require_nonnegative_int("k", k)
    tie_order = require_option("tie_order", tie_order, TIE_ORDERS)
    neginf_picks = require_option("neginf_picks", neginf_picks, NEGINF_PICKS)
    if k > max(scores.shape[-1], MAX_PADDED_K):
        raise ValueError(
            f"k: expected at most max(n_pos={scores.shape[-1]}, {MAX_PADDED_K}) picks, got {k}"
        )
    if mask is not None:
        mask = jnp.asarray(mask)
        require_dtype("mask", mask, "bool")
        require_broadcast("mask", mask.shape, scores.shape)
    return scores, k, mask, tie_order, neginf_picks


def topk(
    scores: Float[Array, "*batch n_pos"],
    k: int,
    mask: Bool[Array, "*batch n_pos"] | None = None,
    *,
    tie_order: str = "oldest",
    neginf_picks: str = "drop",
) -> TopK:
    """The k best positions along the last axis, sorted ascending, −1 for dropped picks.

    DESIGN §3 steps 2–3 (`v41_architecture.md` §3 steps 8–9). `mask` restricts the selection
    (Reindex: positions outside the candidate pool count as −inf). A NaN score is never picked (it
    counts as −inf; the finite picks of its row are kept): debug mode reports NaN index scores
    (`v41jax.ops.invariants`), the selection itself holds positions only.

    −inf picks (`neginf_picks`):
    - 'drop' (project decision, DESIGN §3): a pick whose score is −inf is dropped; that covers
      invisible positions, out-of-pool ones and every pick beyond the number of reachable
      positions.
    - 'keep' (the official reference, `v41_architecture.md` §3 step 11): a position excluded only
      by `mask` (its own score is finite: a visible position outside the pool) is still picked
      when fewer than k positions are in the mask, after every in-mask position, in `tie_order`
      among themselves. A position whose own score is −inf (invisible, beyond compress_lens) is
      never picked: attending to it would break causality. Without a mask it equals 'drop'. The
      reference's prefill ranks invisible positions among the out-of-pool ones before dropping
      them (so its count of kept picks depends on its tie order); its decode has no invisible
      positions. This rule is the decode one, so prefill and decode agree.

    Ties (`tie_order`): 'oldest' (default): `lax.top_k(is_stable=True)` returns equal scores in
    input order, so among tied scores the lowest positions win, deterministically (ReLU scores tie
    at 0 often; −0.0 and +0.0 tie too); 'newest': the highest positions win. Other
    implementations (kernels) must reproduce this rule.

    Args:
      scores: [..., n_pos] float scores, −inf at positions that cannot be picked.
      k: number of picks (Python int ≥ 0); may exceed n_pos, the output is then −1 padded, up
        to `MAX_PADDED_K` picks (a larger k than both is refused as a likely mistake: the
        output alone would take k·8 bytes per row).
      mask: optional bool, broadcastable to scores' shape; False positions cannot be picked
        (with 'keep': only after every True one).
      tie_order: 'oldest' | 'newest' (`TIE_ORDERS`).
      neginf_picks: 'drop' | 'keep' (`NEGINF_PICKS`).

    Returns:
      `TopK(indices [..., k] int32, scores [..., k] float32)`; valid indices come first in
      ascending order, then −1 (score −inf). A kept out-of-mask pick has score −inf.
    """
    scores, k, mask, tie_order, neginf_picks = check_topk_args(
        scores, k, mask, tie_order, neginf_picks
    )
    scores = ranking_scores(scores)
    reachable = scores > -jnp.inf
    if mask is not None:
        scores = jnp.where(mask, scores, -jnp.inf)

    n_pos = scores.shape[-1]
    n_picks = min(k, n_pos)
    batch = scores.shape[:-1]
    if n_picks == 0:
        empty = jnp.zeros((*batch, 0), jnp.int32)
        picks = TopK(empty, empty.astype(jnp.float32))
    else:
        values, indices = ranked_topk(scores, n_picks, tie_order)
        picks = sorted_picks(indices, values, values > -jnp.inf)
    if neginf_picks == "keep" and mask is not None and n_picks:
        # Positions excluded by the mask alone, best first in the tie order: a top-k of keys.
        pos = jnp.arange(n_pos, dtype=jnp.int32)
        order = n_pos - pos if tie_order == "oldest" else pos + 1
        key = jnp.where(reachable & ~mask, order, 0)
        key, extra = ranked_topk(key, n_picks)
        picks = fill_picks(picks, jnp.where(key > 0, extra, -1), n_picks)
    pad = [(0, 0)] * len(batch) + [(0, k - n_picks)]
    indices = jnp.pad(picks.indices, pad, constant_values=-1)
    values = jnp.pad(picks.scores, pad, constant_values=-jnp.inf)
    chex.assert_shape((indices, values), (*batch, k))
    chex.assert_type((indices, values), (jnp.int32, jnp.float32))
    return TopK(indices, values)


def topk_indices(
    scores: Float[Array, "*batch n_pos"],
    k: int,
    mask: Bool[Array, "*batch n_pos"] | None = None,
    *,
    tie_order: str = "oldest",
    neginf_picks: str = "drop",
) -> Int[Array, "*batch k"]:
    """`topk(scores, k, mask, ...).indices`: [..., k] int32, ascending, −1 for dropped picks."""
    return topk(scores, k, mask, tie_order=tie_order, neginf_picks=neginf_picks).indices


def indices_to_mask(indices: Int[Array, "*batch k"], size: int) -> Bool[Array, "*batch size"]:
    """A boolean mask [..., size] that is True at every index in `indices`.

    Entries outside [0, size) (−1 padding in particular) are ignored; duplicates are harmless.

    Args:
      indices: [..., k] integer indices.
      size: length of the mask's last axis (Python int ≥ 0).

    Returns:
      [..., size] bool.
    """
    indices = jnp.asarray(indices)
    require_dtype("indices", indices, "integer")
    require_min_ndim("indices", indices, 1, "[..., k]")
    size = require_nonnegative_int("size", size)
    batch = indices.shape[:-1]
    rows = indices.reshape(math.prod(batch), indices.shape[-1])
    # A scatter, not a one-hot comparison: [rows, k, size] would not fit at long context.
    # Invalid entries write into a spare slot `size` that is cut off afterwards.
    slots = jnp.where((rows >= 0) & (rows < size), rows, size)
    mask = jnp.zeros((rows.shape[0], size + 1), jnp.bool_)
    mask = mask.at[jnp.arange(rows.shape[0])[:, None], slots].set(True)
    return mask[:, :size].reshape(*batch, size)
