"""The sequence-sharded candidate pool, and the candidate source's own top-k, equal the
unsharded ones bit for bit (issue 15).

Runs on 8 devices: `tests/test_multidevice.py` starts it with JAX_NUM_CPU_DEVICES=8 (8 simulated
CPU devices); on a machine with 8 accelerators it runs as it is.
"""

import itertools

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from v41jax.ops.pool import (
    BLOCK_REDUCERS,
    select_candidate_blocks,
    sharded_candidate_blocks,
    sharded_topk,
)
from v41jax.ops.scoring import TIE_ORDERS, topk

if jax.device_count() < 8:
    pytest.skip(
        "needs 8 devices (tests/test_multidevice.py provides them)", allow_module_level=True
    )

MESHES = {  # name: (mesh shape, axis names, positions axis, rows axis)
    "1x8": ((8,), ("context",), "context", None),
    "2x4": ((2, 4), ("data", "context"), "context", "data"),
    "4x2": ((4, 2), ("data", "context"), "context", "data"),
    "8x1": ((8, 1), ("data", "context"), "context", "data"),
}


SHARDED = jax.jit(
    sharded_candidate_blocks,
    static_argnames=(
        "topk_blocks",
        "block_size",
        "reduce",
        "mesh",
        "axis",
        "batch_axis",
        "tie_order",
    ),
)


def _mesh(name):
    shape, names, axis, rows = MESHES[name]
    return Mesh(np.array(jax.devices()[:8]).reshape(shape), names), axis, rows


def _scores(rng, batch, n_pos, block_size):
    """Scores that tie often (small integers, ReLU zeros of both signs), with −inf holes, NaN,
    +inf and huge values, ragged lengths, an empty row and a full one."""
    scores = rng.integers(-2, 3, size=(batch, n_pos)).astype(np.float32)
    scores = np.maximum(scores, 0.0) * rng.choice([1.0, -1.0], size=scores.shape)  # ±0.0
    noisy = rng.random(scores.shape) < 0.3
    scores[noisy] = rng.normal(size=int(noisy.sum()))
    special = rng.random(scores.shape)
    scores[special < 0.15] = -np.inf
    scores[(special > 0.97)] = np.nan
    scores[(special > 0.95) & (special <= 0.97)] = np.inf
    scores[(special > 0.93) & (special <= 0.95)] = 3e38
    lens = rng.integers(0, n_pos + 1, size=batch)
    lens[0], lens[-1] = 0, n_pos
    return scores.astype(np.float32), lens


# Every reducer on the mesh without a batch axis and on one with it, and every mesh met (each
# case compiles its 12 shapes: the suite's budget). The reducers share the merge; they differ in
# the local reduction only.
WITH_BATCH = {"max": "8x1", "mean": "4x2", "top2": "2x4"}
POOL_CASES = [(r, m) for r in sorted(BLOCK_REDUCERS) for m in ("1x8", WITH_BATCH[r])]
assert {m for _, m in POOL_CASES} == set(MESHES), POOL_CASES


@pytest.mark.parametrize(("reduce", "mesh_name"), POOL_CASES)
def test_sharded_pool_is_the_pool_bit_for_bit(mesh_name, reduce):
    mesh, axis, rows = _mesh(mesh_name)
    # Fresh data each run (str hashes are salted per process); a failure names its seed.
    seed = abs(hash((mesh_name, reduce))) % 2**32
    rng = np.random.default_rng(seed)
    # Every shape, and each tie order with every value of each size (pairs, not the product: the
    # tie order enters the selection, not the shapes; 12 compiled shapes a case, not 24).
    for i, j, k in itertools.product(range(2), range(2), range(3)):
        block_size, blocks_per_device, topk_blocks = (1, 4)[i], (1, 3)[j], (1, 5, 40)[k]
        tie_order = TIE_ORDERS[(i + j + k) % 2]
        n_pos = block_size * blocks_per_device * mesh.shape[axis]
        scores, lens = _scores(rng, 8, n_pos, block_size)
        want = select_candidate_blocks(
            scores, lens, topk_blocks, block_size, reduce, tie_order=tie_order
        )
        got = SHARDED(
            scores,
            lens,
            topk_blocks=topk_blocks,
            block_size=block_size,
            reduce=reduce,
            mesh=mesh,
            axis=axis,
            batch_axis=rows,
            tie_order=tie_order,
        )
        case = f"{seed=} {block_size=} {blocks_per_device=} {topk_blocks=} {tie_order=}"
        np.testing.assert_array_equal(got.block_ids, want.block_ids, err_msg=case)
        np.testing.assert_array_equal(got.mask, want.mask, err_msg=case)


