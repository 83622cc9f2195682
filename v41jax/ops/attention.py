"""Core sparse attention: one softmax over window keys, selected compressed keys and a sink.

DESIGN §3 step 4, `v41_architecture.md` §5. For head h of one query, over the valid keys j (the
query's window rows, then the compressed rows its top-k selects):

    out_h = Σ_j e^{s_hj}·v_j / (Σ_j e^{s_hj} + e^{sink_h}),   s_hj = q_h·k_j·scale,

with K = V (one latent per key), the sink logit unscaled and carrying a zero value vector, and
scale = D^-0.5 by default. Invalid keys (window slots marked invalid, index −1) are skipped; a
query with no valid key outputs exactly zero (the sink then holds all the mass), never NaN.
Duplicated indices count twice, as in the reference (there is no deduplication, §5).

Five forms of the one op, all built on `softmax_with_sink` (or its terms):
- `sparse_attention`: queries with per-query indices into a float compressed KV (the definition);
- `packed_sparse_attention`: the same over the packed caches of decode (gather the selected
  packed rows, unpack only those, `sparse_attention`): the definition the FP4-dequant kernel of
  `pallas_kernels.sparse_attention` is tested against (DESIGN §6);
- `sharded_packed_sparse_attention`: the same with the packed cache sharded by position over a
  mesh axis (issue 15): per-device softmax partials combined by the log-sum-exp rule;
- `masked_attention`: a whole sequence (prefill, training): the window as a band over the
  sequence's own rows, the selection as a [T, S] mask over its compressed KV.
- `chunk_attention`: a chunk of a long sequence's queries (training, prefill): the window and
  the selection as gathered rows (O(T·(W + K)) over the sequence), or dense attention under a
  mask over the compressed KV.
"""

from __future__ import annotations

from typing import Literal, NamedTuple, overload

import chex
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Bool, Float, Int, UInt8

from v41jax.ops import formats
from v41jax.ops.checks import (
    check_sequence_sharding,
    require_broadcast,
    require_dtype,
    require_min_ndim,
)


class SparseAttentionResult(NamedTuple):
    """`sparse_attention(..., return_probs=True)`.

    Attributes:
      out: [..., H, D] float32 attention output.
      probs: [..., H, W + K] float32 softmax weight of every key slot: the W window slots first,
        then the K selected slots in `indices` order; 0 at invalid slots. A row sums to
        1 − (the sink's share), which is < 1.
      lse: [..., H] float32 log(Σ_j e^{s_hj} + e^{sink_h}), the normaliser including the sink
        (the indexer KL loss renormalises main-attention weights with it).
    """

    out: Float[Array, "*batch head dim"]
    probs: Float[Array, "*batch head key"]
    lse: Float[Array, "*batch head"]


def _sparse_attention_xla(
    q: Float[Array, "*batch head dim"],
    window_kv: Float[Array, "*#batch window dim"],
    window_valid: Bool[Array, "*#batch window"],
    kv: Float[Array, "*#batch n_kv dim"],
    indices: Int[Array, "*#batch topk"],
    sink: Float[Array, " head"],
    scale: float | Float[Array, ""],
) -> SparseAttentionResult:
    keys, valid, logits = _attention_logits(q, window_kv, window_valid, kv, indices, scale)
    probs, lse = softmax_with_sink(logits, valid[..., None, :], sink)
    out = jnp.einsum("...hj,...jd->...hd", probs, keys, precision=lax.Precision.HIGHEST)
    return SparseAttentionResult(out, probs, lse)


def _attention_logits(
    q: Float[Array, "*batch head dim"],
    window_kv: Float[Array, "*#batch window dim"],
    window_valid: Bool[Array, "*#batch window"],
    kv: Float[Array, "*#batch n_kv dim"],
    indices: Int[Array, "*#batch topk"],
    scale: float | Float[Array, ""],
) -> tuple[
    Float[Array, "*batch key dim"], Bool[Array, "*batch key"], Float[Array, "*batch head key"]
]:
    """The keys of `sparse_attention` (window rows, then the selected rows; zero where invalid),
    their validity and the scaled logits q·k·scale."""
    batch, dim = q.shape[:-2], q.shape[-1]
    n_kv = kv.shape[-2]

    # Gather the selected rows; kv gets leading 1s so take_along_axis broadcasts it over `batch`.
    kv = kv.reshape((1,) * (len(batch) + 2 - kv.ndim) + kv.shape)
    selected_valid = (indices >= 0) & (indices < n_kv)
    safe = jnp.where(selected_valid, indices, 0)
    selected = jnp.take_along_axis(kv, safe[..., None], axis=-2)

    n_window = window_kv.shape[-2]
    keys = jnp.concatenate(
        [
            jnp.broadcast_to(window_kv, (*batch, n_window, dim)).astype(jnp.float32),
            jnp.broadcast_to(selected, (*batch, indices.shape[-1], dim)).astype(jnp.float32),
        ],
        axis=-2,
    )
    valid = jnp.concatenate(
        [
            jnp.broadcast_to(window_valid, (*batch, n_window)),
            jnp.broadcast_to(selected_valid, (*batch, indices.shape[-1])),
        ],
        axis=-1,
    )
    # Zero invalid rows: an unfilled ring-buffer slot may hold garbage (even NaN), and 0·NaN = NaN.
    keys = jnp.where(valid[..., None], keys, 0.0)

    # HIGHEST: true float32 products; a reference must not inherit the GPU's TF32/bf16 default.
    logits = jnp.einsum(
        "...hd,...jd->...hj", q.astype(jnp.float32), keys, precision=lax.Precision.HIGHEST
    )
    return keys, valid, logits * scale


