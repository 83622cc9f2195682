"""The top-k of the kernel routes (issue 16 item 2): `pallas_kernels.topk`'s three methods,
the selection through the best blocks, the radix select and the radix-select kernel
(interpreted), against the definition,
`ops.scoring.topk`, bit for bit (indices and score bits) on fresh random rows with ties, ±0,
−inf, +inf, NaN, subnormals and the float32 extremes, every tie order and pass width, k from 0
past the row's length, rows long enough for several levels of blocks; the radix select's parts
against numpy; the errors; and the kernel routes of pooled scoring and the source scan
selecting through it.
"""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pallas_kernels.topk import blocks, kernel_triton, radix, supports, topk
from pallas_kernels.topk.api import KERNEL_DIGIT_BITS, METHODS, default_method
from v41jax.ops import scoring

F32 = np.finfo(np.float32)
SPECIAL = np.array(
    [-np.inf, np.inf, 0.0, -0.0, 1.0, -1.0, F32.max, -F32.max, F32.smallest_subnormal,
     -F32.smallest_subnormal, F32.tiny, 2.5, np.nan],
    np.float32,
)  # fmt: skip
STATIC = ("k", "tie_order", "neginf_picks", "implementation", "method", "digit_bits")
fast = jax.jit(topk, static_argnames=STATIC)
definition = jax.jit(scoring.topk, static_argnames=("k", "tie_order", "neginf_picks"))


def random_rows(rng, shape, kind):
    """Scores of one `kind`: 'normal' (distinct), 'ties' (small integers), 'relu' (ReLU scores:
    zeros of both signs, −inf at invisible positions, a few NaN), 'special' (only the values
    of `SPECIAL`)."""
    if kind == "normal":
        return rng.normal(size=shape).astype(np.float32)
    if kind == "ties":
        return rng.integers(-2, 3, size=shape).astype(np.float32)
    if kind == "relu":
        x = np.maximum(rng.normal(size=shape), 0).astype(np.float32)
        x[rng.random(shape) < 0.2] = -0.0
        x[rng.random(shape) < 0.3] = -np.inf
        x[rng.random(shape) < 0.05] = np.nan
        return x
    return rng.choice(SPECIAL, size=shape)


def assert_same_picks(got, want):
    np.testing.assert_array_equal(got.indices, want.indices)
    # Bits, not values: −0.0 against +0.0 and NaN against −inf would pass a value comparison.
    np.testing.assert_array_equal(
        np.asarray(got.scores).view(np.uint32), np.asarray(want.scores).view(np.uint32)
    )


# Every kind of row at every digit width, each tie order with every kind and every width (pairs,
# not the product: 16 cases, each a few compiled selections; the 32 of the product took the
# suite twice the time for no pair of parameters more).
RADIX_CASES = [
    (kind, scoring.TIE_ORDERS[(i + j) % 2], bits)
    for i, kind in enumerate(["normal", "ties", "relu", "special"])
    for j, bits in enumerate([2, 3, 4, 8])
]


