"""Rotary position embedding on the tail of a vector, interleaved pairs (`v41_architecture.md` §3).

V4.1 rotates only the last `rope_dim` dims of each vector (main queries, window KV, compressed KV,
indexer queries and keys), treating elements (2i, 2i+1) of that tail as one complex number. The
core attention's output gets the inverse rotation at the query's own position (§5), because
V = K carries rotated dims. YaRN (used by the real model beyond 64K tokens) is not modelled.
"""

import jax.numpy as jnp
from jaxtyping import Array, Float, Int


def rope_angles(
    positions: Int[Array, "*p"], rope_dim: int, theta: float
) -> Float[Array, "*p half"]:
    """Rotation angles `positions * theta**(-2i/rope_dim)` for i < rope_dim/2, float32."""
    if rope_dim % 2:
        raise ValueError(f"rope_dim: expected an even number, got {rope_dim}")
    inv_freq = theta ** (-jnp.arange(0, rope_dim, 2, dtype=jnp.float32) / rope_dim)
    return positions.astype(jnp.float32)[..., None] * inv_freq


def apply_rope(
    x: Float[Array, "*batch dim"],
    positions: Int[Array, "*pos"],
    rope_dim: int,
    theta: float,
    *,
    inverse: bool = False,
) -> Float[Array, "*batch dim"]:
    """Rotates the last `rope_dim` dims of `x` by its position (interleaved pairs).

    Args:
      x: [..., dim] vectors; the leading dims must broadcast against `positions` once the
        trailing axes that `positions` lacks are added (e.g. x [B, T, H, D] with positions [T, 1]
        or [B, T, 1]).
      positions: integer positions, broadcastable to `x.shape[:-1]`.
      rope_dim: number of rotated trailing dims (even; 0 returns `x` unchanged).
      theta: RoPE base.
      inverse: rotate by the negative angle (the conjugate), undoing a forward rotation.

    Returns:
      `x` with its tail rotated, same shape and dtype.
    """
    if rope_dim == 0:
        return x
    if rope_dim > x.shape[-1]:
        raise ValueError(f"rope_dim: expected <= x.shape[-1] = {x.shape[-1]}, got {rope_dim}")
    angles = rope_angles(positions, rope_dim, theta)
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    if inverse:
        sin = -sin
    head, tail = x[..., :-rope_dim], x[..., -rope_dim:].astype(jnp.float32)
    pairs = tail.reshape(*tail.shape[:-1], rope_dim // 2, 2)
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = jnp.stack([even * cos - odd * sin, even * sin + odd * cos], axis=-1)
    rotated = rotated.reshape(tail.shape).astype(x.dtype)
    return jnp.concatenate([head, rotated], axis=-1)