def softmax_with_sink(
    logits: Float[Array, "*batch head key"], valid: Bool[Array, "*#batch #head key"], sink
) -> tuple[Float[Array, "*batch head key"], Float[Array, "*batch head"]]:
    """Softmax over the valid keys and the per-head sink logit; (probs, lse). 0 at invalid keys.

    The sink is one more logit per head with a zero value vector (DESIGN §3 step 4): it takes
    part in the normaliser only, so a row's probabilities sum to 1 − (the sink's share)."""
    row_max, weights, denom = _softmax_terms(logits, valid, sink)
    lse = row_max + jnp.log(denom)
    probs = weights / jnp.where(denom == 0, 1.0, denom)[..., None]
    return probs, lse


def _softmax_terms(
    logits: Float[Array, "*batch head key"], valid: Bool[Array, "*#batch #head key"], sink
) -> tuple[
    Float[Array, "*batch head"], Float[Array, "*batch head key"], Float[Array, "*batch head"]
]:
    """`softmax_with_sink` before normalising: (row max m, e^{logit − m} (0 at invalid keys),
    the denominator Σ e^{logit − m} + e^{sink − m}); m is 0 where every logit and the sink are
    −inf (the denominator is then 0)."""
    logits = jnp.where(valid, logits, -jnp.inf)
    sink = jnp.broadcast_to(sink.astype(jnp.float32), logits.shape[:-1])
    # The sink takes part in the running max, so an empty row has a finite max and exact zeros.
    # The max cancels out of the result: no gradient through it. A −inf max happens only with
    # sink = −inf and an empty row; 0 then keeps exp() finite. Only that case is replaced: a NaN
    # logit or sink makes the max NaN, and the whole row NaN (never a finite, unnormalised row).
    row_max = jnp.maximum(jnp.max(logits, axis=-1, initial=-jnp.inf), sink)
    row_max = lax.stop_gradient(jnp.where(jnp.isneginf(row_max), 0.0, row_max))
    weights = jnp.exp(logits - row_max[..., None])
    denom = jnp.sum(weights, axis=-1) + jnp.exp(sink - row_max)
    return row_max, weights, denom


class MaskedAttentionResult(NamedTuple):
    """`masked_attention`'s result.

    Attributes:
      out: [B, T, H, D] float32 attention output.
      probs: [B, T, H, S] float32 softmax weight of every compressed position (0 where not
        selected), normalized with the window and the sink; NaN in a row whose output is.
      lse: [B, T, H] float32 log of the normaliser including the sink.
    """

    out: Float[Array, "batch seq head dim"]
    probs: Float[Array, "batch seq head n_kv"]
    lse: Float[Array, "batch seq head"]


def sliding_window_rows(
    window_kv: Float[Array, "batch seq dim"],
    window_size: int,
    positions: Int[Array, " query"] | None = None,
) -> tuple[Float[Array, "batch query window dim"], Bool[Array, "batch query window"]]:
    """The window of queries at `positions` (default: every position) as gathered rows (the
    layout of `sparse_attention` and of decode's ring): query p sees positions p−W+1..p, slot w
    holding position p−W+1+w; slots before position 0 or at/after the sequence's end are
    invalid. `masked_attention` computes the same window without the gather."""
    batch, seq = window_kv.shape[:2]
    positions = jnp.arange(seq) if positions is None else jnp.asarray(positions)
    window_pos = positions[:, None] + jnp.arange(window_size) - (window_size - 1)
    rows = window_kv[:, jnp.clip(window_pos, 0, max(seq - 1, 0))]
    valid = (window_pos >= 0) & (window_pos < seq)
    return rows, jnp.broadcast_to(valid, (batch, positions.shape[0], window_size))


def _finite_rows(x: Float[Array, "*rows dim"]) -> tuple[Array, Array]:
    """(x with every non-finite row zeroed, which rows were finite): a zero row that is masked
    out contributes 0 to a matmul, where a NaN one would spread 0·NaN = NaN to every query."""
    finite = jnp.all(jnp.isfinite(x), axis=-1)
    return jnp.where(finite[..., None], x, 0.0), finite


