"""FP4/FP8 KV formats: fake-quant with a straight-through gradient, packed rows, row bytes.

DESIGN §4 fixes the rules (all over the last axis, groups of consecutive values):

| name    | used for        | group | scale | scale rule                              | element |
|---------|-----------------|-------|-------|-----------------------------------------|---------|
| 'nvfp4' | main KV         | 16    | E4M3  | e4m3_rne_satfinite(max(amax, 6·2⁻⁹)/6)  | E2M1    |
| 'mxfp4' | indexer q and k | 32    | E8M0  | 2^ceil(log2(max(amax, 6·2⁻¹²⁶)/6))      | E2M1    |
| 'fp8'   | window KV       | 32    | UE8M0 | 2^ceil(log2(max(amax, 1e-4)/448))       | E4M3    |
| 'bf16'  | baseline        | 1     | none  |                                         | bf16    |
| 'f32'   | no quantization | 1     | none  |                                         | float32 |

Elements are x / s (float32 division) clamped to the element's max (6 or 448) and rounded to
nearest even; the dequantized value is element · s. 'v4_fp8' (DeepSeek-V4's legacy 584 B row) is
registered for byte accounting only. Each format says which caches may store it (`Format.uses`:
'kv' main KV, 'index' index keys and indexer queries, 'window' window KV); the model config and
the CLI read their choices from here (`formats_for`).

No rounding here is a cast round trip through float4/float8/bfloat16: under `jit` on the GPU,
XLA's excess-precision pass deletes those (DESIGN §4, first trap). Rounding is integer arithmetic
on float32 bits, exact power-of-two scaling and `jnp.round` (half to even); the section "Exact
float32 arithmetic" below names two more XLA behaviours that the code works around. The results
are bit-identical on CPU and GPU (tests/test_quant.py::test_gpu_matches_cpu).

Conventions shared by all functions:
- Inputs may be float32, bfloat16 or float16; the arithmetic is float32 and the result is cast
  back to the input dtype (an ordinary round-to-nearest cast, so an MXFP4/FP8 value rounded up past
  the dtype's largest finite number, e.g. |x| close to 65504 in float16, becomes ±inf).
- Signed zero: the sign of an element is kept, so a negative value that rounds to zero gives -0.0
  (as the E2M1/E4M3 sign bit and ml_dtypes do); fq(-x) == -fq(x) bit for bit.
- Non-finite input never becomes a finite number: a group that holds a NaN or ±inf dequantizes to
  NaN in all its positions (its packed scale byte is the format's NaN code, so unpacking gives the
  same). 'bf16' keeps IEEE semantics per element (±inf stays ±inf, NaN stays NaN).
- `pack*` refuse non-finite concrete input with a ValueError. Traced input (inside `jit`) cannot be
  inspected, so it is packed as above; wrap `checked_pack` with `jax.experimental.checkify` to get
  a reported error instead.
"""

from __future__ import annotations

import dataclasses
import functools
import types
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.typing import DTypeLike
from jaxtyping import Array, ArrayLike, Float, Int, UInt8

from v41jax.ops.checks import check_finite

_FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_BITS = {"e2m1": 4, "e4m3": 8, "e8m0": 8, "bf16": 16, "f32": 32}
_SCALE_NAN_CODE = {"e4m3": 0x7F, "e8m0": 0xFF}


@dataclasses.dataclass(frozen=True)
class Format:
    """One KV/index storage format (DESIGN §4).

    Args:
      name: registry key ('nvfp4', 'mxfp4', 'fp8', 'bf16', 'f32', 'v4_fp8').
      group_size: consecutive values along the last axis that share one scale (1: no scale).
      element: element encoding, 'e2m1', 'e4m3', 'bf16' or 'f32'.
      scale: scale encoding, 'e4m3', 'e8m0' (E8M0/UE8M0: a biased power-of-two exponent) or None.
      amax_floor: the group's max magnitude is raised to at least this before the scale rule, so an
        all-zero group keeps a finite, nonzero scale.
      rope_element: encoding of the trailing rope dims when a row stores them apart from the
        quantized ones (only 'v4_fp8': bf16); None when they are quantized like the rest.
      scale_align: the scale bytes of a row are padded up to a multiple of this.
      accounting_only: the format only answers `packed_row_bytes`; it has no fake-quant or packing.
      uses: the caches that may store it: 'kv' (main KV), 'index' (index keys and indexer
        queries), 'window' (sliding-window KV).
    """

    name: str
    group_size: int
    element: str
    scale: str | None
    amax_floor: float = 0.0
    rope_element: str | None = None
    scale_align: int = 1
    accounting_only: bool = False
    uses: frozenset[str] = frozenset({"kv", "index", "window"})


