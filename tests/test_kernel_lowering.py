"""Every Pallas GPU kernel lowers for the H200 on this CPU (`pallas_kernels.lowering`).

The CPU tests run the kernels interpreted, which checks what they compute but not that their
backend can express them: the radix-select kernel passed every interpreted test and then failed
its first H200 run in the Triton lowering (2026-12-03, `results/gpu_tests_topk_h200_2026-12-03_
run3.log`: an int32 add of a boolean). Lowering for CUDA needs no GPU, so these tests run that
step in CI at the GPU tests' shapes, for every kernel and every route into one. They check no
numbers (the GPU tests do, `-m gpu`) and not the Triton/ptxas compiles that follow on a GPU.
"""

import functools
import json
from pathlib import Path

import jax
import jax.experimental.pallas as pl
import jax.numpy as jnp
import pytest
from flax import nnx

from pallas_kernels import lowering, ptxas, registers
from pallas_kernels.pooled_scoring.api import pooled_scores
from pallas_kernels.source_scan.api import candidate_source
from pallas_kernels.sparse_attention import api as attention_api
from pallas_kernels.sparse_attention import bench as attention_bench
from pallas_kernels.sparse_attention import kernel_mgpu
from pallas_kernels.topk import api as topk_api
from pallas_kernels.topk import kernel_triton
from v41jax.nn import config, model
from v41jax.nn.cache import init_cache
from v41jax.ops import formats
from v41jax.ops.scoring import TIE_ORDERS

f32, i32 = jnp.float32, jnp.int32


def spec(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype)


def packed(batch, n, dim, fmt):
    return spec((batch, n, formats.packed_row_bytes(fmt, dim)), jnp.uint8)


def lowers_to(fn, *args, triton=0, mosaic_gpu=0):
    """`fn(*args)` lowers for the H200 and holds this many calls of each GPU backend."""
    calls = lowering.custom_calls(lowering.lower_for_gpu(fn, *args))
    assert calls == {"triton": triton, "mosaic_gpu": mosaic_gpu}, calls


def test_a_kernel_its_backend_cannot_express_fails_here():
    """The check can fail: a Triton kernel that adds a boolean to an int32 (the radix-select
    kernel's first form) raises in the lowering, as it did on the H200."""

    def kernel(x_ref, o_ref):
        count = jnp.sum(x_ref[...])
        o_ref[...] = jnp.broadcast_to(count + jnp.where(count >= 3, 1, 0).astype(i32), (16,))

    def call(x):  # no compiler_params: pallas_call's default GPU backend, Triton
        return pl.pallas_call(kernel, out_shape=spec((16,), i32))(x)

    with pytest.raises(AssertionError, match="i32"):
        lowering.lower_for_gpu(call, spec((16,), i32))


@pytest.mark.parametrize("digit_bits", kernel_triton.DIGIT_BITS)
def test_the_radix_select_kernel_lowers(digit_bits):
    """At a padded row, the pool's 16,384 slots and the longest row a program holds: one call
    of the kernel, or two where the row is split by default (`default_segments`)."""
    for n, k in ((203, 67), (16_384, 512), (kernel_triton.MAX_N, 2048)):
        calls = 1 + (kernel_triton.default_segments(pl.next_power_of_2(n), k) > 1)
        for tie_order in TIE_ORDERS:
            select = functools.partial(
                kernel_triton.select, k=k, tie_order=tie_order, digit_bits=digit_bits
            )
            lowers_to(select, spec((4, n), f32), triton=calls)


def test_the_radix_select_kernel_over_segments_lowers():
    """A row split over 2 and 4 programs: two calls of the kernel (the parts, then their picks)."""
    for segments in (2, 4):
        select = functools.partial(kernel_triton.select, k=512, digit_bits=1, segments=segments)
        lowers_to(select, spec((4, 16_384), f32), triton=2)


def test_the_kernel_top_k_lowers_beyond_one_program():
    """131,072 block scores (1 M positions): `blocks.topk` with the kernel at its leaves."""
    select = functools.partial(
        topk_api.topk, k=2048, implementation="pallas", method="kernel", digit_bits=4
    )
    calls = lowering.custom_calls(lowering.lower_for_gpu(select, spec((2, 131_072), f32)))
    assert calls["triton"] >= 1 and calls["mosaic_gpu"] == 0, calls