def test_top2_of_two_huge_scores_does_not_overflow_in_either_program():
    """The case a fresh-clone run drew (seed 95): block 1's two best scores are 3e38, whose
    mean is 3e38; summed before halving (XLA's simplifier factoring 0.5·a + 0.5·b) they
    overflow to +inf, which the cap turns into the float32 maximum, tying block 1 with the
    blocks that hold +inf. It happened in the sharded program only, and its pool differed."""
    scores = np.zeros((1, 32), np.float32)
    scores[0, 0:4] = [1.0, np.inf, 0.5, 2.0]  # capped to the float32 maximum
    scores[0, 4:8] = [3e38, np.nan, 3e38, 3e38]  # top2 mean 3e38
    scores[0, 8:12] = [3e38, -np.inf, np.nan, -np.inf]  # one valid score: 3e38
    mesh, axis, _ = _mesh("1x8")
    for tie_order in TIE_ORDERS:
        want = select_candidate_blocks(scores, [32], 3, 4, "top2", tie_order=tie_order)
        got = SHARDED(
            scores, np.array([32]), topk_blocks=3, block_size=4, reduce="top2", mesh=mesh,
            axis=axis, batch_axis=None, tie_order=tie_order,
        )  # fmt: skip
        # The pin (block 7), the capped +inf block 0, then blocks 1 and 2 tie at 3e38.
        expected = [0, 1, 7] if tie_order == "oldest" else [0, 2, 7]
        np.testing.assert_array_equal(want.block_ids[0], expected, err_msg=tie_order)
        np.testing.assert_array_equal(got.block_ids[0], expected, err_msg=tie_order)


def test_sharded_pool_names_what_does_not_fit():
    mesh, axis, rows = _mesh("2x4")
    scores = np.zeros((2, 24), np.float32)
    with pytest.raises(ValueError, match=r"scores: expected n_pos to split .* 32\), got 24"):
        sharded_candidate_blocks(scores, [24, 24], 2, 8, mesh=mesh, axis=axis)
    with pytest.raises(ValueError, match=r"axis: expected one of the mesh axes"):
        sharded_candidate_blocks(scores, [24, 24], 2, 2, mesh=mesh, axis="sequence")
    with pytest.raises(ValueError, match=r"scores: expected B divisible by the 2 devices"):
        sharded_candidate_blocks(
            np.zeros((3, 32), np.float32), [1, 2, 3], 2, 2, mesh=mesh, axis=axis, batch_axis=rows
        )


SHARDED_TOPK = jax.jit(
    sharded_topk, static_argnames=("k", "mesh", "axis", "batch_axis", "tie_order")
)


@pytest.mark.parametrize("mesh_name", sorted(MESHES))
def test_sharded_source_topk_is_the_topk_bit_for_bit(mesh_name):
    """The candidate source's own top-k over every position: picks and scores as `topk`'s,
    through ties (±0 among them), −inf, NaN, +inf, more picks than a device holds and than
    there are positions."""
    mesh, axis, rows = _mesh(mesh_name)
    rng = np.random.default_rng(abs(hash(("topk", mesh_name))) % 2**32)
    for per_device, k, tie_order in itertools.product((1, 5, 12), (0, 1, 7, 40), TIE_ORDERS):
        n_pos = per_device * mesh.shape[axis]
        scores, lens = _scores(rng, 8, n_pos, 1)
        scores = np.where(np.arange(n_pos) < lens[:, None], scores, -np.inf).astype(np.float32)
        want = topk(scores, k, tie_order=tie_order)
        got = SHARDED_TOPK(scores, k=k, mesh=mesh, axis=axis, batch_axis=rows, tie_order=tie_order)
        case = f"{per_device=} {k=} {tie_order=}"
        np.testing.assert_array_equal(got.indices, want.indices, err_msg=case)
        np.testing.assert_array_equal(got.scores, want.scores, err_msg=case)


def test_sharded_source_topk_names_what_does_not_fit():
    mesh, axis, _ = _mesh("2x4")
    with pytest.raises(ValueError, match=r"scores: expected n_pos to split .* 4\), got 6"):
        sharded_topk(np.zeros((2, 6), np.float32), 2, mesh=mesh, axis=axis)
    with pytest.raises(ValueError, match=r"scores: expected shape \[B, n_pos\]"):
        sharded_topk(np.zeros((8,), np.float32), 2, mesh=mesh, axis=axis)
