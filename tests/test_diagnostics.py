"""`v41jax.train.diagnostics` against plain numpy loops (DESIGN §7 metrics)."""

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from v41jax.train.diagnostics import (
    DEFAULT_DISTANCE_EDGES,
    Fraction,
    attention_mass_covered,
    candidate_pool_recall,
    distance_buckets,
    in_mask,
    in_selection,
    recall_by_distance,
    within_pool_recall,
)

SETTINGS = settings(deadline=None, max_examples=20)


def picks(rng, batch, k, n_pos):
    """−1 padded ascending picks of distinct positions < n_pos, a random number per row."""
    out = np.full((*batch, k), -1)
    for b in np.ndindex(*batch):
        n = rng.integers(0, min(k, n_pos) + 1)
        out[b][:n] = np.sort(rng.choice(n_pos, n, replace=False))
    return out


@st.composite
def cases(draw):
    batch = tuple(draw(st.lists(st.integers(1, 3), min_size=1, max_size=2)))
    n_pos, k = draw(st.integers(1, 40)), draw(st.integers(1, 8))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    return batch, n_pos, k, rng


def np_mean_recall(hits, totals, counted):
    per_query = [h / t for h, t, c in zip(hits, totals, counted, strict=True) if c and t > 0]
    return (np.mean(per_query) if per_query else 0.0), len(per_query)


@SETTINGS
@given(case=cases())
def test_candidate_pool_recall_matches_numpy(case):
    batch, n_pos, k, rng = case
    topk = picks(rng, batch, k, n_pos)
    pool_mask = rng.random((*batch, n_pos)) < 0.5
    lens = rng.integers(0, n_pos + 1, batch)
    pool_size = int(rng.integers(0, n_pos + 1))
    got = jax.jit(candidate_pool_recall, static_argnums=3)(topk, pool_mask, lens, pool_size)
    hits, totals, counted = [], [], []
    for b in np.ndindex(*batch):
        valid = [p for p in topk[b] if p >= 0]
        hits.append(sum(pool_mask[b][p] for p in valid))
        totals.append(len(valid))
        counted.append(lens[b] > pool_size)
    value, count = np_mean_recall(hits, totals, counted)
    assert isinstance(got, Fraction) and got.value.shape == () and got.count.shape == ()
    np.testing.assert_allclose(got.value, value, rtol=1e-6)
    assert int(got.count) == count


def test_candidate_pool_recall_is_nan_free_when_no_query_qualifies():
    got = candidate_pool_recall(np.array([[0, 3, -1]]), np.ones((1, 8), bool), np.array([5]), 16)
    assert float(got.value) == 0.0 and int(got.count) == 0


@SETTINGS
@given(case=cases(), use_query_mask=st.booleans())
def test_within_pool_recall_matches_numpy(case, use_query_mask):
    batch, n_pos, k, rng = case
    reference = picks(rng, batch, k, n_pos)
    selected = picks(rng, batch, k + 2, n_pos)
    query_mask = rng.random(batch) < 0.6 if use_query_mask else None
    got = jax.jit(within_pool_recall)(selected, reference, query_mask)
    hits, totals = [], []
    for b in np.ndindex(*batch):
        valid = [p for p in reference[b] if p >= 0]
        hits.append(sum(p in set(selected[b]) for p in valid))
        totals.append(len(valid))
    counted = np.ones(batch, bool) if query_mask is None else query_mask
    value, count = np_mean_recall(hits, totals, counted.ravel())
    np.testing.assert_allclose(got.value, value, rtol=1e-6)
    assert int(got.count) == count


@SETTINGS
@given(case=cases())
def test_attention_mass_covered_matches_numpy(case):
    batch, n_pos, k, rng = case
    probs = rng.dirichlet(np.ones(n_pos), batch).astype(np.float32)
    selected = rng.integers(-1, n_pos + 2, (*batch, k))  # −1, duplicates, out of range
    got = jax.jit(attention_mass_covered)(probs, selected)
    want = np.zeros(batch)
    for b in np.ndindex(*batch):
        want[b] = sum(probs[b][p] for p in set(selected[b]) if 0 <= p < n_pos)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)