def test_pooled_scoring_lowers():
    """The Mosaic GPU scoring kernel at the GPU tests' pool (2,048 blocks, 32 heads), then its
    top-512 by `topk.api`'s default method under 'pallas', the radix-select Triton kernel (over
    the pool's 16,384 scores: two calls, the row split in two by `default_segments`)."""
    batch, n_pos, heads, dim, n_blocks = 2, 65_536, 32, 128, 2048
    score = functools.partial(pooled_scores, implementation="pallas", topk=512)
    args = (
        packed(batch, n_pos, dim, "mxfp4"),
        spec((batch, heads, dim), f32),
        spec((batch, heads), f32),
        spec((batch, n_blocks), i32),
        spec((batch,), i32),
    )
    lowers_to(score, *args, mosaic_gpu=1, triton=2)


@pytest.mark.parametrize(
    ("reduce", "topk_blocks", "index_topk"),
    [("max", 256, 512), ("max", 1024, 256), ("mean", 256, 512), ("top2", 256, 512)],
)
def test_the_candidate_source_lowers(reduce, topk_blocks, index_topk):
    """The source scan's kernel routes: block maxima for 'max', scores then blocks otherwise;
    'max' with index_topk < topk_blocks finds the best blocks among the pool's (a lax.cond
    around top-k kernels)."""
    batch, n_pos, heads, dim = 2, 16_384 - 3, 32, 128
    scan = functools.partial(
        candidate_source,
        topk_blocks=topk_blocks,
        index_topk=index_topk,
        reduce=reduce,
        implementation="pallas",
    )
    args = (
        packed(batch, n_pos, dim, "mxfp4"),
        spec((batch, heads, dim), f32),
        spec((batch, heads), f32),
        spec((batch,), i32),
    )
    calls = lowering.custom_calls(lowering.lower_for_gpu(scan, *args))
    assert calls["mosaic_gpu"] >= 1, calls


def attention_args(heads, batch=2, dim=512, n_kv=4096, topk=512, window=128):
    """The attention's arguments at V4.1's sizes: 512-dim NVFP4 rows, top-512, an FP8 window."""
    return (
        spec((batch, heads, dim), jnp.bfloat16),
        packed(batch, n_kv, dim, "nvfp4"),
        spec((batch, topk), i32),
        packed(batch, window, dim, "fp8"),
        spec((batch, window), jnp.bool_),
        spec((heads,), f32),
    )


@pytest.mark.parametrize("backend", attention_api.BACKENDS)
@pytest.mark.parametrize("heads", [64, 128, 3])
def test_fp4_sparse_attention_lowers(backend, heads):
    """V4.1's 512-dim NVFP4 rows and FP8 window, top-512, at the GPU tests' head counts."""
    attend = functools.partial(
        attention_api.fp4_sparse_attention,
        implementation="pallas",
        config=attention_api.Config(backend=backend),
    )
    args = attention_args(heads)
    calls = lowering.custom_calls(lowering.lower_for_gpu(attend, *args))
    kernel = "mosaic_gpu" if backend == "mgpu" else "triton"
    assert calls[kernel] >= 1, calls


@pytest.mark.parametrize("ablation", kernel_mgpu.ABLATIONS)
def test_the_attention_kernels_leave_one_out_variants_lower(ablation):
    """`TuningConfig(kernel="exchange", ablation=...)` (the benchmark's leave-one-out
    timings) lowers, and a config it does not apply to is refused by name."""
    tuning = kernel_mgpu.TuningConfig(kernel="exchange", ablation=ablation)
    attend = functools.partial(
        attention_api.fp4_sparse_attention,
        implementation="pallas",
        config=attention_api.Config(mgpu=tuning),
    )
    lowers_to(attend, *attention_args(64), mosaic_gpu=1)
    with pytest.raises(ValueError, match="ablation: expected None or one of"):
        kernel_mgpu.TuningConfig(kernel="exchange", ablation="no_decode")
    with pytest.raises(ValueError, match="ablation: only with kernel='exchange'"):
        kernel_mgpu.TuningConfig(kernel="specialized", ablation=ablation)


