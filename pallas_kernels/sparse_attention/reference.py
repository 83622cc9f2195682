"""The op's definition: sparse attention over a packed FP4 cache, plus the BF16-cache baseline.

DESIGN §3 step 4 and §6 (kernel 2), `v41_architecture.md` §5. For each query b: gather the packed
main-KV rows its top-k selects, unpack them (`v41jax.quant.unpack`), unpack its FP8 window rows, and
run `v41jax.sparse_attention.sparse_attention`: one softmax over the valid window keys, the
selected compressed keys and a per-head sink logit (unscaled, zero value), K = V, scale D^-0.5,
−1 slots skipped, an empty row gives zeros, duplicates count twice.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, UInt8

from v41jax import quant
from v41jax.sparse_attention import sparse_attention


def _gather_rows(
    kv_packed: UInt8[Array, "batch n_kv row"], indices: Int[Array, "batch topk"]
) -> tuple[UInt8[Array, "batch topk row"], Bool[Array, "batch topk"]]:
    """The selected packed rows (row 0 at a −1 or out-of-range slot) and their validity."""
    valid = (indices >= 0) & (indices < kv_packed.shape[1])
    safe = jnp.where(valid, indices, 0)
    return jnp.take_along_axis(kv_packed, safe[..., None], axis=1), valid


def fp4_sparse_attention_reference(
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
    """Window + top-k + sink attention of B single queries over packed caches (XLA, float32).

    Only the selected rows are unpacked (what a kernel must read), then the library's softmax
    runs on them: the selected keys are passed as a per-query KV of K rows indexed 0..K−1 (−1
    where the original index is invalid), so every semantic rule lives in `sparse_attention`.

    Args:
      q: [B, H, D] queries (bf16 or f32).
      kv_packed: [B, S, packed_row_bytes(kv_fmt, D)] uint8: each query's compressed cache.
      indices: [B, K] integer rows of kv_packed; −1 (any value outside [0, S)) skips the slot.
      window_packed: [B, W, packed_row_bytes(window_fmt, D)] uint8: each query's window rows.
      window_valid: [B, W] bool, False at slots to skip (a ring slot not yet written).
      sink: [H] float32 sink logits (−inf disables the sink).
      kv_fmt, window_fmt: packed formats (`v41jax.quant.FORMATS`).
      scale: logit scale; default D^-0.5.

    Returns:
      [B, H, D] float32.
    """
    dim = q.shape[-1]
    rows, valid = _gather_rows(kv_packed, indices)
    selected = quant.unpack(rows, kv_fmt, dim)
    window = quant.unpack(window_packed, window_fmt, dim)
    local = jnp.where(valid, jnp.arange(indices.shape[-1], dtype=jnp.int32), -1)
    return sparse_attention(q, window, window_valid, selected, local, sink, scale=scale)


def bf16_cache_attention(
    q: Float[Array, "batch head dim"],
    kv: Float[Array, "batch n_kv dim"],
    indices: Int[Array, "batch topk"],
    window: Float[Array, "batch window dim"],
    window_valid: Bool[Array, "batch window"],
    sink: Float[Array, " head"],
    *,
    scale: float | None = None,
) -> Float[Array, "batch head dim"]:
    """Baseline (a): the same attention as XLA would run it over a BF16 cache (DESIGN §6).

    Gather the selected bf16 rows, bf16 einsums with float32 accumulation, float32 softmax with
    the sink, probabilities cast to bf16 before PV (the official kernel's choice): the fast XLA
    path a BF16 cache allows, not the float32 definition.

    Args:
      q: [B, H, D]; kv: [B, S, D] bf16; indices: [B, K] (−1 skips); window: [B, W, D] bf16;
      window_valid: [B, W] bool; sink: [H] float32; scale: default D^-0.5.

    Returns:
      [B, H, D] float32.
    """
    dim = q.shape[-1]
    scale = dim**-0.5 if scale is None else scale
    valid = (indices >= 0) & (indices < kv.shape[1])
    selected = jnp.take_along_axis(kv, jnp.where(valid, indices, 0)[..., None], axis=1)
    keys = jnp.concatenate([window.astype(jnp.bfloat16), selected.astype(jnp.bfloat16)], axis=1)
    valid = jnp.concatenate([window_valid, valid], axis=1)
    keys = jnp.where(valid[..., None], keys, jnp.zeros((), jnp.bfloat16))
    logits = jnp.einsum(
        "bhd,bjd->bhj", q.astype(jnp.bfloat16), keys, preferred_element_type=jnp.float32
    )
    logits = jnp.where(valid[:, None, :], logits * scale, -jnp.inf)
    sink = sink.astype(jnp.float32)[None, :]
    row_max = jnp.maximum(jnp.max(logits, axis=-1), sink)
    row_max = jnp.where(row_max > -jnp.inf, row_max, 0.0)
    weights = jnp.exp(logits - row_max[..., None])
    denom = jnp.sum(weights, axis=-1) + jnp.exp(sink - row_max)
    probs = weights / jnp.where(denom > 0, denom, 1.0)[..., None]
    return jnp.einsum(
        "bhj,bjd->bhd", probs.astype(jnp.bfloat16), keys, preferred_element_type=jnp.float32
    )


def unpacked_caches(
    kv_packed: UInt8[Array, "batch n_kv kv_row"],
    window_packed: UInt8[Array, "batch window window_row"],
    dim: int,
    *,
    kv_fmt: str = "nvfp4",
    window_fmt: str = "fp8",
) -> tuple[Float[Array, "batch n_kv dim"], Float[Array, "batch window dim"]]:
    """The packed caches as bf16 arrays: the inputs of `bf16_cache_attention` holding the same
    (exactly representable) values, for comparing the two on one cache."""
    unpack = jax.jit(quant.unpack, static_argnums=(1, 2), static_argnames="dtype")
    return (
        unpack(kv_packed, kv_fmt, dim, dtype=jnp.bfloat16),
        unpack(window_packed, window_fmt, dim, dtype=jnp.bfloat16),
    )