def _window_logits(q, rows, finite, window_size):
    """Sliding-window logits without gathering each query's rows.

    Queries go in chunks of W; chunk i attends to the 2W positions of chunks i−1 and i, a band
    of which holds its window (key k of the 2W is query q's iff q < k ≤ q + W). Returns (logits
    [B, T, H, 2W], the band's keys [B, T/W, 2W, D] zero-padded, valid [B, T, 1, 2W], poisoned
    [B, T]: a valid window key is non-finite)."""
    (batch, seq, heads, dim), w = q.shape, window_size
    chunks = -(-seq // w)
    pad = chunks * w - seq

    def band_keys(x, fill):  # [B, T, ...] -> [B, chunks, 2W, ...]: chunk i-1's and i's rows
        widths = ((0, 0), (w, pad)) + ((0, 0),) * (x.ndim - 2)
        x = jnp.pad(x, widths, constant_values=fill)
        shape = (batch, chunks, w, *x.shape[2:])
        return jnp.concatenate([x[:, : chunks * w].reshape(shape), x[:, w:].reshape(shape)], axis=2)

    keys = band_keys(rows, 0.0)
    qc = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0))).reshape(batch, chunks, w, heads, dim)
    logits = jnp.einsum("bcqhd,bckd->bcqhk", qc, keys, precision=lax.Precision.HIGHEST)
    logits = logits.reshape(batch, chunks * w, heads, 2 * w)[:, :seq]
    qi, ki = np.arange(w)[:, None], np.arange(2 * w)[None, :]
    band = (qi < ki) & (ki <= qi + w)  # [W, 2W]
    first = band & (ki >= w)  # chunk 0: the previous chunk is before position 0
    valid = np.concatenate([first[None], np.broadcast_to(band, (chunks - 1, w, 2 * w))])
    valid = jnp.asarray(valid.reshape(chunks * w, 2 * w)[:seq])
    bad = ~band_keys(finite, True)[:, :, None, :]  # [B, chunks, 1, 2W]
    bad = jnp.broadcast_to(bad, (batch, chunks, w, 2 * w)).reshape(batch, chunks * w, 2 * w)
    poisoned = jnp.any(bad[:, :seq] & valid, axis=-1)
    return logits, keys, jnp.broadcast_to(valid[:, None, :], (batch, seq, 1, 2 * w)), poisoned


def masked_attention(
    q: Float[Array, "batch seq head dim"],
    window_kv: Float[Array, "batch seq dim"],
    kv: Float[Array, "batch n_kv dim"],
    key_mask: Bool[Array, "batch seq n_kv"],
    sink: Float[Array, " head"],
    *,
    window_size: int,
    scale: float | None = None,
) -> MaskedAttentionResult:
    """`sparse_attention` for a whole sequence: a sliding window over the sequence's own rows
    and the selection given as a mask over its compressed KV (prefill, training).

    The same function as `sparse_attention` of query p with the window rows of positions
    p−W+1..p (`sliding_window_rows`) and `indices` = the True positions of `key_mask[p]`
    (selections hold distinct positions, so nothing is counted twice), laid out for a sequence:
    the window is a band computed chunk by chunk (O(T·W) per head, no per-query gather), and
    every query shares the compressed KV, scored with one [T, S] matmul per head (O(T·S)).

    Args:
      q: [B, T, H, D] queries of positions 0..T−1.
      window_kv: [B, T, D] the window KV row of every position (K = V).
      kv: [B, S, D] compressed KV of the sequence (K = V); key_mask: [B, T, S] selected keys.
      sink: [H] per-head sink logit (unscaled, zero value).
      window_size: W >= 0, the window's length.
      scale: logit scale, default D^-0.5.

    Returns:
      `MaskedAttentionResult(out [B, T, H, D], probs [B, T, H, S], lse [B, T, H])`.

    Non-finite values stay where `sparse_attention` puts them: a NaN or ±inf in a key a query
    attends to (its window or its selection) makes that query's output non-finite, one in a key
    it does not attend to has no effect on it (a shared matmul would otherwise spread 0·NaN to
    every query of the sequence).
    """
    q, window_kv = jnp.asarray(q), jnp.asarray(window_kv)
    kv, key_mask, sink = jnp.asarray(kv), jnp.asarray(key_mask), jnp.asarray(sink)
    for name, x, kind, layout in (
        ("q", q, "floating", "[B, T, H, D]"),
        ("window_kv", window_kv, "floating", "[B, T, D]"),
        ("kv", kv, "floating", "[B, S, D]"),
        ("key_mask", key_mask, "bool", "[B, T, S]"),
        ("sink", sink, "floating", "[H]"),
    ):
        require_dtype(name, x, kind)
        if x.ndim != layout.count(",") + 1:
            raise ValueError(f"{name}: expected shape {layout}, got {x.shape}")
    batch, seq, n_heads, dim = q.shape
    for name, x, want in (
        ("window_kv", window_kv, (batch, seq, dim)),
        ("kv", kv, (batch, kv.shape[1], dim)),
        ("key_mask", key_mask, (batch, seq, kv.shape[1])),
        ("sink", sink, (n_heads,)),
    ):
        if x.shape != want:
            raise ValueError(f"{name}: expected shape {want} (from q and kv), got {x.shape}")
    if isinstance(window_size, bool) or not isinstance(window_size, int) or window_size < 0:
        raise ValueError(f"window_size: expected an int >= 0, got {window_size!r}")
    scale = _resolve_scale(scale, dim)
    hi = lax.Precision.HIGHEST
    q32 = q.astype(jnp.float32)
    kv, finite_kv = _finite_rows(kv.astype(jnp.float32))
    poisoned = jnp.any(key_mask & ~finite_kv[:, None, :], axis=-1)  # [B, T]
    kv_logits = jnp.einsum("bthd,bsd->bths", q32, kv, precision=hi)
    if window_size and seq:
        rows, finite_w = _finite_rows(window_kv.astype(jnp.float32))
        w_logits, w_keys, w_valid, w_poisoned = _window_logits(q32, rows, finite_w, window_size)
        poisoned = poisoned | w_poisoned
        logits = jnp.concatenate([w_logits, kv_logits], axis=-1)
        valid = jnp.concatenate(
            [w_valid, jnp.broadcast_to(key_mask[:, :, None], (batch, seq, 1, key_mask.shape[-1]))],
            axis=-1,
        )
    else:
        logits, valid, w_logits = kv_logits, key_mask[:, :, None], None
    probs, lse = softmax_with_sink(logits * scale, valid, sink)
    out = jnp.einsum(
        "bths,bsd->bthd", probs[..., logits.shape[-1] - kv.shape[1] :], kv, precision=hi
    )
    if w_logits is not None:
        band = 2 * window_size
        chunks = w_keys.shape[1]
        pw = jnp.pad(probs[..., :band], ((0, 0), (0, chunks * window_size - seq), (0, 0), (0, 0)))
        pw = pw.reshape(batch, chunks, window_size, n_heads, band)
        out_w = jnp.einsum("bcqhk,bckd->bcqhd", pw, w_keys, precision=hi)
        out = out + out_w.reshape(batch, chunks * window_size, n_heads, dim)[:, :seq]
        probs = probs[..., band:]
    nan = jnp.float32(jnp.nan)
    out = jnp.where(poisoned[..., None, None], nan, out)
    lse = jnp.where(poisoned[..., None], nan, lse)
    probs = jnp.where(poisoned[..., None, None], nan, probs)
    return MaskedAttentionResult(out, probs, lse)


