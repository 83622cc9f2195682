"""The decode cache: packed rows in the formats of `v41jax.quant` (DESIGN §3–§4).

Per layer (`LayerCache`):
  - window: the sliding window as a ring buffer of `window_size` packed rows (FP8 by default,
    528 B per 512-dim row), slot = position % window_size;
  - main_kv (KV sources): packed compressed main KV rows, NVFP4 by default (288 B per 512 dims),
    row j = entry j;
  - index_k (Full layers): packed index keys, MXFP4 by default (68 B per 128 dims);
  - kv_state / score_state (KV sources with ratio > 1): the compressor's buffer of the current,
    incomplete group, float32 [B, ratio, head_dim].
`Cache` adds the per-sequence lengths (tokens already in the cache). The bytes of global KV that
it holds per token are what `v41jax.accounting` computes for the same config (tested).
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import struct
from jaxtyping import Array, Float, Int, UInt8

from v41jax import quant
from v41jax.config import ModelConfig, Role


@struct.dataclass
class LayerCache:
    """One layer's part of the cache; fields a layer's role does not use are None."""

    window: UInt8[Array, "b window row"]
    main_kv: UInt8[Array, "b entries row"] | None = None
    index_k: UInt8[Array, "b entries irow"] | None = None
    kv_state: Float[Array, "b ratio d"] | None = None
    score_state: Float[Array, "b ratio d"] | None = None


@struct.dataclass
class Cache:
    """The whole decode cache: per-layer packed rows and per-sequence lengths.

    Attributes:
      lengths: [B] int32, tokens already cached per sequence; the next token's position.
      layers: one `LayerCache` per layer.
      max_len: tokens the cache can hold per sequence (static).
    """

    lengths: Int[Array, " b"]
    layers: tuple[LayerCache, ...]
    max_len: int = struct.field(pytree_node=False)

    @property
    def batch(self) -> int:
        return self.lengths.shape[0]


def init_cache(config: ModelConfig, batch: int, max_len: int) -> Cache:
    """An empty cache (all lengths 0) for `batch` sequences of up to `max_len` tokens."""
    if batch <= 0:
        raise ValueError(f"batch: expected a positive int, got {batch}")
    if max_len <= 0:
        raise ValueError(f"max_len: expected a positive int, got {max_len}")
    c = config
    window_row = quant.packed_row_bytes(c.window_format, c.head_dim)
    layers = []
    for plan in c.layers:
        layer = LayerCache(window=jnp.zeros((batch, c.window_size, window_row), jnp.uint8))
        if plan.role in (Role.FULL, Role.DENSE):
            r = plan.compress_ratio
            entries = -(-max_len // r)
            kv_row = quant.packed_row_bytes(c.kv_format, c.head_dim, rope_dim=c.rope_head_dim)
            layer = layer.replace(main_kv=jnp.zeros((batch, entries, kv_row), jnp.uint8))
            if plan.role is Role.FULL:
                index_row = quant.packed_row_bytes(c.index_format, c.index_head_dim)
                layer = layer.replace(index_k=jnp.zeros((batch, entries, index_row), jnp.uint8))
            if r > 1:
                layer = layer.replace(
                    kv_state=jnp.zeros((batch, r, c.head_dim), jnp.float32),
                    score_state=jnp.full((batch, r, c.head_dim), -jnp.inf, jnp.float32),
                )
        layers.append(layer)
    return Cache(lengths=jnp.zeros((batch,), jnp.int32), layers=tuple(layers), max_len=max_len)


def global_kv_bytes_per_token(cache: Cache) -> float:
    """Bytes of compressed main KV and index keys the cache holds per token of capacity.

    Equal to `accounting`'s global KV bytes per token when `max_len` is a multiple of every
    compress ratio (the window ring and compressor buffers are per sequence, not per token).
    """
    total = 0
    for layer in cache.layers:
        for table in (layer.main_kv, layer.index_k):
            if table is not None:
                total += table.shape[1] * table.shape[2]
    return total / cache.max_len