def test_the_default_attention_kernel_stages_its_words_while_they_fit():
    """`kernel_mgpu.supports`' docstring: at D = 512 the pipelined kernel's staged words fit
    beside 48 chunks of slots (a top-k of 2,944 and a window of 128), and from 49 its default
    loads them into registers (`resolve_pipelined`), up to 118 chunks (7,552). Both sides of each
    boundary are lowered: the estimate (`pipelined_shared_bytes`) is Mosaic GPU's own count."""

    def attend(gather=None):
        tuning = kernel_mgpu.TuningConfig(gather=gather, splits=1)
        return functools.partial(
            attention_api.fp4_sparse_attention,
            implementation="pallas",
            config=attention_api.Config(mgpu=tuning),
        )

    default = kernel_mgpu.TuningConfig()
    assert kernel_mgpu.resolve_pipelined(default, 1, 512, n_chunks=2 + 2944 // 64)[0] == "async"
    assert kernel_mgpu.resolve_pipelined(default, 1, 512, n_chunks=3 + 2944 // 64)[0] == "registers"
    assert kernel_mgpu.resolve_pipelined(default, 1, 256, n_chunks=250)[0] == "async"
    lowers_to(attend(), *attention_args(64, topk=2944), mosaic_gpu=1)
    lowers_to(attend(), *attention_args(64, topk=3008), mosaic_gpu=1)
    lowers_to(attend(), *attention_args(64, topk=7552), mosaic_gpu=1)
    for gather, topk in (("async", 3008), (None, 7616)):
        with pytest.raises(ValueError, match="exceeds available shared memory"):
            lowering.lower_for_gpu(attend(gather), *attention_args(64, topk=topk))


def check_the_staging_boundary(splits: int, **options) -> int:
    """The pipelined kernel with `options` at `splits` splits, D = 512, a window of 128: at the
    last chunk count its estimate (`resolve_pipelined`) stages the words for, it lowers; one chunk
    more it lowers with them in registers; two more with the staging forced, Mosaic GPU refuses
    it by name. Returns that last count."""
    config = kernel_mgpu.TuningConfig(splits=splits, **options)
    last = max(
        n
        for n in range(2, 60)
        if kernel_mgpu.resolve_pipelined(config, splits, 512, n)[0] == "async"
    )

    def attend(gather=None):
        tuning = kernel_mgpu.TuningConfig(splits=splits, gather=gather, **options)
        return functools.partial(
            attention_api.fp4_sparse_attention,
            implementation="pallas",
            config=attention_api.Config(mgpu=tuning),
        )

    topk = (last - 2) * 64  # two window chunks
    lowers_to(attend(), *attention_args(64, topk=topk), mosaic_gpu=1)
    lowers_to(attend(), *attention_args(64, topk=topk + 64), mosaic_gpu=1)  # registers
    with pytest.raises(ValueError, match="exceeds available shared memory"):
        lowering.lower_for_gpu(attend("async"), *attention_args(64, topk=topk + 128))
    return last


def test_the_merge_in_the_kernel_leaves_the_staging_where_it_fits():
    """With its two splits merged in the kernel (the default at two; `merge='kernel'`), the
    pipelined kernel takes about 1 KB more (the splits' log-sum-exps, three barriers), so the
    staged words fit beside fewer chunks: the estimate (`pipelined_shared_bytes`) picks 'async'
    only where the kernel lowers, and is at most one chunk short of Mosaic GPU's own count (its
    alignment: a chunk's slots are 256 bytes). At more splits the words go through registers
    (`gather_for`), so there is no boundary to check."""
    last = check_the_staging_boundary(2, merge="kernel")
    assert 38 < last < 48  # 48 without the merge (the test above)


def test_the_split_keys_merging_in_the_kernel_stage_top_512():
    """At two splits merged in the kernel (batch 64), the split keys swap their row maxima
    through the merge's log-sum-exp stage instead of 512 bytes of their own: that is what lets
    the staged words fit beside the P tile and the merge's buffers at top-512 with a window of
    128 (10 chunks; 104 bytes over without it). The estimate stages only where the kernel
    lowers, at most one chunk short of Mosaic GPU's count."""
    last = check_the_staging_boundary(2, qk="keys")
    assert 10 <= last < 38


def test_the_merge_loop_lowers_shorter_and_refuses_columns_that_do_not_tile_d():
    """`merge_columns` (the merge in the kernel, a loop over that many output columns a pass)
    lowers at both head dims, and its Mosaic GPU program is shorter than the unrolled merge's
    (the point of the loop: straight-line code each warp runs once); a width that is not a
    multiple of the 64-column swizzle tile, or does not divide D/2, is refused by name."""

    def lowered(dim, columns):
        tuning = kernel_mgpu.TuningConfig(splits=2, merge_columns=columns)
        attend = functools.partial(
            attention_api.fp4_sparse_attention,
            implementation="pallas",
            config=attention_api.Config(mgpu=tuning),
        )
        return lowering.lower_for_gpu(attend, *attention_args(64, dim=dim)).as_text()

    sizes = {dim: [len(lowered(dim, c)) for c in (None, 128, 64)] for dim in (256, 512)}
    # The default is the loop (twentieth session: faster at batch 64, the same bits). The text
    # carries a hash of the kernel and its source locations, so compare sizes.
    default = functools.partial(
        attention_api.fp4_sparse_attention,
        implementation="pallas",
        config=attention_api.Config(mgpu=kernel_mgpu.TuningConfig(splits=2)),
    )
    default_size = len(lowering.lower_for_gpu(default, *attention_args(64)).as_text())
    assert default_size < 0.9 * sizes[512][0], (default_size, sizes)
    # The serialized module's text: at D = 256, half = 128 is one pass of 128 columns, the
    # unrolled program.
    assert sizes[256][2] < 0.95 * min(sizes[256][:2]), sizes
    assert sizes[512][2] < sizes[512][1] < 0.9 * sizes[512][0], sizes
    for columns in (0, 32, 96):
        with pytest.raises(ValueError, match="merge_columns: expected None or a positive multiple"):
            kernel_mgpu.TuningConfig(merge_columns=columns)
    with pytest.raises(
        ValueError, match=r"merge_columns: expected a divisor of D/2 = 128, got 192"
    ):
        lowered(256, 192)


@pytest.mark.parametrize(("gather", "topk"), [("registers", 4096), ("async", 2048)])
def test_the_exchange_kernel_fits_a_top_k_of_thousands(gather, topk):
    """The exchange kernel's shared memory holds every chunk's slots, enough for a top-k of
    4,096 (2,048 with the staged gather) beside a window of 128 at D = 512; twice as many is
    refused by Mosaic GPU's own check, by name."""
    tuning = kernel_mgpu.TuningConfig(kernel="exchange", gather=gather)
    attend = functools.partial(
        attention_api.fp4_sparse_attention,
        implementation="pallas",
        config=attention_api.Config(mgpu=tuning),
    )
    lowers_to(attend, *attention_args(64, topk=topk), mosaic_gpu=1)
    with pytest.raises(ValueError, match="exceeds available shared memory"):
        lowering.lower_for_gpu(attend, *attention_args(64, topk=2 * topk))


def test_the_split_keys_take_the_staged_gather_only_where_it_fits():
    """`qk='keys'` adds the P tile and the row exchange (9 KB): its estimate
    (`pipelined_shared_bytes`) picks the staged gather only where the kernel lowers; at
    top-512 beside a window of 128 (10 chunks) the words are still staged (with the scale
    words packed, fifteenth session: 12 chunks), so the split keys run the default's gather."""
    last = check_the_staging_boundary(1, qk="keys")
    split = kernel_mgpu.TuningConfig(qk="keys")
    assert (
        10 <= last < 48 and kernel_mgpu.resolve_pipelined(split, 1, 512, last + 1)[0] == "registers"
    )


ATTENTION_VARIANTS = {
    "default": kernel_mgpu.TuningConfig(),
    **{
        label: attention_bench.MGPU_VARIANTS[label]
        for label in (
            *("exchange", "async_gather", "q_overlap", "behind_pv"),
            *("no_topk_gather", "no_topk_decode", "pipelined", "xla_slots", "split_keys"),
            # (Two producers write the same inline PTX as one.)
            *("specialized", "specialized_async", "specialized_async_keys"),
        )
    },
    # Two options no benchmark label carries.
    "prefetch": kernel_mgpu.TuningConfig(kernel="exchange", prefetch=True),
    "merge_in_kernel": kernel_mgpu.TuningConfig(splits=3, merge="kernel"),
}
"""The attention kernel's programs whose inline PTX is assembled: the benchmark's variants
(`bench.MGPU_VARIANTS`) by label, and two configurations of their own."""


@pytest.mark.skipif(ptxas.PTXAS is None, reason="ptxas (CUDA's assembler) is not on PATH")
@pytest.mark.parametrize("variant", ATTENTION_VARIANTS, ids=str)
def test_the_attention_kernels_inline_ptx_assembles(variant):
    """Every inline PTX program a variant of the attention kernel writes, at both head dims,
    assembles for sm_90a (`lowering.assemble_inline_ptx`): a misspelt instruction, a wrong
    vector width or operand kind fails here, not at the variant's first GPU run."""
    attend = functools.partial(
        attention_api.fp4_sparse_attention,
        implementation="pallas",
        config=attention_api.Config(mgpu=ATTENTION_VARIANTS[variant]),
    )
    for heads, dim in ((64, 512), (3, 256)):
        with lowering.recording_inline_ptx() as programs:
            lowering.lower_for_gpu(attend, *attention_args(heads, dim=dim))
        assert programs, "no inline PTX recorded: the kernel did not lower inside the block"
        assert lowering.assemble_inline_ptx(programs) >= 5


@pytest.mark.skipif(ptxas.PTXAS is None, reason="ptxas (CUDA's assembler) is not on PATH")
def test_the_register_split_report_reads_what_ptxas_says(tmp_path, capsys):
    """`registers` on the committed PTX of the warp-specialized kernel (the
    H100's dump, 2026-12-07): at 224 / 56 registers ptxas spills the producer's code, at
    200 / 104 it does not (NOTES.md), and the four-warpgroup program is refused with ptxas's
    own message, and assembles with PV split into 128-column wgmmas (`--wgmma-columns`); the
    rows come back as JSON and as a table, which flags a split past the CTA's register pool
    (208 / 96: 512 of three warpgroups' 504, the split that hung on an H100)."""
    dump = Path(__file__).parents[1] / "experiments/results/ptx_specialized_h100_2026-12-07e.tgz"
    out = tmp_path / "rows.json"
    argv = [str(dump), "--programs", "ptx_specialized_async_keys"]
    rows = registers.main([*argv, "--splits", "224/56", "200/104", "208/96", "--out", str(out)])
    assert json.loads(out.read_text()) == rows
    spilled, clean, _ = rows
    assert [registers.over_pool(r) for r in rows] == [None, None, 504], rows
    assert spilled["spill_store_bytes"] > 0 and spilled["spill_load_bytes"] > 0, spilled
    assert clean["spill_store_bytes"] == clean["spill_load_bytes"] == 0, clean
    # At entry: 65,536 registers over 384 threads, rounded down to a multiple of 8.
    assert spilled["registers"] == clean["registers"] == 65_536 // 384 // 8 * 8, rows
    printed = capsys.readouterr().out
    assert "| ptx_specialized_async_keys | 200 / 104 | 168 | 0 B | 0 B | 0 B |  |" in printed
    assert "| 208 / 96 | 168 | 0 B | 0 B | 0 B | over the CTA's pool of 504" in printed
    argv = [str(dump), "--programs", "ptx_specialized_two_producers", "--splits", "184/72"]
    (refused,) = registers.main(argv)
    assert "Insufficient registers (128)" in refused["fatal"], refused
    (split,) = registers.main([*argv, "--wgmma-columns", "128"])
    assert "fatal" not in split and split["registers"] == 128 and split["wgmma_columns"] == 128
    with pytest.raises(ValueError, match=r"columns: expected a divisor of the wgmma's 256, got 96"):
        registers.with_wgmma_columns(registers.read_ptx([dump])["ptx_specialized"], 96)
    with pytest.raises(ValueError, match=r"setmaxnreg\.inc and a setmaxnreg\.dec"):
        registers.with_split("ret;", 208, 96)


def test_the_ptxas_check_rejects_what_ptxas_rejects():
    """The check can fail: a 16-byte-only `cp.async.cg` given 8 bytes, and a 3-wide vector
    load, are refused with ptxas's message; without ptxas, the check says so."""
    if ptxas.PTXAS is None:
        with pytest.raises(RuntimeError, match="ptxas: not on PATH"):
            lowering.assemble_inline_ptx([])
        return
    bad = kernel_mgpu.CP_ASYNC_16_PTX.replace("16,", "8,")
    with pytest.raises(RuntimeError, match=r"cp\.async"):
        lowering.assemble_inline_ptx([lowering.InlinePtx(bad, ("r", "l", "r"))])
    bad = kernel_mgpu.LD_SHARED_V4_PTX.replace(", $3}", "}")
    with pytest.raises(RuntimeError, match="vector size"):
        lowering.assemble_inline_ptx([lowering.InlinePtx(bad, ("r",) * 5)])
    good = lowering.InlinePtx(kernel_mgpu.LD_SHARED_V4_PTX, ("r",) * 5)
    assert lowering.assemble_inline_ptx([good, good]) == 1  # distinct programs only


def test_the_kernel_decode_step_lowers():
    """`model.decode_step(implementation='pallas')` whole, at the decode bench's config
    (`small_kernels()` with V4.1's pool of 2,048 blocks and top-512) and cache (64 K tokens and
    room for 9 more): every layer with main KV attends through a Mosaic GPU kernel, and the
    indexer layers add their scoring calls, which read the packed index keys where they lie
    (`cache.table_rows`: no pad copies the whole table first, as one did at every call on the
    H200 before, 2026-12-04: 4.0 ms of an 8.5 ms step at 1 M tokens)."""
    cfg = config.small_kernels().replace(candidate_topk_blocks=2048, index_topk=512)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: model.Model(cfg, rngs=nnx.Rngs(0))))
    batch = 4
    cache = jax.eval_shape(lambda: init_cache(cfg, batch, 65_536 + 9))

    def step(state, tokens, cache):
        m = nnx.merge(graphdef, state)
        logits, cache, _ = model.decode_step(m, tokens, cache, implementation="pallas")
        return logits, cache

    lowered = lowering.lower_for_gpu(step, state, spec((batch,), i32), cache)
    calls = lowering.custom_calls(lowered)
    attending = sum(layer.main_kv is not None for layer in cache.layers)
    assert calls["mosaic_gpu"] > attending > 0, (calls, attending)
    tables = {f"tensor<{'x'.join(map(str, x.shape))}xui8>" for x in jax.tree.leaves(cache)}
    pads = [line for line in lowered.as_text().splitlines() if "stablehlo.pad" in line]
    assert pads and not [line for line in pads if any(f"({t}," in line for t in tables)], pads


