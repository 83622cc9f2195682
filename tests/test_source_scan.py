"""The candidate source's scan at decode (issue 16 item 1): its definition
(`v41jax.ops.pool.candidate_source_scan`) against a numpy loop, and every implementation of
`pallas_kernels.source_scan.candidate_source` against the definition on fresh random inputs:
ragged lengths, an empty row, a cache length that is not a multiple of 8, each block reducer,
both tie orders, and caches of equal rows where every score ties. On the CPU the pooled-scoring
Mosaic GPU kernel runs in its interpreter; on a GPU (`-m gpu`) compiled, at a larger cache.
"""

import dataclasses
import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as mgpu_interpret

from pallas_kernels.pooled_scoring import TuningConfig, kernel_mgpu
from pallas_kernels.source_scan import candidate_source
from pallas_kernels.source_scan.api import every_block, selections
from v41jax.ops import formats
from v41jax.ops.pool import block_scores, candidate_source_scan, source_selection
from v41jax.ops.scoring import index_scores

ON_GPU = jax.default_backend() == "gpu"
gpu = pytest.mark.skipif(not ON_GPU, reason="needs a GPU as jax's default backend")

pack_mxfp4 = jax.jit(functools.partial(formats.pack, fmt="mxfp4"))
fake_quant = jax.jit(formats.mxfp4_fake_quant)
SELECT = ("topk_blocks", "index_topk", "reduce", "tie_order")
definition = jax.jit(candidate_source_scan, static_argnames=SELECT)
scan = jax.jit(candidate_source, static_argnames=(*SELECT, "implementation", "config"))
selection_of = jax.jit(source_selection, static_argnames=SELECT)
# 203 positions: 26 blocks, the last one partial; interpreted with small tiles (several CTAs).
CPU_SHAPE = {"batch": 4, "n_pos": 203}
INTERPRET = {"implementation": "pallas_interpret", "config": TuningConfig(4, 2)}


