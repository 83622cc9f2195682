"""`v41jax.ops.formats` against an independent numpy/ml_dtypes model of the DESIGN §4 rules.

The reference below uses ml_dtypes casts (with the pre-clamps they need) and frexp exponents, the
library uses float32 bit arithmetic; every comparison is on bit patterns (signed zeros included;
NaN positions must agree, NaN payloads are not compared).
"""

import functools
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from jax.experimental import checkify

from v41jax.ops import formats

F32 = np.float32
E2M1 = ml_dtypes.float4_e2m1fn
E4M3 = ml_dtypes.float8_e4m3fn
E8M0 = ml_dtypes.float8_e8m0fnu
BF16 = ml_dtypes.bfloat16

BLOCK_FORMATS = ("nvfp4", "mxfp4", "fp8")
FORMATS = (*BLOCK_FORMATS, "bf16")
GROUP = {"nvfp4": 16, "mxfp4": 32, "fp8": 32, "bf16": 1}
ELEMENT_MAX = {"nvfp4": 6.0, "mxfp4": 6.0, "fp8": 448.0}
SHAPE = (4, 128)  # one shape everywhere, so each jitted function compiles once per dtype
HYPOTHESIS = settings(deadline=None, max_examples=20, suppress_health_check=[HealthCheck.too_slow])

fake_quant_jit = jax.jit(formats.fake_quant, static_argnums=1)
pack_jit = jax.jit(formats.pack, static_argnums=1)
unpack_jit = jax.jit(formats.unpack, static_argnums=(1, 2), static_argnames="dtype")

E2M1_TIES = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], F32)
E4M3_VALUES = np.arange(0x7F, dtype=np.uint8).view(E4M3).astype(F32)  # +0 ... 448
E4M3_TIES = (E4M3_VALUES[1:] + E4M3_VALUES[:-1]) / 2  # exact in float32
E4M3_SCALES = E4M3_VALUES[E4M3_VALUES >= 2.0**-9]  # every scale the nvfp4 rule can produce


# ---------------------------------------------------------------------------------------------
# Independent reference.


def ref_pow2_ceil(y):
    """2**ceil(log2 y) for positive float32 y, from frexp (y = m·2^e with m in [0.5, 1))."""
    m, e = np.frexp(y.astype(np.float64))
    return np.ldexp(1.0, e - (m == 0.5)).astype(F32)


def ref_quantize(x, fmt):
    """Per-group element values q, scales s and the all-finite mask of a block format."""
    g = np.asarray(x).astype(F32).reshape(*np.shape(x)[:-1], -1, GROUP[fmt])
    finite = np.isfinite(g).all(-1, keepdims=True)
    g = np.where(finite, g, F32(0))
    amax = np.abs(g).max(-1, keepdims=True)
    if fmt == "nvfp4":
        s = np.maximum(amax, F32(6 * 2.0**-9)) / F32(6)
        s = np.minimum(s, F32(448)).astype(E4M3).astype(F32)  # the e4m3 cast does not saturate
        q = np.clip(g / s, -6, 6).astype(E2M1).astype(F32)
    elif fmt == "mxfp4":
        s = ref_pow2_ceil(np.maximum(amax, F32(6 * 2.0**-126)) / F32(6))
        q = np.clip(g / s, -6, 6).astype(E2M1).astype(F32)
    else:
        s = ref_pow2_ceil(np.maximum(amax, F32(1e-4)) / F32(448))
        q = np.clip(g / s, -448, 448).astype(E4M3).astype(F32)
    return q, s, finite


def ref_fake_quant(x, fmt):
    x = np.asarray(x)
    with np.errstate(over="ignore", invalid="ignore"):
        if fmt == "bf16":
            return x.astype(F32).astype(BF16).astype(F32).astype(x.dtype)
        q, s, finite = ref_quantize(x, fmt)
        y = np.where(finite, q * s, F32(np.nan))
        return y.reshape(x.shape).astype(x.dtype)