def chunk_attention(
    q: Float[Array, "batch query head dim"],
    window_rows: Float[Array, "batch query window dim"],
    window_valid: Bool[Array, "batch query window"],
    kv: Float[Array, "batch n_kv dim"],
    sink: Float[Array, " head"],
    *,
    indices: Int[Array, "batch query topk"] | None = None,
    key_mask: Bool[Array, "batch query n_kv"] | None = None,
    scale: float | None = None,
) -> MaskedAttentionResult:
    """`sparse_attention` of a chunk of a sequence's queries (long-sequence training, prefill).

    Each query attends to its own window rows (`sliding_window_rows`) and to compressed keys
    given one of two ways:
      - `indices` [B, C, K]: its selection, gathered from `kv` (O(C·(W + K)) memory: the sparse
        layers' form, no [T, S] array);
      - `key_mask` [B, C, S]: a mask over the whole of `kv`, shared by the chunk's queries (dense
        attention: the warm-up and the dense baseline, O(C·S) memory).
    The same function as `masked_attention` for these queries (one softmax over window, keys and
    sink; the sink's rule; a query without keys outputs 0), and the same treatment of
    non-finite keys: a NaN or ±inf in a key the query attends to makes its output, probabilities
    and lse NaN; one in a key it does not attend to has no effect on it.

    Args:
      q: [B, C, H, D] queries; window_rows: [B, C, W, D] and window_valid: [B, C, W] their windows.
      kv: [B, S, D] the sequence's compressed KV (K = V); sink: [H] per-head sink logits.
      indices: [B, C, K] selected positions, −1 (anything outside [0, S)) for none; or
      key_mask: [B, C, S] the attended positions. Exactly one of the two.
      scale: logit scale, default D^-0.5.

    Returns:
      `MaskedAttentionResult(out [B, C, H, D], probs [B, C, H, K] (`indices` order) or
      [B, C, H, S], lse [B, C, H])`, float32; probs are normalized with the window and the sink.
    """
    if (indices is None) == (key_mask is None):
        raise ValueError("chunk_attention: expected exactly one of indices and key_mask")
    q, window_rows, window_valid = (
        jnp.asarray(q),
        jnp.asarray(window_rows),
        jnp.asarray(window_valid),
    )
    kv, sink = jnp.asarray(kv), jnp.asarray(sink)
    if q.ndim != 4:
        raise ValueError(f"q: expected shape [B, C, H, D], got {q.shape}")
    batch, n_query, n_heads, dim = q.shape
    n_kv, n_window = kv.shape[1], window_rows.shape[2]
    for name, x, want in (
        ("window_rows", window_rows, (batch, n_query, n_window, dim)),
        ("window_valid", window_valid, (batch, n_query, n_window)),
        ("kv", kv, (batch, n_kv, dim)),
        ("sink", sink, (n_heads,)),
    ):
        if x.shape != want:
            raise ValueError(f"{name}: expected shape {want} (from q), got {x.shape}")
    scale = _resolve_scale(scale, dim)
    hi = lax.Precision.HIGHEST
    q32 = q.astype(jnp.float32)
    rows, finite_w = _finite_rows(window_rows.astype(jnp.float32))
    kv, finite_kv = _finite_rows(kv.astype(jnp.float32))
    poisoned = jnp.any(window_valid & ~finite_w, axis=-1)
    if indices is not None:
        indices = jnp.asarray(indices)
        require_dtype("indices", indices, "integer")
        if indices.shape[:2] != (batch, n_query) or indices.ndim != 3:
            raise ValueError(
                f"indices: expected shape [{batch}, {n_query}, K], got {indices.shape}"
            )
        selected = (indices >= 0) & (indices < n_kv)
        safe = jnp.where(selected, indices, 0).reshape(batch, -1)
        keys = jnp.take_along_axis(kv, safe[..., None], axis=1, mode="clip")
        keys = keys.reshape(*indices.shape, dim)
        key_finite = jnp.take_along_axis(finite_kv, safe, axis=1, mode="clip")
        poisoned |= jnp.any(selected & ~key_finite.reshape(indices.shape), axis=-1)
        keys = jnp.concatenate([rows, jnp.where(selected[..., None], keys, 0.0)], axis=2)
        valid = jnp.concatenate([window_valid, selected], axis=-1)
        logits = jnp.einsum("bchd,bckd->bchk", q32, keys, precision=hi)
        probs, lse = softmax_with_sink(logits * scale, valid[:, :, None], sink)
        out = jnp.einsum("bchk,bckd->bchd", probs, keys, precision=hi)
    else:
        key_mask = jnp.asarray(key_mask)
        require_dtype("key_mask", key_mask, "bool")
        if key_mask.shape != (batch, n_query, n_kv):
            raise ValueError(
                f"key_mask: expected shape {(batch, n_query, n_kv)} (q's and kv's), "
                f"got {key_mask.shape}"
            )
        poisoned |= jnp.any(key_mask & ~finite_kv[:, None, :], axis=-1)
        logits = jnp.concatenate(
            [
                jnp.einsum("bchd,bcwd->bchw", q32, rows, precision=hi),
                jnp.einsum("bchd,bsd->bchs", q32, kv, precision=hi),
            ],
            axis=-1,
        )
        valid = jnp.concatenate([window_valid, key_mask], axis=-1)
        probs, lse = softmax_with_sink(logits * scale, valid[:, :, None], sink)
        out = jnp.einsum("bchw,bcwd->bchd", probs[..., :n_window], rows, precision=hi)
        out = out + jnp.einsum("bchs,bsd->bchd", probs[..., n_window:], kv, precision=hi)
    nan = jnp.float32(jnp.nan)
    out = jnp.where(poisoned[..., None, None], nan, out)
    lse = jnp.where(poisoned[..., None], nan, lse)
    probs = jnp.where(poisoned[..., None, None], nan, probs[..., n_window:])
    return MaskedAttentionResult(out, probs, lse)


