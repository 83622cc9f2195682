"""RoPE and YaRN (`v41jax.nn.rope`): the frequency ramp against an independent float64 numpy
computation, hand-checked boundary pairs, V4.1's figures, and where the model applies it."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from v41jax.nn import config, model
from v41jax.nn.cache import init_cache
from v41jax.nn.config import Role
from v41jax.nn.rope import Yarn, apply_rope, rope_frequencies, yarn_ramp

V41 = Yarn(factor=16.0, original_len=65_536, beta_fast=32.0, beta_slow=1.0)


def _numpy_yarn(rope_dim, theta, factor, original_len, beta_fast, beta_slow):
    """YaRN's frequencies written out again in float64: the pair whose wavelength makes
    `turns` turns over the original context is d = rope_dim·ln(L/(2π·turns))/(2·ln θ)."""
    i = np.arange(rope_dim // 2, dtype=np.float64)
    freqs = theta ** (-2.0 * i / rope_dim)
    dim_at = [
        rope_dim * np.log(original_len / (2 * np.pi * turns)) / (2 * np.log(theta))
        for turns in (beta_fast, beta_slow)
    ]
    low, high = max(math.floor(dim_at[0]), 0), min(math.ceil(dim_at[1]), rope_dim - 1)
    ramp = np.clip((i - low) / max(high - low, 1e-3), 0.0, 1.0)
    return (1 - ramp) * freqs + ramp * freqs / factor, low, high


@pytest.mark.parametrize(
    ("rope_dim", "theta", "yarn"),
    [
        (64, 160_000.0, V41),
        (16, 160_000.0, Yarn(4.0, 64)),
        (32, 10_000.0, Yarn(8.0, 4096, 16.0, 2.0)),
        (64, 1e6, Yarn(40.0, 4096)),
    ],
)
def test_yarn_frequencies_equal_an_independent_computation(rope_dim, theta, yarn):
    want, low, high = _numpy_yarn(rope_dim, theta, *yarn)
    got_low, got_high, _ = yarn_ramp(rope_dim, theta, yarn)
    assert (got_low, got_high) == (low, high)
    got = np.asarray(rope_frequencies(rope_dim, theta, yarn), np.float64)
    np.testing.assert_allclose(got, want, rtol=2e-6)


def test_v41_boundaries_kept_ramped_and_divided_pairs():
    """rope_dim 64, θ 160,000, L 65,536, factor 16, β 32/1: d(32) = 15.45 and d(1) = 24.71, so
    pairs 0..15 keep their frequency bit for bit, pairs 25..31 are divided by 16 exactly (a
    power of two), and pair 20 sits halfway on the ramp: 16 pairs are rescaled."""
    plain = np.asarray(rope_frequencies(64, 160_000.0))
    yarn = np.asarray(rope_frequencies(64, 160_000.0, V41))
    low, high, _ = yarn_ramp(64, 160_000.0, V41)
    assert (low, high) == (15, 25)
    np.testing.assert_array_equal(yarn[:16], plain[:16])
    np.testing.assert_array_equal(yarn[25:], plain[25:] / 16)
    np.testing.assert_allclose(yarn[20], plain[20] * (0.5 + 0.5 / 16), rtol=1e-6)
    assert np.all(yarn[16:25] < plain[16:25]) and np.all(yarn[16:25] > plain[16:25] / 16)
    assert int(np.sum(yarn != plain)) == 16


def test_v41_rotation_differences_match_the_reference_figures():
    """The rotation difference YaRN makes, largest over pairs (wrapped to [−π, π]): the figures
    of the comparison with the official code (issue 13): 0.34 rad at 1 K, 1.36 at 4 K, 2.84 at
    16 K tokens."""
    plain = np.asarray(rope_frequencies(64, 160_000.0), np.float64)
    yarn = np.asarray(rope_frequencies(64, 160_000.0, V41), np.float64)
    for position, radians in ((1024, 0.34), (4096, 1.36), (16_384, 2.84)):
        delta = position * (plain - yarn)
        wrapped = np.abs((delta + np.pi) % (2 * np.pi) - np.pi)
        assert abs(wrapped.max() - radians) < 0.01, (position, wrapped.max())


def test_apply_rope_with_yarn_rotates_by_the_rescaled_angles_and_inverts():
    x = jax.random.normal(jax.random.key(0), (3, 5, 24))
    positions = jnp.asarray([0, 7, 100, 1000, 5000])
    yarn = Yarn(4.0, 256)
    out = apply_rope(x, positions, 16, 160_000.0, yarn=yarn)
    np.testing.assert_array_equal(out[..., :8], x[..., :8])
    angles = np.asarray(positions, np.float64)[:, None] * _numpy_yarn(16, 160_000.0, *yarn)[0]
    pairs = np.asarray(x[..., 8:], np.float64).reshape(3, 5, 8, 2)
    z = (pairs[..., 0] + 1j * pairs[..., 1]) * np.exp(1j * angles)
    want = np.stack([z.real, z.imag], -1).reshape(3, 5, 16)
    np.testing.assert_allclose(out[..., 8:], want, atol=1e-3)  # float32 angles up to 5000 rad
    back = apply_rope(out, positions, 16, 160_000.0, inverse=True, yarn=yarn)
    np.testing.assert_allclose(back, x, atol=1e-4)


def test_yarn_reaches_layers_with_compressed_kv_only():
    """With `yarn_original_len` set, every layer with compressed KV (and its indexer) rotates
    with YaRN and the compress base; window-only layers keep plain RoPE with `rope_theta`.
    v41_flash() carries V4.1's values; the toys have no YaRN unless asked."""
    cfg = config.tiny().replace(yarn_original_len=64, yarn_factor=4.0)
    m = model.Model(cfg, rngs=nnx.Rngs(0))
    for plan, block in zip(cfg.layers, m.blocks, strict=True):
        attention = block.attn
        if plan.role is Role.WINDOW:
            assert (attention.theta, attention.yarn) == (cfg.rope_theta, None)
        else:
            assert attention.theta == cfg.compress_rope_theta
            assert attention.yarn == Yarn(4.0, 64, 32.0, 1.0)
    assert config.v41_flash().rope(1) == (160_000.0, V41)
    assert config.v41_flash().rope(0) == (10_000.0, None)
    assert config.tiny().rope(1) == (config.tiny().compress_rope_theta, None)


