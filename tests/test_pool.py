"""`v41jax.ops.pool` against a plain numpy loop (DESIGN §3 step 3, `v41_architecture.md` §4)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from v41jax.ops.pool import (
    BLOCK_REDUCERS,
    CandidatePool,
    pool_mask_from_block_ids,
    select_candidate_blocks,
    slot_positions,
)
from v41jax.ops.scoring import topk_indices

SETTINGS = settings(deadline=None, max_examples=40)
select_jit = jax.jit(select_candidate_blocks, static_argnums=(2, 3, 4))


def np_select(scores, lens, topk_blocks, block_size, reduce):
    """Loop version of DESIGN §3 step 3; returns (mask, block_ids)."""
    *batch, n_pos = scores.shape
    n_blocks = math.ceil(n_pos / block_size)
    mask = np.zeros(scores.shape, bool)
    ids = np.full((*batch, topk_blocks), -1)
    for b in np.ndindex(*batch):
        n = min(max(int(lens[b]), 0), n_pos)
        block_scores = []
        for j in range(n_blocks):
            vals = [scores[b][p] for p in range(j * block_size, min((j + 1) * block_size, n))]
            vals = [v for v in vals if v > -np.inf]
            if j == (n - 1) // block_size and n > 0:
                block_scores.append(np.inf)
            elif not vals:
                block_scores.append(-np.inf)
            else:
                block_scores.append(
                    {"max": max, "mean": np.mean, "top2": lambda v: np.mean(sorted(v)[-2:])}[
                        reduce
                    ](vals)
                )
        ranked = sorted(range(n_blocks), key=lambda j: (-block_scores[j], j))
        kept = sorted(j for j in ranked[:topk_blocks] if block_scores[j] > -np.inf)
        ids[b][: len(kept)] = kept
        for j in kept:
            mask[b][j * block_size : min((j + 1) * block_size, n)] = True
    return mask, ids


@st.composite
def pool_cases(draw):
    batch = tuple(draw(st.lists(st.integers(1, 3), max_size=2)))
    block_size = draw(st.integers(1, 5))
    n_pos = draw(st.integers(0, 30))  # often not a multiple of block_size
    topk_blocks = draw(st.integers(1, 6))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    lens = rng.integers(0, n_pos + 1, batch)
    lens.flat[: draw(st.integers(0, lens.size))] = 0  # some empty rows
    scores = rng.normal(size=(*batch, n_pos)).astype(np.float32)
    visible = np.arange(n_pos) < lens[..., None]
    holes = rng.random((*batch, n_pos)) < 0.2  # e.g. positions a Reindex mask removed
    scores = np.where(visible & ~holes, scores, -np.inf).astype(np.float32)
    return scores, lens, topk_blocks, block_size


def pool_and_expanded(scores, lens, topk_blocks, block_size, reduce):
    """The pool and its block ids expanded back to a mask, in one compiled call."""
    pool = select_candidate_blocks(scores, lens, topk_blocks, block_size, reduce)
    return pool, pool_mask_from_block_ids(pool.block_ids, scores.shape[-1], block_size, lens)


pool_and_expanded_jit = jax.jit(pool_and_expanded, static_argnums=(2, 3, 4))


@SETTINGS
@given(case=pool_cases(), reduce=st.sampled_from(sorted(BLOCK_REDUCERS)))
def test_select_candidate_blocks_matches_numpy_and_invariants(case, reduce):
    scores, lens, topk_blocks, block_size = case
    pool, expanded = pool_and_expanded_jit(scores, lens, topk_blocks, block_size, reduce)
    assert isinstance(pool, CandidatePool)
    assert pool.mask.dtype == jnp.bool_ and pool.block_ids.dtype == jnp.int32
    want_mask, want_ids = np_select(scores, lens, topk_blocks, block_size, reduce)
    np.testing.assert_array_equal(pool.mask, want_mask)
    np.testing.assert_array_equal(pool.block_ids, want_ids)

    # The spec's properties, checked directly rather than through the numpy loop.
    mask, ids = np.asarray(pool.mask), np.asarray(pool.block_ids)
    n_pos = scores.shape[-1]
    block_of = np.arange(n_pos) // block_size
    np.testing.assert_array_equal(expanded, mask)  # block_ids ↔ mask
    # Only visible positions; compress_lens = 0 gives an empty pool.
    assert not np.any(mask & (np.arange(n_pos) >= lens[..., None]))
    assert not np.any(mask[lens == 0]) and np.all(ids[lens == 0] == -1)
    for b in np.ndindex(*lens.shape):
        n, kept = lens[b], ids[b][ids[b] >= 0]
        # ids ascending, −1 padded, and the same set as the mask's blocks.
        assert np.all(np.diff(kept) > 0) and np.all(ids[b][len(kept) :] == -1)
        assert set(kept) == set(block_of[mask[b]])
        if n == 0:
            continue
        newest = (n - 1) // block_size
        assert newest in kept  # the newest block is always in
        reachable = set(block_of[:n][scores[b][:n] > -np.inf]) | {newest}
        assert set(kept) <= reachable  # −inf blocks are never picked (the pinned one aside)
        if len(reachable) <= topk_blocks:
            assert set(kept) == reachable  # all reachable blocks kept while they fit


def test_reindex_picks_lie_in_the_pool_and_the_source_is_unrestricted():
    # Level one picks blocks from the candidate source's scores; a Reindex layer's own scores are
    # then restricted to the pool, while the source's top-k is not.
    rng = np.random.default_rng(5)
    lens = np.array([0, 3, 17, 40, 40])
    visible = np.arange(40) < lens[:, None]
    source, reindex = (
        np.where(visible, rng.normal(size=(5, 40)), -np.inf).astype(np.float32) for _ in range(2)
    )
    pool = select_jit(source, lens, 3, 4)
    mask = np.asarray(pool.mask)
    picks = np.asarray(topk_indices(reindex, 10, pool.mask))
    assert np.all(np.take_along_axis(mask, picks.clip(min=0), -1)[picks >= 0])
    np.testing.assert_array_equal((picks >= 0).sum(-1), mask.sum(-1).clip(max=10))
    own = np.asarray(topk_indices(source, 10))
    assert np.any(~np.take_along_axis(mask, own.clip(min=0), -1)[own >= 0])


def test_invisible_positions_are_ignored_even_when_finite():
    # compress_lens wins over the scores: a huge score beyond it neither enters nor sways the pool.
    scores = np.array([[1.0, 0.0, 0.0, 5.0, 0.0, 0.0, 99.0, 99.0]], np.float32)
    pool = select_jit(scores, np.array([4]), topk_blocks=2, block_size=2)
    np.testing.assert_array_equal(pool.block_ids, [[0, 1]])
    np.testing.assert_array_equal(pool.mask, [[1, 1, 1, 1, 0, 0, 0, 0]])


def test_mean_and_max_differ_on_a_needle_and_agree_on_flat_blocks():
    # Block 0 holds one needle among low scores; block 1 is uniformly fairly high; block 2 is
    # the newest (pinned). max keeps the needle's block, mean the uniform one.
    scores = np.array([[-3.0, 10.0, -3.0, -3.0, 4.0, 4.0, 4.0, 4.0, 0.0, 0.0]], np.float32)
    lens = np.array([10])
    by_max = select_jit(scores, lens, 2, 4, reduce="max")
    by_mean = select_jit(scores, lens, 2, 4, reduce="mean")
    np.testing.assert_array_equal(by_max.block_ids, [[0, 2]])
    np.testing.assert_array_equal(by_mean.block_ids, [[1, 2]])
    # Constant blocks (max = mean) and block_size 1 give the same pool under both reducers.
    flat = np.repeat(np.random.default_rng(0).normal(size=(3, 6)), 4, axis=-1).astype(np.float32)
    lens = np.array([24, 17, 9])
    for block_size, data in ((4, flat), (1, flat + np.arange(24, dtype=np.float32))):
        a = select_jit(data, lens, 3, block_size, reduce="max")
        b = select_jit(data, lens, 3, block_size, reduce="mean")
        np.testing.assert_array_equal(a.block_ids, b.block_ids)
        np.testing.assert_array_equal(a.mask, b.mask)


def test_mean_ignores_neg_inf_entries():
    # Block 0: one reachable 2.0 among −inf holes → mean 2.0, beats block 1's mean of 1.5.
    inf = np.inf
    scores = np.array([[2.0, -inf, -inf, 1.0, 2.0, -inf, 0.0]], np.float32)
    pool = select_jit(scores, np.array([7]), 2, 3, reduce="mean")
    np.testing.assert_array_equal(pool.block_ids, [[0, 2]])


def test_top2_sits_between_max_and_mean():
    # Block 0: a lone needle (10) among lows; block 1: a two-token piece of evidence (7, 7);
    # block 2: uniformly fairly high (4s); block 3: the newest (pinned). With 2 slots, max keeps
    # the needle, mean the uniform block, top2 the pair.
    scores = np.array([[-3, 10, -3, -3, 7, 7, -3, -3, 4, 4, 4, 4, 0, 0]], np.float32)
    lens = np.array([14])
    picked = {
        r: select_jit(scores, lens, 2, 4, reduce=r).block_ids for r in ("max", "mean", "top2")
    }
    np.testing.assert_array_equal(picked["max"], [[0, 3]])
    np.testing.assert_array_equal(picked["mean"], [[2, 3]])
    np.testing.assert_array_equal(picked["top2"], [[1, 3]])
    # One valid position: its score alone (not halved with −inf); block_size 1: the score.
    inf = np.inf
    one = np.array([[5.0, -inf, 1.0, 2.0, 0.0, 0.0]], np.float32)
    np.testing.assert_array_equal(
        select_jit(one, np.array([6]), 2, 2, reduce="top2").block_ids, [[0, 2]]
    )
    flat = np.random.default_rng(1).normal(size=(2, 9)).astype(np.float32)
    a = select_jit(flat, np.array([9, 5]), 3, 1, reduce="max")
    b = select_jit(flat, np.array([9, 5]), 3, 1, reduce="top2")
    np.testing.assert_array_equal(a.block_ids, b.block_ids)
    # Huge scores do not overflow to inf (the halves are added).
    big = np.array([[3e38, 3e38, 1e38, 1e38, 0.0, 0.0]], np.float32)
    reduced = BLOCK_REDUCERS["top2"](
        jnp.asarray(big[:, :4].reshape(1, 2, 2)), jnp.ones((1, 2, 2), bool)
    )
    np.testing.assert_array_equal(np.asarray(reduced), big[:, [0, 2]])


def test_custom_reducer_plugs_in():
    def block_min(scores, valid):
        return jnp.min(jnp.where(valid, scores, jnp.inf), axis=-1)

    scores = np.array([[5.0, -1.0, 2.0, 2.0, 0.0, 0.0]], np.float32)
    pool = select_jit(scores, np.array([6]), 2, 2, reduce=block_min)
    np.testing.assert_array_equal(pool.block_ids, [[1, 2]])


def test_lens_broadcast_and_decode_int():
    rng = np.random.default_rng(3)
    scores = rng.normal(size=(2, 3, 20)).astype(np.float32)
    column = np.array([5, 13, 20])
    scores = np.where(np.arange(20) < column[:, None], scores, -np.inf).astype(np.float32)
    got = select_jit(scores, column, 2, 4)
    want = np_select(scores, np.broadcast_to(column, (2, 3)), 2, 4, "max")
    np.testing.assert_array_equal(got.mask, want[0])
    np.testing.assert_array_equal(got.block_ids, want[1])
    decode = select_jit(scores[:, 2], 20, 2, 4)
    np.testing.assert_array_equal(decode.block_ids, want[1][:, 2])


def test_slot_positions_are_the_pools_positions_at_those_slots():
    """Against a numpy loop over fresh random ids (−1 blocks, −1 slots, ids out of order)."""
    rng = np.random.default_rng(8)
    for block_size in (1, 4, 8):
        ids = rng.integers(-1, 50, (3, 2, 9))
        slots = rng.integers(-1, 9 * block_size, (3, 2, 11))
        want = np.full(slots.shape, -1)
        for index in np.ndindex(*slots.shape):
            slot = slots[index]
            block = ids[index[:-1]][slot // block_size] if slot >= 0 else -1
            if block >= 0:
                want[index] = block * block_size + slot % block_size
        got = jax.jit(slot_positions, static_argnums=2)(ids, slots, block_size)
        np.testing.assert_array_equal(got, want)
        assert got.dtype == jnp.int32


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"scores": np.zeros((2, 8), np.int32)}, "scores"),
        ({"compress_lens": np.array([1.0, 2.0])}, "compress_lens"),
        ({"compress_lens": np.array([1, 2, 3])}, "compress_lens"),
        ({"topk_blocks": 0}, "topk_blocks"),
        ({"block_size": 0}, "block_size"),
        ({"block_size": 2.0}, "block_size"),
        ({"reduce": "median"}, "reduce"),
    ],
)
def test_select_candidate_blocks_rejects_bad_input(kwargs, name):
    args = {
        "scores": np.zeros((2, 8), np.float32),
        "compress_lens": np.array([3, 8]),
        "topk_blocks": 2,
        "block_size": 4,
    }
    with pytest.raises(ValueError, match=f"^{name}: expected") as err:
        select_candidate_blocks(**(args | kwargs))
    if name == "reduce":
        assert "'max'" in str(err.value) and "'mean'" in str(err.value)


def test_pool_mask_from_block_ids_rejects_bad_input():
    with pytest.raises(ValueError, match=r"^block_ids: expected"):
        pool_mask_from_block_ids(np.zeros(2, np.float32), 8, 4, 8)
    with pytest.raises(ValueError, match=r"^n_pos: expected"):
        pool_mask_from_block_ids(np.zeros(2, np.int32), -1, 4, 8)
    with pytest.raises(ValueError, match=r"^compress_lens: expected"):
        pool_mask_from_block_ids(np.zeros((3, 2), np.int32), 8, 4, np.array([1, 2]))
