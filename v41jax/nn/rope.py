"""Rotary position embedding on the tail of a vector, interleaved pairs, with optional YaRN
(`v41_architecture.md` §1, §3).

V4.1 rotates only the last `rope_dim` dims of each vector (main queries, window KV, compressed KV,
indexer queries and keys), treating elements (2i, 2i+1) of that tail as one complex number. The
core attention's output gets the inverse rotation at the query's own position (§5), because
V = K carries rotated dims.

YaRN (`Yarn`) rescales the rotation frequencies, as the reference's frequency table does: pair i
turns at f_i = theta^(−2i/rope_dim) radians per position; its wavelength 2π/f_i is compared with
the original context L through the correction dims d(β) = rope_dim·ln(L / (2πβ)) / (2 ln theta),
the dim at which a pair turns β times over L. With low = max(⌊d(beta_fast)⌋, 0) and
high = min(⌈d(beta_slow)⌉, rope_dim − 1), the ramp r_i = clip((i − low) / (high − low), 0, 1)
blends

    f_i' = f_i / factor · r_i + f_i · (1 − r_i):

pairs below `low` (fast, many turns over L) keep their frequency, pairs from `high` on (slow,
wavelengths beyond L) are divided by `factor`, those between are on a linear ramp. The attention
scale is not changed (V4.1 has no mscale). The rescaled table holds at **every** position, not
only beyond L: V4.1's serving length (1 M) exceeds L = 65,536, so its layers with compressed KV
(base `compress_rope_theta`: queries, window KV, compressed KV, indexer) always turn at f'; its
window-only layers keep plain RoPE with `rope_theta`. With rope_dim 64, theta 160,000, L 65,536,
factor 16, β 32/1: low 15, high 25, so 16 of the 32 pairs are rescaled (pair 15 sits at the
ramp's foot, unchanged).
"""

import math
from typing import NamedTuple

import jax.numpy as jnp
from jaxtyping import Array, Float, Int


class Yarn(NamedTuple):
    """YaRN's frequency rescaling (module docstring), as V4.1's config.json names it.

    Attributes:
      factor: frequencies beyond the original context are divided by it (`rope_factor`, 16).
      original_len: the original training context L (`original_seq_len`, 65,536).
      beta_fast: turns over L at and above which a pair is kept (32).
      beta_slow: turns over L at and below which a pair is fully divided (1).
    """

    factor: float
    original_len: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0


def yarn_ramp(rope_dim: int, theta: float, yarn: Yarn) -> tuple[int, int, Float[Array, " half"]]:
    """(low, high, ramp [rope_dim/2] float32): YaRN's correction range and the ramp r_i, 0 for
    kept pairs, 1 for fully divided ones (module docstring)."""

    def correction_dim(turns: float) -> float:
        return (
            rope_dim * math.log(yarn.original_len / (turns * 2 * math.pi)) / (2 * math.log(theta))
        )

    low = max(math.floor(correction_dim(yarn.beta_fast)), 0)
    high = min(math.ceil(correction_dim(yarn.beta_slow)), rope_dim - 1)
    width = (high - low) or 0.001  # the reference's guard when low == high
    ramp = jnp.clip((jnp.arange(rope_dim // 2, dtype=jnp.float32) - low) / width, 0.0, 1.0)
    return low, high, ramp


def rope_frequencies(
    rope_dim: int, theta: float, yarn: Yarn | None = None
) -> Float[Array, " half"]:
    """Radians per position of each pair, f_i = theta^(−2i/rope_dim), YaRN-rescaled when `yarn`
    is given; float32 [rope_dim/2]."""
    if rope_dim % 2:
        raise ValueError(f"rope_dim: expected an even number, got {rope_dim}")
    freqs = theta ** (-jnp.arange(0, rope_dim, 2, dtype=jnp.float32) / rope_dim)
    if yarn is None or not rope_dim:
        return freqs
    _, _, ramp = yarn_ramp(rope_dim, theta, yarn)
    return freqs / yarn.factor * ramp + freqs * (1.0 - ramp)


def rope_angles(
    positions: Int[Array, "*p"], rope_dim: int, theta: float, yarn: Yarn | None = None
) -> Float[Array, "*p half"]:
    """Rotation angles `positions * f_i` for i < rope_dim/2 (`rope_frequencies`), float32."""
    return positions.astype(jnp.float32)[..., None] * rope_frequencies(rope_dim, theta, yarn)


def apply_rope(
    x: Float[Array, "*batch dim"],
    positions: Int[Array, "*pos"],
    rope_dim: int,
    theta: float,
    *,
    inverse: bool = False,
    yarn: Yarn | None = None,
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
      yarn: YaRN's rescaling of the frequencies (`Yarn`), or None for plain RoPE.

    Returns:
      `x` with its tail rotated, same shape and dtype.
    """
    if rope_dim == 0:
        return x
    if rope_dim > x.shape[-1]:
        raise ValueError(f"rope_dim: expected <= x.shape[-1] = {x.shape[-1]}, got {rope_dim}")
    angles = rope_angles(positions, rope_dim, theta, yarn)
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    if inverse:
        sin = -sin
    head, tail = x[..., :-rope_dim], x[..., -rope_dim:].astype(jnp.float32)
    pairs = tail.reshape(*tail.shape[:-1], rope_dim // 2, 2)
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = jnp.stack([even * cos - odd * sin, even * sin + odd * cos], axis=-1)
    rotated = rotated.reshape(tail.shape).astype(x.dtype)
    return jnp.concatenate([head, rotated], axis=-1)