def test_a_yarn_model_decodes_what_it_prefills():
    """YaRN is one function of the position in prefill and decode: the last token's logits of
    a prefill equal those of decoding the sequence token by token (float32 storage: nothing
    rounds)."""
    cfg = config.tiny().replace(
        yarn_original_len=64, yarn_factor=4.0, kv_format="f32", index_format="f32"
    )
    cfg = cfg.replace(window_format="f32")
    m = model.Model(cfg, rngs=nnx.Rngs(1))
    tokens = jax.random.randint(jax.random.key(2), (2, 12), 4, cfg.vocab_size, jnp.int32)
    logits, _, _ = model.prefill(m, tokens, jnp.full((2,), 12), max_len=12)
    cache = init_cache(cfg, 2, 12)
    for t in range(12):
        step_logits, cache, _ = model.decode_step(m, tokens[:, t], cache)
    np.testing.assert_allclose(step_logits, logits[:, -1], atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("yarn_original_len", -1),
        ("yarn_original_len", 1.5),
        ("yarn_factor", 0.5),
        ("yarn_factor", float("nan")),
        ("yarn_beta_slow", 0.0),
        ("yarn_beta_fast", 0.5),  # not above beta_slow (1)
    ],
)
def test_bad_yarn_fields_name_the_field(field, value):
    with pytest.raises(ValueError, match=rf"ModelConfig\.{field}: expected"):
        config.tiny().replace(**{field: value})
