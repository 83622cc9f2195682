"""`v41jax.ops.attention` against a numpy loop (DESIGN §3 step 4, `v41_architecture.md` §5)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from v41jax.ops.attention import (
    SparseAttentionResult,
    masked_attention,
    sliding_window_rows,
    sparse_attention,
)

SETTINGS = settings(deadline=None, max_examples=20)
attend = jax.jit(functools.partial(sparse_attention, return_probs=True))


def np_attention(q, window_kv, window_valid, kv, indices, sink, scale=None):
    """One softmax over valid window rows + selected rows + sink, per query row and head; loops.

    Every array is already broadcast to q's batch dims. Returns (out, probs, lse).
    """
    *batch, n_heads, dim = q.shape
    scale = dim**-0.5 if scale is None else scale
    n_window, n_kv = window_kv.shape[-2], kv.shape[-2]
    out = np.zeros(q.shape)
    probs = np.zeros((*batch, n_heads, n_window + indices.shape[-1]))
    lse = np.zeros((*batch, n_heads))
    for b in np.ndindex(*batch):
        slots = [(j, window_kv[b][j]) for j in range(n_window) if window_valid[b][j]]
        slots += [(n_window + i, kv[b][p]) for i, p in enumerate(indices[b]) if 0 <= p < n_kv]
        for h in range(n_heads):
            logits = [float(q[b][h] @ key) * scale for _, key in slots]
            m = max([*logits, sink[h]])
            e = [np.exp(s - m) for s in logits]
            denom = sum(e) + np.exp(sink[h] - m)
            lse[b][h] = m + np.log(denom)
            for (slot, key), e_j in zip(slots, e, strict=True):
                probs[b][h][slot] = e_j / denom
                out[b][h] += e_j / denom * key
    return out, probs, lse


@st.composite
def attention_cases(draw):
    batch = tuple(draw(st.lists(st.integers(1, 2), max_size=2)))
    n_heads, dim = draw(st.integers(1, 3)), draw(st.sampled_from([4, 8]))
    n_window, n_kv, n_sel = (
        draw(st.integers(0, 5)),
        draw(st.integers(1, 7)),
        draw(st.integers(0, 6)),
    )
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    f32 = lambda *shape: rng.normal(size=shape).astype(np.float32)
    q = 2 * f32(*batch, n_heads, dim)
    window_kv = f32(*batch, n_window, dim)
    window_valid = rng.random((*batch, n_window)) < 0.7
    kv = f32(*batch, n_kv, dim)
    indices = rng.integers(-1, n_kv, (*batch, n_sel))  # −1 holes and duplicates
    if batch and draw(st.booleans()):  # an empty row: nothing valid at all
        window_valid[(0,) * len(batch)] = False
        indices[(0,) * len(batch)] = -1
    sink = f32(n_heads)
    return q, window_kv, window_valid, kv, indices, sink


def assert_matches_numpy(args, got, scale=None):
    want = np_attention(*(np.asarray(a) for a in args), scale=scale)
    assert isinstance(got, SparseAttentionResult)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == jnp.float32 and g.shape == w.shape
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-6)


@SETTINGS
@given(case=attention_cases())
def test_sparse_attention_matches_numpy(case):
    assert_matches_numpy(case, attend(*case))


def test_broadcast_kv_over_queries_and_custom_scale():
    # Prefill layout: kv [B, 1, N, D] shared by the T queries of a sequence, per-query windows.
    rng = np.random.default_rng(0)
    b, t, h, d, w, n, k = 2, 3, 4, 8, 5, 9, 6
    q = rng.normal(size=(b, t, h, d)).astype(np.float32)
    window_kv = rng.normal(size=(b, t, w, d)).astype(np.float32)
    window_valid = rng.random((b, t, w)) < 0.6
    kv = rng.normal(size=(b, 1, n, d)).astype(np.float32)
    indices = rng.integers(-1, n, (b, t, k))
    sink = rng.normal(size=h).astype(np.float32)
    got = attend(q, window_kv, window_valid, kv, indices, sink, scale=0.3)
    full = (q, window_kv, window_valid, np.broadcast_to(kv, (b, t, n, d)), indices, sink)
    assert_matches_numpy(full, got, scale=0.3)


def test_empty_rows_give_zeros_and_sink_lse():
    rng = np.random.default_rng(1)
    q = rng.normal(size=(2, 3, 8)).astype(np.float32)
    window_kv = np.full((2, 4, 8), np.nan, np.float32)  # unfilled ring-buffer garbage
    window_valid = np.zeros((2, 4), bool)
    kv = rng.normal(size=(2, 5, 8)).astype(np.float32)
    indices = np.array([[-1, -1], [-1, 7]])  # 7 is out of range: skipped like −1
    sink = rng.normal(size=3).astype(np.float32)
    got = attend(q, window_kv, window_valid, kv, indices, sink)
    assert np.all(np.asarray(got.out) == 0.0) and np.all(np.asarray(got.probs) == 0.0)
    np.testing.assert_allclose(got.lse, np.broadcast_to(sink, (2, 3)), rtol=1e-6)
    # A −inf sink (no sink) still yields zeros, not NaN.
    no_sink = attend(q, window_kv, window_valid, kv, indices, np.full(3, -np.inf, np.float32))
    assert np.all(np.asarray(no_sink.out) == 0.0)


def test_duplicate_indices_count_twice_and_invalid_slots_are_skipped():
    rng = np.random.default_rng(2)
    q = rng.normal(size=(2, 8)).astype(np.float32)
    window_kv = rng.normal(size=(3, 8)).astype(np.float32)
    window_valid = np.array([True, False, True])
    kv = rng.normal(size=(4, 8)).astype(np.float32)
    sink = rng.normal(size=2).astype(np.float32)
    once = attend(q, window_kv, window_valid, kv, np.array([2, -1, -1]), sink)
    twice = attend(q, window_kv, window_valid, kv, np.array([2, 2, -1]), sink)
    assert_matches_numpy((q, window_kv, window_valid, kv, np.array([2, 2, -1]), sink), twice)
    np.testing.assert_allclose(twice.probs[:, 3], twice.probs[:, 4])
    assert np.all(np.asarray(twice.probs[:, 3]) < np.asarray(once.probs[:, 3]))
    # An invalid window slot changes nothing whatever its content.
    window_kv[1] = 1e6
    again = attend(q, window_kv, window_valid, kv, np.array([2, -1, -1]), sink)
    np.testing.assert_array_equal(again.out, once.out)


def test_default_return_is_the_output_array():
    rng = np.random.default_rng(4)
    args = (
        rng.normal(size=(2, 4)).astype(np.float32),
        rng.normal(size=(3, 4)).astype(np.float32),
        np.ones(3, bool),
        rng.normal(size=(5, 4)).astype(np.float32),
        np.array([0, 4]),
        np.zeros(2, np.float32),
    )
    out = jax.jit(sparse_attention)(*args)
    np.testing.assert_array_equal(out, attend(*args).out)
    as_bf16 = [jnp.asarray(a, jnp.bfloat16) if a.dtype == np.float32 else a for a in args]
    assert sparse_attention(*as_bf16).dtype == jnp.float32


def test_gradients_are_finite_with_empty_rows():
    rng = np.random.default_rng(3)
    q = rng.normal(size=(3, 2, 8)).astype(np.float32)
    window_kv = rng.normal(size=(3, 4, 8)).astype(np.float32)
    window_valid = rng.random((3, 4)) < 0.5
    window_valid[0] = False
    window_kv[0] = np.nan  # garbage in skipped slots must not leak into gradients either
    kv = rng.normal(size=(3, 6, 8)).astype(np.float32)
    indices = np.array([[-1, -1, -1], [0, 0, 5], [-1, 3, 1]])
    sink = rng.normal(size=2).astype(np.float32)

    def loss(q, window_kv, kv, sink):
        res = sparse_attention(q, window_kv, window_valid, kv, indices, sink, return_probs=True)
        return jnp.sum(res.out**2) + jnp.sum(res.lse) + jnp.sum(res.probs**2)

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(q, window_kv, kv, sink)
    g_q, g_window, g_kv, g_sink = (np.asarray(g) for g in grads)
    assert np.all(np.isfinite(g_q)) and np.all(np.isfinite(g_kv)) and np.all(np.isfinite(g_sink))
    assert np.all(g_q[0] == 0.0)  # the empty row's output is constant zero
    assert np.all(g_window[~window_valid] == 0.0) and np.all(np.isfinite(g_window))
    # Against finite differences on the sink and one kv row.
    eps = 1e-3
    for h in range(2):
        bump = np.eye(2, dtype=np.float32)[h] * eps
        fd = (loss(q, window_kv, kv, sink + bump) - loss(q, window_kv, kv, sink - bump)) / (2 * eps)
        np.testing.assert_allclose(g_sink[h], fd, rtol=2e-2, atol=2e-3)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"q": np.zeros((2, 8), np.int32)}, "q"),
        ({"q": np.zeros(8, np.float32)}, "q"),
        ({"window_kv": np.zeros((3, 4), np.float32)}, "window_kv"),
        ({"window_valid": np.ones(3, np.int32)}, "window_valid"),
        ({"window_valid": np.ones(4, bool)}, "window_valid"),
        ({"kv": np.zeros((5, 4), np.float32)}, "kv"),
        ({"kv": np.zeros((3, 5, 8), np.float32)}, "kv"),
        ({"indices": np.zeros(2, np.float32)}, "indices"),
        ({"indices": np.zeros((3, 2), np.int32)}, "indices"),
        ({"sink": np.zeros(3, np.float32)}, "sink"),
        ({"scale": float("nan")}, "scale"),
        ({"scale": np.ones(2, np.float32)}, "scale"),
    ],
)
def test_sparse_attention_rejects_bad_input(kwargs, name):
    args = {
        "q": np.zeros((2, 8), np.float32),
        "window_kv": np.zeros((3, 8), np.float32),
        "window_valid": np.ones(3, bool),
        "kv": np.zeros((5, 8), np.float32),
        "indices": np.zeros(2, np.int32),
        "sink": np.zeros(2, np.float32),
    }
    with pytest.raises(ValueError, match=f"^{name}: expected"):
        sparse_attention(**(args | kwargs))


@pytest.mark.parametrize("t,w", [(5, 4), (3, 8), (8, 4), (7, 1)])
def test_masked_attention_equals_sparse_attention_on_the_selected_positions(t, w):
    """The prefill/training layout (the window as a band over the sequence, a mask over the
    sequence's KV) is the same function as the gather layout with the window's rows and the
    mask's positions as indices: T below, at and beyond a multiple of the window."""
    rng = np.random.default_rng(5)
    b, h, d, s, k = 2, 3, 16, 11, 6
    q = jnp.asarray(rng.standard_normal((b, t, h, d)), jnp.float32)
    window_seq = jnp.asarray(rng.standard_normal((b, t, d)), jnp.float32)
    window, window_valid = sliding_window_rows(window_seq, w)
    kv = jnp.asarray(rng.standard_normal((b, s, d)), jnp.float32)
    sink = jnp.asarray(rng.standard_normal(h), jnp.float32)
    # Distinct picks with −1 anywhere (any order is valid input), one row empty.
    scores = rng.random((b, t, s))
    picks = np.sort(np.argsort(scores, -1)[..., :k], -1)
    picks = np.where(rng.random((b, t, k)) < 0.7, picks, -1)
    picks[0, 0] = -1
    indices = jnp.asarray(picks, jnp.int32)
    mask = (
        jnp.zeros((b, t, s), bool)
        .at[np.arange(b)[:, None, None], np.arange(t)[None, :, None], np.maximum(picks, 0)]
        .max(picks >= 0)
    )

    masked = masked_attention(q, window_seq, kv, mask, sink, window_size=w)
    gathered = jax.vmap(
        lambda q_t, w_t, v_t, i_t: sparse_attention(
            q_t, w_t, v_t, kv, i_t, sink, return_probs=True
        ),
        in_axes=1,
        out_axes=1,
    )(q, window, window_valid, indices)
    np.testing.assert_allclose(masked.out, gathered.out, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(masked.lse, gathered.lse, rtol=1e-5, atol=1e-6)
    # The probability of each picked key sits at its position in the masked layout.
    per_position = np.asarray(masked.probs)
    picked = np.take_along_axis(per_position, np.maximum(picks, 0)[:, :, None, :], -1)
    expected = np.where(picks[:, :, None, :] >= 0, np.asarray(gathered.probs)[..., w:], 0)
    np.testing.assert_allclose(np.where(picks[:, :, None, :] >= 0, picked, 0), expected, atol=1e-6)