@pytest.mark.parametrize(("kind", "tie_order", "digit_bits"), RADIX_CASES)
def test_radix_select_equals_the_definition(kind, tie_order, digit_bits):
    rng = np.random.default_rng([radix.DIGIT_BITS.index(digit_bits), len(kind), len(tie_order)])
    for n in (1, 203):
        scores = random_rows(rng, (3, n), kind)
        for k in sorted({0, 1, n // 3, n - 1, n + 5}):
            got = fast(
                scores,
                k,
                tie_order=tie_order,
                implementation="pallas",
                method="radix",
                digit_bits=digit_bits,
            )
            assert_same_picks(got, definition(scores, k, tie_order=tie_order))


@pytest.mark.parametrize("kind", ["normal", "ties", "relu", "special"])
@pytest.mark.parametrize("tie_order", scoring.TIE_ORDERS)
def test_the_selection_through_blocks_equals_the_definition(kind, tie_order):
    """Rows of 1, 203 and 1,500 scores (at k = 3 the last goes through three levels of blocks:
    1,500 → 188 block maxima → 24 → 3), k from 0 past the row's length."""
    rng = np.random.default_rng([len(kind), len(tie_order)])
    for n in (1, 203, 1500):
        scores = random_rows(rng, (3, n), kind)
        for k in sorted({0, 1, 3, 24, n // 3, n - 1, n + 5}):
            got = fast(scores, k, tie_order=tie_order, implementation="pallas", method="blocks")
            assert_same_picks(got, definition(scores, k, tie_order=tie_order))


def test_the_selection_through_blocks_recurses_while_blocks_outnumber_k(monkeypatch):
    """Each level selects over the block maxima until k is at least the number of blocks; the
    leaves then see n/8 maxima and k·8 slots, never the n scores."""
    sizes = []
    real = scoring.topk

    def leaf(scores, k, **kwargs):
        sizes.append(scores.shape[-1])
        return real(scores, k, **kwargs)

    scores = random_rows(np.random.default_rng(0), (2, 1500), "ties")
    got = blocks.topk(jnp.asarray(scores), 3, tie_order="oldest", leaf=leaf)
    assert_same_picks(got, definition(scores, 3, tie_order="oldest"))
    assert sizes == [24, 24, 24]  # 24 maxima of maxima; then 3 blocks' 24 slots, twice


# Both tie orders at the kernel's digit width (`api.KERNEL_DIGIT_BITS`), one each at the others:
# each case is an interpreted program per (n, k), the suite's largest share of this file.
KERNEL_CASES = [(t, KERNEL_DIGIT_BITS) for t in scoring.TIE_ORDERS] + [
    (scoring.TIE_ORDERS[(i + 1) % 2], bits)
    for i, bits in enumerate(b for b in kernel_triton.DIGIT_BITS if b != KERNEL_DIGIT_BITS)
]


@pytest.mark.parametrize(("tie_order", "digit_bits"), KERNEL_CASES)
def test_the_radix_select_kernel_equals_the_definition(tie_order, digit_bits):
    """One interpreted program per row, rows of every kind side by side: 1, 64 and 203 scores
    (the last padded to 256 with −inf), k = 1, a third of the row and all of it."""
    rng = np.random.default_rng([digit_bits, len(tie_order), 7])
    kinds = ["normal", "ties", "relu", "special"]
    for n, k in ((1, 1), (64, 64), (203, 1), (203, 67)):
        scores = np.concatenate([random_rows(rng, (2, n), kind) for kind in kinds])
        got = kernel_triton.select(
            jnp.asarray(scores), k, tie_order=tie_order, digit_bits=digit_bits, interpret=True
        )
        assert_same_picks(got, definition(scores, k, tie_order=tie_order))


@pytest.mark.parametrize("tie_order", scoring.TIE_ORDERS)
def test_the_kernel_over_segments_of_a_row_equals_the_definition(tie_order):
    """Each row split over 2 or 4 programs, then one more over their picks: the definition's
    picks, rows of every kind side by side. 203 scores (padded to 256) in 4 parts of 64 at
    k = 67 (every score of a part is its candidate), at k = 5 (five of each); 64 in 2 at
    k = 30; ties across the parts' boundaries ('ties', 'special') go by position. A part
    wholly −inf (the padding) has no candidate."""
    rng = np.random.default_rng([len(tie_order), 13])
    kinds = ["normal", "ties", "relu", "special"]
    for n, k, segments in ((203, 67, 4), (203, 5, 4), (64, 30, 2)):
        scores = np.concatenate([random_rows(rng, (2, n), kind) for kind in kinds])
        got = kernel_triton.select(
            jnp.asarray(scores),
            k,
            tie_order=tie_order,
            digit_bits=1,
            segments=segments,
            interpret=True,
        )
        assert_same_picks(got, definition(scores, k, tie_order=tie_order))


@pytest.mark.parametrize("row_output", (True, False))
def test_both_outputs_of_the_kernel_equal_the_definition(row_output):
    """The programs writing every slot of their partitions (`row_output=True`, the default for
    rows of 16,384 or more: `default_row_output`) or only the first k, masked (below): the
    same picks, split or not, on rows of every kind."""
    rng = np.random.default_rng([row_output, 19])
    scores = np.concatenate([random_rows(rng, (2, 203), kind) for kind in ["ties", "special"]])
    for k, segments in ((37, 1), (5, 4)):
        got = kernel_triton.select(
            jnp.asarray(scores), k, digit_bits=1, segments=segments, interpret=True,
            row_output=row_output,
        )  # fmt: skip
        assert_same_picks(got, definition(scores, k, tie_order="oldest"))
    assert kernel_triton.default_row_output(16_384) and not kernel_triton.default_row_output(8_192)


def test_the_kernel_over_segments_has_the_definitions_gradient():
    """Through both passes a pick's score carries its position's tangent."""
    rng = np.random.default_rng(17)
    scores = jnp.asarray(random_rows(rng, (2, 100), "ties"))
    weights = jnp.asarray(rng.standard_normal((2, 20)), jnp.float32)

    def loss(scores, select):
        picks = select(scores, 20)
        return jnp.sum(jnp.where(picks.indices >= 0, picks.scores, 0.0) * weights)

    segmented = functools.partial(kernel_triton.select, digit_bits=1, segments=4, interpret=True)
    got = jax.grad(loss)(scores, segmented)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(jax.grad(loss)(scores, definition)))
    assert np.count_nonzero(np.asarray(got)) == 2 * 20


def test_the_kernel_refuses_segments_it_cannot_split_into():
    """Not a power of two, or more parts than the padded row's scores: refused by name with
    what it takes."""
    for segments in (0, 3, 512):
        limits = kernel_triton.supports(203, 5, digit_bits=1, segments=segments).limits
        assert [limit.argument for limit in limits] == ["segments"], segments
    assert kernel_triton.supports(203, 5, digit_bits=1, segments=256)  # parts of one score
    with pytest.raises(ValueError, match="segments: expected a power of two"):
        kernel_triton.select(jnp.ones((2, 16)), 4, digit_bits=1, segments=3, interpret=True)


@pytest.mark.parametrize("method", METHODS)
def test_every_method_has_the_definitions_gradient(method):
    """The picks' scores carry their positions' tangents, as through the definition's top-k: a
    route that differentiates through its selection (pooled scoring's VJP) may run any method.
    The kernel has no derivative of its own (its JVP is declared beside it): the H200's GPU
    test of pooled scoring's VJP failed with it before (2026-12-04). Rows of 203 scores with
    ties and −inf; direct and through the best blocks (k·8 > rows' length / 8)."""
    rng = np.random.default_rng(5)
    scores = jnp.asarray(random_rows(rng, (3, 203), "ties"))
    scores = scores.at[0, :50].set(-jnp.inf)
    weights = jnp.asarray(rng.standard_normal((3, 40)), jnp.float32)

    def loss(scores, select):
        picks = select(scores, 40)
        return jnp.sum(jnp.where(picks.indices >= 0, picks.scores, 0.0) * weights)

    fast = functools.partial(topk, implementation="pallas_interpret", method=method)
    if method != "blocks":
        fast = functools.partial(fast, digit_bits=2)
    got = jax.grad(loss)(scores, fast)
    want = jax.grad(loss)(scores, definition)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert np.count_nonzero(np.asarray(got)) == 3 * 40  # every pick of every row moves


def test_the_kernel_method_goes_through_blocks_past_the_kernels_rows(monkeypatch):
    """Rows longer than `kernel_triton.MAX_N` (made 64 here) are selected through the best
    blocks with the kernel at the leaves, each leaf at most 64 scores; the picks are the
    definition's. A k whose leaves would not fit either is refused by name."""
    monkeypatch.setattr(kernel_triton, "MAX_N", 64)
    sizes = []
    real = kernel_triton.select

    def counted(scores, k, **kwargs):
        sizes.append(scores.shape[-1])
        return real(scores, k, **kwargs)

    monkeypatch.setattr(kernel_triton, "select", counted)
    rng = np.random.default_rng(11)
    for tie_order in scoring.TIE_ORDERS:
        scores = random_rows(rng, (2, 1500), "ties")
        got = topk(
            scores,
            8,
            tie_order=tie_order,
            implementation="pallas_interpret",
            method="kernel",
            digit_bits=2,
        )
        assert_same_picks(got, definition(scores, 8, tie_order=tie_order))
    assert sizes and max(sizes) <= 64, sizes
    with pytest.raises(ValueError, match=r"n_pos, k: expected rows of at most 64 scores"):
        topk(scores, 9, implementation="pallas_interpret", method="kernel")
    with pytest.raises(ValueError, match=r"n: expected 1 ≤ scores per row ≤ 64"):
        real(jnp.asarray(scores), 8, interpret=True)
    empty = real(jnp.zeros((0, 3, 40), jnp.float32), 5, interpret=True)  # no rows
    assert empty.indices.shape == empty.scores.shape == (0, 3, 5)


@st.composite
def score_cases(draw):
    batch = tuple(draw(st.lists(st.integers(0, 3), max_size=2)))
    n = draw(st.integers(1, 40))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    kind = draw(st.sampled_from(["normal", "ties", "relu", "special"]))
    return random_rows(rng, (*batch, n), kind), draw(st.integers(0, n + 3)), rng


@given(
    case=score_cases(),
    tie_order=st.sampled_from(scoring.TIE_ORDERS),
    masked=st.booleans(),
    implementation=st.sampled_from(["pallas", "pallas_interpret"]),
    method=st.sampled_from(METHODS),
)
def test_the_methods_equal_the_definition_property(case, tie_order, masked, implementation, method):
    scores, k, rng = case
    mask = rng.random(scores.shape) < 0.6 if masked else None
    bits = {"digit_bits": 2} if method == "kernel" else {}  # 2: the kernel's fastest compile
    if method == "kernel":
        implementation = "pallas_interpret"  # a Pallas program: compiled only on a GPU
    got = topk(
        scores, k, mask, tie_order=tie_order, implementation=implementation, method=method, **bits
    )
    assert_same_picks(got, scoring.topk(scores, k, mask, tie_order=tie_order))


@pytest.mark.parametrize("tie_order", scoring.TIE_ORDERS)
def test_rows_where_everything_ties_or_nothing_is_reachable(tie_order):
    n = 50
    rows = np.stack(
        [np.zeros(n), -np.zeros(n), np.full(n, -np.inf), np.full(n, np.nan), np.full(n, np.inf)]
    ).astype(np.float32)
    for k, method in [(k, m) for k in (1, 17, n) for m in METHODS]:
        kernel = method == "kernel"
        got = fast(
            rows,
            k,
            tie_order=tie_order,
            implementation="pallas_interpret" if kernel else "pallas",
            method=method,
            digit_bits=2 if kernel else 4,
        )
        assert_same_picks(got, definition(rows, k, tie_order=tie_order))
        span = np.arange(k) if tie_order == "oldest" else np.arange(n - k, n)
        np.testing.assert_array_equal(got.indices[0], span)  # the tie rule, spelled out
        np.testing.assert_array_equal(got.indices[2], -1)  # −inf and NaN are never picked
        np.testing.assert_array_equal(got.indices[3], -1)


def test_order_keys_sort_as_the_floats():
    values = np.array(
        [-np.inf, -F32.max, -1.0, -F32.tiny, -F32.smallest_subnormal, 0.0, F32.smallest_subnormal,
         F32.tiny, 1.0, F32.max, np.inf],
        np.float32,
    )  # fmt: skip
    keys = np.asarray(radix.order_keys(jnp.asarray(values)))
    assert np.all(np.diff(keys.astype(np.int64)) > 0), keys
    rng = np.random.default_rng(3)
    x = rng.normal(size=1000).astype(np.float32) * np.exp2(rng.integers(-40, 40, 1000))
    keys = np.asarray(radix.order_keys(jnp.asarray(x)))
    np.testing.assert_array_equal(np.argsort(keys, kind="stable"), np.argsort(x, kind="stable"))


@pytest.mark.parametrize("digit_bits", [1, 2, 5])
def test_largest_threshold_against_a_count(digit_bits):
    rng = np.random.default_rng(digit_bits)
    keys = rng.integers(0, 2**12, size=(4, 30)).astype(np.uint32)
    keys[1] = 7  # one value everywhere
    eligible = rng.random(keys.shape) < 0.7
    need = np.array([1, 30, 5, 40], np.int32)  # the last one: not enough keys, t = 0
    got = radix.largest_threshold(jnp.asarray(keys), jnp.asarray(eligible), need, 12, digit_bits)
    for row in range(4):
        counts = [np.sum(eligible[row] & (keys[row] >= t)) for t in range(2**12)]
        want = max([t for t, c in enumerate(counts) if c >= need[row]], default=0)
        assert int(got[row]) == want, (row, int(got[row]), want)


@pytest.mark.parametrize("digit_bits", [1, 2, 4])
def test_the_kernels_search_stops_once_exactly_need_values_remain(digit_bits):
    """The radix-select kernel's digit search (`kernel_triton._search`, plain jnp outside a
    kernel) against counts over every threshold: after each digit its t is the largest prefix
    (a multiple of the digit's place) with at least `need` values ≥ it, and it stops after the
    first digit whose prefix has exactly `need`, its lower digits 0; on distinct values that is
    before the last digit."""
    rng = np.random.default_rng(10 + digit_bits)
    n_bits = 12
    cases = [  # (values, eligible, need)
        (rng.permutation(2**n_bits)[:300], np.ones(300, bool), 17),  # distinct
        (rng.integers(0, 40, 300), rng.random(300) < 0.8, 9),  # many ties
        (np.full(50, 7), np.ones(50, bool), 3),  # one value everywhere
        (rng.integers(0, 2**n_bits, 64), np.ones(64, bool), 64),  # need = every value
    ]
    for i, (values, eligible, need) in enumerate(cases):
        t, count = kernel_triton._search(
            jnp.asarray(values, jnp.int32),
            jnp.asarray(eligible),
            jnp.int32(need),
            jnp.int32(eligible.sum()),
            n_bits,
            digit_bits,
            np.int32(0),
        )
        counts = np.array([np.sum(eligible & (values >= u)) for u in range(2**n_bits)])
        for shift, _ in radix._digits(n_bits, digit_bits):  # the first digit always runs
            want = max(u for u in range(0, 2**n_bits, 2**shift) if counts[u] >= need)
            if counts[want] == need:
                break
        assert (int(t), int(count)) == (want, counts[want]), (i, int(t), want)
        if i == 0:
            assert counts[want] == need and want % 2**digit_bits == 0, want


def test_the_kernel_routes_select_with_it(monkeypatch):
    """Pooled scoring's `topk` and the source scan's selections run the selection through the
    best blocks under the kernel implementations (not the definition's sort of every score),
    and their picks still equal 'xla''s."""
    from pallas_kernels.pooled_scoring import TuningConfig, pooled_scores
    from pallas_kernels.source_scan import candidate_source
    from pallas_kernels.source_scan.bench import random_inputs

    calls = []
    real = blocks.topk

    def counted(*args, **kwargs):
        calls.append(args[1])
        return real(*args, **kwargs)

    monkeypatch.setattr(blocks, "topk", counted)
    k_packed, q, weights, lengths = random_inputs(
        jax.random.key(5), batch=2, n_pos=64, n_heads=2, dim=128
    )
    lengths = jnp.array([64, 21], jnp.int32)
    block_ids = jnp.array([[0, 3, 5, -1], [1, 2, -1, -1]], jnp.int32)
    route = {"implementation": "pallas_interpret", "config": TuningConfig(4, 2)}
    pooled = functools.partial(pooled_scores, k_packed, q, weights, block_ids, lengths, topk=6)
    assert_same_picks(pooled(**route), pooled())
    assert calls == [6]
    source = functools.partial(
        candidate_source, k_packed, q, weights, lengths, topk_blocks=3, index_topk=5
    )
    got, want = source(**route), source()
    np.testing.assert_array_equal(got.block_ids, want.block_ids)
    assert_same_picks(got.topk, want.topk)
    assert calls == [6, 3, 5, 5]  # the pool; the best blocks by max, then their slots


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"k": -1}, "k"),
        ({"k": 2**17}, "k"),
        ({"tie_order": "random"}, "tie_order"),
        ({"neginf_picks": "all"}, "neginf_picks"),
        ({"implementation": "cuda"}, "implementation"),
        ({"digit_bits": 7}, "digit_bits"),
        ({"method": "sort"}, "method"),
        ({"mask": np.ones((2, 9), bool), "neginf_picks": "keep"}, "neginf_picks"),
        ({"mask": np.ones((2, 9), np.int32)}, "mask"),
        ({"scores": np.ones((2, 9), np.int32)}, "scores"),
    ],
)
def test_errors_name_the_argument(kwargs, name):
    call = {"scores": np.ones((2, 9), np.float32), "k": 3, "implementation": "pallas", **kwargs}
    with pytest.raises(ValueError, match=rf"(^|: ){name}: expected"):
        topk(**call)