def test_the_attention_programs_digest_compares_versions(tmp_path, capsys):
    """`sparse_attention.programs`: one digest per configuration and splits, the same however
    many programs lowered before it in the process (Mosaic GPU numbers its dump names per
    process; `mosaic_gpu_modules` writes them out), different where the program is; a
    refused configuration recorded as its error; the comparison names what changed."""
    from pallas_kernels.sparse_attention import programs

    todo = programs.programs(["default", "specialized_two_producers"])
    assert set(todo) == {
        *(f"default@{n}" for n in (1, 2, 4)),
        "default_merge_kernel@4",
        *(f"specialized_two_producers@{n}" for n in (1, 2)),
    }
    fields, batch = todo["default@2"]
    assert fields["splits"] == 2 and batch == 64
    first = programs.digest(fields, batch)
    programs.digest(*todo["specialized_two_producers@1"])  # something else lowers in between
    assert programs.digest(fields, batch) == first
    assert programs.digest(*todo["default@1"]) != first
    refused = programs.digest({**fields, "producers": 3}, batch)
    assert refused == "error: producers: expected 1 or 2, got 3", refused
    with pytest.raises(ValueError, match=r"labels: expected 'default' or a bench variant"):
        programs.programs(["fastest"])
    before, after = tmp_path / "before.json", tmp_path / "after.json"
    before.write_text(json.dumps({"a@1": "x", "b@1": "y"}))
    after.write_text(json.dumps({"a@1": "x", "b@1": "z", "c@1": "w"}))
    changed = programs.main(["--compare", str(before), str(after)])
    assert changed == ["b@1: y -> z", "c@1: absent -> w"], changed
    assert "b@1: y -> z" in capsys.readouterr().out
