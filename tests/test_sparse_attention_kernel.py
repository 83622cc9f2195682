"""FP4-dequant sparse attention kernels against the op's definition (DESIGN §6, kernel 2).

One parameterized base runs every backend of `fp4_sparse_attention` against
`v41jax.ops.attention.packed_sparse_attention` on fresh random data: on CPU the Pallas kernels run
interpreted ('pallas_interpret') at small sizes (outputs start as NaN there, so an unwritten
element fails; the Mosaic GPU kernel runs with the interpreter's race detector on), on a GPU
(`-m gpu`) at the real V4.1 size, 64 heads × 512. The inline-PTX decode of the Mosaic GPU kernel
cannot run on CPU; its PTX programs are executed here instruction by instruction in numpy and
checked bit for bit against `formats.unpack`.
"""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as mgpu_interpret

from pallas_kernels import lowering
from pallas_kernels.sparse_attention import api, kernel_mgpu
from pallas_kernels.sparse_attention.bench import bf16_cache_attention, unpacked_caches
from v41jax.ops import formats
from v41jax.ops.attention import packed_sparse_attention

ON_GPU = jax.default_backend() == "gpu"
KERNELS = tuple(api.BACKENDS)  # 'mgpu', 'triton'
# The kernels compiled on a GPU, interpreted on the CPU: the same test bodies run both ways.
KERNEL_IMPLEMENTATION = "pallas" if ON_GPU else "pallas_interpret"


_pack = jax.jit(formats.pack, static_argnums=1)
_reference = jax.jit(packed_sparse_attention)


def attention_fn(backend: str, **kwargs):
    """`fp4_sparse_attention` through `backend` ('xla', or a kernel run as
    `KERNEL_IMPLEMENTATION`), with `kwargs` bound."""
    if backend == "xla":
        return functools.partial(api.fp4_sparse_attention, implementation="xla", **kwargs)
    config = kwargs.pop("config", api.Config())
    return functools.partial(
        api.fp4_sparse_attention,
        implementation=KERNEL_IMPLEMENTATION,
        config=dataclasses.replace(config, backend=backend),
        **kwargs,
    )


def make_case(seed, batch, heads, dim, n_kv, topk, window, *, empty_row=False, dtype=jnp.bfloat16):
    """Random q and caches packed from normals with per-row magnitudes spread over 2^±2 (logits of
    a few units: a softmax neither flat nor one-hot), indices with −1 holes, out-of-range values
    and duplicates, ~75% valid window slots."""
    rng = np.random.default_rng(seed)

    def packed(n, fmt):
        if not n:
            return jnp.zeros((batch, 0, formats.packed_row_bytes(fmt, dim)), jnp.uint8)
        rows = rng.normal(size=(batch, n, dim)) * 2.0 ** rng.uniform(-2, 2, (batch, n, 1))
        return _pack(jnp.asarray(rows, jnp.float32), fmt)

    q = jnp.asarray(rng.normal(size=(batch, heads, dim)), dtype)
    kv, win = packed(n_kv, "nvfp4"), packed(window, "fp8")
    indices = rng.integers(-1, n_kv, (batch, topk))
    if topk >= 3:
        indices[:, 1] = indices[:, 0]  # a duplicate counts twice
        indices[:, 2] = n_kv + 5  # out of range: skipped like −1
    valid = rng.random((batch, window)) < 0.75
    if empty_row:
        indices[0], valid[0] = -1, False
    sink = jnp.asarray(rng.normal(size=(heads,)), jnp.float32)
    return q, kv, jnp.asarray(indices, jnp.int32), win, jnp.asarray(valid), sink


CPU_CASES = {
    # chunks not full: 40 window slots, 70 selected of 100 rows; 3 heads (padded to 64)
    "ragged": dict(batch=2, heads=3, dim=256, n_kv=100, topk=70, window=40),
    # one head; query 0 has no valid key at all → zeros
    "empty_row": dict(batch=2, heads=1, dim=256, n_kv=5, topk=10, window=3, empty_row=True),
    "no_window": dict(batch=1, heads=2, dim=256, n_kv=64, topk=64, window=0),
    "no_topk": dict(batch=1, heads=2, dim=256, n_kv=7, topk=0, window=64),
    "dim512": dict(batch=1, heads=2, dim=512, n_kv=80, topk=65, window=64),
}
GPU_CASES = {
    "v41": dict(batch=4, heads=64, dim=512, n_kv=4096, topk=512, window=128),
    # two head groups; a ragged top-k; 3 heads with an empty row
    "v41_128_heads": dict(batch=3, heads=128, dim=512, n_kv=1000, topk=300, window=128),
    "v41_3_heads": dict(batch=5, heads=3, dim=512, n_kv=777, topk=512, window=100, empty_row=True),
}


def rel_err(out, ref):
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30)


def assert_no_races(implementation):
    """The Mosaic GPU interpreter's race detector (on in `kernel_mgpu`) found no race."""
    if implementation == "mgpu" and not ON_GPU:
        assert not mgpu_interpret.get_races().races_found


def check_against_reference(case, implementation):
    """The backend's output against the float32 definition on the same inputs: bf16 q for the
    kernels (their operand type; the definition widens it exactly), float32 q for 'xla'."""
    spec = dict(case)
    if implementation == "xla":
        spec["dtype"] = jnp.float32
    args = make_case(0, **spec)
    attend = jax.jit(attention_fn(implementation))
    out = attend(*args)
    ref = _reference(*args)
    assert out.shape == ref.shape and out.dtype == args[0].dtype
    assert np.isfinite(np.asarray(out, np.float32)).all()
    # bf16 probabilities and output with fp32 accumulation: ~3e-3 in practice.
    tolerance = 1e-6 if implementation == "xla" else 1e-2
    assert rel_err(out, ref) <= tolerance
    if spec.get("empty_row"):
        assert np.all(np.asarray(out[0]) == 0)
    assert_no_races(implementation)
    return attend, args, out


