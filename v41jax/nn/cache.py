"""The decode cache: packed rows in the formats of `v41jax.ops.formats` (DESIGN §3–§4), and how
a layer's cache is built from a prefill and written by a decode step.

Per layer (`LayerCache`):
  - window: the sliding window as a ring buffer of `window_size` packed rows (FP8 by default,
    528 B per 512-dim row), slot = position % window_size;
  - main_kv (KV sources): packed compressed main KV rows, NVFP4 by default (288 B per 512 dims),
    row j = entry j; `table_rows` rows (the entries of `max_len` tokens, rounded up);
  - index_k (Full layers): packed index keys, MXFP4 by default (68 B per 128 dims);
  - kv_state / score_state (KV sources with ratio > 1): the compressor's buffer of the current,
    incomplete group, float32 [B, ratio, head_dim].
`Cache` adds the per-sequence lengths (tokens already in the cache). The bytes of global KV that
it holds per token are what `v41jax.accounting` computes for the same config (tested).

The builders below are pure functions of arrays: `Attention.prefill_cache` and
`Attention.decode` compute the rows, these place them.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import struct
from jaxtyping import Array, Bool, Float, Int, UInt8

from pallas_kernels import pooled_scoring as pooled_kernel
from v41jax.nn.config import ModelConfig, Role
from v41jax.ops import formats


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


def table_rows(max_len: int, ratio: int) -> int:
    """Rows of a compressed table (main KV, index keys) that holds `max_len` tokens at compress
    `ratio`: the ceil(max_len / ratio) entries, rounded up to a multiple of the kernels'
    `pooled_scoring.IN_PLACE_ROWS` (32: 4 candidate blocks of 8). The kernels read a table of
    any other length only after copying it whole into whole blocks, at every call: the two index
    tables' copies took 4.0 ms of an 8.5 ms decode step at 1 M tokens × 32 sequences on the
    H200 (2026-12-04, BENCHMARKS.md).
    The rows past the entries are never visible (a query sees `compress_lens` entries)."""
    entries = -(-max_len // ratio)
    multiple = pooled_kernel.IN_PLACE_ROWS
    return -(-entries // multiple) * multiple


def init_cache(config: ModelConfig, batch: int, max_len: int) -> Cache:
    """An empty cache (all lengths 0) for `batch` sequences of up to `max_len` tokens."""
    if batch <= 0:
        raise ValueError(f"batch: expected a positive int, got {batch}")
    if max_len <= 0:
        raise ValueError(f"max_len: expected a positive int, got {max_len}")
    c = config
    window_row = formats.packed_row_bytes(c.window_format, c.head_dim)
    layers = []
    for plan in c.layers:
        layer = LayerCache(window=jnp.zeros((batch, c.window_size, window_row), jnp.uint8))
        if plan.role in (Role.FULL, Role.DENSE):
            r = plan.compress_ratio
            entries = table_rows(max_len, r)
            kv_row = formats.packed_row_bytes(c.kv_format, c.head_dim, rope_dim=c.rope_head_dim)
            layer = layer.replace(main_kv=jnp.zeros((batch, entries, kv_row), jnp.uint8))
            if plan.role is Role.FULL:
                index_row = formats.packed_row_bytes(c.index_format, c.index_head_dim)
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

    Equal to `accounting`'s global KV bytes per token when every table holds exactly the entries
    of `max_len` tokens (`max_len` a multiple of `IN_PLACE_ROWS` × every compress ratio: no rows
    added by `table_rows`); the window ring and compressor buffers are per sequence, not per
    token.
    """
    total = 0
    for layer in cache.layers:
        for table in (layer.main_kv, layer.index_k):
            if table is not None:
                total += table.shape[1] * table.shape[2]
    return total / cache.max_len


# --- building a layer's cache ---


def window_slot_valid(position: Int[Array, " b"], window: int) -> Bool[Array, "b window"]:
    """Which ring-buffer slots hold a token for a query at `position` (the token itself included).

    Slot s holds the latest position p <= `position` with p ≡ s (mod window); it is valid iff
    p >= 0, i.e. the ring buffer has been written there for this sequence.
    """
    slots = jnp.arange(window)
    latest = position[:, None] - (position[:, None] - slots) % window
    return latest >= 0


def ring_from_prefill(
    window_kv: Float[Array, "b t d"], lengths: Int[Array, " b"], window: int, fmt: str
) -> UInt8[Array, "b window row"]:
    """The window ring after a prefill of `lengths` tokens: slot s holds the latest position
    p < length with p ≡ s (mod window), packed in `fmt`; slots never written are zero."""
    rows = jnp.arange(window_kv.shape[0])[:, None]
    last = lengths[:, None] - 1
    slot_pos = last - (last - jnp.arange(window)) % window
    ring = formats.pack(window_kv[rows, jnp.maximum(slot_pos, 0)], fmt)
    return jnp.where((slot_pos >= 0)[..., None], ring, 0)


def table_from_prefill(
    values: Float[Array, "b n d"], lengths: Int[Array, " b"], ratio: int, max_len: int, fmt: str
) -> UInt8[Array, "b entries row"]:
    """A compressed table (main KV or index keys) after a prefill: the entries complete within
    each sequence's `lengths`, packed in `fmt`, zero beyond; `table_rows(max_len, ratio)` rows."""
    packed = formats.pack(values, fmt)
    complete = lengths[:, None] // ratio
    packed = jnp.where((jnp.arange(packed.shape[1]) < complete)[..., None], packed, 0)
    rows = table_rows(max_len, ratio)
    return jnp.pad(packed, ((0, 0), (0, rows - packed.shape[1]), (0, 0)))


def buffer_from_prefill(
    kv: Float[Array, "b t d"], score: Float[Array, "b t d"], lengths: Int[Array, " b"], ratio: int
) -> tuple[Float[Array, "b ratio d"], Float[Array, "b ratio d"]]:
    """The compressor's buffer after a prefill: each sequence's trailing incomplete group of
    projected tokens and gate scores (zeros and −inf in the slots it has not filled)."""
    rows = jnp.arange(kv.shape[0])[:, None]
    tail = lengths[:, None] // ratio * ratio + jnp.arange(ratio)
    buffered = tail < lengths[:, None]
    tail = jnp.minimum(tail, kv.shape[1] - 1)
    return (
        jnp.where(buffered[..., None], kv[rows, tail], 0.0),
        jnp.where(buffered[..., None], score[rows, tail], -jnp.inf),
    )


def write_ring(
    ring: UInt8[Array, "b window row"], positions: Int[Array, " b"], row: UInt8[Array, "b row"]
) -> UInt8[Array, "b window row"]:
    """Writes each sequence's packed window row at its slot, position % window."""
    slot = positions % ring.shape[1]
    return ring.at[jnp.arange(ring.shape[0]), slot].set(row)


def write_entry(
    table: UInt8[Array, "b entries row"],
    entry: Int[Array, " b"],
    row: UInt8[Array, "b row"],
    complete: Bool[Array, " b"],
) -> UInt8[Array, "b entries row"]:
    """Writes packed row `entry` of the sequences whose group is `complete`; the others keep
    theirs."""
    rows = jnp.arange(table.shape[0])
    old = table[rows, entry]
    return table.at[rows, entry].set(jnp.where(complete[:, None], row, old))