def _resolve_scale(scale: float | Float[Array, ""] | None, dim: int) -> float | Float[Array, ""]:
    """D^-0.5 by default; a Python number must be finite, a traced scalar passes unchecked."""
    if scale is None:
        return dim**-0.5
    if isinstance(scale, int | float | np.number) and not isinstance(scale, bool):
        if not np.isfinite(scale):
            raise ValueError(f"scale: expected a finite number or None, got {scale!r}")
        return float(scale)
    try:
        scale = jnp.asarray(scale)
    except TypeError:
        raise ValueError(f"scale: expected a float scalar or None, got {scale!r}") from None
    if scale.shape != () or not jnp.issubdtype(scale.dtype, jnp.floating):
        raise ValueError(
            f"scale: expected a float scalar or None, got shape {scale.shape} dtype {scale.dtype}"
        )
    return scale


@overload
def sparse_attention(
    q: Float[Array, "*batch head dim"],
    window_kv: Float[Array, "*#batch window dim"],
    window_valid: Bool[Array, "*#batch window"],
    kv: Float[Array, "*#batch n_kv dim"],
    indices: Int[Array, "*#batch topk"],
    sink: Float[Array, " head"],
    *,
    scale: float | Float[Array, ""] | None = None,
    return_probs: Literal[False] = False,
) -> Float[Array, "*batch head dim"]: ...