@pytest.mark.parametrize("case", CPU_CASES, ids=str)
@pytest.mark.parametrize("implementation", ("xla", *KERNELS))
def test_matches_reference_small(implementation, case):
    """Edge cases at small sizes: interpreted on CPU, compiled on a GPU."""
    check_against_reference(CPU_CASES[case], implementation)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a GPU as jax's default backend")
@pytest.mark.parametrize("case", GPU_CASES, ids=str)
@pytest.mark.parametrize("implementation", KERNELS)
def test_matches_reference_gpu(implementation, case):
    attend, args, out = check_against_reference(GPU_CASES[case], implementation)
    again = attend(*args)  # deterministic: the same bits twice
    np.testing.assert_array_equal(np.asarray(again, np.float32), np.asarray(out, np.float32))


@pytest.mark.parametrize("splits", (2, 3))
def test_split_kv_matches_reference(splits):
    """Split-KV: CTAs over shares of the chunks, merged by log-sum-exp (the sink in split 0)."""
    for case in ("ragged", "empty_row"):
        args = make_case(7, **CPU_CASES[case])
        config = api.Config(mgpu=kernel_mgpu.TuningConfig(splits=splits))
        out = attention_fn("mgpu", config=config)(*args)
        assert rel_err(out, _reference(*args)) <= 1e-2
        if case == "empty_row":
            assert np.all(np.asarray(out[0]) == 0)
        assert_no_races("mgpu")


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a GPU as jax's default backend")
@pytest.mark.parametrize("case", [*GPU_CASES, *CPU_CASES], ids=str)
@pytest.mark.parametrize("splits", (None, 2))
@pytest.mark.parametrize(
    ("gather", "qk", "producers"),
    [(None, None, 1), ("async", None, 1), ("async", "keys", 1), ("async", "keys", 2)],
)
def test_specialized_kernel_matches_reference_gpu(case, splits, gather, qk, producers):
    """The warp-specialized Mosaic GPU kernel (`TuningConfig(kernel='specialized')`), its words
    loaded or staged, its consumers computing every logit or half the keys each, one producer
    or two, compiled: the interpreter does not finish its three warpgroups on a 2-core CPU
    (2026-12-04: the two consumers wait at their first barrier and the producer never runs),
    so it has no CPU case. Two producers issue PV as wgmmas of 128 columns (at D = 512, one of
    256 did not compile on an H100, 2026-12-07: NOTES.md)."""
    tuning = kernel_mgpu.TuningConfig(
        kernel="specialized", splits=splits, gather=gather, qk=qk, producers=producers
    )
    check_variant_compiled(tuning, case, 9)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a GPU as jax's default backend")
@pytest.mark.parametrize("case", ("v41_3_heads", "ragged"))
@pytest.mark.parametrize(("producers", "registers"), [(1, (200, 104)), (2, (176, 80))])
def test_specialized_kernel_at_a_register_split_gpu(case, producers, registers):
    """The warp-specialized kernel at a register split of its own (`TuningConfig.registers`,
    the benchmark's `_r200` and `two_producers_r176`) finishes and matches the definition: a
    split asking for more than the CTA started with waits in `setmaxnreg.inc` forever."""
    tuning = kernel_mgpu.TuningConfig(
        kernel="specialized", gather="async", qk="keys", producers=producers, registers=registers
    )
    check_variant_compiled(tuning, case, 10)


def variant_cases(splits) -> tuple[str, ...]:
    """The CPU cases an interpreted variant runs at `splits`: at the default (one split on the
    CPU), the 512-dim rows (two 64-dim pieces per thread) and the empty row; with more splits,
    the ragged chunks and the window-less row. Across its two split settings a variant meets
    each of the four, at half the suite time of all four at both."""
    return ("dim512", "empty_row") if splits is None else ("ragged", "no_window")


def check_variant_interpreted(tuning, cases, seed):
    """A Mosaic GPU kernel variant interpreted, on cases of `CPU_CASES`, against the definition:
    within bf16's tolerance, zeros for an empty row, no race found."""
    for case in cases:
        args = make_case(seed, **CPU_CASES[case])
        out = attention_fn("mgpu", config=api.Config(mgpu=tuning))(*args)
        assert rel_err(out, _reference(*args)) <= 1e-2, case
        if CPU_CASES[case].get("empty_row"):
            assert np.all(np.asarray(out[0]) == 0)
        assert_no_races("mgpu")


def check_variant_compiled(tuning, case, seed):
    """A Mosaic GPU kernel variant compiled, on a case of either list, against the definition:
    finite, within bf16's tolerance, zeros for an empty row, the same bits twice."""
    spec = {**GPU_CASES, **CPU_CASES}[case]
    args = make_case(seed, **spec)
    attend = jax.jit(attention_fn("mgpu", config=api.Config(mgpu=tuning)))
    out = attend(*args)
    assert np.isfinite(np.asarray(out, np.float32)).all()
    assert rel_err(out, _reference(*args)) <= 1e-2
    if spec.get("empty_row"):
        assert np.all(np.asarray(out[0]) == 0)
    again = attend(*args)  # deterministic: the same bits twice
    np.testing.assert_array_equal(np.asarray(again, np.float32), np.asarray(out, np.float32))