CACHE_ROLES = ("kv", "index", "window")
"""The caches a `Format` can be used for (`Format.uses`)."""

FORMATS: Mapping[str, Format] = types.MappingProxyType(
    {
        "nvfp4": Format(
            "nvfp4", 16, "e2m1", "e4m3", amax_floor=6 * 2.0**-9, uses=frozenset({"kv"})
        ),
        "mxfp4": Format(
            "mxfp4", 32, "e2m1", "e8m0", amax_floor=6 * 2.0**-126, uses=frozenset({"kv", "index"})
        ),
        "fp8": Format("fp8", 32, "e4m3", "e8m0", amax_floor=1e-4, uses=frozenset({"kv", "window"})),
        "bf16": Format("bf16", 1, "bf16", None),
        # Identity: the exact reference, e.g. to check prefill against decode without rounding.
        "f32": Format("f32", 1, "f32", None),
        # DeepSeek-V4's main-KV row: 448 E4M3 nope values with one UE8M0 scale per 64 (7 bytes,
        # padded to 8) and the 64 rope dims kept in bf16: 448 + 8 + 128 = 584 B.
        "v4_fp8": Format(
            "v4_fp8",
            64,
            "e4m3",
            "e8m0",
            rope_element="bf16",
            scale_align=8,
            accounting_only=True,
            uses=frozenset({"kv"}),
        ),
    }
)


def formats_for(use: str, *, quantizable: bool = False) -> tuple[str, ...]:
    """Names of the registered formats a cache may store, in registry order.

    Args:
      use: 'kv' (main KV), 'index' (index keys) or 'window' (window KV).
      quantizable: leave out the accounting-only formats (what a model can run with).
    """
    if use not in CACHE_ROLES:
        raise ValueError(f"use: expected one of {CACHE_ROLES}, got {use!r}")
    return tuple(
        name
        for name, f in FORMATS.items()
        if use in f.uses and not (quantizable and f.accounting_only)
    )


def _format(fmt: str, *, quantizable: bool = True) -> Format:
    """The registered Format called `fmt`; ValueError if unknown (or accounting-only when
    `quantizable`)."""
    choices = [n for n, f in FORMATS.items() if not (quantizable and f.accounting_only)]
    if fmt not in FORMATS:
        raise ValueError(f"fmt: expected one of {choices}, got {fmt!r}")
    f = FORMATS[fmt]
    if quantizable and f.accounting_only:
        raise ValueError(
            f"fmt: {fmt!r} is accounting-only (it has no fake-quant, pack or unpack); "
            f"expected one of {choices}"
        )
    return f


