"""The radix select and its compaction as one program per row: a Pallas Triton kernel, the
stepping stone towards a fused selection (issue 16 item 2; DESIGN §1: Triton as a baseline).

Why a kernel: `radix.threshold_topk` is the right algorithm in the wrong form. On the H200
(`results/bench_topk_h200_2026-12-03.json`, its per-kernel profile) each of its counting
passes is a separate XLA fusion of about 5 µs that reads the row from memory again, and the
compaction (a cumulative sum, then a binary search per output) is another ~40 µs of small
kernels: 134 µs at 16,384 scores × 64 rows, no faster than the sort. Here one program holds
its row in registers from the first pass to the last store, so the passes cost compares and
block reductions, not launches and memory round trips.

What a program does, for its row (the same steps as `radix`, whose docstring argues them):
1. Load the row's scores ([n_pad] float32, n_pad a power of two: the rows are padded with
   −inf by the caller), NaN → −inf and −0.0 → +0.0, and form signed order keys (float bits,
   the magnitude bits flipped for negatives: a signed compare of keys orders as the floats).
2. Find the k-th largest key t digit by digit from the top (`radix._digits`), comparing in
   the unsigned space that `radix` searches (a key's top bit flipped), then among the keys
   equal to t the tie rank that keeps exactly k − #{> t} of them (rank n_pad − 1 − position
   under 'oldest', position under 'newest'). Both searches stop as soon as exactly the
   number wanted lie at or above the prefix found so far (`_search`): on distinct scores
   after about log2(n) digits plus a few, not 32, and the ranks' search after one digit. On
   the H200 that took the top-k of 16,384 scores × 64 rows from 0.036 to 0.028 ms
   (BENCHMARKS.md, 2026-12-04).
3. Compact by a stable partition of the row: a pick's output slot is the number of picks
   before it (an exclusive cumulative sum), every other position goes after the picks in
   position order as −1 and −inf. The partition is a permutation of the n_pad slots, so each
   of the k_pad (k to a power of two) slots that leave is written by exactly one lane, and
   each lane masked off (slot ≥ k_pad) has a slot of its own: no ordering between lanes
   matters (the Pallas interpreter reports a masked scatter whose masked lanes share a slot
   as a race). The caller keeps the first k. A program over a row of 16,384 scores or more
   writes all n_pad slots instead, and XLA copies the first k out: on the H200 that was
   faster there, the masked k slots faster below (`default_row_output`).

`supports` says what it takes; `pallas_kernels.topk.api` (method 'kernel') calls it for rows of
at most `MAX_N` scores, and through `blocks.topk` (its leaves) for longer ones.
`tests/test_topk_select.py` checks it, interpreted, against `scoring.topk` bit for bit; its
speed on the H200 is `pallas_kernels.topk.bench`'s `kernel` entry.
"""

from __future__ import annotations

import functools

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.triton as plt
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array, Float

from pallas_kernels.dispatch import Support, support
from pallas_kernels.topk import radix
from v41jax.ops import scoring
from v41jax.ops.scoring import TIE_ORDERS, TopK

MAX_N = 32_768
"""The longest row a program holds in registers (32 warps × 32 threads × 32 scores)."""

DIGIT_BITS = (1, 2, 4)
"""Key bits a counting pass decides (2^bits − 1 independent counts per pass)."""

_SIGN = np.int32(np.iinfo(np.int32).min)  # the top bit, as an int32


def _i32(value: int) -> np.int32:
    """`value` mod 2^32 as an int32 bit pattern."""
    return np.uint32(value % 2**32).view(np.int32)


WARPS = (1, 2, 4, 8, 16, 32)
"""Warps a program may have (`select(num_warps=...)`)."""