@overload
def sparse_attention(
    q: Float[Array, "*batch head dim"],
    window_kv: Float[Array, "*#batch window dim"],
    window_valid: Bool[Array, "*#batch window"],
    kv: Float[Array, "*#batch n_kv dim"],
    indices: Int[Array, "*#batch topk"],
    sink: Float[Array, " head"],
    *,
    scale: float | Float[Array, ""] | None = None,
    return_probs: Literal[True],
) -> SparseAttentionResult: ...


def sparse_attention(
    q: Float[Array, "*batch head dim"],
    window_kv: Float[Array, "*#batch window dim"],
    window_valid: Bool[Array, "*#batch window"],
    kv: Float[Array, "*#batch n_kv dim"],
    indices: Int[Array, "*#batch topk"],
    sink: Float[Array, " head"],
    *,
    scale: float | Float[Array, ""] | None = None,
    return_probs: bool = False,
) -> Float[Array, "*batch head dim"] | SparseAttentionResult:
    """Window + top-k + sink attention of one or many queries (DESIGN §3 step 4).

    The window comes as gathered rows with a validity mask, the one form both callers can build
    cheaply: prefill gathers each query's last `window_size` tokens, decode passes its ring buffer
    (unfilled slots invalid). Compressed keys come as the whole compressed KV plus per-query
    indices into it, the form the kernel consumes. Unlike the reference's concatenated KV, the
    indices carry no window offset.

    Every argument except `sink` broadcasts against q's batch dims `...` by numpy rules, e.g.
    q [B, T, H, D] with kv [B, 1, N, D] (one compressed cache for the T queries of a sequence)
    and window_kv [B, T, W, D] (prefill) or [B, 1, W, D] (a decode ring buffer).

    Args:
      q: [..., H, D] queries (RoPE applied), any float dtype.
      window_kv: [..., W, D] window keys = values; W may be 0.
      window_valid: [..., W] bool, False at slots to skip (beyond the sequence start, unfilled).
      kv: [..., N, D] compressed keys = values.
      indices: [..., K] integer rows of kv to attend to; −1 (any value outside [0, N)) skips the
        slot, duplicates are attended twice. K may be 0.
      sink: [H] per-head sink logit, added unscaled with a zero value; −inf disables it.
      scale: logit scale (a number, or a float scalar array under jit); default D^-0.5.
      return_probs: also return the per-slot probabilities and the log-sum-exp.

    Returns:
      out [..., H, D] float32, or `SparseAttentionResult(out, probs, lse)` if return_probs.
    """
    q, window_kv, window_valid = jnp.asarray(q), jnp.asarray(window_kv), jnp.asarray(window_valid)
    kv, indices, sink = jnp.asarray(kv), jnp.asarray(indices), jnp.asarray(sink)
    for name, x, kind, ndim, layout in (
        ("q", q, "floating", 2, "[..., H, D]"),
        ("window_kv", window_kv, "floating", 2, "[..., W, D]"),
        ("window_valid", window_valid, "bool", 1, "[..., W]"),
        ("kv", kv, "floating", 2, "[..., N, D]"),
        ("indices", indices, "integer", 1, "[..., K]"),
        ("sink", sink, "floating", 1, "[H]"),
    ):
        require_dtype(name, x, kind)
        require_min_ndim(name, x, ndim, layout)
    batch, (n_heads, dim) = q.shape[:-2], q.shape[-2:]
    for name, x in (("window_kv", window_kv), ("kv", kv)):
        if x.shape[-1] != dim:
            raise ValueError(f"{name}: expected last dim D = {dim} (q's), got shape {x.shape}")
        require_broadcast(name, x.shape, (*batch, x.shape[-2], dim))
    require_broadcast("window_valid", window_valid.shape, (*batch, window_kv.shape[-2]))
    require_broadcast("indices", indices.shape, (*batch, indices.shape[-1]))
    if sink.shape != (n_heads,):
        raise ValueError(f"sink: expected shape ({n_heads},) (q's H), got {sink.shape}")
    scale = _resolve_scale(scale, dim)

    result = _sparse_attention_xla(q, window_kv, window_valid, kv, indices, sink, scale)
    n_keys = window_kv.shape[-2] + indices.shape[-1]
    chex.assert_shape(
        result, [(*batch, n_heads, dim), (*batch, n_heads, n_keys), (*batch, n_heads)]
    )
    chex.assert_type(result, jnp.float32)
    return result if return_probs else result.out