def make_inputs(seed, *, batch, n_pos, n_heads=3, dim=128, equal_rows=False):
    """Packed MXFP4 keys (per-group scales vary), fake-quantized q, weights and ragged lengths
    (row 0 full, row 2 empty when batch > 2); `equal_rows`: every row of a sequence the same."""
    rng = np.random.default_rng(seed)
    keys = rng.normal(size=(batch, 1 if equal_rows else n_pos, dim)).astype(np.float32)
    group_scales = np.exp2(rng.integers(-3, 4, size=(*keys.shape[:2], dim // 32, 1)))
    keys *= np.broadcast_to(group_scales, (*keys.shape[:2], dim // 32, 32)).reshape(keys.shape)
    keys = np.broadcast_to(keys, (batch, n_pos, dim))
    q = fake_quant(rng.normal(size=(batch, n_heads, dim)).astype(np.float32))
    # Positive weights: with equal rows each query then has one score > 0 everywhere (no −0.0).
    weights = np.abs(rng.normal(size=(batch, n_heads))).astype(np.float32) + 0.1
    lengths = rng.integers(1, n_pos + 1, size=batch).astype(np.int32)
    lengths[0] = n_pos
    if batch > 2:
        lengths[2] = 0
    return pack_mxfp4(keys), q, weights, lengths


def reference_scores(k_packed, q, weights, lengths):
    keys = formats.unpack(k_packed, "mxfp4", q.shape[-1])
    return index_scores(q[:, None], weights[:, None], keys, lengths[:, None])[:, 0]


def numpy_selection(scores, lengths, topk_blocks, index_topk, reduce, tie_order):
    """The source's two selections by plain loops: block scores over visible finite positions,
    the block of the newest visible position pinned, the best blocks and positions with the tie
    rule."""
    scores = np.asarray(scores, np.float32)
    batch, n_pos = scores.shape
    n_blocks = -(-n_pos // 8)
    ids = np.full((batch, topk_blocks), -1)
    picks = np.full((batch, index_topk), -1)
    older_first = tie_order == "oldest"
    for b in range(batch):
        n = int(min(lengths[b], n_pos))
        ranked = []
        for i in range(n_blocks):
            s = scores[b, i * 8 : min(i * 8 + 8, n)]
            s = s[np.isfinite(s)]
            if i == (n - 1) // 8:  # pinned, even where its visible scores are all −inf
                ranked.append((-np.inf, i if older_first else -i, i))
                continue
            if s.size == 0:
                continue
            # In float32 as the ops compute them: a mean's rounding decides its ties.
            top2 = np.sort(s)[-2:]
            value = {
                "max": s.max(),
                "mean": np.float32(s.sum(dtype=np.float32)) / np.float32(s.size),
                "top2": np.float32(0.5) * top2[0] + np.float32(0.5) * top2[-1],
            }[reduce]
            ranked.append((-value, i if older_first else -i, i))
        kept = sorted(i for *_, i in sorted(ranked)[:topk_blocks])
        ids[b, : len(kept)] = kept
        visible = [(-scores[b, p], p if older_first else -p, p) for p in range(n)]
        best = sorted(p for *_, p in sorted(v for v in visible if np.isfinite(v[0]))[:index_topk])
        picks[b, : len(best)] = best
    return ids, picks


def assert_same_choice(got, want, value_of, tol, what):
    """Same chosen ids per row, except among ids whose reference value lies within `tol` of
    the row's last kept value (there rounding may legitimately swap them); ascending, −1 after."""
    got, want = np.asarray(got), np.asarray(want)
    for b in range(got.shape[0]):
        g, w = set(got[b][got[b] >= 0].tolist()), set(want[b][want[b] >= 0].tolist())
        assert len(g) == len(w), (what, b, len(g), len(w))
        kth = min((value_of[b][i] for i in w), default=0.0)
        for i in g ^ w:
            assert abs(value_of[b][i] - kth) <= tol, (what, b, i, value_of[b][i], kth)
        np.testing.assert_array_equal(got[b][: len(g)], np.sort(got[b][: len(g)]))


@pytest.mark.parametrize("reduce", ["max", "mean", "top2"])
@pytest.mark.parametrize("tie_order", ["oldest", "newest"])
def test_selection_matches_a_numpy_loop_on_tied_scores(reduce, tie_order):
    """`source_selection` picks exactly what the loops pick, on scores with many exact ties,
    −inf entries, a row shorter than its scores and an empty row."""
    rng = np.random.default_rng(zlib.crc32(f"{reduce}-{tie_order}".encode()))
    scores = rng.integers(-2, 3, size=(4, 203)).astype(np.float32)
    scores[rng.random(scores.shape) < 0.1] = -np.inf
    lengths = np.array([203, 97, 0, 150], np.int32)
    got = selection_of(
        scores, lengths, topk_blocks=6, index_topk=20, reduce=reduce, tie_order=tie_order
    )
    ids, picks = numpy_selection(scores, lengths, 6, 20, reduce, tie_order)
    np.testing.assert_array_equal(got.block_ids, ids)
    np.testing.assert_array_equal(got.topk.indices, picks)
    assert (np.asarray(got.block_ids[2]) == -1).all() and (
        np.asarray(got.topk.indices[2]) == -1
    ).all()


@pytest.mark.parametrize("reduce", ["max", "mean", "top2"])
@pytest.mark.parametrize("tie_order", ["oldest", "newest"])
def test_the_routes_selections_equal_the_definitions(reduce, tie_order):
    """`selections` under a kernel implementation (its default top-k there: the selection
    through the best blocks by max; the GPU's radix-select kernel is the GPU tests') picks what
    the definition's `source_selection` picks from the same scores: tied, −inf and NaN scores,
    ragged lengths, an empty row."""
    rng = np.random.default_rng(len(reduce) + len(tie_order))
    scores = rng.integers(-3, 4, size=(4, 203)).astype(np.float32)
    scores[rng.random(scores.shape) < 0.1] = -np.inf
    scores[rng.random(scores.shape) < 0.02] = np.nan
    lengths = np.array([203, 77, 0, 150], np.int32)
    for topk_blocks, index_topk in ((0, 12), (5, 12), (26, 203), (40, 300)):
        rule = dict(
            topk_blocks=topk_blocks, index_topk=index_topk, reduce=reduce, tie_order=tie_order
        )
        want = selection_of(scores, lengths, **rule)
        got = selections(scores, lengths, implementation="pallas_interpret", **rule)
        np.testing.assert_array_equal(got.block_ids, want.block_ids)
        np.testing.assert_array_equal(got.topk.indices, want.topk.indices)
        np.testing.assert_array_equal(got.topk.scores, want.topk.scores)


def test_the_definition_scores_every_visible_position():
    """The definition = the packed keys' scores (`index_scores` of the unpacked rows) selected
    by the loops; positions at or past a row's length never appear."""
    k_packed, q, weights, lengths = make_inputs(1, **CPU_SHAPE)
    got = definition(k_packed, q, weights, lengths, topk_blocks=5, index_topk=17)
    scores = reference_scores(k_packed, q, weights, lengths)
    ids, picks = numpy_selection(scores, lengths, 5, 17, "max", "oldest")
    np.testing.assert_array_equal(got.block_ids, ids)
    np.testing.assert_array_equal(got.topk.indices, picks)
    for b, n in enumerate(lengths):
        assert (np.asarray(got.topk.indices[b]) < max(n, 1)).all()


def test_every_block_is_the_cache_up_to_each_rows_last_visible_block():
    ids = np.asarray(every_block(jnp.array([203, 9, 0, 8, 500]), 203, 8))
    assert ids.shape == (5, 26)
    np.testing.assert_array_equal(ids[0], np.arange(26))
    np.testing.assert_array_equal(ids[1], [0, 1] + [-1] * 24)
    assert (ids[2] == -1).all() and ids[3].tolist() == [0] + [-1] * 25
    np.testing.assert_array_equal(ids[4], np.arange(26))  # clipped to the cache


def run_case(seed, *, reduce="max", tie_order="oldest", topk_blocks=5, index_topk=17, **shape):
    k_packed, q, weights, lengths = make_inputs(seed, **shape)
    select = dict(
        topk_blocks=topk_blocks, index_topk=index_topk, reduce=reduce, tie_order=tie_order
    )
    want = definition(k_packed, q, weights, lengths, **select)
    got = scan(k_packed, q, weights, lengths, **select, **options_for_backend())
    scores = np.asarray(reference_scores(k_packed, q, weights, lengths))
    tol = 1e-5 * float(np.abs(scores[np.isfinite(scores)]).max(initial=1.0))
    blocks = np.asarray(block_scores(scores, lengths, 8, reduce))
    assert_same_choice(got.block_ids, want.block_ids, blocks, tol, "blocks")
    assert_same_choice(got.topk.indices, want.topk.indices, scores, tol, "positions")
    if not ON_GPU:
        assert not mgpu_interpret.get_races().races_found
    return got, want


def options_for_backend():
    return {"implementation": "pallas"} if ON_GPU else INTERPRET


@pytest.mark.parametrize(
    ("reduce", "tie_order"), [("max", "oldest"), ("mean", "newest"), ("top2", "oldest")]
)
def test_the_kernel_route_matches_the_definition(reduce, tie_order):
    run_case(3, reduce=reduce, tie_order=tie_order, **CPU_SHAPE)


@pytest.mark.parametrize("tie_order", ["oldest", "newest"])
def test_the_kernel_route_keeps_the_tie_rule_when_every_score_ties(tie_order):
    """Equal rows: every visible position of a row has one score, so the pool is the pinned
    newest block and the oldest (newest) others, and the top-k the oldest (newest) positions,
    exactly, in both implementations."""
    k_packed, q, weights, lengths = make_inputs(4, equal_rows=True, **CPU_SHAPE)
    select = dict(topk_blocks=4, index_topk=11, reduce="max", tie_order=tie_order)
    want = definition(k_packed, q, weights, lengths, **select)
    got = scan(k_packed, q, weights, lengths, **select, **options_for_backend())
    np.testing.assert_array_equal(got.block_ids, want.block_ids)
    np.testing.assert_array_equal(got.topk.indices, want.topk.indices)
    n = int(lengths[0])
    newest = (n - 1) // 8
    others = [0, 1, 2] if tie_order == "oldest" else [newest - 3, newest - 2, newest - 1]
    assert np.asarray(got.block_ids[0]).tolist() == sorted({*others, newest})
    first = list(range(11)) if tie_order == "oldest" else list(range(n - 11, n))
    assert np.asarray(got.topk.indices[0]).tolist() == first
    assert (np.asarray(got.block_ids[2]) == -1).all()  # the empty row
    assert (np.asarray(got.topk.indices[2]) == -1).all()


def with_nan_rows(k_packed, seed, fraction=0.03):
    """A copy of the packed keys where some rows carry the NaN scale code 0xFF (their scores
    are NaN in the definition and in the kernel)."""
    rng = np.random.default_rng(seed)
    k_packed = np.array(k_packed)
    k_packed[rng.random(k_packed.shape[:2]) < fraction, 64] = 0xFF
    return jnp.asarray(k_packed)


def scattered_blocks(seed, lengths, n_pos, n_slots):
    """Ascending block ids with −1 slots among them and ids past the cache end (the kernel
    masks them): what a pool hands the kernel, not only `every_block`'s prefix."""
    rng = np.random.default_rng(seed)
    ids = np.sort(rng.choice(-(-n_pos // 8) + 3, size=(len(lengths), n_slots)), axis=1)
    ids[rng.random(ids.shape) < 0.2] = -1
    return jnp.asarray(ids, jnp.int32)


def block_max_of(scores):
    """`ops.pool.block_max` of the kernel's scores: NaN and −inf are no valid score."""
    scores = np.asarray(scores)
    scores = np.where(np.isnan(scores), -np.inf, scores)
    return scores.reshape(scores.shape[0], -1, 8).max(axis=-1)


def check_block_max_kernel(seed, *, n_pos, n_heads, n_slots, config, interpret):
    """The block-max kernel's output = the block max of the scores kernel's output, bit for bit
    (NaN rows, −1 slots, ids past the cache, ragged lengths, an empty row); both the same with
    whole-tile copies as block by block, and over every block (`block_ids=None`) as with
    `every_block`'s ids; the scores those of the definition.

    Block by block is compared on `every_block`'s ids only: there every tile is whole, so the
    tile copies are what runs, where scattered ids take them for few tiles (interpreted, each
    further kernel run is ~5 s of the suite)."""
    # Three rows: full, ragged, empty (an interpreted run costs in proportion to its rows).
    batch = 3
    k_packed, q, weights, lengths = make_inputs(seed, batch=batch, n_pos=n_pos, n_heads=n_heads)
    k_packed = with_nan_rows(k_packed, seed)
    run = dict(config=config, interpret=interpret)
    by_block = dict(config=dataclasses.replace(config, tile_copies=False), interpret=interpret)
    want = np.asarray(reference_scores(k_packed, q, weights, lengths))
    every = every_block(jnp.asarray(lengths), n_pos, 8)
    for ids in (every, scattered_blocks(seed, lengths, n_pos, n_slots)):
        scores = kernel_mgpu.pooled_scores_mgpu(k_packed, q, weights, ids, lengths, **run)
        maxima = kernel_mgpu.pooled_block_max_mgpu(k_packed, q, weights, ids, lengths, **run)
        assert maxima.shape == ids.shape
        np.testing.assert_array_equal(np.asarray(maxima), block_max_of(scores))
        for fn, got in (
            (kernel_mgpu.pooled_scores_mgpu, scores),
            (kernel_mgpu.pooled_block_max_mgpu, maxima),
        ):
            if ids is every:
                by_block_got = fn(k_packed, q, weights, ids, lengths, **by_block)
                np.testing.assert_array_equal(by_block_got, got)
                np.testing.assert_array_equal(fn(k_packed, q, weights, None, lengths, **run), got)
        positions = np.asarray(ids)[:, :, None] * 8 + np.arange(8)
        in_cache = (np.asarray(ids)[:, :, None] >= 0) & (positions < n_pos)
        expected = np.take_along_axis(want, np.where(in_cache, positions, 0).reshape(batch, -1), 1)
        expected = np.where(in_cache.reshape(batch, -1), expected, -np.inf)
        np.testing.assert_allclose(
            np.asarray(scores),
            expected,
            rtol=1e-5,
            atol=1e-5 * np.nanmax(np.abs(want[np.isfinite(want)])),
        )
        assert np.isfinite(np.asarray(maxima)[0]).any() and np.isnan(scores).any()
        assert (np.asarray(maxima)[2] == -np.inf).all()  # the empty row
        if interpret:
            assert not mgpu_interpret.get_races().races_found


def test_the_block_max_kernel_reduces_the_kernels_scores():
    """Interpreted, 700 positions (88 blocks, 11 tiles): two CTAs per query at 8 tiles each."""
    check_block_max_kernel(
        6, n_pos=700, n_heads=3, n_slots=40, config=TuningConfig(8, 2), interpret=True
    )


def check_max_route(seed, *, tie_order, equal_rows=False, edge_cases=True, **shape):
    """The 'max' route (block maxima from the kernel, the own top-k rescored in its best
    blocks) picks exactly what the definition's selections pick from the kernel's own scores of
    every position: the same block ids, positions and scores, bit for bit. `edge_cases`: also
    with no pool, and with a pool and a top-k larger than the cache."""
    k_packed, q, weights, lengths = make_inputs(seed, equal_rows=equal_rows, **shape)
    if not equal_rows:
        k_packed = with_nan_rows(k_packed, seed)
    n_pos = k_packed.shape[1]
    options = options_for_backend()
    run = dict(config=options.get("config", TuningConfig()), interpret=not ON_GPU)
    ids = every_block(jnp.asarray(lengths), n_pos, 8)
    scores = kernel_mgpu.pooled_scores_mgpu(k_packed, q, weights, ids, lengths, **run)[:, :n_pos]
    n_blocks = ids.shape[1]
    # (12, 5): the best blocks found among the pool's (`_best_blocks`), as at V4.1's sizes.
    cases = ((5, 17), (12, 5))
    cases += ((0, 9), (n_blocks + 3, 8 * n_blocks + 5)) if edge_cases else ()
    for topk_blocks, index_topk in cases:
        rule = dict(
            topk_blocks=topk_blocks, index_topk=index_topk, reduce="max", tie_order=tie_order
        )
        want = selection_of(scores, lengths, **rule)
        got = scan(k_packed, q, weights, lengths, **rule, **options)
        np.testing.assert_array_equal(got.block_ids, want.block_ids)
        np.testing.assert_array_equal(got.topk.indices, want.topk.indices)
        np.testing.assert_array_equal(got.topk.scores, want.topk.scores)


# Each tie order once and each kind of rows once (the tie orders on every score tied have a test
# of their own below): the four pairs took twice the suite time for the same code paths. The
# edge cases once (each case is ~5 s of interpreted kernels).
@pytest.mark.parametrize(
    ("tie_order", "equal_rows", "edge_cases"), [("oldest", False, True), ("newest", True, False)]
)
def test_the_max_route_picks_what_the_kernels_scores_give(tie_order, equal_rows, edge_cases):
    check_max_route(
        7, tie_order=tie_order, equal_rows=equal_rows, edge_cases=edge_cases, **CPU_SHAPE
    )


def test_rejects_unsupported_arguments():
    k_packed, q, weights, lengths = make_inputs(0, **CPU_SHAPE)
    select = dict(topk_blocks=4, index_topk=8)
    with pytest.raises(ValueError, match="implementation"):
        candidate_source(k_packed, q, weights, lengths, **select, implementation="triton")
    with pytest.raises(ValueError, match="score_dtype: expected 'float32', got 'bfloat16'"):
        candidate_source(
            k_packed, q, weights, lengths, **select, score_dtype="bfloat16", **INTERPRET
        )
    with pytest.raises(ValueError, match="block_size: expected 8, got 16"):
        candidate_source(k_packed, q, weights, lengths, **select, block_size=16, **INTERPRET)
    with pytest.raises(ValueError, match="k_packed"):
        candidate_source(k_packed[..., :-1], q, weights, lengths, **select)
    with pytest.raises(ValueError, match="lengths"):
        candidate_source(k_packed, q, weights, lengths[:2], **select)


@pytest.mark.gpu
@gpu
def test_the_kernel_route_matches_the_definition_gpu():
    """Compiled, on a 64 K-position cache (+3: not a multiple of 8), 32 heads, V4.1's pool of
    2,048 blocks and top-512."""
    run_case(5, batch=8, n_pos=65536 + 3, n_heads=32, topk_blocks=2048, index_topk=512)


@pytest.mark.gpu
@gpu
def test_the_block_max_kernel_reduces_the_kernels_scores_gpu():
    """Compiled: 64 K − 5 positions (8,192 blocks, the last one partial: whole-tile copies
    taken), 32 heads, the default tiles (32 per CTA)."""
    check_block_max_kernel(
        8, n_pos=65536 - 5, n_heads=32, n_slots=2048, config=TuningConfig(), interpret=False
    )


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("tie_order", ["oldest", "newest"])
def test_the_max_route_picks_what_the_kernels_scores_give_gpu(tie_order):
    check_max_route(9, tie_order=tie_order, batch=8, n_pos=16384 - 3, n_heads=32)


@pytest.mark.parametrize("tie_order", ["oldest", "newest"])
def test_the_best_blocks_come_from_the_pool_only_where_it_holds_them(tie_order):
    """The max route's best blocks by raw maximum (`_best_blocks`) equal a top-k over every
    block: on tied, −inf and NaN maxima from the pool's blocks, and where the pool's capped
    order is not the raw one (maxima of +inf beside float32's largest, which the cap ties) from
    every block again. The +inf case fails without that guard: the pool keeps the oldest
    (newest) of the tied capped blocks, not the +inf ones."""
    from pallas_kernels.source_scan.api import _best_blocks, _pool_blocks
    from v41jax.ops.scoring import topk

    select = functools.partial(topk, tie_order=tie_order)
    rng = np.random.default_rng(5)
    big = np.finfo(np.float32).max
    cases = []
    for _ in range(6):  # ties (4 values), −inf blocks, ragged rows
        m = rng.integers(0, 4, (3, 40)).astype(np.float32)
        m[rng.random(m.shape) < 0.2] = -np.inf
        cases.append((m, np.array([320, 150, 0])))
    m = np.full((2, 40), big, np.float32)
    m[:, [5, 30]] = np.inf  # raw order: these two first
    cases.append((m, np.array([320, 320])))
    m = rng.normal(size=(2, 40)).astype(np.float32)
    m[0, 7] = np.nan
    cases.append((m, np.array([320, 200])))
    m = rng.normal(size=(2, 40)).astype(np.float32)
    m[0, 12] = m[1, 24] = np.inf  # one +inf among finite maxima (row 1: the pinned block)
    cases.append((m, np.array([320, 200])))
    for maxima, lengths in cases:
        maxima, lengths = jnp.asarray(maxima), jnp.asarray(lengths)
        for topk_blocks, k in ((4, 2), (10, 3), (10, 9), (6, 6)):
            pool_ids = _pool_blocks(maxima, lengths, topk_blocks, 8, tie_order, select, pin=True)
            got = _best_blocks(maxima, pool_ids, k, tie_order, select)
            want = select(maxima, k).indices
            np.testing.assert_array_equal(got, want, err_msg=f"{topk_blocks=} {k=} {maxima}")
            below_cap = jnp.isnan(maxima) | (maxima < big)
            if k < topk_blocks and bool(jnp.all(below_cap)):
                # No maximum the cap could change: the picks come from the pool's blocks alone
                # (a top-k over every block, here made wrong on purpose, is not what ran).
                def wrong_over_every_block(x, k, *, tie_order, n=maxima.shape[-1]):
                    picks = select(x, k)
                    if x.shape[-1] == n:
                        return picks._replace(indices=jnp.full_like(picks.indices, -1))
                    return picks

                got = _best_blocks(maxima, pool_ids, k, tie_order, wrong_over_every_block)
                np.testing.assert_array_equal(got, want)
