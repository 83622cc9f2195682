"""FP4-dequant sparse attention through the Pallas Triton backend: the stepping stone.

DESIGN §6 kernel 2, the same contract as `kernel_mgpu` (bf16 output), written the plain
way: one program per (query, 64 heads); each chunk of 64 key slots is gathered with per-element
pointer arithmetic (a byte per dim for the E2M1 nibbles, a byte per dim for the scales: the
duplicate addresses hit L1), decoded with float arithmetic, and fed to two `jnp.dot`s (bf16 in,
float32 out) with an online softmax opened by the sink. The Triton backend is deprecated since JAX
0.11 (DESIGN §1); this kernel is kept as a baseline and as the easiest version to read.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.triton as plt
import jax.numpy as jnp
from jax import lax

from pallas_kernels.dispatch import Support, support
from v41jax.ops import formats

BLOCK_HEADS = 64
BLOCK_KV = 64
_LOG2E = math.log2(math.e)


def supports(*, kv_fmt: str, window_fmt: str, dim: int) -> Support:
    """Whether the kernel takes attention over `kv_fmt` main-KV rows and `window_fmt` window rows
    of `dim` values: NVFP4 main KV, FP8 window, D a power of two >= 32 (Triton blocks)."""
    return support(
        "the FP4 sparse-attention Triton kernel",
        (kv_fmt == "nvfp4", "kv_fmt", "'nvfp4'", kv_fmt),
        (window_fmt == "fp8", "window_fmt", "'fp8'", window_fmt),
        (dim >= 32 and not dim & (dim - 1), "dim", "a power of two >= 32", dim),
    )


@dataclasses.dataclass(frozen=True)
class TuningConfig:
    """Knobs of the Triton kernel.

    Args:
      num_warps: warps per program (the [64, D] float32 accumulator needs 8 at D = 512).
      num_stages: software-pipelining depth Triton may use for the chunk loop.
    """

    num_warps: int = 8
    num_stages: int = 1


def _e4m3(byte: jax.Array) -> jax.Array:
    """float32 value of E4M3 bytes (the hardware conversion: exact, NaN code → NaN)."""
    return lax.bitcast_convert_type(byte, jnp.float8_e4m3fn).astype(jnp.float32)


def _ue8m0(byte: jax.Array) -> jax.Array:
    """2^(byte − 127) from the float32 exponent field; 0xFF → NaN; 0x00 (2^-127, never written by
    `pack`) → 0."""
    power = lax.bitcast_convert_type(byte.astype(jnp.int32) << 23, jnp.float32)
    return jnp.where(byte == 0xFF, jnp.nan, power)


def _e2m1(nibble: jax.Array) -> jax.Array:
    """float32 value of E2M1 nibbles (sign in bit 3): magnitude codes 0..7 are the integers
    {0, 1, 2, 3, 4, 6, 8, 12} halved; 2+m shifted by e−1 for the normal codes."""
    code = nibble & 7
    normal = (2 + (code & 1)) << jnp.maximum((code >> 1) - 1, 0)
    value = jnp.where(code < 4, code, normal).astype(jnp.float32) * 0.5
    return jnp.where(nibble >= 8, -value, value)


def _kernel(
    q_ref,
    kv_ref,
    win_ref,
    slots_ref,
    sink_ref,
    o_ref,
    *,
    dim: int,
    n_window_chunks: int,
    n_topk_chunks: int,
    logit_scale: float,
):
    b = pl.program_id(0)
    q = q_ref[...]
    dims = jnp.arange(dim, dtype=jnp.int32)[None, :]

    def chunk_rows(chunk):
        slots = slots_ref[pl.ds(chunk * BLOCK_KV, BLOCK_KV)]
        return slots >= 0, jnp.maximum(slots, 0)[:, None]

    def attend(keys, valid, carry):
        acc, m, denom = carry
        keys = jnp.where(valid[:, None], keys, 0.0).astype(jnp.bfloat16)
        s = jnp.dot(q, keys.T, preferred_element_type=jnp.float32)
        s = jnp.where(valid[None, :], s * logit_scale, -jnp.inf)
        m_new = jnp.maximum(m, s.max(axis=1))
        alpha = jnp.exp2(m - m_new)
        p = jnp.exp2(s - m_new[:, None])
        denom = denom * alpha + p.sum(axis=1)
        pv = jnp.dot(p.astype(jnp.bfloat16), keys, preferred_element_type=jnp.float32)
        return acc * alpha[:, None] + pv, m_new, denom

    def window_step(c, carry):
        valid, rows = chunk_rows(c)
        values = _e4m3(win_ref[b, rows, dims])
        scales = _ue8m0(win_ref[b, rows, dim + dims // 32])
        return attend(values * scales, valid, carry)

    def topk_step(c, carry):
        valid, rows = chunk_rows(n_window_chunks + c)
        packed = kv_ref[b, rows, dims // 2]
        values = _e2m1((packed >> ((dims & 1) * 4).astype(jnp.uint8)) & 0xF)
        scales = _e4m3(kv_ref[b, rows, dim // 2 + dims // 16])
        return attend(values * scales, valid, carry)

    sink = sink_ref[...]
    m0 = jnp.maximum(sink, -1e30)
    carry = (jnp.zeros((BLOCK_HEADS, dim), jnp.float32), m0, jnp.exp2(sink - m0))
    carry = lax.fori_loop(0, n_window_chunks, window_step, carry)
    acc, _, denom = lax.fori_loop(0, n_topk_chunks, topk_step, carry)
    o_ref[...] = (acc / jnp.where(denom > 0, denom, 1.0)[:, None]).astype(o_ref.dtype)


def _round_up(n: int, k: int) -> int:
    return -(-n // k) * k


def fp4_sparse_attention_triton(
    q: jax.Array,
    kv_packed: jax.Array,
    indices: jax.Array,
    window_packed: jax.Array,
    window_valid: jax.Array,
    sink: jax.Array,
    *,
    kv_fmt: str = "nvfp4",
    window_fmt: str = "fp8",
    scale: float | None = None,
    config: TuningConfig = TuningConfig(),
    interpret: bool = False,
) -> jax.Array:
    """Triton forward of `v41jax.ops.attention.packed_sparse_attention`; arguments as in
    `kernel_mgpu.fp4_sparse_attention_mgpu` (a call `supports` takes). Returns [B, H, D]
    bfloat16."""
    batch, n_heads, dim = q.shape
    supported = supports(kv_fmt=kv_fmt, window_fmt=window_fmt, dim=dim)
    if not supported:
        raise supported.error()
    scale = dim**-0.5 if scale is None else scale
    n_kv, n_window = kv_packed.shape[1], window_packed.shape[1]
    heads = _round_up(max(n_heads, 1), BLOCK_HEADS)
    q = jnp.pad(q.astype(jnp.bfloat16), ((0, 0), (0, heads - n_heads), (0, 0)))
    sink = jnp.pad(sink.astype(jnp.float32) * _LOG2E, (0, heads - n_heads), constant_values=-1e30)
    window_slots = jnp.where(window_valid, jnp.arange(n_window, dtype=jnp.int32), -1)
    topk_slots = jnp.where((indices >= 0) & (indices < n_kv), indices, -1).astype(jnp.int32)
    pad = lambda x: jnp.pad(
        x, ((0, 0), (0, _round_up(x.shape[1], BLOCK_KV) - x.shape[1])), constant_values=-1
    )
    window_slots, topk_slots = pad(window_slots), pad(topk_slots)
    slots = jnp.concatenate([window_slots, topk_slots], axis=1)
    if n_kv == 0:  # a clamped −1 slot still reads row 0
        kv_packed = jnp.zeros((batch, 1, formats.packed_row_bytes("nvfp4", dim)), jnp.uint8)
    if n_window == 0:
        window_packed = jnp.zeros((batch, 1, formats.packed_row_bytes("fp8", dim)), jnp.uint8)

    kernel = functools.partial(
        _kernel,
        dim=dim,
        n_window_chunks=window_slots.shape[1] // BLOCK_KV,
        n_topk_chunks=topk_slots.shape[1] // BLOCK_KV,
        logit_scale=scale * _LOG2E,
    )
    whole = lambda x: pl.BlockSpec(x.shape, lambda b, g: (0,) * x.ndim)
    out = pl.pallas_call(
        kernel,
        grid=(batch, heads // BLOCK_HEADS),
        in_specs=[
            pl.BlockSpec((None, BLOCK_HEADS, dim), lambda b, g: (b, g, 0)),
            whole(kv_packed),
            whole(window_packed),
            pl.BlockSpec((None, slots.shape[1]), lambda b, g: (b, 0)),
            pl.BlockSpec((BLOCK_HEADS,), lambda b, g: (g,)),
        ],
        out_specs=pl.BlockSpec((None, BLOCK_HEADS, dim), lambda b, g: (b, g, 0)),
        out_shape=jax.ShapeDtypeStruct((batch, heads, dim), jnp.bfloat16),
        compiler_params=plt.CompilerParams(
            num_warps=config.num_warps, num_stages=config.num_stages
        ),
        interpret=interpret,
        name="fp4_sparse_attention_triton",
    )(q, kv_packed, window_packed, slots, sink)
    return out[:, :n_heads]