def check_packed_attention_args(
    q: Array,
    kv_packed: Array,
    indices: Array,
    window_packed: Array,
    window_valid: Array,
    sink: Array,
    kv_fmt: str,
    window_fmt: str,
) -> None:
    """The argument checks of `packed_sparse_attention`, which every implementation of the op
    runs (the kernels included): each names the bad argument, the expected and received value."""
    for name, x, ndim, layout, kind in (
        ("q", q, 3, "[B, H, D]", jnp.floating),
        ("kv_packed", kv_packed, 3, "[B, S, row_bytes]", jnp.unsignedinteger),
        ("indices", indices, 2, "[B, K]", jnp.integer),
        ("window_packed", window_packed, 3, "[B, W, row_bytes]", jnp.unsignedinteger),
        ("window_valid", window_valid, 2, "[B, W]", jnp.bool_),
        ("sink", sink, 1, "[H]", jnp.floating),
    ):
        if x.ndim != ndim or not jnp.issubdtype(x.dtype, kind):
            raise ValueError(f"{name}: expected {layout} {kind.__name__}, got {x.dtype}{x.shape}")
    batch, n_heads, dim = q.shape
    for name, x, fmt in (
        ("kv_packed", kv_packed, kv_fmt),
        ("window_packed", window_packed, window_fmt),
    ):
        want = (batch, x.shape[1], formats.packed_row_bytes(fmt, dim))
        if x.shape != want or x.dtype != jnp.uint8:
            raise ValueError(
                f"{name}: expected uint8{want} ({fmt} rows of D = {dim}), got {x.dtype}{x.shape}"
            )
    if indices.shape[0] != batch:
        raise ValueError(f"indices: expected [{batch}, K] (q's B), got {indices.shape}")
    if window_valid.shape != window_packed.shape[:2]:
        raise ValueError(
            f"window_valid: expected {window_packed.shape[:2]} (window_packed's [B, W]), "
            f"got {window_valid.shape}"
        )
    if sink.shape != (n_heads,):
        raise ValueError(f"sink: expected shape ({n_heads},) (q's H), got {sink.shape}")


def packed_sparse_attention(
    q: Float[Array, "batch head dim"],
    kv_packed: UInt8[Array, "batch n_kv kv_row"],
    indices: Int[Array, "batch topk"],
    window_packed: UInt8[Array, "batch window window_row"],
    window_valid: Bool[Array, "batch window"],
    sink: Float[Array, " head"],
    *,
    kv_fmt: str = "nvfp4",
    window_fmt: str = "fp8",
    scale: float | None = None,
) -> Float[Array, "batch head dim"]:
    """Window + top-k + sink attention of B single queries over packed caches (decode; float32).

    Gathers the selected packed main-KV rows, unpacks only those (what a kernel must read),
    unpacks the window rows, then runs `sparse_attention` with the selected rows as a per-query
    KV of K rows indexed 0..K−1 (−1 where the original index is invalid), so every semantic rule
    lives in `sparse_attention`.

    Args:
      q: [B, H, D] queries (bf16 or f32).
      kv_packed: [B, S, packed_row_bytes(kv_fmt, D)] uint8: each query's compressed cache.
      indices: [B, K] integer rows of kv_packed; −1 (any value outside [0, S)) skips the slot.
      window_packed: [B, W, packed_row_bytes(window_fmt, D)] uint8: each query's window rows.
      window_valid: [B, W] bool, False at slots to skip (a ring slot not yet written).
      sink: [H] float sink logits (−inf disables the sink).
      kv_fmt, window_fmt: packed formats (`formats.FORMATS`).
      scale: logit scale; default D^-0.5.

    Returns:
      [B, H, D] float32.
    """
    q, kv_packed, indices = jnp.asarray(q), jnp.asarray(kv_packed), jnp.asarray(indices)
    window_packed, window_valid = jnp.asarray(window_packed), jnp.asarray(window_valid)
    sink = jnp.asarray(sink)
    check_packed_attention_args(
        q, kv_packed, indices, window_packed, window_valid, sink, kv_fmt, window_fmt
    )
    dim = q.shape[-1]
    selected, local = _selected_rows(kv_packed, indices, kv_fmt, dim, first_position=0)
    window = formats.unpack(window_packed, window_fmt, dim)
    return sparse_attention(q, window, window_valid, selected, local, sink, scale=scale)


def _selected_rows(
    kv_packed: UInt8[Array, "batch rows kv_row"],
    indices: Int[Array, "batch topk"],
    kv_fmt: str,
    dim: int,
    first_position: int | Int[Array, ""],
) -> tuple[Float[Array, "batch topk dim"], Int[Array, "batch topk"]]:
    """The selected rows that `kv_packed` holds (positions first_position … + rows − 1), gathered
    and unpacked, and their slots as `sparse_attention` indices: k for slot k, −1 where the
    index is −1 or held elsewhere."""
    local = indices - first_position
    valid = (indices >= 0) & (local >= 0) & (local < kv_packed.shape[1])
    rows = jnp.take_along_axis(kv_packed, jnp.where(valid, local, 0)[..., None], axis=1)
    selected = formats.unpack(rows, kv_fmt, dim)
    return selected, jnp.where(valid, jnp.arange(indices.shape[-1], dtype=jnp.int32), -1)