def ref_pack(x, fmt):
    assert sys.byteorder == "little"  # the bf16 row is the values' little-endian bytes
    x = np.asarray(x)
    if fmt == "bf16":
        return x.astype(F32).astype(BF16).view(np.uint8)
    q, s, _ = ref_quantize(x, fmt)
    if fmt == "fp8":
        data = q.astype(E4M3).view(np.uint8).reshape(x.shape)
    else:
        nibbles = q.astype(E2M1).view(np.uint8).reshape(x.shape)
        data = nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)
    scales = s.astype(E4M3 if fmt == "nvfp4" else E8M0).view(np.uint8)[..., 0]
    return np.concatenate([data, scales], axis=-1)


def assert_bits_equal(actual, expected):
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert (actual.dtype, actual.shape) == (expected.dtype, expected.shape)
    if actual.dtype.kind == "u":
        diff = actual != expected
    else:
        uint = {1: np.uint8, 2: np.uint16, 4: np.uint32}[actual.dtype.itemsize]
        nan_a, nan_e = np.isnan(actual.astype(F32)), np.isnan(expected.astype(F32))
        diff = (nan_a != nan_e) | (~nan_a & (actual.view(uint) != expected.view(uint)))
    if diff.any():
        i = tuple(int(j) for j in np.argwhere(diff)[0])
        pytest.fail(
            f"{diff.sum()} of {diff.size} differ; first at {i}: got {actual[i]!r}, "
            f"expected {expected[i]!r}"
        )


# ---------------------------------------------------------------------------------------------
# Inputs.

KINDS = (
    "gaussian",
    "student_t",
    "cauchy",
    "tiny",
    "f32_subnormal",
    "huge",
    "near_max",
    "group_scales",
    "zeros",
    "ties",
)


def wiggle(v, rng):
    """v, or one float32 ulp below or above it (half the entries stay exact)."""
    v = np.asarray(v, F32)
    r = rng.random(v.shape)
    return np.where(
        r < 0.25, np.nextafter(v, F32(-np.inf)), np.where(r < 0.75, v, np.nextafter(v, F32(np.inf)))
    )


def ties(fmt, rng, shape):
    """Values exactly halfway between two representable neighbours after scaling (or one ulp
    off), each group's max set so that the scale is known exactly; nvfp4 also puts half of its
    scales on E4M3 ties and mxfp4/fp8 move amax one ulp around a power of two."""
    sign = np.where(rng.random(shape) < 0.5, F32(-1), F32(1))
    if fmt == "bf16":
        bits = rng.integers(0x0080, 0x7F00, shape).astype(np.uint32) << 16 | 0x8000
        return wiggle(bits.view(F32), rng) * sign
    n, group = int(np.prod(shape)) // GROUP[fmt], GROUP[fmt]
    top = ELEMENT_MAX[fmt]
    if fmt == "nvfp4":
        scales = rng.choice(E4M3_SCALES, n)
    else:
        scales = 2.0 ** rng.integers(-120 if fmt == "mxfp4" else -20, 120, n).astype(F32)
    mids = E2M1_TIES if fmt != "fp8" else E4M3_TIES
    g = wiggle(rng.choice(mids, (n, group)) * scales[:, None], rng)
    g[:, 0] = top * scales
    moved = rng.random(n) < 0.5
    if fmt == "nvfp4":
        scale_ties = np.append(E4M3_TIES[E4M3_TIES > 2.0**-9], F32(464))
        g[moved, 0] = wiggle(6 * rng.choice(scale_ties, moved.sum()), rng)
    else:
        g[moved, 0] = wiggle(g[moved, 0], rng)
    return g.reshape(shape) * sign