@pytest.mark.parametrize(
    ("heads", "dim", "splits", "gather", "qk"),
    [
        (64, 512, None, None, None),
        (128, 512, 2, None, None),
        (3, 256, 4, None, None),
        (64, 512, 1, "async", None),
        (64, 512, 1, "async", "keys"),
        (3, 256, 2, None, "keys"),
    ],
)
@pytest.mark.parametrize(
    ("producers", "registers", "slots", "merge"),
    [
        (1, None, None, None),
        (2, None, None, None),
        (1, (200, 104), None, None),
        (2, None, "kernel", "kernel"),
    ],
)
def test_specialized_kernel_lowers(
    heads, dim, splits, gather, qk, producers, registers, slots, merge
):
    """The warp-specialized kernel has no interpreted CPU case: at least its Pallas program
    lowers for the H200 here (`pallas_kernels.lowering`), at the GPU tests' shapes, its words
    loaded or staged, its consumers splitting the keys or not, its registers split as by
    default or as given (one split: the default shape of batch 128, 10 chunks per CTA), its
    slots copied in or built by its four warpgroups (`slots='kernel'`), its splits merged in
    XLA or, one cluster, by its consumers (`merge='kernel'`). PV is one wgmma of D/2 columns,
    except with two producers: wgmmas of `PV_COLUMNS`, which four warpgroups' 128 registers a
    thread fit (ptxas refused the one of 256 columns)."""
    batch, n_kv, topk, window = 2, 4096, 512, 128
    tuning = kernel_mgpu.TuningConfig(
        kernel="specialized",
        splits=splits,
        gather=gather,
        qk=qk,
        producers=producers,
        registers=registers,
        slots=slots,
        merge=merge,
    )
    attend = functools.partial(
        api.fp4_sparse_attention, implementation="pallas", config=api.Config(mgpu=tuning)
    )
    args = (
        jax.ShapeDtypeStruct((batch, heads, dim), jnp.bfloat16),
        jax.ShapeDtypeStruct((batch, n_kv, formats.packed_row_bytes("nvfp4", dim)), jnp.uint8),
        jax.ShapeDtypeStruct((batch, topk), jnp.int32),
        jax.ShapeDtypeStruct((batch, window, formats.packed_row_bytes("fp8", dim)), jnp.uint8),
        jax.ShapeDtypeStruct((batch, window), jnp.bool_),
        jax.ShapeDtypeStruct((heads,), jnp.float32),
    )
    lowered = lowering.lower_for_gpu(attend, *args)
    calls = lowering.custom_calls(lowered)
    assert calls["mosaic_gpu"] == 1, calls
    (program,) = lowering.mosaic_gpu_modules(lowered)
    widths = set(map(int, re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k16", program)))
    n_keys = kernel_mgpu.HALF_KV if qk == "keys" else kernel_mgpu.BLOCK_KV  # QK^T's
    # A wgmma of n columns holds n / 2 float32 accumulator registers a thread: four
    # warpgroups' 128 leave room for 64 of them beside the operands, not for 128.
    pv = min(128, dim // 2) if producers == 2 else dim // 2
    assert widths == {n_keys, pv}, (widths, n_keys, pv)


@pytest.mark.parametrize("implementation", ("xla", *KERNELS))
def test_vjp_is_the_reference_vjp(implementation):
    q, kv, indices, win, valid, sink = make_case(1, **CPU_CASES["ragged"], dtype=jnp.float32)
    cotangent = jnp.asarray(np.random.default_rng(2).normal(size=q.shape), jnp.float32)
    attend = attention_fn(implementation)
    _, vjp = jax.vjp(lambda q, s: attend(q, kv, indices, win, valid, s), q, sink)
    _, vjp_ref = jax.vjp(
        lambda q, s: packed_sparse_attention(q, kv, indices, win, valid, s), q, sink
    )
    for got, want in zip(vjp(cotangent), vjp_ref(cotangent), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_bf16_cache_baseline_matches_reference():
    q, kv, indices, win, valid, sink = make_case(3, **CPU_CASES["ragged"])
    kv_bf16, win_bf16 = unpacked_caches(kv, win, q.shape[-1])
    out = bf16_cache_attention(q, kv_bf16, indices, win_bf16, valid, sink)
    assert rel_err(out, packed_sparse_attention(q, kv, indices, win, valid, sink)) < 1e-2


@pytest.mark.parametrize("splits", (1, 2))
def test_the_sink_weighs_as_in_the_definition(splits):
    """Sinks of 2–5 against few keys, so that the sink holds much of each softmax: a sink taken
    to the log2 domain wrongly, or counted in more than split 0, moves the output far outside
    the tolerance (the random cases' sinks are too small a share to show it)."""
    q, kv, indices, win, valid, sink = make_case(
        12, batch=2, heads=3, dim=256, n_kv=20, topk=8, window=8
    )
    sink = sink + 3.0
    args = (q, kv, indices, win, valid, sink)
    config = api.Config(mgpu=kernel_mgpu.TuningConfig(splits=splits))
    out = attention_fn("mgpu", config=config)(*args)
    ref = _reference(*args)
    no_sink = _reference(q, kv, indices, win, valid, jnp.full_like(sink, -jnp.inf))
    assert rel_err(no_sink, ref) > 0.3  # the sink matters here
    assert rel_err(out, ref) <= 1e-2
    assert_no_races("mgpu")


@pytest.mark.parametrize("splits", (None, 2))
def test_async_gather_matches_reference(splits):
    """`TuningConfig(gather='async')`: the next top-k chunk's rows copied into shared memory
    while this chunk computes. Interpreted, the copies are the jnp gather itself, so this
    checks the kernel's order of steps (the first chunk staged before the window's, each
    chunk's decode before the next one's copies); the PTX path is the GPU test's below."""
    tuning = kernel_mgpu.TuningConfig(kernel="exchange", gather="async", splits=splits)
    check_variant_interpreted(tuning, variant_cases(splits), 11)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a GPU as jax's default backend")
@pytest.mark.parametrize("case", [*GPU_CASES, *CPU_CASES], ids=str)
@pytest.mark.parametrize("splits", (None, 2))
def test_async_gather_matches_reference_gpu(case, splits):
    """The staged gather compiled (`cp.async` copies, each thread reading back its own words):
    every case, the empty row and the top-k-less one included, against the definition, and
    the same bits twice."""
    check_variant_compiled(
        kernel_mgpu.TuningConfig(kernel="exchange", gather="async", splits=splits), case, 10
    )


CARRYING_VARIANTS = {
    "prefetch": kernel_mgpu.TuningConfig(kernel="exchange", prefetch=True),
    "behind_pv": kernel_mgpu.TuningConfig(kernel="exchange", gather="behind_pv"),
}
"""Variants that load a top-k chunk's words one step ahead and carry them into the next."""


@pytest.mark.parametrize("splits", (None, 2))
@pytest.mark.parametrize("variant", CARRYING_VARIANTS)
def test_words_carried_to_the_next_chunk_are_that_chunks(variant, splits):
    """`prefetch` and `gather='behind_pv'` load the next top-k chunk's words before its step
    (the window's chunks load the first one's). The interpreter's decode reads the words it is
    carried, not the rows (`_jnp_dequant`), so a step that carried another chunk's words, or
    a split that started from the wrong first chunk, fails here."""
    tuning = dataclasses.replace(CARRYING_VARIANTS[variant], splits=splits)
    check_variant_interpreted(tuning, variant_cases(splits), 15)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a GPU as jax's default backend")
@pytest.mark.parametrize("case", [*GPU_CASES, *CPU_CASES], ids=str)
@pytest.mark.parametrize("splits", (None, 2))
@pytest.mark.parametrize("variant", CARRYING_VARIANTS)
def test_words_carried_to_the_next_chunk_are_that_chunks_gpu(variant, splits, case):
    """The same, compiled (the PTX gather's words, in registers across the step)."""
    tuning = dataclasses.replace(CARRYING_VARIANTS[variant], splits=splits)
    check_variant_compiled(tuning, case, 16)


@pytest.mark.parametrize("splits", (None, 3))
def test_q_overlap_matches_reference(splits):
    """`TuningConfig(kernel="exchange", q_overlap=True)`: q's copy awaited only before each
    split's first QK^T. Three splits over the window-then-top-k chunks start one split in the
    window and others in the top-k, so both loops hold a first chunk; the interpreter's race
    check sees the q buffer read before its copy landed, if the wait came too late."""
    tuning = kernel_mgpu.TuningConfig(kernel="exchange", q_overlap=True, splits=splits)
    check_variant_interpreted(tuning, variant_cases(splits), 13)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a GPU as jax's default backend")
@pytest.mark.parametrize("case", [*GPU_CASES, *CPU_CASES], ids=str)
@pytest.mark.parametrize("splits", (None, 3))
def test_q_overlap_matches_reference_gpu(case, splits):
    """q's copy awaited at the first product, compiled: every case against the definition."""
    check_variant_compiled(
        kernel_mgpu.TuningConfig(kernel="exchange", q_overlap=True, splits=splits), case, 14
    )


@pytest.mark.parametrize("splits", (None, 2))
def test_exchange_kernel_matches_reference(splits):
    """`TuningConfig(kernel='exchange')`, the default before the pipelined kernel: one key tile,
    the partial logits exchanged; at one split its words load behind PV, with two at each
    chunk's start (`gather_for`)."""
    tuning = kernel_mgpu.TuningConfig(kernel="exchange", splits=splits)
    check_variant_interpreted(tuning, ("ragged", "empty_row"), 19)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a GPU as jax's default backend")
@pytest.mark.parametrize("case", [*GPU_CASES, *CPU_CASES], ids=str)
@pytest.mark.parametrize("splits", (None, 1, 2))
def test_exchange_kernel_matches_reference_gpu(case, splits):
    """The exchange kernel compiled, at its own default gathers: every case against the
    definition, the same bits twice."""
    check_variant_compiled(kernel_mgpu.TuningConfig(kernel="exchange", splits=splits), case, 20)


@pytest.mark.parametrize(("gather", "splits"), [("registers", None), ("registers", 3), (None, 3)])
def test_pipelined_kernel_matches_reference(gather, splits):
    """`TuningConfig(kernel='pipelined')` (the default): two key tiles, the next chunk decoded
    while PV runs, QK^T over the full D. With gather='registers' the interpreter's decode reads
    the words it is given (loaded one chunk ahead), and its barrier checks see a tile read
    before both halves were written; three splits start one split in the window and the others
    in the top-k, so the first chunk of a split is decoded from either source, and a split's
    last chunk has none after it. With the default gather ('async') the interpreter's copies
    are the decode's own gather (so the order of copies and waits is the GPU test's below).
    Cases: `variant_cases`."""
    tuning = kernel_mgpu.TuningConfig(kernel="pipelined", gather=gather, splits=splits)
    check_variant_interpreted(tuning, variant_cases(splits), 17)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a GPU as jax's default backend")
@pytest.mark.parametrize("case", [*GPU_CASES, *CPU_CASES], ids=str)
@pytest.mark.parametrize("splits", (None, 1, 3))
@pytest.mark.parametrize("gather", ("registers", None))
def test_pipelined_kernel_matches_reference_gpu(case, splits, gather):
    """The two-tile kernel compiled: every case against the definition, the same bits twice;
    its PV in flight while the next chunk's PTX decode runs, from words loaded into registers
    or copied into shared memory (`cp.async`, each group awaited before the next)."""
    tuning = kernel_mgpu.TuningConfig(kernel="pipelined", gather=gather, splits=splits)
    check_variant_compiled(tuning, case, 18)


@pytest.mark.parametrize(("gather", "splits"), [("registers", None), (None, 3)])
def test_keys_split_between_the_warpgroups_match_reference(gather, splits):
    """`qk='keys'`: each warpgroup computes the logits of half the chunk's keys, the two swap
    their row maxima, write P into one shared tile and run PV from it; the sink counts once,
    the row sums are added at the end. Interpreted (its race detector sees both P halves
    written before either PV reads the tile), at one split and at three (splits that start in
    the window or the top-k, ragged chunks, no window, an empty row: `variant_cases`)."""
    tuning = kernel_mgpu.TuningConfig(qk="keys", gather=gather, splits=splits)
    check_variant_interpreted(tuning, variant_cases(splits), 25)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a GPU as jax's default backend")
@pytest.mark.parametrize("case", [*GPU_CASES, *CPU_CASES], ids=str)
@pytest.mark.parametrize("splits", (None, 1, 2))
def test_keys_split_between_the_warpgroups_match_reference_gpu(case, splits):
    """`qk='keys'` compiled: every case against the definition, the same bits twice; P's
    halves stored at their swizzled addresses by hand (`_store_p_half`), PV's A from that
    tile. `splits=None` runs four on 132 SMs at these batches (merged in XLA), two merge in
    the kernel."""
    check_variant_compiled(kernel_mgpu.TuningConfig(qk="keys", splits=splits), case, 26)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a GPU as jax's default backend")
@pytest.mark.parametrize("case", [*GPU_CASES, *CPU_CASES], ids=str)
@pytest.mark.parametrize(
    ("splits", "kernel"),
    [
        *((splits, {}) for splits in (2, 3, 4)),
        (2, dict(kernel="specialized", gather="async", qk="keys", producers=2, slots="kernel")),
    ],
    ids=("pipelined-2", "pipelined-3", "pipelined-4", "specialized_two_producers-2"),
)
def test_the_merge_in_the_kernel_equals_the_merge_in_xla_gpu(case, splits, kernel):
    """`merge='kernel'` (the pipelined kernel's default at two splits, an option of the
    specialized kernel's, whose two consumers merge; GPU only, `_merge_splits`): the splits of
    a query meet as one cluster and merge their partials in the kernel, here at any number of
    splits. Against the definition (`check_variant_compiled`), and against `merge='xla'` on
    the same partials: the two sum the same bf16 partials with the same float32 weights, so
    they differ at most in the rounding of the last bf16 bit, never in which values are
    finite."""
    tuning = functools.partial(kernel_mgpu.TuningConfig, splits=splits, **kernel)
    check_variant_compiled(tuning(merge="kernel"), case, 21)
    args = make_case(22, **{**GPU_CASES, **CPU_CASES}[case])
    merged = {}
    for merge in ("kernel", "xla"):
        config = api.Config(mgpu=tuning(merge=merge))
        merged[merge] = np.asarray(jax.jit(attention_fn("mgpu", config=config))(*args), np.float32)
    np.testing.assert_allclose(merged["kernel"], merged["xla"], rtol=2**-7, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a GPU as jax's default backend")
@pytest.mark.parametrize("case", [*GPU_CASES, *CPU_CASES], ids=str)
@pytest.mark.parametrize(("splits", "columns"), [(2, 64), (3, 128)])
def test_the_merge_loop_is_the_unrolled_merge_bit_for_bit_gpu(case, splits, columns):
    """`merge_columns`: the merge in the kernel looping over `columns` of the output a pass
    does per element what the unrolled merge does (the same loads, weights, products and sum
    in the same order), so the two give the same bits; and against the definition."""
    tuning = kernel_mgpu.TuningConfig(splits=splits, merge="kernel", merge_columns=columns)
    check_variant_compiled(tuning, case, 27)
    args = make_case(28, **{**GPU_CASES, **CPU_CASES}[case])
    merged = {}
    for pass_columns in (None, columns):
        tuning = kernel_mgpu.TuningConfig(splits=splits, merge="kernel", merge_columns=pass_columns)
        attend = jax.jit(attention_fn("mgpu", config=api.Config(mgpu=tuning)))
        merged[pass_columns] = np.asarray(attend(*args), np.float32)
    np.testing.assert_array_equal(merged[columns], merged[None])


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a GPU as jax's default backend")
@pytest.mark.parametrize("case", [*GPU_CASES, *CPU_CASES], ids=str)
@pytest.mark.parametrize("splits", (None, 3))
@pytest.mark.parametrize(
    "kernel",
    [{}, dict(kernel="specialized", gather="async", qk="keys", producers=2)],
    ids=("pipelined", "specialized_two_producers"),
)
def test_the_slots_built_in_the_kernel_are_xlas_gpu(case, splits, kernel):
    """`slots='kernel'` (`_slot_builder`; the pipelined kernel's default, an option of the
    specialized kernel's, whose four warpgroups all build): the kernel builds its slots from
    the window flags and the indices as given. Against the definition
    (`check_variant_compiled`: ragged rows, −1 and out-of-range indices, duplicates, an empty
    row, no window, no top-k), and bit for bit against the same kernel reading the slots an
    XLA op made: the same slots, so the same output."""
    tuning = functools.partial(kernel_mgpu.TuningConfig, splits=splits, **kernel)
    check_variant_compiled(tuning(slots="kernel"), case, 23)
    args = make_case(24, **{**GPU_CASES, **CPU_CASES}[case])
    outs = {}
    for slots in ("kernel", "xla"):
        config = api.Config(mgpu=tuning(slots=slots))
        outs[slots] = np.asarray(jax.jit(attention_fn("mgpu", config=config))(*args), np.float32)
    np.testing.assert_array_equal(outs["kernel"], outs["xla"])


def test_the_merge_and_the_slots_run_in_the_pipelined_kernel_by_default():
    """`merges_in_kernel`: the pipelined kernel merges its splits itself at two splits, at any
    number when told 'kernel', never when told 'xla'; one split has nothing to merge; the other
    kernels merge in XLA, and refuse 'kernel'. Likewise `builds_slots`: the pipelined kernel
    builds its slots unless told 'xla'."""
    default = kernel_mgpu.TuningConfig()
    assert [default.merges_in_kernel(s) for s in (1, 2, 3, 4)] == [False, True, False, False]
    forced = kernel_mgpu.TuningConfig(merge="kernel")
    assert [forced.merges_in_kernel(s) for s in (1, 2, 3, 4)] == [False, True, True, True]
    assert not kernel_mgpu.TuningConfig(merge="xla").merges_in_kernel(2)
    assert not kernel_mgpu.TuningConfig(kernel="exchange").merges_in_kernel(2)
    specialized = functools.partial(kernel_mgpu.TuningConfig, kernel="specialized")
    assert not specialized().merges_in_kernel(2)  # told only
    assert [specialized(merge="kernel").merges_in_kernel(s) for s in (1, 2, 3)] == [0, 1, 1]
    with pytest.raises(
        ValueError, match="merge: 'kernel' only with kernel='pipelined' or 'specialized', got "
    ):
        kernel_mgpu.TuningConfig(kernel="exchange", merge="kernel")
    with pytest.raises(ValueError, match=r"merge: expected None or one of \('kernel', 'xla'\)"):
        kernel_mgpu.TuningConfig(merge="cluster")
    assert default.builds_slots()
    assert not kernel_mgpu.TuningConfig(slots="xla").builds_slots()
    assert not kernel_mgpu.TuningConfig(kernel="exchange").builds_slots()
    assert kernel_mgpu.TuningConfig(kernel="specialized", slots="kernel").builds_slots()
    assert not kernel_mgpu.TuningConfig(kernel="specialized").builds_slots()
    with pytest.raises(
        ValueError, match="slots: 'kernel' only with kernel='pipelined' or 'specialized', got "
    ):
        kernel_mgpu.TuningConfig(kernel="exchange", slots="kernel")
    with pytest.raises(ValueError, match=r"slots: expected None or one of \('kernel', 'xla'\)"):
        kernel_mgpu.TuningConfig(slots="smem")


def test_the_default_gather_resolves_per_kernel_and_split():
    """`gather=None` resolves per call: the pipelined kernel (the default) stages its words
    with `cp.async` at one or two splits, loads them into registers at more; it splits the
    keys between its warpgroups unless only the full logits leave room for the staging
    (`resolve_pipelined`); the exchange kernel loads them behind PV where a CTA runs all its query's
    chunks (one split), at each chunk's start with more splits, under an ablation or beside
    `prefetch`; a gather that is set is kept."""
    default = kernel_mgpu.TuningConfig()
    assert default.gather is None and default.kernel == "pipelined"
    assert [default.gather_for(s) for s in (1, 2, 3, 4)] == ["async"] * 2 + ["registers"] * 2
    # Top-512 beside a window of 128: at two splits the rows are swapped through the merge's
    # log-sum-exps, which leaves the P tile room beside the staged words (sixteenth session).
    assert [kernel_mgpu.resolve_pipelined(default, s, 512, 10) for s in (1, 2, 3, 4)] == [
        ("async", True),
        ("async", True),
        ("registers", True),
        ("registers", True),
    ]
    # Past 12 chunks at one split only the full logits leave room for the staged words.
    assert kernel_mgpu.resolve_pipelined(default, 1, 512, 13) == ("async", False)
    heads = kernel_mgpu.TuningConfig(qk="heads")
    assert kernel_mgpu.resolve_pipelined(heads, 1, 512, 10) == ("async", False)
    keys = kernel_mgpu.TuningConfig(qk="keys")
    assert kernel_mgpu.resolve_pipelined(keys, 1, 512, 13) == ("registers", True)
    exchange = kernel_mgpu.TuningConfig(kernel="exchange")
    assert [exchange.gather_for(s) for s in (1, 2, 4)] == ["behind_pv", "registers", "registers"]
    assert kernel_mgpu.TuningConfig(kernel="pipelined", gather="registers").gather_for(1) == (
        "registers"
    )
    for other in (
        kernel_mgpu.TuningConfig(kernel="exchange", ablation="no_topk_rows"),
        kernel_mgpu.TuningConfig(kernel="exchange", prefetch=True),
        kernel_mgpu.TuningConfig(kernel="specialized"),
    ):
        assert other.gather_for(1) == "registers", other
    assert (
        kernel_mgpu.TuningConfig(kernel="exchange", gather="registers").gather_for(1) == "registers"
    )
    assert kernel_mgpu.TuningConfig(kernel="exchange", gather="async").gather_for(2) == "async"


def test_tuning_errors_name_the_option():
    with pytest.raises(ValueError, match="gather"):
        kernel_mgpu.TuningConfig(gather="tma")
    with pytest.raises(ValueError, match="gather: 'behind_pv' only with kernel='exchange'"):
        kernel_mgpu.TuningConfig(gather="behind_pv", kernel="specialized")
    with pytest.raises(ValueError, match="gather: 'behind_pv' only with kernel='exchange'"):
        kernel_mgpu.TuningConfig(gather="behind_pv", kernel="pipelined")
    with pytest.raises(ValueError, match="prefetch=True"):
        kernel_mgpu.TuningConfig(kernel="exchange", gather="async", prefetch=True)
    with pytest.raises(ValueError, match="gather: 'behind_pv' only with kernel='exchange'"):
        kernel_mgpu.TuningConfig(kernel="exchange", gather="behind_pv", prefetch=True)
    with pytest.raises(ValueError, match="ablation='no_topk_rows'"):
        kernel_mgpu.TuningConfig(kernel="exchange", gather="behind_pv", ablation="no_topk_rows")
    with pytest.raises(ValueError, match="q_overlap: only with kernel='exchange'"):
        kernel_mgpu.TuningConfig(q_overlap=True, kernel="specialized")
    with pytest.raises(ValueError, match=r"prefetch: only with kernel='exchange'.*'pipelined'"):
        kernel_mgpu.TuningConfig(prefetch=True, kernel="pipelined")
    with pytest.raises(ValueError, match=r"kernel: expected one of .*'pipelined'.*got 'fused'"):
        kernel_mgpu.TuningConfig(kernel="fused")
    with pytest.raises(ValueError, match="ablation"):
        kernel_mgpu.TuningConfig(ablation="no_window")
    with pytest.raises(ValueError, match="producers: expected 1 or 2, got 3"):
        kernel_mgpu.TuningConfig(kernel="specialized", producers=3)
    with pytest.raises(ValueError, match="producers: 2 only with kernel='specialized'"):
        kernel_mgpu.TuningConfig(producers=2)
    with pytest.raises(ValueError, match="registers: only with kernel='specialized'"):
        kernel_mgpu.TuningConfig(registers=(208, 96))
    for bad in ((208, 90), (208,), [208, 96], (264, 24), (208, 16)):
        with pytest.raises(ValueError, match=r"registers: expected a tuple .* got"):
            kernel_mgpu.TuningConfig(kernel="specialized", registers=bad)
    with pytest.raises(ValueError, match=r"\(224, 96\) ask for 544 .* at most 504"):
        kernel_mgpu.TuningConfig(kernel="specialized", registers=(224, 96))
    # 512 is all of four warpgroups' registers but more than three start with (168 each):
    # the split that hung on an H100 (2026-12-08).
    with pytest.raises(ValueError, match=r"\(208, 96\) ask for 512 .* at most 504 \(3 × the 168"):
        kernel_mgpu.TuningConfig(kernel="specialized", registers=(208, 96))
    with pytest.raises(ValueError, match=r"2 producer warpgroups at \(184, 80\) ask for 528"):
        kernel_mgpu.TuningConfig(kernel="specialized", producers=2, registers=(184, 80))
    for producers, (consumers, each) in kernel_mgpu.SPECIALIZED_REGISTERS.items():
        warpgroups = 2 + producers  # the defaults use the whole pool, and are accepted
        assert 2 * consumers + producers * each == warpgroups * kernel_mgpu.entry_registers(
            warpgroups
        )
        kernel_mgpu.TuningConfig(
            kernel="specialized", producers=producers, registers=(consumers, each)
        )
    with pytest.raises(
        ValueError, match=r"qk: expected None or one of \('heads', 'keys'\), got 'dims'"
    ):
        kernel_mgpu.TuningConfig(qk="dims")
    with pytest.raises(
        ValueError,
        match="qk: 'keys' only with kernel='pipelined' or 'specialized', got kernel='exchange'",
    ):
        kernel_mgpu.TuningConfig(qk="keys", kernel="exchange")
    args = make_case(4, **CPU_CASES["ragged"])
    for ablation in ("no_topk_gather", "no_topk_decode"):
        config = api.Config(mgpu=kernel_mgpu.TuningConfig(kernel="exchange", ablation=ablation))
        with pytest.raises(ValueError, match=f"config.ablation: '{ablation}'.*dequant='ptx'"):
            attention_fn("mgpu", config=config)(*args)


def test_errors_name_the_argument():
    q, kv, indices, win, valid, sink = make_case(4, **CPU_CASES["ragged"])
    with pytest.raises(ValueError, match="kv_packed"):
        api.fp4_sparse_attention(q, kv[..., :-1], indices, win, valid, sink)
    with pytest.raises(ValueError, match="sink"):
        api.fp4_sparse_attention(q, kv, indices, win, valid, sink[:1])
    with pytest.raises(ValueError, match="implementation"):
        api.fp4_sparse_attention(q, kv, indices, win, valid, sink, implementation="cuda")


# ---------------------------------------------------------------------------------------------
# The Mosaic GPU kernel's PTX programs, executed in numpy.


def _prmt(a, b, selector):
    """PTX prmt.b32 (default mode): byte i of the result is byte (selector nibble i) of b:a,
    or that byte's sign replicated when the nibble's bit 3 is set."""
    pool = (b.astype(np.uint64) << 32) | a.astype(np.uint64)
    out = np.zeros(np.broadcast(a, b, selector).shape, np.uint64)
    for i in range(4):
        nibble = (selector.astype(np.uint64) >> np.uint64(4 * i)) & np.uint64(0xF)
        byte = (pool >> (np.uint64(8) * (nibble & np.uint64(7)))) & np.uint64(0xFF)
        byte = np.where(nibble & np.uint64(8), np.where(byte & np.uint64(0x80), 0xFF, 0), byte)
        out |= byte.astype(np.uint64) << np.uint64(8 * i)
    return out.astype(np.uint32)


def _bf16x2_fma(a, b, c):
    """PTX fma.rn.bf16x2 lane by lane: exact products in float64, rounded to bf16 (subnormals
    kept, as the hardware does for bf16)."""
    lanes = lambda x: [
        ((x >> shift) & 0xFFFF).astype(np.uint16).view(ml_dtypes.bfloat16).astype(np.float64)
        for shift in (0, 16)
    ]
    out = np.zeros(np.broadcast(a, b, c).shape, np.uint32)
    for shift, x, y, z in zip((0, 16), lanes(a), lanes(b), lanes(c), strict=True):
        with np.errstate(over="ignore"):  # ±inf, as the hardware rounds
            value = (x * y + z).astype(ml_dtypes.bfloat16).view(np.uint16).astype(np.uint32)
        out |= value << shift
    return out


_OPS = {
    "mov.b32": lambda a: a,
    "and.b32": lambda a, b: a & b,
    "or.b32": lambda a, b: a | b,
    "shr.u32": lambda a, b: a >> b,
    "shl.b32": lambda a, b: a << b,
    "add.u32": lambda a, b: a + b,
    "mul.lo.u32": lambda a, b: a * b,
    "prmt.b32": _prmt,
    "fma.rn.bf16x2": _bf16x2_fma,
    "setp.eq.u32": lambda a, b: a == b,
    "selp.b32": lambda a, b, p: np.where(p, a, b),
}


def run_ptx(program: str, n_out: int, *inputs: np.ndarray) -> list[np.ndarray]:
    """Executes a straight-line PTX program ($0.. outputs, then inputs) on uint32 arrays."""
    env = {f"${n_out + i}": np.asarray(x, np.uint32) for i, x in enumerate(inputs)}

    def value(operand):
        if re.fullmatch(r"-?(0x[0-9a-fA-F]+|\d+)", operand):
            return np.uint32(int(operand, 0) & 0xFFFFFFFF)
        return env[operand]

    for statement in program.replace("{", "").replace("}", "").split(";"):
        statement = statement.strip()
        if not statement or statement.startswith(".reg"):
            continue
        op, operands = statement.split(None, 1)
        dest, *sources = (o.strip() for o in operands.split(","))
        result = _OPS[op](*(value(s) for s in sources))
        env[dest] = result if result.dtype == bool else np.asarray(result).astype(np.uint32)
    return [env[f"${i}"] for i in range(n_out)]


def _words(rows: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(rows).view("<u4")


def _bf16(words: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(words).view(ml_dtypes.bfloat16).astype(np.float32)


def assert_same_values(got, want):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))


def test_ptx_nvfp4_decode_is_bit_exact():
    """E4M3_SCALES_PTX + E2M1_PTX on packed rows (every nibble and scale byte, NaN scales too)
    equal `formats.unpack`, the sign of zero included."""
    dim, rng = 512, np.random.default_rng(5)
    rows = rng.integers(0, 256, (512, formats.packed_row_bytes("nvfp4", dim)), dtype=np.uint8)
    rows[:256, dim // 2] = np.arange(256)  # every E4M3 scale byte, 0x7F/0xFF (NaN) included
    values = np.asarray(formats.pack(jnp.asarray(rng.normal(size=(64, dim)) * 1e3), "nvfp4"))
    rows[-64:] = values
    nibbles, scales = _words(rows[:, : dim // 2]), _words(rows[:, dim // 2 :])
    pairs = np.stack(run_ptx(kernel_mgpu.E4M3_SCALES_PTX, 4, scales), -1)
    got = []
    for k in range(dim // 8):  # word k: dims 8k..8k+7, scale of group 16 → pair k // 2
        got += run_ptx(kernel_mgpu.E2M1_PTX, 4, nibbles[:, k], pairs[:, k // 8, k % 8 // 2])
    got = _bf16(np.stack(got, -1))
    assert_same_values(got, formats.unpack(rows, "nvfp4", dim))


def test_ptx_fp8_window_decode_is_bit_exact():
    """UE8M0_PTX + E4M3_PTX on window rows (every E4M3 byte, NaN codes, scale 0xFF) equal
    `formats.unpack`. Scale bytes start at 10: below, products fall under bf16's normal range
    (`pack` writes E >= 105, its 1e-4 amax floor), and byte 0 decodes to zero by design."""
    dim, rng = 256, np.random.default_rng(6)
    rows = rng.integers(0, 256, (256, formats.packed_row_bytes("fp8", dim)), dtype=np.uint8)
    rows[:, :256] = np.arange(256)[None, :]  # every element byte in every row
    rows[:, dim:] = np.clip(rows[:, dim:], 10, 255)
    rows[:8, dim] = 0xFF
    data, scales = _words(rows[:, :dim]), rows[:, dim:]
    got = []
    for piece in range(dim // 64):  # a thread's piece: 64 dims, 2 scale bytes
        pair = (
            scales[:, 2 * piece].astype(np.uint32) | scales[:, 2 * piece + 1].astype(np.uint32) << 8
        )
        factors = run_ptx(kernel_mgpu.UE8M0_PTX, 2, pair)
        for j in range(16):
            word = data[:, 16 * piece + j]
            got += run_ptx(kernel_mgpu.E4M3_PTX, 2, word, factors[j // 8])
    got = _bf16(np.stack(got, -1))
    assert_same_values(got, formats.unpack(rows, "fp8", dim))