def supports(
    n: int,
    k: int,
    *,
    tie_order: str = "oldest",
    digit_bits: int = 2,
    num_warps: int | None = None,
    segments: int = 1,
) -> Support:
    """Whether the kernel selects k of n scores per row under `tie_order` by `digit_bits`,
    with `num_warps` warps per program (None: `default_warps`), each row split over `segments`
    programs (`select`): a power of two, at most the padded row's scores (the candidates
    left for the second pass, `segments`·min(k, a part's scores), are then at most the padded
    row's `MAX_N`)."""
    n_pad = pl.next_power_of_2(max(n, 1))
    valid_segments = segments >= 1 and segments & (segments - 1) == 0 and segments <= n_pad
    return support(
        "the radix-select kernel (pallas_kernels.topk.kernel_triton)",
        (1 <= n <= MAX_N, "n", f"1 ≤ scores per row ≤ {MAX_N}", n),
        (1 <= k <= n, "k", f"1 ≤ k ≤ the row's {n} scores", k),
        (tie_order in TIE_ORDERS, "tie_order", f"one of {TIE_ORDERS}", tie_order),
        (digit_bits in DIGIT_BITS, "digit_bits", f"one of {DIGIT_BITS}", digit_bits),
        (num_warps is None or num_warps in WARPS, "num_warps", f"None or one of {WARPS}",
         num_warps),
        (valid_segments, "segments", f"a power of two ≤ the padded row's {n_pad} scores",
         segments),
    )  # fmt: skip


