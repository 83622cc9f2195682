"""`v41jax.ops.scoring` against plain numpy loops (DESIGN §3 steps 2–3)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from v41jax.ops.scoring import index_scores, indices_to_mask, topk, topk_indices

SETTINGS = settings(deadline=None, max_examples=20)
topk_jit = jax.jit(topk, static_argnums=1)


def np_index_scores(q, w, k, lens):
    """I[t, s] = Σ_h w[t, h]·ReLU(q[t, h]·k[s]) for s < lens[t], −inf otherwise; loops."""
    *batch, n_q, n_heads, _ = q.shape
    n_pos = k.shape[-2]
    out = np.full((*batch, n_q, n_pos), -np.inf)
    for b in np.ndindex(*batch):
        for t in range(n_q):
            for s in range(min(lens[b][t], n_pos)):
                out[b][t, s] = sum(
                    w[b][t, h] * max(float(q[b][t, h] @ k[b][s]), 0.0) for h in range(n_heads)
                )
    return out


def np_topk(scores, k, mask=None):
    """Best k by (score desc, position asc) among picks > −inf, sorted by position, −1 padded."""
    *batch, n_pos = scores.shape
    indices = np.full((*batch, k), -1)
    values = np.full((*batch, k), -np.inf)
    for b in np.ndindex(*batch):
        cands = [
            (scores[b][p], p)
            for p in range(n_pos)
            if scores[b][p] > -np.inf and (mask is None or mask[b][p])
        ]
        best = sorted(sorted(cands, key=lambda c: (-c[0], c[1]))[:k], key=lambda c: c[1])
        for i, (v, p) in enumerate(best):
            indices[b][i], values[b][i] = p, v
    return indices, values


@st.composite
def score_rows(draw, ties=False):
    """Random [batch..., n_pos] scores with −inf holes, and k (possibly > n_pos)."""
    batch = tuple(draw(st.lists(st.integers(1, 3), max_size=2)))
    n_pos = draw(st.integers(0, 20))
    k = draw(st.integers(0, 24))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    # Few distinct values force ties, the case where the tie-breaking rule matters.
    scores = rng.integers(-2, 3, (*batch, n_pos)) if ties else rng.normal(size=(*batch, n_pos))
    scores = np.where(rng.random((*batch, n_pos)) < 0.3, -np.inf, scores).astype(np.float32)
    mask = rng.random((*batch, n_pos)) < 0.5
    return scores, k, mask


# --- index_scores ---


@SETTINGS
@given(
    batch=st.lists(st.integers(1, 2), max_size=2).map(tuple),
    n_q=st.integers(1, 5),
    n_heads=st.integers(1, 3),
    n_pos=st.integers(1, 9),
    dim=st.sampled_from([4, 8]),
    seed=st.integers(0, 2**32 - 1),
)
def test_index_scores_matches_numpy(batch, n_q, n_heads, n_pos, dim, seed):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(*batch, n_q, n_heads, dim)).astype(np.float32)
    w = rng.normal(size=(*batch, n_q, n_heads)).astype(np.float32)
    k = rng.normal(size=(*batch, n_pos, dim)).astype(np.float32)
    lens = rng.integers(0, n_pos + 3, (*batch, n_q))  # ragged, including 0 and beyond n_pos
    got = np.asarray(jax.jit(index_scores)(q, w, k, lens))
    want = np_index_scores(q, w, k, lens)
    assert got.dtype == np.float32 and got.shape == (*batch, n_q, n_pos)
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_index_scores_future_entries_are_neg_inf_and_lens_broadcast():
    rng = np.random.default_rng(0)
    q = rng.normal(size=(2, 4, 3, 8)).astype(np.float32)
    w = rng.normal(size=(2, 4, 3)).astype(np.float32)
    k = rng.normal(size=(2, 6, 8)).astype(np.float32)
    column = np.array([0, 1, 3, 6])  # prefill: one column shared by the batch
    got = np.asarray(index_scores(q, w, k, column))
    for t, n in enumerate(column):
        assert np.all(np.isneginf(got[:, t, n:])) and np.all(np.isfinite(got[:, t, :n]))
    decode = np.asarray(index_scores(q, w, k, 4))  # decode: one Python int
    assert np.all(np.isneginf(decode[..., 4:])) and np.all(np.isfinite(decode[..., :4]))


def test_index_scores_bf16_inputs_give_float32():
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.normal(size=(3, 2, 8)), jnp.bfloat16)
    w = jnp.asarray(rng.normal(size=(3, 2)), jnp.bfloat16)
    k = jnp.asarray(rng.normal(size=(5, 8)), jnp.bfloat16)
    got = index_scores(q, w, k, np.array([1, 3, 5]))
    want = np_index_scores(*(np.asarray(x, np.float32) for x in (q, w, k)), np.array([1, 3, 5]))
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"q": np.zeros((3, 2, 8), np.int32)}, "q"),
        ({"q": np.zeros((2, 8))}, "q"),
        ({"weights": np.zeros((3, 3))}, "weights"),
        ({"k": np.zeros((5, 4))}, "k"),
        ({"k": np.zeros((2, 5, 8))}, "k"),
        ({"compress_lens": np.array([1.0, 2.0, 3.0])}, "compress_lens"),
        ({"compress_lens": np.array([1, 2])}, "compress_lens"),
    ],
)
def test_index_scores_rejects_bad_input(kwargs, name):
    args = {
        "q": np.zeros((3, 2, 8), np.float32),
        "weights": np.zeros((3, 2), np.float32),
        "k": np.zeros((5, 8), np.float32),
        "compress_lens": np.array([1, 2, 3]),
    }
    with pytest.raises(ValueError, match=f"^{name}: expected"):
        index_scores(**(args | kwargs))


# --- topk ---


@SETTINGS
@given(case=score_rows(), use_mask=st.booleans())
def test_topk_matches_numpy(case, use_mask):
    scores, k, mask = case
    mask = mask if use_mask else None
    got = topk_jit(scores, k, mask)
    want_idx, want_val = np_topk(scores, k, mask)
    assert got.indices.dtype == jnp.int32 and got.indices.shape == (*scores.shape[:-1], k)
    np.testing.assert_array_equal(got.indices, want_idx)
    np.testing.assert_array_equal(got.scores, want_val)


@SETTINGS
@given(case=score_rows(ties=True))
def test_topk_ties_pick_lowest_positions(case):
    scores, k, _ = case
    np.testing.assert_array_equal(topk_jit(scores, k).indices, np_topk(scores, k)[0])


@SETTINGS
@given(case=score_rows())
def test_topk_invariants(case):
    scores, k, mask = case
    picks = np.asarray(topk_jit(scores, k, mask).indices)
    valid = picks >= 0
    # Valid picks first, strictly ascending; −1 padding only at the end.
    assert np.all(np.diff(valid.astype(int), axis=-1) <= 0)
    both = valid[..., 1:] & valid[..., :-1]
    assert np.all(np.diff(picks, axis=-1)[both] > 0)
    # Picks lie in the mask and never at −inf (a trailing pad column keeps −1 indexable).
    padded_mask = np.pad(mask, [(0, 0)] * (mask.ndim - 1) + [(0, 1)])
    padded_scores = np.pad(scores, [(0, 0)] * (mask.ndim - 1) + [(0, 1)])
    assert np.all(np.take_along_axis(padded_mask, picks, -1)[valid])
    assert np.all(np.isfinite(np.take_along_axis(padded_scores, picks, -1)[valid]))
    # As many picks as pickable positions allow.
    pickable = np.sum(mask & (scores > -np.inf), axis=-1)
    np.testing.assert_array_equal(valid.sum(-1), np.minimum(pickable, k))
    # The unrestricted top-k does not depend on any pool.
    np.testing.assert_array_equal(
        topk_jit(scores, k).indices, topk_jit(scores, k, np.ones_like(mask)).indices
    )


def test_topk_k_larger_than_positions_and_empty_shapes():
    scores = np.array([[1.0, -np.inf, 3.0]], np.float32)
    got = topk(scores, 5)
    np.testing.assert_array_equal(got.indices, [[0, 2, -1, -1, -1]])
    np.testing.assert_array_equal(got.scores, [[1.0, 3.0, -np.inf, -np.inf, -np.inf]])
    assert topk_indices(scores, 0).shape == (1, 0)
    np.testing.assert_array_equal(topk_indices(np.zeros((2, 0), np.float32), 3), -np.ones((2, 3)))


@pytest.mark.parametrize(
    ("args", "name"),
    [
        ((np.zeros(4, np.int32), 2), "scores"),
        ((np.zeros(4, np.float32), -1), "k"),
        ((np.zeros(4, np.float32), 2.0), "k"),
        ((np.zeros(4, np.float32), 2, np.ones(4, np.int32)), "mask"),
        ((np.zeros(4, np.float32), 2, np.ones(3, bool)), "mask"),
    ],
)
def test_topk_rejects_bad_input(args, name):
    with pytest.raises(ValueError, match=f"^{name}: expected"):
        topk(*args)


# --- indices_to_mask ---


@SETTINGS
@given(
    batch=st.lists(st.integers(0, 3), max_size=2).map(tuple),
    k=st.integers(0, 6),
    size=st.integers(0, 10),
    seed=st.integers(0, 2**32 - 1),
)
def test_indices_to_mask_matches_numpy(batch, k, size, seed):
    indices = np.random.default_rng(seed).integers(-2, size + 3, (*batch, k))
    want = np.zeros((*batch, size), bool)
    for b in np.ndindex(*batch):
        for i in indices[b]:
            if 0 <= i < size:
                want[b][i] = True
    np.testing.assert_array_equal(jax.jit(indices_to_mask, static_argnums=1)(indices, size), want)


def test_indices_to_mask_rejects_bad_input():
    with pytest.raises(ValueError, match=r"^indices: expected"):
        indices_to_mask(np.zeros(3, np.float32), 4)
    with pytest.raises(ValueError, match=r"^size: expected"):
        indices_to_mask(np.zeros(3, np.int32), -1)