def sample(kind, fmt, rng, shape=SHAPE):
    """float32 test input of the given kind."""
    x = rng.standard_normal(shape)
    per_group = (*shape[:-1], shape[-1] // 16, 1)  # one factor per 16 values
    if kind == "student_t":
        x = rng.standard_t(3, shape)
    elif kind == "cauchy":
        x = rng.standard_cauchy(shape)
    elif kind == "tiny":
        x = x * 1e-30
    elif kind == "f32_subnormal":
        x = x * 3e-39  # float32 subnormals and MXFP4 results down to 2**-127
    elif kind == "huge":
        x = (x.reshape((*per_group[:-1], 16)) * 10 ** rng.uniform(4, 30, per_group)).reshape(shape)
    elif kind == "near_max":  # MXFP4/FP8 values may round up past float32's max: ±inf
        x = np.clip(x, -3, 3) * 1e38
    elif kind == "group_scales":
        x = x.reshape((*per_group[:-1], 16)) * 2.0 ** rng.integers(-60, 60, per_group)
        x = x.reshape(shape)
    elif kind == "zeros":  # whole zero groups of 32 and scattered signed zeros
        x = x.reshape(*shape[:-1], -1, 32) * (rng.random((*shape[:-1], shape[-1] // 32, 1)) < 0.5)
        x = x.reshape(shape)
        x[rng.random(shape) < 0.2] = 0.0
        x[rng.random(shape) < 0.2] = -0.0
    elif kind == "ties":
        x = ties(fmt, rng, shape)
    return np.asarray(x, F32)


def seeded(kinds, fmt="mxfp4"):
    return st.builds(
        lambda kind, seed: sample(kind, fmt, np.random.default_rng(seed)),
        st.sampled_from(kinds),
        st.integers(0, 2**32 - 1),
    )


def finite_inputs(max_value=None, kinds=KINDS):
    """Hypothesis arrays of SHAPE: element-wise floats, or a seeded sample of one kind."""
    bound = float(np.finfo(F32).max if max_value is None else F32(max_value))
    elements = st.floats(-bound, bound, width=32, allow_nan=False, allow_infinity=False)
    return st.one_of(hnp.arrays(F32, SHAPE, elements=elements), seeded(kinds))


BOUNDED_KINDS = tuple(k for k in KINDS if k != "near_max")


# ---------------------------------------------------------------------------------------------
# Bit-exact against the reference.


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_matches_reference(fmt, kind):
    x = sample(kind, fmt, np.random.default_rng([FORMATS.index(fmt), KINDS.index(kind)]))
    expected = ref_fake_quant(x, fmt)
    assert_bits_equal(fake_quant_jit(x, fmt), expected)
    rows = pack_jit(x, fmt)
    assert_bits_equal(rows, ref_pack(x, fmt))
    assert_bits_equal(unpack_jit(rows, fmt, None), expected)


@pytest.mark.parametrize("fmt", FORMATS)
@HYPOTHESIS
@given(x=finite_inputs())
def test_matches_reference_hypothesis(fmt, x):
    expected = ref_fake_quant(x, fmt)
    assert_bits_equal(fake_quant_jit(x, fmt), expected)
    rows = pack_jit(x, fmt)
    assert_bits_equal(rows, ref_pack(x, fmt))
    assert_bits_equal(unpack_jit(rows, fmt, None), expected)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("fmt", FORMATS)
def test_low_precision_inputs(fmt, dtype):
    rng = np.random.default_rng(7)
    x = sample("group_scales", fmt, rng)
    x = np.clip(x * 2.0**-44, -60000, 60000)  # about 2**-60 ... 60000: float16 range and beyond
    x[0, :16] = 65504.0  # float16 max: MXFP4/FP8 round it up to 65536, which is inf in float16
    x = np.asarray(x.astype(dtype))
    y = fake_quant_jit(x, fmt)
    assert y.dtype == dtype
    assert_bits_equal(y, ref_fake_quant(x, fmt))
    assert_bits_equal(formats.unpack(pack_jit(x, fmt), fmt, dtype=dtype), y)


@pytest.mark.parametrize("fmt", FORMATS)
@HYPOTHESIS
@given(x=finite_inputs(max_value=60000.0), use_bf16=st.booleans())
def test_low_precision_inputs_hypothesis(fmt, x, use_bf16):
    x = np.asarray(np.clip(x, -60000, 60000).astype(BF16 if use_bf16 else np.float16))
    y = fake_quant_jit(x, fmt)
    assert_bits_equal(y, ref_fake_quant(x, fmt))
    assert_bits_equal(unpack_jit(pack_jit(x, fmt), fmt, None, dtype=x.dtype), y)


@pytest.mark.parametrize("sign", [1.0, -1.0])
@pytest.mark.parametrize(
    ("amax", "dequantized_max"),
    [
        (0.0, 0.0),
        (2.0**-12, 0.0),
        (6 * 2.0**-9, 6 * 2.0**-9),
        (6.375, 6.0),
        (7.125, 7.5),
        (2688.0, 2688.0),
        (1e6, 2688.0),
        (8.25, 8.25),
    ],
)
def test_nvfp4_boundary_table(amax, dequantized_max, sign):
    """DESIGN §4: the group max of the main-KV rule, dequantized."""
    rng = np.random.default_rng(0)
    x = (rng.uniform(-0.5, 0.5, SHAPE) * amax).astype(F32)
    x[:, ::16] = sign * amax
    y = np.asarray(formats.nvfp4_fake_quant(x))
    assert_bits_equal(y, ref_fake_quant(x, "nvfp4"))
    np.testing.assert_array_equal(np.abs(y).reshape(-1, 16).max(-1), F32(dequantized_max))
    np.testing.assert_array_equal(y[:, ::16], F32(sign * dequantized_max))


def test_e2m1_round_table():
    x = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.5, 1e30, -0.1, -0.75, 0.0], F32)
    expected = np.array([0, 1, 1, 2, 2, 4, 4, 6, 6, -0.0, -1, 0], F32)
    assert_bits_equal(formats.e2m1_round(x), expected)


def test_e2m1_round_sweep_matches_ml_dtypes():
    grid = np.linspace(-7, 7, 20001, dtype=F32)
    mids = np.concatenate([E2M1_TIES, -E2M1_TIES, [1e-40, -1e-40, 2.0**-126]]).astype(F32)
    x = np.concatenate([grid, mids, np.nextafter(mids, F32(np.inf)), np.nextafter(mids, F32(0))])
    assert_bits_equal(jax.jit(formats.e2m1_round)(x), x.astype(E2M1).astype(F32))
    assert_bits_equal(formats.e2m1_codes(x), x.astype(E2M1).view(np.uint8))


def test_e2m1_decode_table_matches_ml_dtypes():
    expected = np.arange(16, dtype=np.uint8).view(E2M1).astype(F32)
    assert_bits_equal(formats.e2m1_decode_table(), expected)


def test_unpack_decodes_every_byte():
    """Every element and scale byte of each layout against ml_dtypes' decoding."""
    every = np.arange(256, dtype=np.uint8)
    one = np.uint8(0x22)  # two E2M1 1.0 nibbles
    # fp8 elements, with a UE8M0 scale of 1
    rows = np.concatenate([every, np.full(8, 127, np.uint8)])
    assert_bits_equal(unpack_jit(rows, "fp8", None), every.view(E4M3).astype(F32))
    # E2M1 nibbles, with an E8M0 scale of 1
    rows = np.concatenate([every, np.full(16, 127, np.uint8)])
    nibbles = np.stack([every & 0xF, every >> 4], -1).reshape(-1).view(E2M1).astype(F32)
    assert_bits_equal(unpack_jit(rows, "mxfp4", None), nibbles)
    # E8M0 scales (0 is 2**-127, 255 is NaN) and E4M3 scales (negative ones included)
    rows = np.concatenate([np.full((256, 16), one), every[:, None]], -1)
    expected = np.repeat(every.view(E8M0).astype(F32)[:, None], 32, -1)
    assert_bits_equal(unpack_jit(rows, "mxfp4", None), expected)
    rows = np.concatenate([np.full((256, 8), one), every[:, None]], -1)
    expected = np.repeat(every.view(E4M3).astype(F32)[:, None], 16, -1)
    assert_bits_equal(unpack_jit(rows, "nvfp4", None), expected)


# ---------------------------------------------------------------------------------------------
# Properties.


@pytest.mark.parametrize("fmt", FORMATS)
@HYPOTHESIS
@given(x=finite_inputs(max_value=1e37, kinds=BOUNDED_KINDS))
def test_idempotent(fmt, x):
    if fmt == "nvfp4":  # keep every scale an E4M3 normal; test_nvfp4_... shows why
        x = x.copy()
        groups = x.reshape(-1, 16)
        groups[np.abs(groups).max(-1) < 0.1, 0] = 0.1
    y = fake_quant_jit(x, fmt)
    assert_bits_equal(fake_quant_jit(y, fmt), y)


def test_nvfp4_not_idempotent_with_subnormal_scale():
    """amax = 9·2⁻⁹: amax/6 = 1.5·2⁻⁹ is an E4M3 tie → scale 2⁻⁸, 4.5 → E2M1 4, so the max
    becomes 2⁻⁶; a second pass takes scale e4m3(2⁻⁶/6) = 2⁻⁹ and clamps 8 to 6: 6·2⁻⁹."""
    x = np.zeros(SHAPE, F32)
    x[0, 0] = 9 * 2.0**-9
    y = fake_quant_jit(x, "nvfp4")
    assert (y[0, 0], fake_quant_jit(y, "nvfp4")[0, 0]) == (2.0**-6, 6 * 2.0**-9)


@pytest.mark.parametrize("fmt", FORMATS)
@HYPOTHESIS
@given(x=finite_inputs())
def test_sign_symmetry(fmt, x):
    assert_bits_equal(fake_quant_jit(-x, fmt), -np.asarray(fake_quant_jit(x, fmt)))


@pytest.mark.parametrize("fmt", ["mxfp4", "fp8"])
@HYPOTHESIS
@given(seed=st.integers(0, 2**32 - 1), k=st.integers(-40, 40))
def test_power_of_two_scaling_invariance(fmt, seed, k):
    """Power-of-two scales make fq(x·2^k) = fq(x)·2^k while nothing hits a floor or the range."""
    rng = np.random.default_rng(seed)
    # Group maxima in [2**30, 2**50] keep the fp8 floor (1e-4) from binding for any k, and
    # elements down to 2**-12 of them keep float32 normal.
    amax = 2.0 ** rng.uniform(30, 50, (SHAPE[0], SHAPE[1] // 32, 1))
    mags = (amax * 2.0 ** rng.uniform(-12, 0, (SHAPE[0], SHAPE[1] // 32, 32))).reshape(SHAPE)
    x = (mags * rng.choice([-1.0, 1.0], SHAPE)).astype(F32)
    scaled = (x * F32(2.0**k)).astype(F32)
    expected = np.asarray(fake_quant_jit(x, fmt)) * F32(2.0**k)
    assert_bits_equal(fake_quant_jit(scaled, fmt), expected)


def half_step(v, fmt):
    """Half the distance between representable element neighbours around |v| (float64)."""
    a = np.minimum(np.abs(v), ELEMENT_MAX[fmt])
    if fmt == "fp8":
        return 2.0 ** (np.maximum(np.floor(np.log2(np.maximum(a, 2.0**-200))), -6) - 4)
    return np.where(a < 2, 0.25, np.where(a < 4, 0.5, 1.0))


@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
@HYPOTHESIS
@given(x=finite_inputs(max_value=1e37, kinds=BOUNDED_KINDS))
def test_error_bound(fmt, x):
    """|x − fq(x)| ≤ s·(half a grid step at x/s + the clamp excess), plus the float32 rounding
    of x/s itself (for nvfp4's non-power-of-two scales)."""
    _, s, _ = ref_quantize(x, fmt)
    s = s.astype(np.float64)
    groups = x.astype(np.float64).reshape((*s.shape[:-1], GROUP[fmt]))
    v = groups / s
    excess = np.maximum(np.abs(v) - ELEMENT_MAX[fmt], 0)
    bound = s * (half_step(v, fmt) + excess + np.abs(v) * 2.0**-23)
    y = np.asarray(fake_quant_jit(x, fmt), np.float64).reshape(groups.shape)
    assert np.all(np.abs(groups - y) <= bound)


@pytest.mark.parametrize(
    ("fmt", "dim", "rope_dim", "expected"),
    [
        ("nvfp4", 512, 0, 288),
        ("nvfp4", 512, 64, 288),  # V4.1 quantizes the rope dims with the rest
        ("mxfp4", 128, 0, 68),
        ("fp8", 512, 0, 528),
        ("bf16", 512, 0, 1024),
        ("v4_fp8", 512, 64, 584),
    ],
)
def test_packed_row_bytes_table(fmt, dim, rope_dim, expected):
    assert formats.packed_row_bytes(fmt, dim, rope_dim=rope_dim) == expected


@pytest.mark.parametrize("fmt", FORMATS)
@settings(HYPOTHESIS, max_examples=8)
@given(groups=st.integers(1, 64), lead=st.lists(st.integers(1, 3), max_size=2))
def test_packed_widths(fmt, groups, lead):
    dim = groups * (32 if fmt == "bf16" else GROUP[fmt])
    width = formats.packed_row_bytes(fmt, dim)
    bits = {"nvfp4": 4 * dim + 8 * dim // 16, "mxfp4": 4 * dim + 8 * dim // 32}
    bits |= {"fp8": 8 * dim + 8 * dim // 32, "bf16": 16 * dim}
    assert 8 * width == bits[fmt]
    x = jax.ShapeDtypeStruct((*lead, dim), jnp.float32)
    rows = jax.eval_shape(functools.partial(formats.pack, fmt=fmt), x)
    assert (rows.shape, rows.dtype) == ((*lead, width), jnp.uint8)
    values = jax.eval_shape(functools.partial(formats.unpack, fmt=fmt), rows)
    assert values.shape == x.shape


def test_jit_matches_eager():
    rng = np.random.default_rng(3)
    # every kind, mixed per group of 32 values
    per_kind = np.stack([sample(k, "nvfp4", rng) for k in KINDS]).reshape(len(KINDS), -1, 32)
    pick = rng.integers(0, len(KINDS), per_kind.shape[1])
    x = per_kind[pick, np.arange(per_kind.shape[1])].reshape(SHAPE)
    x_nan = x.copy()
    x_nan[0, 40], x_nan[1, 70] = np.nan, -np.inf
    for fmt in FORMATS:
        assert_bits_equal(formats.fake_quant(x_nan, fmt), fake_quant_jit(x_nan, fmt))
        rows = formats.pack(x, fmt)
        assert_bits_equal(rows, pack_jit(x, fmt))
        assert_bits_equal(formats.unpack(rows, fmt), unpack_jit(rows, fmt, None))
    assert_bits_equal(formats.e2m1_round(x_nan), jax.jit(formats.e2m1_round)(x_nan))


# ---------------------------------------------------------------------------------------------
# Non-finite input.


@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_nonfinite_groups_become_nan(fmt):
    rng = np.random.default_rng(5)
    x = sample("gaussian", fmt, rng)
    bad = x.copy()
    bad[0, 3], bad[1, 40], bad[2, 127] = np.nan, np.inf, -np.inf
    y = np.asarray(fake_quant_jit(bad, fmt))
    hit = np.zeros(SHAPE, bool).reshape(4, -1, GROUP[fmt])
    hit[0, 0], hit[1, 40 // GROUP[fmt]], hit[2, -1] = True, True, True
    hit = hit.reshape(SHAPE)
    assert np.isnan(y[hit]).all()
    assert_bits_equal(y[~hit], np.asarray(fake_quant_jit(x, fmt))[~hit])
    assert_bits_equal(y, ref_fake_quant(bad, fmt))
    # Traced pack cannot refuse: it stores the NaN scale byte, so the group unpacks to NaN.
    assert_bits_equal(unpack_jit(pack_jit(bad, fmt), fmt, None), y)


def test_bf16_keeps_ieee_specials():
    x = np.array([np.nan, np.inf, -np.inf, 3.4e38, 1.0], F32)
    expected = np.array([np.nan, np.inf, -np.inf, np.inf, 1.0], F32)
    assert_bits_equal(fake_quant_jit(x, "bf16"), expected)


def test_e2m1_round_nonfinite_is_nan():
    y = formats.e2m1_round(np.array([np.nan, np.inf, -np.inf, 7.0], F32))
    assert_bits_equal(y, np.array([np.nan, np.nan, np.nan, 6.0], F32))


@pytest.mark.parametrize("fmt", FORMATS)
def test_pack_refuses_nonfinite_eagerly(fmt):
    x = np.ones((2, 64), F32)
    x[1, 5] = np.nan
    with pytest.raises(ValueError, match=r"x: expected finite .*got 1 non-finite.*\(1, 5\)"):
        formats.pack(x, fmt)


@pytest.mark.parametrize("fmt", ["nvfp4", "bf16"])  # the check runs before any format code
def test_checked_pack_reports_under_jit(fmt):
    checked = checkify.checkify(jax.jit(formats.checked_pack, static_argnums=1))
    x = np.ones((2, 64), F32)
    err, rows = checked(x, fmt)
    assert err.get() is None
    assert_bits_equal(rows, formats.pack(x, fmt))
    x[0, 1] = np.inf
    err, _ = checked(x, fmt)
    assert "x: expected finite values, got 1 non-finite" in err.get()
    with pytest.raises(checkify.JaxRuntimeError, match="x: expected finite"):
        err.throw()


# ---------------------------------------------------------------------------------------------
# Straight-through gradient.

STE_FUNCTIONS = {
    **{fmt: functools.partial(formats.fake_quant, fmt=fmt) for fmt in FORMATS},
    "e2m1_round": formats.e2m1_round,
}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("name", list(STE_FUNCTIONS))
def test_straight_through_gradient(name, dtype):
    fn = STE_FUNCTIONS[name]
    kx, kc = jax.random.split(jax.random.key(11))
    x = (3 * jax.random.normal(kx, SHAPE)).astype(dtype)
    cotangent = jax.random.normal(kc, SHAPE).astype(dtype)
    y, vjp = jax.vjp(fn, x)
    assert_bits_equal(y, fn(x))
    assert_bits_equal(vjp(cotangent)[0], cotangent)
    jit_vjp = jax.jit(lambda x, c: jax.vjp(fn, x)[1](c)[0])
    assert_bits_equal(jit_vjp(x, cotangent), cotangent)
    jit_grad = jax.jit(jax.grad(lambda x, c: jnp.sum(fn(x) * c)))
    assert_bits_equal(jit_grad(x, cotangent), cotangent)


# ---------------------------------------------------------------------------------------------
# Errors for people.

ROWS = np.zeros((2, 100), np.uint8)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (
            lambda: formats.fake_quant(np.ones((2, 20), F32), "nvfp4"),
            r"x: expected a last dimension that is a multiple of the nvfp4 group size 16, "
            r"got shape \(2, 20\)",
        ),
        (lambda: formats.pack(np.ones((2, 48), F32), "mxfp4"), r"x: .*group size 32, got .*48"),
        (
            lambda: formats.fake_quant(np.ones((2, 32), np.int32), "mxfp4"),
            r"x: expected dtype float32, bfloat16 or float16, got int32",
        ),
        (lambda: formats.fp8_window_fake_quant(np.ones((2, 32))), r"x: expected dtype .*float64"),
        (lambda: formats.e2m1_round(np.arange(4)), r"x: expected dtype .*int64"),
        (
            lambda: formats.fake_quant(np.ones(32, F32), "fp4"),
            r"fmt: expected one of \['nvfp4', 'mxfp4', 'fp8', 'bf16', 'f32'\], got 'fp4'",
        ),
        (
            lambda: formats.fake_quant(np.ones(64, F32), "v4_fp8"),
            r"fmt: 'v4_fp8' is accounting-only",
        ),
        (lambda: formats.pack(np.ones(64, F32), "v4_fp8"), r"fmt: 'v4_fp8' is accounting-only"),
        (lambda: formats.unpack(ROWS, "fp4"), r"fmt: expected one of .*got 'fp4'"),
        (
            lambda: formats.unpack(ROWS, "nvfp4", 512),
            r"rows: expected last dimension packed_row_bytes\('nvfp4', 512\) = 288, got 100",
        ),
        (
            lambda: formats.unpack(ROWS, "nvfp4"),
            r"rows: expected a last dimension that is a multiple of 9 .*got 100",
        ),
        (
            lambda: formats.unpack(ROWS.astype(F32), "bf16"),
            r"rows: expected a uint8 array .*float32",
        ),
        (lambda: formats.unpack(ROWS, "bf16", dtype=jnp.int8), r"dtype: expected .*got int8"),
        (
            lambda: formats.packed_row_bytes("nvfp4", 100),
            r"dim: expected a positive dim that is a multiple of the nvfp4 group size 16, "
            r"got dim=100",
        ),
        (
            lambda: formats.packed_row_bytes("v4_fp8", 512, rope_dim=60),
            r"dim: expected a positive dim - rope_dim .*group size 64, got dim=512, rope_dim=60",
        ),
        (
            lambda: formats.packed_row_bytes("v4_fp8", 512, rope_dim=600),
            r"rope_dim: expected 0 <= rope_dim <= dim=512, got 600",
        ),
        (
            lambda: formats.packed_row_bytes("int4", 512),
            r"fmt: expected one of .*'v4_fp8'\], got 'int4'",
        ),
    ],
)
def test_bad_input_messages(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# ---------------------------------------------------------------------------------------------
# GPU against CPU (DESIGN §4: XLA's excess precision must not change a single bit).


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU as jax's default backend")
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("fmt", FORMATS)
def test_gpu_matches_cpu(fmt, dtype):
    rng = np.random.default_rng(13)
    x = np.concatenate([sample(k, fmt, rng, (2, 128)) for k in KINDS])
    if dtype == jnp.float16:
        x = np.clip(x, -60000, 60000)
    x[0, 5] = np.nan
    x = np.asarray(x.astype(dtype))
    finite = np.where(np.isfinite(x.astype(F32)), x, 0).astype(x.dtype)

    def run(device):
        y = fake_quant_jit(jax.device_put(x, device), fmt)
        rows = pack_jit(jax.device_put(finite, device), fmt)
        back = unpack_jit(rows, fmt, None, dtype=dtype)
        e2m1 = jax.jit(formats.e2m1_round)(jax.device_put(x, device))
        return [np.asarray(a) for a in (y, rows, back, e2m1)]

    gpu, cpu = run(jax.devices("gpu")[0]), run(jax.devices("cpu")[0])
    for on_gpu, on_cpu in zip(gpu, cpu, strict=True):
        assert_bits_equal(on_gpu, on_cpu)
    assert_bits_equal(gpu[0], ref_fake_quant(x, fmt))


def test_f32_format_is_the_identity_with_4_byte_rows():
    x = np.random.default_rng(11).standard_normal(SHAPE).astype(F32)
    x[0, :4] = [0.0, -0.0, 1e-45, -3.4e38]  # signed zero, a subnormal, near the float32 max
    assert formats.packed_row_bytes("f32", SHAPE[-1]) == 4 * SHAPE[-1]
    assert_bits_equal(fake_quant_jit(x, "f32"), x)
    rows = pack_jit(x, "f32")
    assert_bits_equal(rows, x.view(np.uint8))  # the values' little-endian bytes
    assert_bits_equal(unpack_jit(rows, "f32", SHAPE[-1]), x)
    cotangent = np.random.default_rng(12).standard_normal(SHAPE).astype(F32)
    _, vjp = jax.vjp(lambda v: formats.fake_quant(v, "f32"), x)
    assert_bits_equal(vjp(cotangent)[0], cotangent)