def default_warps(n_pad: int) -> int:
    """Warps per program by default: about 32 scores per thread, 4 to 32 warps."""
    return int(min(32, max(4, n_pad // 1024)))


def default_row_output(n_pad: int) -> bool:
    """Whether a program over a row of `n_pad` scores writes every slot of its partition (and
    XLA copies the first k out) rather than only the first k slots, masked. On the H200
    (2026-12-04, seventh session, `results/bench_topk_h200_2026-12-04_row_output.json`, one
    process): rows of 16,384 took 28.1 µs writing every slot against 35.1 writing k = 512, and
    29.0 against 34.8 at k = 2,048; parts of 8,192 (a row split in two) and rows of 4,096 were
    faster writing k slots (22.1 against 25.4 µs, 10.1 against 12.4)."""
    return n_pad >= 16_384


def default_segments(n_pad: int, k: int) -> int:
    """Programs per row by default (`select(segments=None)`): 2 for rows of at least 16,384
    (padded) scores whose k is at most a 32nd of them, else 1. Measured on the H200 at batch 64
    with 1-bit passes (results/bench_topk_h200_2026-12-04_segments*.json): a pool's 16,384
    slots → 512 in 0.026 ms over 2 programs against 0.028 in one, on ReLU-like and on distinct
    scores alike; 16,384 → 2,048 (0.035 against 0.030) and 4,096 → 512 (0.017 against 0.013)
    are slower split, the second pass then costing more than the first saves."""
    return 2 if n_pad >= 16_384 and 32 * k <= n_pad else 1


def _search(values, eligible, need, count, n_bits: int, digit_bits: int, flip):
    """The largest t < 2^n_bits (unsigned) with #{eligible values ≥ t} ≥ need, where a value v
    compares as `v ≥ t ^ flip` (flip = the top bit for the keys, so the unsigned search runs on
    signed keys; 0 for the nonnegative ranks), decided digit by digit from the top until exactly
    `need` values are ≥ t: the digits after that are left 0, since no lower threshold changes
    which values are ≥ it. The first digit always runs. `count` = #{eligible values} (the count
    at t = 0).

    Returns (t as an int32 bit pattern, #{eligible values ≥ t}): the count equals `need` when the
    search stopped early or the ≥ t values are `need` exactly; larger, t is the need-th largest
    value and more than one eligible value equals it."""
    t = jnp.int32(0)
    for shift, width in radix._digits(n_bits, digit_bits):

        def digit_pass(t, count, shift=shift, width=width):
            best, count_at_best = jnp.int32(0), count
            for digit in range(1, 2**width):
                candidate = (t | _i32(digit << shift)) ^ flip
                above = eligible & (values >= candidate)
                c = jnp.sum(jnp.where(above, 1, 0).astype(jnp.int32))
                # Counts fall as the digit grows: the digits that reach `need` are 1 … best.
                # (Selects: Pallas's Triton lowering cannot add a boolean cast to int32,
                # 2026-12-03.)
                best = jnp.where(c >= need, best + 1, best)
                count_at_best = jnp.where(c >= need, c, count_at_best)
            return t | lax.shift_left(best, jnp.int32(shift)), count_at_best

        if shift + width == n_bits:
            # The first digit runs unconditionally: Pallas's Triton lowering of `lax.cond`
            # cannot pass a literal operand (t = 0) through a branch (jax 0.11.2).
            t, count = digit_pass(t, count)
            continue
        # Once exactly `need` values are ≥ t, the remaining passes are skipped: on distinct
        # scores that is after about log2(n) + a few digits, not all 32 (and the tie ranks'
        # search then has nothing to decide).
        t, count = lax.cond(count == need, lambda t, c: (t, c), digit_pass, t, count)
    return t, count


def _kernel(scores_ref, indices_ref, values_ref, *, k, n_pad, tie_order, digit_bits, row_output):
    x = scoring.ranking_scores(scores_ref[...])
    bits = lax.bitcast_convert_type(x, jnp.int32)
    keys = jnp.where(bits < 0, bits ^ np.int32(0x7FFFFFFF), bits)
    everything = keys == keys
    t, at_or_above = _search(
        keys, everything, jnp.int32(k), jnp.int32(n_pad), 32, digit_bits, _SIGN
    )
    t = t ^ _SIGN
    # Where the search stopped early, t need not be a key: the keys ≥ t are the k picks, and
    # those > t and = t together are they, the ties (if any) all kept by the rank search below,
    # which then stops after its first digit (its count, all ties, is already what is left).
    above = keys > t
    ties = keys == t
    position = lax.broadcasted_iota(jnp.int32, (n_pad,), 0)
    rank = (n_pad - 1 - position) if tie_order == "oldest" else position
    n_above = jnp.sum(jnp.where(above, 1, 0).astype(jnp.int32))
    left = k - n_above
    n_ties = at_or_above - n_above  # the search's count of keys ≥ t, less those > t
    rank_bits = max(1, (n_pad - 1).bit_length())
    r, _ = _search(rank, ties, left, n_ties, rank_bits, digit_bits, np.int32(0))
    picked = (above | (ties & (rank >= r))) & (x > -jnp.inf)
    # A stable partition of the row: the picks to slots 0 … total − 1 in position order, every
    # other position after them, each slot written once (no masks, no two lanes on one slot).
    ones = jnp.where(picked, 1, 0).astype(jnp.int32)
    before = jnp.cumsum(ones) - ones  # picks before each position
    total = jnp.sum(ones)
    slot = jnp.where(picked, before, total + position - before)
    # Only the first k_pad slots leave (the picks, then −1 up to k_pad): a lane whose slot lies
    # past them is masked, each such lane at its own slot. (`row_output`: every slot leaves.)
    kept = None if row_output else slot < indices_ref.shape[0]
    plt.store(indices_ref.at[slot], jnp.where(picked, position, -1), mask=kept)
    plt.store(values_ref.at[slot], jnp.where(picked, x, -jnp.inf), mask=kept)


@functools.partial(
    jax.jit,
    static_argnames=(
        "k", "tie_order", "digit_bits", "interpret", "num_warps", "segments", "row_output"
    ),
)  # fmt: skip
def select(
    scores: Float[Array, "*batch n"],
    k: int,
    *,
    tie_order: str = "oldest",
    digit_bits: int = 2,
    interpret: bool = False,
    num_warps: int | None = None,
    segments: int | None = None,
    row_output: bool | None = None,
) -> TopK:
    """`scoring.topk(scores, k, tie_order=tie_order)` (no mask, −inf picks dropped) bit for
    bit, one program per row (module docstring) of `num_warps` warps (None: `default_warps`);
    what it takes: `supports`. Differentiable in `scores` as the definition is: a pick's score
    carries its position's tangent, a −1 slot none (`_select`'s JVP; the kernel itself has no
    derivative).

    `segments` > 1 splits each row (padded to a power of two) into that many contiguous parts,
    one program each, then selects among the parts' picks with one more program per row
    (`_segmented`): the same picks, from `segments` times the programs, for batches too small
    to fill the GPU's SMs with one program per row. None: `default_segments`.

    `row_output` (the same picks either way): True, the programs write every slot of their
    partition and XLA copies the first k out; False, they write only the first k slots; None,
    each program by `default_row_output` of its row.

    Returns `TopK(indices [..., k] ascending then −1, scores [..., k] float32, −inf at −1)`.
    """
    *batch, n = scores.shape
    if segments is None:
        segments = default_segments(pl.next_power_of_2(n), k) if 1 <= k <= n else 1
    supported = supports(
        n, k, tie_order=tie_order, digit_bits=digit_bits, num_warps=num_warps, segments=segments
    )
    if not supported:
        raise supported.error()
    rows = int(np.prod(batch, dtype=np.int64))
    if rows == 0:  # no program to run (a grid of 0 is not a call)
        return TopK(jnp.zeros((*batch, k), jnp.int32), jnp.zeros((*batch, k), jnp.float32))
    flat = scores.astype(jnp.float32).reshape(rows, n)
    program = (num_warps, row_output)
    if segments > 1:
        indices, values = _segmented(flat, k, tie_order, digit_bits, interpret, program, segments)
    else:
        indices, values = _select(flat, k, tie_order, digit_bits, interpret, program)
    return TopK(indices.reshape(*batch, k), values.reshape(*batch, k))


def _segmented(flat, k: int, tie_order, digit_bits, interpret, program, segments: int):
    """`select` over rows [rows, n] split into `segments` parts: each part's best min(k, part)
    by one program, then the best k of those candidates by another. Exact: the k best of a row
    under the selection's total order (score, then position by `tie_order`) are among the k
    best of the part that holds them. The candidates, part after part and ascending within a
    part, are in position order, so ranking their slots by `tie_order` ranks their positions;
    the parts' −1 picks score −inf and are dropped again."""
    rows, n = flat.shape
    n_pad = pl.next_power_of_2(n)
    if n_pad != n:
        flat = jnp.pad(flat, ((0, 0), (0, n_pad - n)), constant_values=-jnp.inf)
    part = n_pad // segments
    k_part = min(k, part)
    indices, values = _select(
        flat.reshape(rows * segments, part), k_part, tie_order, digit_bits, interpret, program
    )
    candidates_row = (None, program[1])  # default warps for the candidates' row
    picks, scores = _select(
        values.reshape(rows, segments * k_part), k, tie_order, digit_bits, interpret,
        candidates_row,
    )  # fmt: skip
    # Candidate c is pick c % k_part of part c // k_part: its position in the row is that
    # part's pick plus the part's offset. (A −1 pick of a part scores −inf, so it is never
    # picked again.) Gathered from the first programs' output as it came, then offset: one
    # gather and one select over the [rows, k] picks, nothing over the candidates first.
    safe = jnp.maximum(picks, 0)
    local = jnp.take_along_axis(indices.reshape(rows, segments * k_part), safe, axis=-1)
    return jnp.where(picks >= 0, local + part * (safe // k_part), -1), scores


@functools.partial(jax.custom_jvp, nondiff_argnums=(1, 2, 3, 4, 5))
def _select(flat, k: int, tie_order: str, digit_bits: int, interpret: bool, program: tuple):
    """The kernel over rows [rows, n]: (indices [rows, k], scores [rows, k]). `program`:
    (warps per program or None for `default_warps`, `row_output` or None for
    `default_row_output`)."""
    warps, row_output = program
    rows, n = flat.shape
    n_pad = pl.next_power_of_2(n)
    if row_output is None:
        row_output = default_row_output(n_pad)
    if n_pad != n:
        flat = jnp.pad(flat, ((0, 0), (0, n_pad - n)), constant_values=-jnp.inf)
    kernel = functools.partial(
        _kernel, k=k, n_pad=n_pad, tie_order=tie_order, digit_bits=digit_bits,
        row_output=row_output,
    )  # fmt: skip
    k_pad = n_pad if row_output else pl.next_power_of_2(k)  # Triton's blocks: powers of two
    row = lambda i: (i, 0)
    indices, values = pl.pallas_call(
        kernel,
        grid=(rows,),
        in_specs=[pl.BlockSpec((None, n_pad), row)],
        out_specs=[pl.BlockSpec((None, k_pad), row), pl.BlockSpec((None, k_pad), row)],
        out_shape=[
            jax.ShapeDtypeStruct((rows, k_pad), jnp.int32),
            jax.ShapeDtypeStruct((rows, k_pad), jnp.float32),
        ],
        compiler_params=plt.CompilerParams(num_warps=warps or default_warps(n_pad), num_stages=1),
        interpret=interpret,
        name="topk_radix_select",
    )(flat)
    return indices[:, :k], values[:, :k]


@_select.defjvp
def _select_jvp(k, tie_order, digit_bits, interpret, program, primals, tangents):
    """A pick's score moves with its position's score (the picks themselves are piecewise
    constant); −1 slots (−inf scores, no position) have a zero tangent, as in the definition."""
    (flat,), (d_flat,) = primals, tangents
    indices, values = _select(flat, k, tie_order, digit_bits, interpret, program)
    picked = jnp.take_along_axis(d_flat, jnp.maximum(indices, 0), axis=-1)
    d_values = jnp.where(indices >= 0, picked, jnp.zeros_like(picked))
    d_indices = np.zeros(indices.shape, jax.dtypes.float0)
    return (indices, values), (d_indices, d_values)