def sharded_packed_sparse_attention(
    q: Float[Array, "batch head dim"],
    kv_packed: UInt8[Array, "batch n_kv kv_row"],
    indices: Int[Array, "batch topk"],
    window_packed: UInt8[Array, "batch window window_row"],
    window_valid: Bool[Array, "batch window"],
    sink: Float[Array, " head"],
    *,
    mesh: jax.sharding.Mesh,
    axis: str,
    batch_axis: str | None = None,
    kv_fmt: str = "nvfp4",
    window_fmt: str = "fp8",
    scale: float | None = None,
) -> Float[Array, "batch head dim"]:
    """`packed_sparse_attention` with the packed main-KV cache sharded by position over the mesh
    axis `axis` (issue 15): equal to it up to float summation order.

    Each device gathers and unpacks only the selected rows it holds (`_selected_rows`) and
    computes the partial statistics of the softmax over them (`_softmax_terms`, the one
    definition): its maximum logit m_d, its sum of exponentials l_d = Σ e^{s − m_d} and its
    weighted values o_d = Σ e^{s − m_d}·v. The window rows and the sink count on the last device
    of `axis` only: the window holds the newest tokens, which a sequence-sharded cache keeps
    where the sequence ends; here they come replicated (a window is W ≤ 128 rows), and the other
    devices mark them invalid and use a −inf sink. The partials combine by the log-sum-exp rule:
    M = pmax(m_d), out = psum(o_d·e^{m_d − M}) / psum(l_d·e^{m_d − M}). A device without a valid
    key or sink counts m_d = −inf (and contributes 0). The rules of `sparse_attention` carry
    over: a query without a valid key outputs 0, −1 (or any index outside [0, S)) skips a slot,
    duplicates count twice, and a NaN in a selected row or valid window row makes that query's
    output NaN (through every partial sum it enters) and no other query's.

    Args:
      q: [B, H, D] queries; sink: [H]; window_packed: [B, W, row] and window_valid: [B, W] the
        window rows, replicated over `axis`; kv_fmt, window_fmt, scale: as
        `packed_sparse_attention`.
      kv_packed: [B, S, packed_row_bytes(kv_fmt, D)] uint8, S divisible by mesh.shape[axis].
      indices: [B, K] global positions into kv_packed (−1 for none), replicated over `axis`.
      mesh: the device mesh; axis: its axis the positions are sharded over; batch_axis: an
        optional mesh axis the rows are sharded over (B divisible by its size).

    Returns:
      [B, H, D] float32.
    """
    q, kv_packed, indices = jnp.asarray(q), jnp.asarray(kv_packed), jnp.asarray(indices)
    window_packed, window_valid = jnp.asarray(window_packed), jnp.asarray(window_valid)
    sink = jnp.asarray(sink)
    check_packed_attention_args(
        q, kv_packed, indices, window_packed, window_valid, sink, kv_fmt, window_fmt
    )
    n_local = check_sequence_sharding("kv_packed", "S", kv_packed.shape, 1, mesh, axis, batch_axis)
    dim = q.shape[-1]
    if not (kv_packed.shape[0] and kv_packed.shape[1]):
        # No key to shard (a zero-size shard_map operand does not compile): the window alone.
        return packed_sparse_attention(
            q, kv_packed, indices, window_packed, window_valid, sink,
            kv_fmt=kv_fmt, window_fmt=window_fmt, scale=scale,
        )  # fmt: skip
    scale = jnp.asarray(_resolve_scale(scale, dim), jnp.float32)
    n_dev = mesh.shape[axis]

    def local(q, kv_packed, indices, sink, scale, *window):
        device = lax.axis_index(axis)
        selected, slots = _selected_rows(kv_packed, indices, kv_fmt, dim, device * n_local)
        if window:
            window_packed, window_valid = window
        else:
            window_packed = jnp.zeros((q.shape[0], 0, window_row), jnp.uint8)
            window_valid = jnp.zeros((q.shape[0], 0), bool)
        window = formats.unpack(window_packed, window_fmt, dim)
        owner = device == n_dev - 1
        keys, valid, logits = _attention_logits(
            q, window, window_valid & owner, selected, slots, scale
        )
        row_max, weights, denom = _softmax_terms(
            logits, valid[..., None, :], jnp.where(owner, sink, -jnp.inf)
        )
        hi = lax.Precision.HIGHEST
        values = jnp.einsum("...hj,...jd->...hd", weights, keys, precision=hi)
        # A device with nothing to add reports m = −inf (`_softmax_terms` gives 0 and l = 0).
        row_max = jnp.where(denom == 0, -jnp.inf, row_max)
        top = lax.pmax(row_max, axis)
        rescale = jnp.exp(row_max - jnp.where(jnp.isneginf(top), 0.0, top))
        total = lax.psum(denom * rescale, axis)
        values = lax.psum(values * rescale[..., None], axis)
        return values / jnp.where(total == 0, 1.0, total)[..., None]

    # An empty window is built inside: a zero-size shard_map operand crashes XLA's CPU
    # compiler (jax 0.11.2).
    window_row = window_packed.shape[-1]
    window = (window_packed, window_valid) if window_packed.shape[1] else ()
    rows = P(batch_axis)
    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(rows, P(batch_axis, axis), rows, P(), P(), *(rows,) * len(window)),
        out_specs=rows,
    )(q, kv_packed, indices, sink, scale, *window)
