"""An exact top-k by threshold (radix select) and compaction: no sort (issue 16 item 2).

`scoring.topk` returns its picks sorted by position, not by score, so it needs only the set of
the k best and never their order. This module finds that set as XLA's sort-based `lax.top_k`
cannot: by counting. Per row:

1. Every score becomes an order key, an unsigned 32-bit integer that sorts as the float does
   (the sign bit flipped for positives, every bit for negatives; NaN was turned into −inf and
   −0.0 into +0.0 first, as `topk` does).
2. The k-th largest key t is found digit by digit from the top, `digit_bits` bits per pass: a
   pass counts, for each of the 2^digit_bits − 1 candidate digits, the keys ≥ the threshold so
   far with that digit appended, and keeps the largest digit whose count still reaches k. Each
   pass reads the row once; 32 / digit_bits passes find t exactly.
3. Every key > t is picked. Among the keys equal to t, the tie order decides which `k − #{> t}`
   are picked: the same search over a second key that ranks positions (n − 1 − position for
   'oldest', so the lowest positions rank highest; position for 'newest'), restricted to the
   ties. Exactly min(k, reachable) positions are picked; −inf never is.
4. The picks are compacted in position order: the j-th output is the first position whose
   running count of picks reaches j + 1 (a cumulative sum, then one binary search per output).

The cost is linear in n: (32 + log2 n) / digit_bits passes of compare-and-count, one cumulative
sum and k·log2 n reads, against a sort of n. On a GPU the passes are reductions XLA fuses; how
fast they are against the sort is the benchmark's question (`pallas_kernels.topk.bench`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Bool, Float, Int, UInt32

from v41jax.ops import scoring
from v41jax.ops.scoring import TopK

DIGIT_BITS = (1, 2, 3, 4, 5, 6, 8)
"""Bits of the key a counting pass decides (2^bits − 1 counts per element and pass)."""


def order_keys(scores: Float[Array, "*batch n"]) -> UInt32[Array, "*batch n"]:
    """Unsigned keys that order as the float32 scores do (scores hold no NaN; −0.0 and +0.0
    give different keys, so normalize them first): a ≤ b ⇔ key(a) ≤ key(b)."""
    bits = lax.bitcast_convert_type(scores.astype(jnp.float32), jnp.uint32)
    negative = bits >= jnp.uint32(0x80000000)
    return jnp.where(negative, ~bits, bits | jnp.uint32(0x80000000))


def _digits(n_bits: int, digit_bits: int) -> list[tuple[int, int]]:
    """(shift, width) of each pass, from the top bit down; the first takes the remainder."""
    widths = [n_bits % digit_bits] if n_bits % digit_bits else []
    widths += [digit_bits] * (n_bits // digit_bits)
    out, shift = [], n_bits
    for width in widths:
        shift -= width
        out.append((shift, width))
    return out


def largest_threshold(
    keys: UInt32[Array, "*batch n"],
    eligible: Bool[Array, "*batch n"] | None,
    need: Int[Array, "*batch"],
    n_bits: int,
    digit_bits: int,
) -> UInt32[Array, "*batch"]:
    """Per row, the largest t < 2^n_bits with #{eligible keys ≥ t} ≥ need (0 when even t = 0
    falls short). Keys must be < 2^n_bits. One pass over the row per `digit_bits` bits."""
    t = jnp.zeros(keys.shape[:-1], jnp.uint32)
    for shift, width in _digits(n_bits, digit_bits):
        digits = jnp.arange(1, 2**width, dtype=jnp.uint32) << shift
        candidates = t[..., None] | digits  # [..., 2^width − 1]
        above = keys[..., None, :] >= candidates[..., :, None]
        if eligible is not None:
            above = above & eligible[..., None, :]
        counts = jnp.sum(above, axis=-1, dtype=jnp.int32)
        # Counts fall as the digit grows: the number of digits that reach `need` is the best one.
        best = jnp.sum(counts >= need[..., None], axis=-1, dtype=jnp.uint32)
        t = t | (best << shift)
    return t


def _compact(picked: Bool[Array, "*batch n"], k: int) -> Int[Array, "*batch k"]:
    """The positions of `picked` in ascending order, −1 padded to k (at most k are picked)."""
    running = jnp.cumsum(picked, axis=-1, dtype=jnp.int32)
    wanted = jnp.arange(1, k + 1, dtype=jnp.int32)
    n = picked.shape[-1]
    flat = running.reshape(-1, n)
    found = jax.vmap(lambda r: jnp.searchsorted(r, wanted, side="left", method="scan"))(flat)
    found = found.reshape(*picked.shape[:-1], k).astype(jnp.int32)
    return jnp.where(wanted <= running[..., -1:], found, -1)


def threshold_topk(
    scores: Float[Array, "*batch n"], k: int, *, tie_order: str = "oldest", digit_bits: int = 4
) -> TopK:
    """`scoring.topk(scores, k, tie_order=tie_order)` (no mask, −inf picks dropped), bit for bit,
    by radix select and compaction (module docstring). The arguments are the caller's to
    check (`pallas_kernels.topk.topk` does): float scores [..., n], 0 ≤ k ≤ n, `tie_order` in
    `scoring.TIE_ORDERS`, `digit_bits` in `DIGIT_BITS`.

    Returns `TopK(indices [..., k] ascending then −1, scores [..., k] float32, −inf at −1)`.
    """
    scores = scoring.ranking_scores(scores)
    batch, n = scores.shape[:-1], scores.shape[-1]
    if k == 0 or n == 0:
        empty = jnp.zeros((*batch, k), jnp.int32)
        return TopK(empty - 1, jnp.full((*batch, k), -jnp.inf, jnp.float32))
    keys = order_keys(scores)
    need = jnp.full(batch, k, jnp.int32)
    t = largest_threshold(keys, None, need, 32, digit_bits)
    above = keys > t[..., None]
    ties = keys == t[..., None]
    position = jnp.arange(n, dtype=jnp.uint32)
    rank = (n - 1 - position) if tie_order == "oldest" else position
    n_bits = max(1, (n - 1).bit_length())
    left = need - jnp.sum(above, axis=-1, dtype=jnp.int32)
    r = largest_threshold(jnp.broadcast_to(rank, keys.shape), ties, left, n_bits, digit_bits)
    picked = (above | (ties & (rank >= r[..., None]))) & (scores > -jnp.inf)
    indices = _compact(picked, k)
    values = jnp.take_along_axis(scores, jnp.maximum(indices, 0), axis=-1)
    return TopK(indices, jnp.where(indices >= 0, values, -jnp.inf))