def test_supports_says_what_it_takes():
    assert supports("xla", masked=True, neginf_picks="keep")
    assert supports("pallas", masked=True)
    assert supports("pallas", masked=False, neginf_picks="keep")
    limited = supports("pallas", masked=True, neginf_picks="keep", method="heap", digit_bits=7)
    assert not limited
    arguments = [limit.argument for limit in limited.limits]
    assert arguments == ["method", "neginf_picks", "digit_bits"]
    assert supports("pallas", method="kernel", digit_bits=2, n_pos=2**20, k=512)
    kernel = supports(
        "pallas", masked=True, neginf_picks="keep", method="kernel", digit_bits=4, n_pos=2**20,
        k=2**13,
    )  # fmt: skip
    assert [limit.argument for limit in kernel.limits] == ["neginf_picks", "n_pos, k"]
    assert not supports("pallas", method="kernel", digit_bits=8)
    warps = kernel_triton.supports(16, 4, digit_bits=1, num_warps=3)
    assert [limit.argument for limit in warps.limits] == ["num_warps"]
    with pytest.raises(ValueError, match="num_warps: expected None or one of"):
        kernel_triton.select(jnp.ones((2, 16)), 4, digit_bits=1, num_warps=3, interpret=True)


def test_the_default_method_is_the_kernel_where_it_takes_the_call():
    kernel = ("kernel", KERNEL_DIGIT_BITS)
    assert default_method("pallas", n_pos=16_384, k=2048) == kernel
    assert default_method("pallas", n_pos=2**17, k=2048) == kernel  # through the best blocks
    assert default_method("pallas", n_pos=2**20, k=2**13)[0] == "blocks"  # k·8 over MAX_N
    assert default_method("pallas", masked=True, neginf_picks="keep", n_pos=64, k=8)[0] == (
        "blocks"
    )
    assert default_method("pallas_interpret", n_pos=64, k=8)[0] == "blocks"
    with pytest.raises(ValueError, match="implementation: expected"):
        default_method("triton", n_pos=64, k=8)


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU as jax's default backend")
def test_the_benchmark_times_equal_picks_gpu():
    """The benchmark's selection through the best blocks, its radix select and the radix-select
    kernel give the sort's picks on its own data (compiled on a GPU, at the pool's size), and
    their timings come back."""
    from pallas_kernels.topk import bench

    result = bench.run(shapes={"pool_slots": (16_384, 512)}, digit_bits=(4,), iterations=2)
    entry = result["shapes"]["pool_slots"]
    assert "median_ms" in entry["xla_sort"], entry
    assert entry["radix_4bit"]["equal_to_sort"], entry
    assert entry["blocks"]["equal_to_sort"], entry
    assert entry["kernel_4bit"]["equal_to_sort"], entry


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU as jax's default backend")
@pytest.mark.parametrize("digit_bits", kernel_triton.DIGIT_BITS)
def test_the_radix_select_kernel_compiled_equals_the_definition_gpu(digit_bits):
    """The compiled kernel (Triton, on the GPU) against the definition on the same GPU: rows of
    every kind, 203 scores (padded) and the pool's 16,384, both tie orders."""
    rng = np.random.default_rng(digit_bits)
    for n, k in ((203, 67), (16_384, 512)):
        kinds = ["normal", "ties", "relu", "special"]
        scores = np.concatenate([random_rows(rng, (2, n), kind) for kind in kinds])
        for tie_order in scoring.TIE_ORDERS:
            got = kernel_triton.select(
                jnp.asarray(scores), k, tie_order=tie_order, digit_bits=digit_bits
            )
            assert_same_picks(got, definition(scores, k, tie_order=tie_order))


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU as jax's default backend")
def test_the_radix_select_kernel_over_segments_compiled_equals_the_definition_gpu():
    """Rows split over 2 and 4 compiled programs, then their picks selected: the definition's
    picks on the same GPU at a padded row, the own top-512 of 4,096 slots and the pool's
    16,384, both tie orders."""
    rng = np.random.default_rng(23)
    for n, k in ((203, 67), (4_096, 512), (16_384, 512)):
        kinds = ["normal", "ties", "relu", "special"]
        scores = np.concatenate([random_rows(rng, (2, n), kind) for kind in kinds])
        for tie_order, segments in itertools.product(scoring.TIE_ORDERS, (2, 4)):
            got = kernel_triton.select(
                jnp.asarray(scores), k, tie_order=tie_order, digit_bits=1, segments=segments
            )
            assert_same_picks(got, definition(scores, k, tie_order=tie_order))
