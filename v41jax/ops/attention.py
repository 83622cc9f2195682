"""Core sparse attention: one softmax over window keys, selected compressed keys and a sink.

DESIGN §3 step 4, `v41_architecture.md` §5. For head h of one query, over the valid keys j (the
query's window rows, then the compressed rows its top-k selects):

    out_h = Σ_j e^{s_hj}·v_j / (Σ_j e^{s_hj} + e^{sink_h}),   s_hj = q_h·k_j·scale,

with K = V (one latent per key), the sink logit unscaled and carrying a zero value vector, and
scale = D^-0.5 by default. Invalid keys (window slots marked invalid, index −1) are skipped; a
query with no valid key outputs exactly zero (the sink then holds all the mass), never NaN.
Duplicated indices count twice, as in the reference (there is no deduplication, §5).

Three forms of the one op, all built on `softmax_with_sink`:
- `sparse_attention`: queries with per-query indices into a float compressed KV (the definition);
- `packed_sparse_attention`: the same over the packed caches of decode (gather the selected
  packed rows, unpack only those, `sparse_attention`): the definition the FP4-dequant kernel of
  `pallas_kernels.sparse_attention` is tested against (DESIGN §6);
- `masked_attention`: a whole sequence with the selection as a [T, S] mask (prefill, training).
"""

from __future__ import annotations

from typing import Literal, NamedTuple, overload

import chex
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array, Bool, Float, Int, UInt8

from v41jax.ops import formats
from v41jax.ops.checks import require_broadcast, require_dtype, require_min_ndim


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
    probs, lse = softmax_with_sink(logits * scale, valid[..., None, :], sink)
    out = jnp.einsum("...hj,...jd->...hd", probs, keys, precision=lax.Precision.HIGHEST)
    return SparseAttentionResult(out, probs, lse)


def softmax_with_sink(
    logits: Float[Array, "*batch head key"], valid: Bool[Array, "*#batch #head key"], sink
) -> tuple[Float[Array, "*batch head key"], Float[Array, "*batch head"]]:
    """Softmax over the valid keys and the per-head sink logit; (probs, lse). 0 at invalid keys.

    The sink is one more logit per head with a zero value vector (DESIGN §3 step 4): it takes
    part in the normaliser only, so a row's probabilities sum to 1 − (the sink's share)."""
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
    lse = row_max + jnp.log(denom)
    probs = weights / jnp.where(denom == 0, 1.0, denom)[..., None]
    return probs, lse


def masked_attention(
    q: Float[Array, "batch seq head dim"],
    window_kv: Float[Array, "batch seq window dim"],
    window_valid: Bool[Array, "batch seq window"],
    kv: Float[Array, "batch n_kv dim"],
    key_mask: Bool[Array, "batch seq n_kv"],
    sink: Float[Array, " head"],
    *,
    scale: float | None = None,
) -> SparseAttentionResult:
    """`sparse_attention` for a whole sequence, with the selection given as a mask over `kv`.

    The same function as `sparse_attention` with `indices` = the True positions of `key_mask`
    (selections hold distinct positions, so nothing is counted twice), laid out for prefill and
    training: every query row shares the sequence's compressed KV, and the selected keys are
    scored with one [T, S] matmul per head instead of a [T, K, D] gather, which is what makes
    training on the CPU affordable. Like the official reference, it computes every position and
    masks; the cost is O(T·S) per head.

    Args:
      q: [B, T, H, D] queries.
      window_kv: [B, T, W, D] each query's window rows; window_valid: [B, T, W].
      kv: [B, S, D] compressed KV of the sequence (K = V); key_mask: [B, T, S] selected keys.
      sink: [H] per-head sink logit (unscaled, zero value).
      scale: logit scale, default D^-0.5.

    Returns:
      `SparseAttentionResult(out [B, T, H, D], probs [B, T, H, W + S] (window slots, then every
      position of `kv`, 0 where not selected), lse [B, T, H])`.

    Non-finite values stay where `sparse_attention` puts them: a NaN or ±inf in a selected key
    makes that query's output non-finite, one in a key the query does not select has no effect
    on it (the [T, S] matmul would otherwise spread 0·NaN to every query of the sequence).
    """
    q, window_kv, window_valid = jnp.asarray(q), jnp.asarray(window_kv), jnp.asarray(window_valid)
    kv, key_mask, sink = jnp.asarray(kv), jnp.asarray(key_mask), jnp.asarray(sink)
    for name, x, kind, layout in (
        ("q", q, "floating", "[B, T, H, D]"),
        ("window_kv", window_kv, "floating", "[B, T, W, D]"),
        ("window_valid", window_valid, "bool", "[B, T, W]"),
        ("kv", kv, "floating", "[B, S, D]"),
        ("key_mask", key_mask, "bool", "[B, T, S]"),
        ("sink", sink, "floating", "[H]"),
    ):
        require_dtype(name, x, kind)
        if x.ndim != layout.count(",") + 1:
            raise ValueError(f"{name}: expected shape {layout}, got {x.shape}")
    (batch, seq, n_heads, dim), n_window = q.shape, window_kv.shape[2]
    for name, x, want in (
        ("window_kv", window_kv, (batch, seq, n_window, dim)),
        ("window_valid", window_valid, (batch, seq, n_window)),
        ("kv", kv, (batch, kv.shape[1], dim)),
        ("key_mask", key_mask, (batch, seq, kv.shape[1])),
        ("sink", sink, (n_heads,)),
    ):
        if x.shape != want:
            raise ValueError(f"{name}: expected shape {want} (from q and kv), got {x.shape}")
    scale = _resolve_scale(scale, dim)
    q32 = q.astype(jnp.float32)
    window_kv = jnp.where(window_valid[..., None], window_kv.astype(jnp.float32), 0.0)
    kv = kv.astype(jnp.float32)
    finite_row = jnp.all(jnp.isfinite(kv), axis=-1)  # [B, S]
    poisoned = jnp.any(key_mask & ~finite_row[:, None, :], axis=-1)  # [B, T]
    hi = lax.Precision.HIGHEST
    logits = jnp.concatenate(
        [
            jnp.einsum("bthd,btwd->bthw", q32, window_kv, precision=hi),
            jnp.einsum("bthd,bsd->bths", q32, kv, precision=hi),
        ],
        axis=-1,
    )
    valid = jnp.concatenate([window_valid, key_mask], axis=-1)[..., None, :]
    probs, lse = softmax_with_sink(logits * scale, valid, sink)
    n_window = window_kv.shape[-2]
    out = jnp.einsum("bthw,btwd->bthd", probs[..., :n_window], window_kv, precision=hi)
    clean = jnp.where(finite_row[..., None], kv, 0.0)
    out = out + jnp.einsum("bths,bsd->bthd", probs[..., n_window:], clean, precision=hi)
    out = jnp.where(poisoned[..., None, None], jnp.nan, out)
    return SparseAttentionResult(out, probs, lse)


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
    valid = (indices >= 0) & (indices < kv_packed.shape[1])
    rows = jnp.take_along_axis(kv_packed, jnp.where(valid, indices, 0)[..., None], axis=1)
    selected = formats.unpack(rows, kv_fmt, dim)
    window = formats.unpack(window_packed, window_fmt, dim)
    local = jnp.where(valid, jnp.arange(indices.shape[-1], dtype=jnp.int32), -1)
    return sparse_attention(q, window, window_valid, selected, local, sink, scale=scale)