def packed_row_bytes(fmt: str, dim: int, *, rope_dim: int = 0) -> int:
    """Bytes of one packed row of `dim` values in format `fmt` (DESIGN §4 layouts, §5 tables).

    nvfp4: D/2 + D/16 (288 for D=512); mxfp4: D/2 + D/32 (68 for D=128); fp8: D + D/32 (528 for
    D=512); bf16: 2·D; v4_fp8: (D − rope_dim) + ceil8((D − rope_dim)/64) + 2·rope_dim (584 for
    D=512, rope_dim=64). `rope_dim` only changes 'v4_fp8', the one layout that stores rope dims
    apart; the V4.1 formats quantize the rope dims with the rest.
    """
    f = _format(fmt, quantizable=False)
    if isinstance(dim, bool) or not isinstance(dim, int | np.integer) or dim <= 0:
        raise ValueError(f"dim: expected a positive int, got {dim!r}")
    if not 0 <= rope_dim <= dim:
        raise ValueError(f"rope_dim: expected 0 <= rope_dim <= dim={dim}, got {rope_dim}")
    quantized = dim - rope_dim if f.rope_element else dim
    if quantized % f.group_size:
        what = "dim - rope_dim" if f.rope_element else "dim"
        raise ValueError(
            f"dim: expected a positive {what} that is a multiple of the {fmt} group size "
            f"{f.group_size}, got dim={dim}, rope_dim={rope_dim}"
        )
    data = quantized * _BITS[f.element] // 8
    scales = 0
    if f.scale:
        scales = quantized // f.group_size * _BITS[f.scale] // 8
        scales = -(-scales // f.scale_align) * f.scale_align
    rope = rope_dim * _BITS[f.rope_element] // 8 if f.rope_element else 0
    return data + scales + rope


def _checked_input(x: ArrayLike, f: Format | None, name: str = "x") -> jax.Array:
    """`x` as an array after checking its dtype and (for a Format) its last dimension."""
    dtype = jnp.dtype(x.dtype) if hasattr(x, "dtype") else jnp.asarray(x).dtype
    if dtype not in _FLOAT_DTYPES:
        raise ValueError(
            f"{name}: expected dtype float32, bfloat16 or float16, got {dtype} "
            "(cast to float32 first)"
        )
    x = jnp.asarray(x)
    if f is not None and (x.ndim == 0 or x.shape[-1] % f.group_size):
        raise ValueError(
            f"{name}: expected a last dimension that is a multiple of the {f.name} group size "
            f"{f.group_size}, got shape {x.shape}"
        )
    return x


# ---------------------------------------------------------------------------------------------
# Exact float32 arithmetic. Besides the GPU's deleted cast round trips (DESIGN §4), two more XLA
# behaviours shape this code, both observed with jax 0.11.2: XLA:CPU flushes float32 subnormals
# to zero in arithmetic (FTZ/DAZ), and XLA rewrites a division by a broadcast array as a
# multiplication by its rounded reciprocal. So values are assembled from integer fields
# (`_ldexp`), and the one true division (by an E4M3 scale) is settled exactly (`_round_quotient`).


def _exp2(k: Int[Array, "*s"]) -> Float[Array, "*s"]:
    """2**k as float32 for integer k in [-126, 127], written straight into the exponent field."""
    return lax.bitcast_convert_type((k + 127) << 23, jnp.float32)


def _floor_log2(a: Float[Array, "*s"]) -> Int[Array, "*s"]:
    """floor(log2 a) for a >= 0 normal float32; -127 for zero and subnormals."""
    return (lax.bitcast_convert_type(a, jnp.int32) >> 23) - 127


def _ceil_log2(a: Float[Array, "*s"]) -> Int[Array, "*s"]:
    """Exact ceil(log2 a) for positive normal float32 a: the exponent, plus one unless a is a
    power of two (the kernels' `fast_round_scale`)."""
    bits = lax.bitcast_convert_type(a, jnp.int32)
    return (bits >> 23) - 127 + ((bits & 0x7FFFFF) != 0).astype(jnp.int32)


def _significand_exponent(a: Float[Array, "*s"]) -> tuple[Int[Array, "*s"], Int[Array, "*s"]]:
    """Integers (n, e) with a = n · 2**e exactly, for float32 a >= 0, subnormals included."""
    bits = lax.bitcast_convert_type(a, jnp.int32)
    field, mantissa = bits >> 23, bits & 0x7FFFFF
    n = jnp.where(field > 0, mantissa | 0x800000, mantissa)
    return n, jnp.maximum(field, 1) - 150


def _ldexp(n: Int[Array, "*s"], e: Int[Array, "*s"]) -> Float[Array, "*s"]:
    """float32 n · 2**e for integers 0 <= n < 2**24, from bits: exact when representable
    (subnormals included), +inf above the range; below 2**-149 the low bits are cut (callers only
    go there for values that round to zero)."""
    bits = lax.bitcast_convert_type(n.astype(jnp.float32), jnp.int32)  # exact and normal
    field = (bits >> 23) + e
    shift = e + 149
    subnormal = jnp.where(shift >= 0, n << jnp.clip(shift, 0, 31), n >> jnp.clip(-shift, 0, 31))
    out = jnp.where(field >= 1, bits + (e << 23), subnormal)
    out = jnp.where(field >= 255, 0x7F800000, out)
    return lax.bitcast_convert_type(jnp.where(n == 0, 0, out), jnp.float32)


@dataclasses.dataclass(frozen=True)
class _Minifloat:
    """A sign-magnitude float with `mantissa_bits` stored bits, smallest normal exponent
    `min_exp` (below it, subnormals in steps of 2**(min_exp - mantissa_bits)) and largest finite
    magnitude `max_value` (code `max_code`); the sign is bit `sign_bit` of the code."""

    mantissa_bits: int
    min_exp: int
    max_value: float
    max_code: int
    sign_bit: int
    nan_code: int | None  # magnitude code that decodes to NaN (E2M1 has none)


_MINIFLOATS = types.MappingProxyType(
    {
        "e2m1": _Minifloat(1, 0, 6.0, 0x7, 3, None),
        "e4m3": _Minifloat(3, -6, 448.0, 0x7E, 7, 0x7F),
    }
)


def _round_magnitude(a: Float[Array, "*s"], spec: _Minifloat) -> Int[Array, "*s"]:
    """Magnitude code of float32 a >= 0 (finite), clamped to max_value, rounded to nearest even.

    Scaling a by the quantum of its binade (an exact power of two) puts the representable
    neighbours on consecutive integers n, so `jnp.round` (half to even) is the RNE rounding; a
    round-up into the next binade (n = 2**(M+1)) is carried by the code arithmetic.
    """
    m = spec.mantissa_bits
    a = jnp.minimum(a, spec.max_value)
    k = jnp.maximum(_floor_log2(a), spec.min_exp) - m
    n = jnp.round(a * _exp2(-k)).astype(jnp.int32)
    return ((k - (spec.min_exp - m)) << m) + n


def _round_quotient(
    a: Float[Array, "*s"], c: Float[Array, "*s"], spec: _Minifloat
) -> Int[Array, "*s"]:
    """Magnitude code of RN_f32(a / c) rounded to nearest even on `spec`'s grid, saturating.

    a >= 0 finite; c > 0 with few significant bits (an E4M3 scale, or 6), so that every grid
    midpoint times c is exact. The computed a / c may be off by an ulp or two (see above); it only
    matters next to a grid midpoint, so that decision is taken exactly: a - mid·c is exact there
    (Sterbenz), and RN_f32(a / c) lands on mid exactly when a / c is within half a float32 ulp
    of it, a tie that then goes to the even neighbour.
    """
    m = spec.mantissa_bits
    q = jnp.minimum(a / c, spec.max_value)
    k = jnp.maximum(_floor_log2(q), spec.min_exp) - m
    n = jnp.floor(q * _exp2(-k))  # grid index below q, in steps of 2**k
    mid = (n + 0.5) * _exp2(k)
    diff = a - mid * c
    half_ulp = _exp2(_floor_log2(mid) - 24) * c
    # The smallest midpoint (n = 0) is a power of two: the float32 ulp below it is half as big.
    half_ulp_below = jnp.where(n == 0, half_ulp / 2, half_ulp)
    tie = (diff <= half_ulp) & (diff >= -half_ulp_below)
    n = n + jnp.where(tie, n % 2, diff > 0)
    code = ((k - (spec.min_exp - m)) << m) + n.astype(jnp.int32)
    return jnp.minimum(code, spec.max_code)


def _minifloat_parts(code: Int[Array, "*s"], spec: _Minifloat) -> tuple[jax.Array, ...]:
    """(negative, n, e, is_nan) of codes whose magnitude is the integer n times 2**e."""
    m = spec.mantissa_bits
    magnitude = code & ((1 << spec.sign_bit) - 1)
    exponent = magnitude >> m
    n = (magnitude & ((1 << m) - 1)) + jnp.where(exponent > 0, 1 << m, 0)
    e = jnp.maximum(exponent, 1) - 1 + spec.min_exp - m
    is_nan = magnitude == (spec.nan_code if spec.nan_code is not None else -1)
    return (code >> spec.sign_bit) & 1 == 1, n, e, is_nan


def _signed_value(negative: jax.Array, n: jax.Array, e: jax.Array, is_nan: jax.Array) -> jax.Array:
    value = jnp.where(is_nan, jnp.nan, _ldexp(n, e))
    return jnp.where(negative, -value, value)


def _decode_minifloat(code: Int[Array, "*s"], spec: _Minifloat) -> Float[Array, "*s"]:
    """float32 value of `code` (exact; -0.0 for a negative zero; NaN for the NaN code)."""
    return _signed_value(*_minifloat_parts(code, spec))


def _encode_blocks(
    x: Float[Array, "*batch dim"], f: Format
) -> tuple[Int[Array, "*batch dim"], Int[Array, "*batch groups"]]:
    """Element codes and per-group scale codes of float32 `x` under the block format `f`."""
    element = _MINIFLOATS[f.element]
    groups = x.reshape(*x.shape[:-1], x.shape[-1] // f.group_size, f.group_size)
    finite = jnp.all(jnp.isfinite(groups), axis=-1, keepdims=True)
    # A non-finite group is marked by its NaN scale code; zeroing it keeps the arithmetic finite.
    groups = jnp.where(finite, groups, 0.0)
    magnitude = jnp.abs(groups)
    amax = jnp.maximum(jnp.max(magnitude, axis=-1, keepdims=True), f.amax_floor)
    if f.scale == "e4m3":
        e4m3 = _MINIFLOATS["e4m3"]
        scale_code = _round_quotient(amax, jnp.float32(element.max_value), e4m3)
        codes = _round_quotient(magnitude, _decode_minifloat(scale_code, e4m3), element)
    else:
        # ceil(log2(.)) of amax / max is the same whether XLA divides or multiplies by the
        # rounded reciprocal (checked for every float32 mantissa, for 6 and 448); x / 2**e is
        # assembled exactly, subnormal x included.
        exponent = _ceil_log2(amax / element.max_value)
        scale_code = exponent + 127
        n, e = _significand_exponent(magnitude)
        codes = _round_magnitude(_ldexp(n, e - exponent), element)
    codes = codes | (jnp.signbit(groups).astype(jnp.int32) << element.sign_bit)
    scale_code = jnp.where(finite, scale_code, _SCALE_NAN_CODE[f.scale])
    return codes.reshape(x.shape), scale_code[..., 0]


def _decode_blocks(
    codes: Int[Array, "*batch dim"], scale_codes: Int[Array, "*batch groups"], f: Format
) -> Float[Array, "*batch dim"]:
    """float32 values of element and scale codes; a NaN scale makes its whole group NaN.

    element · scale = (n_element · n_scale) · 2**(e_element + e_scale) is assembled exactly from
    integers, so subnormal results survive XLA:CPU's flush to zero.
    """
    shape = (*scale_codes.shape, f.group_size)
    negative, n, e, is_nan = _minifloat_parts(codes.reshape(shape), _MINIFLOATS[f.element])
    scale_codes = scale_codes[..., None]
    if f.scale == "e4m3":
        scale_negative, scale_n, scale_e, scale_nan = _minifloat_parts(
            scale_codes, _MINIFLOATS["e4m3"]
        )
        negative, n = negative ^ scale_negative, n * scale_n
    else:  # E8M0: 2**(code - 127), 0xFF is NaN
        scale_e, scale_nan = scale_codes - 127, scale_codes == _SCALE_NAN_CODE["e8m0"]
    return _signed_value(negative, n, e + scale_e, is_nan | scale_nan).reshape(codes.shape)


def _bf16_bits(x: Float[Array, "*s"]) -> jax.Array:
    """uint32 bits of float32 `x` rounded to nearest even to bfloat16 (low 16 bits zero)."""
    bits = lax.bitcast_convert_type(x, jnp.uint32)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & jnp.uint32(0xFFFF0000)
    # The carry would turn a NaN with a small payload into inf.
    return jnp.where(jnp.isnan(x), jnp.uint32(0x7FC00000), rounded)


def _fake_quant_forward(x: Float[Array, "*batch dim"], fmt: str) -> Float[Array, "*batch dim"]:
    f = FORMATS[fmt]
    x32 = x.astype(jnp.float32)
    if f.element == "f32":
        y = x32
    elif f.element == "bf16":
        y = lax.bitcast_convert_type(_bf16_bits(x32), jnp.float32)
    else:
        y = _decode_blocks(*_encode_blocks(x32, f), f)
    return y.astype(x.dtype)


def _e2m1_codes(x: Float[Array, "*s"]) -> Int[Array, "*s"]:
    """E2M1 codes of finite float32 x (sign in bit 3)."""
    spec = _MINIFLOATS["e2m1"]
    return _round_magnitude(jnp.abs(x), spec) | (jnp.signbit(x).astype(jnp.int32) << spec.sign_bit)


def _e2m1_round_forward(x: Float[Array, "*s"]) -> Float[Array, "*s"]:
    x32 = x.astype(jnp.float32)
    finite = jnp.isfinite(x32)
    y = _decode_minifloat(_e2m1_codes(jnp.where(finite, x32, 0.0)), _MINIFLOATS["e2m1"])
    return jnp.where(finite, y, jnp.nan).astype(x.dtype)


def _straight_through(
    forward: Callable[[jax.Array], jax.Array],
) -> Callable[[jax.Array], jax.Array]:
    """`forward` with an identity gradient: the cotangent is passed back unchanged.

    A raw cast's own VJP would quantize the gradient too (DESIGN §4, last trap).
    """
    ste = jax.custom_vjp(forward)
    ste.defvjp(lambda x: (forward(x), None), lambda _, g: (g,))
    return ste


_STE = types.MappingProxyType(
    {
        name: _straight_through(functools.partial(_fake_quant_forward, fmt=name))
        for name, f in FORMATS.items()
        if not f.accounting_only
    }
)
_E2M1_ROUND_STE = _straight_through(_e2m1_round_forward)


# ---------------------------------------------------------------------------------------------
# E2M1 elements.


def e2m1_round(x: Float[ArrayLike, "*s"]) -> Float[Array, "*s"]:
    """Rounds each value to nearest even on the E2M1 grid {0, .5, 1, 1.5, 2, 3, 4, 6}, saturating
    at ±6 (ties 0.25→0, 0.75→1, 1.25→1, 1.75→2, 2.5→2, 3.5→4, 5→4; DESIGN §4).

    Any shape; float32/bfloat16/float16 in, same dtype out; sign of zero kept; NaN and ±inf give
    NaN. Straight-through gradient.
    """
    return _E2M1_ROUND_STE(_checked_input(x, None))


def e2m1_codes(x: Float[ArrayLike, "*s"]) -> UInt8[Array, "*s"]:
    """4-bit E2M1 codes (uint8, bit 3 = sign, bits 0-2 = magnitude index into the grid) of
    `e2m1_round(x)`. E2M1 has no NaN or inf: callers must mark non-finite values elsewhere (the
    packed formats do it in the scale byte); here they get the code of ±0."""
    x32 = _checked_input(x, None).astype(jnp.float32)
    return _e2m1_codes(jnp.where(jnp.isfinite(x32), x32, jnp.copysign(0.0, x32))).astype(jnp.uint8)


def e2m1_decode_table() -> Float[Array, " 16"]:
    """float32 value of each E2M1 nibble 0..15 (0..7: +grid, 8..15: -grid, 8 is -0.0): the
    lookup table a kernel uses to decode packed rows."""
    return _decode_minifloat(jnp.arange(16, dtype=jnp.int32), _MINIFLOATS["e2m1"])


# ---------------------------------------------------------------------------------------------
# Fake-quant (quantize then dequantize; straight-through gradient).


def fake_quant(x: Float[ArrayLike, "*batch dim"], fmt: str) -> Float[Array, "*batch dim"]:
    """Quantizes `x` to format `fmt` ('nvfp4' | 'mxfp4' | 'fp8' | 'bf16') and dequantizes it.

    Shapes [..., D] with D a multiple of the group size; float32/bfloat16/float16 in, same dtype
    out. Forward bit-exact to DESIGN §4; gradient = the cotangent, unchanged (jax.custom_vjp).
    Jit with `fmt` static. A group holding NaN/±inf comes out all NaN ('bf16': per element, IEEE).
    """
    f = _format(fmt)
    return _STE[f.name](_checked_input(x, f))


def nvfp4_fake_quant(x: Float[ArrayLike, "*batch dim"]) -> Float[Array, "*batch dim"]:
    """Main-KV NVFP4 fake-quant (DESIGN §4): groups of 16, scale
    s = e4m3_rne_satfinite(max(amax, 6·2⁻⁹)/6), elements E2M1(clamp(x/s, ±6)), no global scale.

    The dequantized max is 2688 (= 448·6). Because the E4M3 scale rounds to nearest it is not
    idempotent for groups whose scale is an E4M3 subnormal (6·2⁻⁹ < amax ≲ 6·2⁻⁶): there a
    second pass can pick a different scale. See `fake_quant` for shapes, dtypes and NaN handling.
    """
    return fake_quant(x, "nvfp4")


def mxfp4_fake_quant(x: Float[ArrayLike, "*batch dim"]) -> Float[Array, "*batch dim"]:
    """Indexer MXFP4 fake-quant (DESIGN §4): groups of 32, scale
    s = 2^ceil(log2(max(amax, 6·2⁻¹²⁶)/6)) (exact, from the float32 bits), elements E2M1(x/s).
    See `fake_quant` for shapes, dtypes and NaN handling."""
    return fake_quant(x, "mxfp4")


def fp8_window_fake_quant(x: Float[ArrayLike, "*batch dim"]) -> Float[Array, "*batch dim"]:
    """Window-KV FP8 fake-quant (DESIGN §4): groups of 32, scale
    s = 2^ceil(log2(max(amax, 1e-4)/448)), elements E4M3(clamp(x/s, ±448)) rounded to nearest
    even. Also the 'fp8' main-KV format. See `fake_quant` for shapes, dtypes and NaN handling."""
    return fake_quant(x, "fp8")


# ---------------------------------------------------------------------------------------------
# Packed rows (the real cache format): [element bytes | scale bytes] per row.


def _refuse_nonfinite(x: jax.Array, fmt: str) -> None:
    if isinstance(x, jax.core.Tracer):  # traced values cannot be inspected; see checked_pack
        return
    bad = ~np.isfinite(np.asarray(x).astype(np.float32))
    if bad.any():
        first = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(
            f"x: expected finite values to pack as {fmt!r} (a packed row cannot hold NaN/inf), "
            f"got {int(bad.sum())} non-finite, the first at index {first}"
        )


def pack(x: Float[ArrayLike, "*batch dim"], fmt: str) -> UInt8[Array, "*batch row_bytes"]:
    """Packs rows of `x` into the cache bytes of `fmt`; row_bytes = packed_row_bytes(fmt, dim).

    'nvfp4' / 'mxfp4': dim/2 bytes of E2M1 codes (element 2i in the low nibble, 2i+1 in the high
    one, sign in bit 3 of each nibble), then one E4M3 / E8M0 scale byte per group. 'fp8': dim
    E4M3 bytes, then one UE8M0 byte per group. 'bf16': the 2·dim little-endian bytes of the bf16
    values; 'f32': the 4·dim bytes of the float32 values. `unpack(pack(x, fmt), fmt)` equals
    `fake_quant(x, fmt)` bit for bit (DESIGN §4).

    Concrete non-finite input raises ValueError. Under `jit` it cannot be checked: a non-finite
    group is stored with the NaN scale byte (E4M3 0x7F, E8M0 0xFF; 'bf16' stores the NaN/inf), so
    it unpacks to NaN; use `checked_pack` under `checkify.checkify` to have it reported.
    """
    f = _format(fmt)
    x = _checked_input(x, f)
    _refuse_nonfinite(x, fmt)
    x32 = x.astype(jnp.float32)
    if f.element == "f32":  # little-endian float32 bytes
        return lax.bitcast_convert_type(x32, jnp.uint8).reshape(*x.shape[:-1], 4 * x.shape[-1])
    if f.element == "bf16":
        half = _bf16_bits(x32) >> 16
        return (
            jnp.stack([half & 0xFF, half >> 8], axis=-1)
            .reshape(*x.shape[:-1], 2 * x.shape[-1])
            .astype(jnp.uint8)
        )
    codes, scale_codes = _encode_blocks(x32, f)
    if f.element == "e2m1":
        codes = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return jnp.concatenate([codes, scale_codes], axis=-1).astype(jnp.uint8)


def unpack(
    rows: UInt8[ArrayLike, "*batch row_bytes"],
    fmt: str,
    dim: int | None = None,
    *,
    dtype: DTypeLike = jnp.float32,
) -> Float[Array, "*batch dim"]:
    """Decodes packed rows of `fmt` (layout in `pack`) to values of `dtype` (float32 default).

    `dim` (values per row) is inferred from the row width when None; given, it is checked
    against it. Decodes every byte exactly, including E4M3/E8M0 NaN codes (their group → NaN).
    """
    f = _format(fmt)
    rows = jnp.asarray(rows)
    if rows.dtype != jnp.uint8 or rows.ndim == 0:
        raise ValueError(
            f"rows: expected a uint8 array of packed rows, got {rows.dtype}{rows.shape}"
        )
    if jnp.dtype(dtype) not in _FLOAT_DTYPES:
        raise ValueError(f"dtype: expected float32, bfloat16 or float16, got {jnp.dtype(dtype)}")
    width = rows.shape[-1]
    group_bytes = packed_row_bytes(fmt, f.group_size)
    if dim is None:
        if width % group_bytes:
            raise ValueError(
                f"rows: expected a last dimension that is a multiple of {group_bytes} "
                f"(bytes per {f.group_size}-value group of {fmt}), got {width}"
            )
        dim = width // group_bytes * f.group_size
    elif width != packed_row_bytes(fmt, dim):
        raise ValueError(
            f"rows: expected last dimension packed_row_bytes({fmt!r}, {dim}) = "
            f"{packed_row_bytes(fmt, dim)}, got {width}"
        )
    if f.element == "f32":
        words = rows.reshape(*rows.shape[:-1], dim, 4)
        return lax.bitcast_convert_type(words, jnp.float32).astype(dtype)
    rows = rows.astype(jnp.int32)
    if f.element == "bf16":
        half = rows[..., 0::2] | (rows[..., 1::2] << 8)
        return lax.bitcast_convert_type(half << 16, jnp.float32).astype(dtype)
    data_bytes = dim * _BITS[f.element] // 8
    codes, scale_codes = rows[..., :data_bytes], rows[..., data_bytes:]
    if f.element == "e2m1":
        codes = jnp.stack([codes & 0xF, codes >> 4], axis=-1).reshape(*rows.shape[:-1], dim)
    return _decode_blocks(codes, scale_codes, f).astype(dtype)


def checked_pack(x: Float[ArrayLike, "*batch dim"], fmt: str) -> UInt8[Array, "*batch row_bytes"]:
    """`pack` that also reports non-finite input under `jit`: wrap it as
    `err, rows = checkify.checkify(jax.jit(checked_pack, static_argnums=1))(x, fmt)` and call
    `err.throw()`."""
    check_finite(x, "x")
    return pack(x, fmt)