@SETTINGS
@given(case=cases(), edges=st.sampled_from([DEFAULT_DISTANCE_EDGES, (4,), (2, 5, 9)]))
def test_recall_by_distance_matches_numpy(case, edges):
    batch, n_pos, k, rng = case
    reference = picks(rng, batch, k, n_pos)
    hit = rng.random((*batch, k)) < 0.5
    t = rng.integers(0, n_pos, batch)
    query_mask = rng.random(batch) < 0.7
    got = jax.jit(recall_by_distance, static_argnums=3)(hit, reference, t, edges, query_mask)
    buckets = jax.jit(distance_buckets, static_argnums=2)(reference, t, edges)
    n_buckets = len(edges) + 1
    hits, counts = np.zeros(n_buckets), np.zeros(n_buckets, int)
    for b in np.ndindex(*batch):
        for i, p in enumerate(reference[b]):
            want_bucket = -1 if p < 0 else sum(t[b] - p >= e for e in edges)
            assert buckets[b][i] == want_bucket
            if p >= 0 and query_mask[b]:
                counts[want_bucket] += 1
                hits[want_bucket] += hit[b][i]
    assert got.value.shape == got.count.shape == (n_buckets,)
    np.testing.assert_array_equal(got.count, counts)
    np.testing.assert_allclose(got.value, hits / np.maximum(counts, 1), rtol=1e-6)


def test_membership_helpers():
    indices = np.array([[0, 5, 7, -1], [2, 2, -1, -1]])
    mask = np.zeros((2, 8), bool)
    mask[0, [5, 7]] = mask[1, 0] = True
    np.testing.assert_array_equal(in_mask(indices, mask), [[0, 1, 1, 0], [0, 0, 0, 0]])
    selected = np.array([[7, -1], [2, -1]])
    np.testing.assert_array_equal(in_selection(indices, selected), [[0, 0, 1, 0], [1, 1, 0, 0]])


@pytest.mark.parametrize(
    ("call", "name"),
    [
        (
            lambda: candidate_pool_recall(np.zeros((2, 3)), np.ones((2, 8), bool), 4, 2),
            "unrestricted_topk",
        ),
        (
            lambda: candidate_pool_recall(np.zeros((2, 3), int), np.ones((3, 8), bool), 4, 2),
            "pool_mask",
        ),
        (lambda: candidate_pool_recall(np.zeros((2, 3), int), np.ones((2, 8)), 4, 2), "pool_mask"),
        (
            lambda: candidate_pool_recall(np.zeros((2, 3), int), np.ones((2, 8), bool), 4, -1),
            "pool_size",
        ),
        (
            lambda: candidate_pool_recall(
                np.zeros((2, 3), int), np.ones((2, 8), bool), np.ones(3, int), 2
            ),
            "query_lens",
        ),
        (lambda: within_pool_recall(np.zeros((3, 2), int), np.zeros((2, 2), int)), "selected"),
        (
            lambda: within_pool_recall(np.zeros((2, 2), int), np.zeros((2, 2), int), np.ones(2)),
            "query_mask",
        ),
        (
            lambda: attention_mass_covered(np.ones((2, 4), int), np.zeros((2, 2), int)),
            "attn_probs_dense",
        ),
        (lambda: attention_mass_covered(np.ones((2, 4)), np.zeros((3, 2), int)), "selected"),
        (lambda: distance_buckets(np.zeros((2, 2), int), 5, (8, 4)), "edges"),
        (lambda: recall_by_distance(np.ones((2, 3), bool), np.zeros((2, 2), int), 5), "hit"),
    ],
)
def test_diagnostics_reject_bad_input(call, name):
    with pytest.raises(ValueError, match=f"^{name}: expected"):
        call()
