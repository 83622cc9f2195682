"""The numerics switches of issue 13 (`ModelConfig.index_score_dtype`, `tie_order`,
`neginf_picks`) and `with_reference_numerics`: each against an independent numpy computation on
fresh random inputs with engineered ties (exact zeros from ReLU, equal block maxima), ragged
lengths, −1 padding and empty rows; then through the model (prefill = decode, the chunked pass =
the whole pass) and the kernels' `supports`.
"""

import functools
import itertools
import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from jax.experimental import checkify

from pallas_kernels.pooled_scoring import pooled_scores
from pallas_kernels.pooled_scoring import supports as pooled_supports
from pallas_kernels.pooled_scoring.kernel_mgpu import TuningConfig
from tests._models import four_layer_f32
from v41jax.nn import config as config_lib
from v41jax.nn import dispatch, model
from v41jax.ops import formats
from v41jax.ops.invariants import check_selection
from v41jax.ops.pool import (
    full_scan_topk,
    pool_mask_from_block_ids,
    pool_positions,
    pool_topk_from_scores,
    pooled_topk,
    select_candidate_blocks,
)
from v41jax.ops.scoring import NEGINF_PICKS, TIE_ORDERS, index_scores, topk

SWITCHES = [(t, n) for t in TIE_ORDERS for n in NEGINF_PICKS]
topk_jit = jax.jit(topk, static_argnames=("k", "tie_order", "neginf_picks"))
scores_jit = jax.jit(index_scores, static_argnames=("score_dtype",))
select_jit = jax.jit(select_candidate_blocks, static_argnums=(2, 3), static_argnames="tie_order")
pool_topk_jit = jax.jit(
    pool_topk_from_scores,
    static_argnames=("k", "block_size", "tie_order", "neginf_picks", "ascending_ids"),
)


# --- independent numpy versions of the rules ---


def np_topk(scores, k, mask, tie_order, neginf_picks):
    """Per row: in-mask positions scoring > −inf by (score desc, then position in the tie
    order); with 'keep', then out-of-mask positions whose own score is > −inf, in the tie order;
    the first k, sorted ascending, −1 padded."""
    *batch, n = scores.shape
    out = np.full((*batch, k), -1)
    sign = 1 if tie_order == "oldest" else -1
    for b in np.ndindex(*batch):
        row = np.where(np.isnan(scores[b]), -np.inf, scores[b])
        inside = [p for p in range(n) if row[p] > -np.inf and (mask is None or mask[b][p])]
        picks = sorted(inside, key=lambda p: (-row[p], sign * p))[:k]
        if neginf_picks == "keep" and mask is not None:
            outside = [p for p in range(n) if row[p] > -np.inf and not mask[b][p]]
            picks += sorted(outside, key=lambda p: sign * p)[: k - len(picks)]
        out[b][: len(picks)] = sorted(picks)
    return out


def np_pool_blocks(scores, lens, topk_blocks, block_size, tie_order):
    """Block ids of the candidate pool (block max over visible finite positions, newest block
    pinned, reachable blocks only, ties in the tie order), ascending, −1 padded."""
    *batch, n_pos = scores.shape
    n_blocks = math.ceil(n_pos / block_size)
    ids = np.full((*batch, topk_blocks), -1)
    sign = 1 if tie_order == "oldest" else -1
    for b in np.ndindex(*batch):
        n = min(int(lens[b]), n_pos)
        block_score = {}
        for j in range(n_blocks):
            vals = [
                scores[b][p] for p in range(j * block_size, min(j * block_size + block_size, n))
            ]
            vals = [v for v in vals if v > -np.inf]
            if n > 0 and j == (n - 1) // block_size:
                block_score[j] = np.inf
            elif vals:
                block_score[j] = max(vals)
        kept = sorted(block_score, key=lambda j: (-block_score[j], sign * j))[:topk_blocks]
        ids[b][: len(kept)] = sorted(kept)
    return ids


def np_bf16(x):
    return (
        np.asarray(x, np.float64).astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)
    )


def np_index_scores_bf16(q, w, k, lens):
    """The reference's bf16 roundings (module docstring of `ops.scoring`), in float64 between
    them: exact here, since the inputs are MXFP4 values whose products and sums are exact."""
    q, w, k = np_bf16(q), np_bf16(w), np_bf16(k)
    logits = np_bf16(np.einsum("bthd,bsd->bths", q, k))
    terms = np_bf16(w[..., None] * np.maximum(logits, 0.0))
    scores = np_bf16(terms.sum(axis=-2))
    visible = np.arange(k.shape[-2]) < np.asarray(lens)[..., None]
    return np.where(visible, scores, -np.inf)


# --- inputs with ties ---


def tied_scores(seed, batch, n_pos, *, levels=3):
    """Scores on a coarse grid (so many tie exactly; most are 0, as after a ReLU), −inf beyond
    ragged visible lengths (one row empty, one full), and ragged pool masks (some smaller than
    any k used here)."""
    rng = np.random.default_rng(seed)
    scores = np.maximum(rng.integers(-4, levels, (batch, n_pos)), 0).astype(np.float32) * 0.5
    lens = rng.integers(1, n_pos + 1, batch)
    lens[0], lens[1] = 0, n_pos
    scores = np.where(np.arange(n_pos) < lens[:, None], scores, -np.inf).astype(np.float32)
    mask = rng.random((batch, n_pos)) < rng.choice([0.05, 0.2, 0.6], (batch, 1))
    return scores, lens, mask


def mxfp4_inputs(seed, batch, t, s, heads, dim=32):
    """MXFP4-quantized q and k (products and short sums exact in float32), weights near each
    other (bf16 rounding makes neighbours collide), ragged compress_lens with an empty row."""
    rng = np.random.default_rng(seed)
    q = formats.mxfp4_fake_quant(rng.normal(size=(batch, t, heads, dim)).astype(np.float32))
    k = formats.mxfp4_fake_quant(rng.normal(size=(batch, s, dim)).astype(np.float32))
    w = (1.0 + 1e-3 * rng.normal(size=(batch, t, heads))).astype(np.float32)
    lens = rng.integers(0, s + 1, (batch, t))
    lens[0, 0] = 0
    return np.asarray(q), w, np.asarray(k), lens


# --- the ops ---


@pytest.mark.parametrize(("tie_order", "neginf_picks"), SWITCHES)
@pytest.mark.parametrize("masked", [False, True])
def test_topk_switches_match_numpy(tie_order, neginf_picks, masked):
    scores, lens, mask = tied_scores(1, 12, 45)
    scores[3, 5] = np.nan  # a NaN is never picked, under either rule
    for k in (0, 4, 13, 60):
        got = topk_jit(
            scores,
            k=k,
            mask=mask if masked else None,
            tie_order=tie_order,
            neginf_picks=neginf_picks,
        )
        want = np_topk(scores, k, mask if masked else None, tie_order, neginf_picks)
        np.testing.assert_array_equal(got.indices, want, err_msg=f"k={k}")
        picked = np.asarray(got.indices) >= 0
        kept_outside = picked & ~np.take_along_axis(mask, np.maximum(want, 0), -1) & masked
        # Scores of picks: their own in the mask, −inf for kept out-of-mask ones.
        expect = np.where(
            kept_outside, -np.inf, np.take_along_axis(scores, np.maximum(want, 0), -1)
        )
        np.testing.assert_array_equal(np.asarray(got.scores)[picked], expect[picked])
        assert np.isneginf(np.asarray(got.scores)[~picked]).all()
        # Never a position beyond the visible length (nor anything in the empty row 0).
        assert (np.where(picked, want, -1) < lens[:, None]).all()


def test_switches_bite():
    """On these inputs the switches change the picks (else the tests above could not fail):
    'newest' picks higher positions among ties, 'keep' adds visible out-of-pool picks."""
    scores, lens, mask = tied_scores(2, 16, 64)
    base = np.asarray(topk_jit(scores, k=10, mask=mask).indices)
    newest = np.asarray(topk_jit(scores, k=10, mask=mask, tie_order="newest").indices)
    keep = np.asarray(topk_jit(scores, k=10, mask=mask, neginf_picks="keep").indices)
    assert (newest.sum(-1) >= base.sum(-1)).all() and (newest != base).any()
    assert (keep >= 0).sum() > (base >= 0).sum()
    outside = (keep >= 0) & ~np.take_along_axis(mask, np.maximum(keep, 0), -1)
    assert outside.any() and (np.where(keep >= 0, keep, -1) < lens[:, None]).all()


@pytest.mark.parametrize("tie_order", TIE_ORDERS)
def test_candidate_pool_tie_order_matches_numpy(tie_order):
    # Block maxima on a 2-level grid: many blocks tie exactly; ragged lengths pin ragged blocks.
    scores, lens, _ = tied_scores(3, 10, 70, levels=1)
    for topk_blocks in (1, 3, 12):
        pool = select_jit(scores, lens, topk_blocks, 8, tie_order=tie_order)
        want = np_pool_blocks(scores, lens, topk_blocks, 8, tie_order)
        np.testing.assert_array_equal(pool.block_ids, want)
        np.testing.assert_array_equal(
            pool.mask, pool_mask_from_block_ids(jnp.asarray(want), 70, 8, lens)
        )
    other = "newest" if tie_order == "oldest" else "oldest"
    want = np_pool_blocks(scores, lens, 3, 8, tie_order)
    assert (np.asarray(select_jit(scores, lens, 3, 8, tie_order=other).block_ids) != want).any()


@pytest.mark.parametrize(("tie_order", "neginf_picks"), SWITCHES)
def test_pool_slots_topk_equals_full_topk(tie_order, neginf_picks):
    """The compact form (scores of the pool's slots, `pool_topk_from_scores`: what the chunked
    pass and the pooled-scoring kernel use) picks what the mask form picks over every position,
    including the out-of-pool positions 'keep' adds, for pools of real candidate blocks and for
    arbitrary ascending −1-padded block ids (the newest block not always among them); with
    and without the sort of the picks that `ascending_ids=True` skips."""
    scores, lens, _ = tied_scores(4, 14, 83)
    rng = np.random.default_rng(4)
    arbitrary = np.full((14, 5), -1)
    for b in range(14):
        n = rng.integers(0, 6)
        arbitrary[b, :n] = np.sort(rng.choice(11, n, replace=False))
    pooled = select_jit(scores, lens, 3, 8, tie_order=tie_order).block_ids
    for block_ids in (np.asarray(pooled), arbitrary):
        pos = np.asarray(pool_positions(block_ids, 8))
        slot_scores = np.where(
            (pos >= 0) & (pos < lens[:, None]),
            np.take_along_axis(scores, np.clip(pos, 0, 82), -1),
            -np.inf,
        )
        mask = np.asarray(pool_mask_from_block_ids(block_ids, 83, 8, lens))
        for k, ascending_ids in itertools.product((0, 5, 30), (False, True)):
            got = pool_topk_jit(
                slot_scores,
                block_ids,
                k=k,
                block_size=8,
                lengths=lens,
                tie_order=tie_order,
                neginf_picks=neginf_picks,
                ascending_ids=ascending_ids,
            )
            want = np_topk(scores, k, mask, tie_order, neginf_picks)
            np.testing.assert_array_equal(got.indices, want, err_msg=f"k={k}, {ascending_ids}")
    with pytest.raises(ValueError, match="lengths"):
        pool_topk_from_scores(slot_scores, block_ids, 5, neginf_picks="keep")


def test_bf16_scores_match_numpy_and_create_ties():
    q, w, k, lens = mxfp4_inputs(5, 3, 6, 40, 4)
    got = np.asarray(scores_jit(q, w, k, lens, score_dtype="bfloat16"))
    want = np_index_scores_bf16(q, w, k, lens)
    np.testing.assert_array_equal(got, want)
    f32 = np.asarray(scores_jit(q, w, k, lens))
    finite = np.isfinite(f32)
    # bf16 values, one to a few bf16 steps from the float32 scores.
    np.testing.assert_array_equal(got[finite], np_bf16(got[finite]))
    np.testing.assert_allclose(
        got[finite], f32[finite], rtol=2**-6, atol=2**-6 * np.abs(f32[finite]).max()
    )
    assert (got[finite] != f32[finite]).mean() > 0.5

    def ties(s):  # pairs of equal nonzero finite scores per row
        return sum(
            len(v) - len(set(v))
            for v in (r[np.isfinite(r) & (r != 0)].tolist() for r in s.reshape(-1, 40))
        )

    assert ties(got) > ties(f32)
    # Scores that collide in bf16 tie, and their tie order replaces the float32 order.
    changed = [
        (topk_jit(got, k=k).indices != topk_jit(f32, k=k).indices).any() for k in (3, 6, 10, 15, 22)
    ]
    assert any(changed)
    with pytest.raises(ValueError, match="score_dtype: expected one of"):
        index_scores(q, w, k, lens, score_dtype="float16")


def test_bad_switch_values_name_the_argument():
    scores, _, mask = tied_scores(0, 3, 9)
    with pytest.raises(ValueError, match=r"tie_order: expected one of \('oldest', 'newest'\)"):
        topk(scores, 2, tie_order="random")
    with pytest.raises(ValueError, match=r"neginf_picks: expected one of .*got 'keeps'"):
        topk(scores, 2, mask, neginf_picks="keeps")
    with pytest.raises(ValueError, match="tie_order"):
        select_candidate_blocks(scores, 9, 1, 8, tie_order="lowest")


# --- the config ---


@pytest.mark.parametrize(
    ("field", "value"),
    [("index_score_dtype", "float16"), ("tie_order", "lowest"), ("neginf_picks", True)],
)
def test_config_validates_switches(field, value):
    with pytest.raises(ValueError, match=rf"ModelConfig\.{field}: expected one of .*got {value!r}"):
        config_lib.tiny().replace(**{field: value})


def test_defaults_and_reference_numerics():
    defaults = {"index_score_dtype": "float32", "tie_order": "oldest", "neginf_picks": "drop"}
    for name, make in config_lib.PRESETS.items():
        cfg = make()
        assert {f: getattr(cfg, f) for f in defaults} == defaults, name
        ref = cfg.with_reference_numerics()
        assert (ref.index_score_dtype, ref.neginf_picks) == ("bfloat16", "keep")
        # The reference's tie order is implementation-defined: the helper leaves it alone.
        assert cfg.replace(tie_order="newest").with_reference_numerics().tie_order == "newest"
        assert ref.replace(index_score_dtype="float32", neginf_picks="drop") == cfg
    assert config_lib.v41_flash_reference() == config_lib.v41_flash().with_reference_numerics()


# --- the kernels ---


def test_kernel_supports_declare_the_switches():
    common = dict(fmt="mxfp4", dim=128, block_size=8, n_heads=32)
    assert pooled_supports("pallas", **common)
    refused = pooled_supports("pallas", score_dtype="bfloat16", **common)
    assert not refused and [lim.argument for lim in refused.limits] == ["score_dtype"]
    assert pooled_supports("xla", score_dtype="bfloat16", **common)
    kernels = config_lib.small_kernels()
    for cfg in (
        kernels.replace(tie_order="newest", neginf_picks="keep"),
        kernels.replace(tie_order="newest", neginf_picks="keep").replace(query_chunk=4),
    ):
        dispatch.check_kernel_config(cfg, "pallas")
    with pytest.raises(
        ValueError, match=r"config\.index_score_dtype: expected 'float32', got 'bfloat16'"
    ):
        dispatch.check_kernel_config(kernels.with_reference_numerics(), "pallas")
    dispatch.check_kernel_config(kernels.with_reference_numerics(), "xla")


def test_pooled_kernel_honours_tie_order_and_neginf_picks(tie_order="newest", neginf_picks="keep"):
    """The kernel (interpreted) with the top-k switches against the full scan with the same
    switches. Most keys are zero, so most scores are exact zeros in both and ties decide."""
    rng = np.random.default_rng(6)
    batch, n_pos, n_blocks, k = 4, 75, 4, 20
    keys = rng.normal(size=(batch, n_pos, 128)).astype(np.float32)
    keys *= rng.random((batch, n_pos, 1)) < 0.2
    k_packed = formats.pack(keys, "mxfp4")
    q = formats.mxfp4_fake_quant(rng.normal(size=(batch, 2, 128)).astype(np.float32))
    weights = rng.random((batch, 2)).astype(np.float32)
    lengths = np.array([n_pos, 0, 50, 9], np.int32)
    ids = np.full((batch, n_blocks), -1, np.int32)
    ids[0], ids[2, :2], ids[3, :1] = [0, 3, 5, 9], [2, 6], [1]
    switches = dict(tie_order=tie_order, neginf_picks=neginf_picks)
    got = jax.jit(
        functools.partial(
            pooled_scores,
            implementation="pallas_interpret",
            topk=k,
            config=TuningConfig(4, 2),
            **switches,
        )
    )(k_packed, q, weights, ids, lengths)
    want = full_scan_topk(k_packed, q, weights, ids, lengths, k, **switches)
    np.testing.assert_array_equal(got.indices, want.indices)
    outside = (np.asarray(want.indices) >= 0) & np.isneginf(np.asarray(want.scores))
    assert outside.any()
    # With bf16 scores ('xla' only) the pooled definition still picks what the full scan picks.
    bf16 = dict(score_dtype="bfloat16", **switches)
    np.testing.assert_array_equal(
        pooled_topk(k_packed, q, weights, ids, lengths, k, **bf16).indices,
        full_scan_topk(k_packed, q, weights, ids, lengths, k, **bf16).indices,
    )
    with pytest.raises(ValueError, match="score_dtype: expected 'float32'"):
        pooled_scores(
            k_packed,
            q,
            weights,
            ids,
            lengths,
            implementation="pallas_interpret",
            score_dtype="bfloat16",
        )


# --- the model: prefill = decode, chunked = whole, with each switch ---


def _model_config(**switches):
    """`four_layer_f32` with a pool of one block of 4, fewer than index_topk = 6 (so 'keep'
    bites): nothing rounds but the switches."""
    return four_layer_f32(candidate_topk_blocks=1, **switches)


MODEL_SWITCHES = [
    pytest.param({"index_score_dtype": "bfloat16"}, id="bf16"),
    pytest.param({"neginf_picks": "keep"}, id="keep"),
    pytest.param({"tie_order": "newest", "reference": True}, id="reference-newest"),
]


def _switched(switches):
    switches = dict(switches)
    cfg = _model_config(**{k: v for k, v in switches.items() if k != "reference"})
    return cfg.with_reference_numerics() if switches.get("reference") else cfg


def _assert_same_picks(got, want, scores, tol):
    """Selections agree, except between picks whose scores tie within `tol` of the row's scale
    (float32 last bits, or a bf16 rounding boundary, may order those either way); at most a
    few such rows. Returns the [batch] mask of sequences with such a row."""
    got, want = np.asarray(got), np.asarray(want)
    rows = np.argwhere((got != want).any(-1))
    for row in rows:
        swapped = sorted(set(got[tuple(row)].tolist()) ^ set(want[tuple(row)].tolist()))
        r = scores[tuple(row)]
        values = r[[p for p in swapped if p >= 0]]
        values = values[np.isfinite(values)]
        scale = np.abs(r[np.isfinite(r)]).max(initial=1.0)
        # Exact ties (ReLU zeros above all) resolve by the tie order, the same in every path.
        assert values.size and (values != 0).any(), (row, swapped, values)
        assert np.ptp(values) <= tol * scale, (row, swapped, values)
    assert len(rows) <= max(2, got[..., 0].size // 50), len(rows)
    tied = np.zeros(got.shape[0], bool)
    tied[rows[:, 0]] = True
    return tied


@pytest.mark.parametrize("switches", MODEL_SWITCHES)
def test_model_prefill_decode_and_chunks_agree(switches):
    cfg = _switched(switches)
    m = model.Model(cfg, rngs=nnx.Rngs(0))
    batch, seq, prefix = 2, 23, np.array([15, 9])
    tokens = jax.random.randint(jax.random.key(1), (batch, seq), 0, cfg.vocab_size, jnp.int32)
    logits, trace = m.run(tokens, diagnostics=True)
    tol = 2**-6 if cfg.index_score_dtype == "bfloat16" else 1e-5
    _, cache, _ = model.prefill(m, tokens, jnp.asarray(prefix), max_len=seq + 1)
    steps = seq - int(prefix.max())
    rows = np.arange(batch)[:, None]
    cols = prefix[:, None] + np.arange(steps)
    decoded, picks = [], {}
    for j in range(steps):
        out, cache, sel = model.decode_step(m, tokens[rows[:, 0], cols[:, j]], cache)
        decoded.append(np.asarray(out))
        for layer, idx in sel.topk.items():
            picks.setdefault(layer, []).append(np.asarray(idx[:, 0]))
    tied = np.zeros(batch, bool)
    for layer, idx in picks.items():
        scores = np.asarray(trace[layer].aux["scores"])[rows, cols]
        want = np.asarray(trace[layer].shared.topk)[rows, cols]
        tied |= _assert_same_picks(np.stack(idx, 1), want, scores, tol)
    # The last decoded token's logits, in sequences where no near-tie went the other way.
    assert not tied.all()
    np.testing.assert_allclose(
        decoded[-1][~tied], np.asarray(logits)[rows[:, 0], cols[:, -1]][~tied], atol=1e-4, rtol=0
    )
    # The chunked pass (`query_chunk`) selects what the whole pass selects.
    chunked = model.Model(cfg.replace(query_chunk=5), rngs=nnx.Rngs(0))
    _, chunk_trace = chunked.run(tokens)
    for layer in picks:
        _assert_same_picks(
            chunk_trace[layer].shared.topk,
            trace[layer].shared.topk,
            np.asarray(trace[layer].aux["scores"]),
            tol,
        )
    if cfg.neginf_picks == "keep":
        pool = np.asarray(trace[1].shared.pool.mask)
        reindex = np.asarray(trace[2].shared.topk)
        outside = (reindex >= 0) & ~np.take_along_axis(pool, np.maximum(reindex, 0), -1)
        assert outside.any()  # the switch reaches the Reindex layer
        lens = np.arange(1, seq + 1)
        assert (np.where(reindex >= 0, reindex, -1) < lens[None, :, None]).all()
        # Debug mode's invariant accepts these picks under 'keep' and flags them under 'drop'.
        lens = jnp.broadcast_to(jnp.asarray(lens), (batch, seq))
        for rule, ok in (("keep", True), ("drop", False)):
            error, _ = checkify.checkify(check_selection)(
                2,
                trace[2].shared.topk,
                lens,
                trace[1].shared.pool,
                block_size=cfg.candidate_block_size,
                restricted=True,
                publishes_pool=False,
                neginf_picks=rule,
            )
            assert (error.get() is None) == ok, (rule, error.get())


def test_model_switches_change_selections():
    """Each switch reaches the model's selections (else the test above could pass vacuously)."""
    tokens = jax.random.randint(jax.random.key(2), (2, 23), 0, 256, jnp.int32)

    def topks(cfg):
        _, trace = model.Model(cfg, rngs=nnx.Rngs(0)).run(tokens)
        return np.concatenate([np.asarray(trace[i].shared.topk) for i in (0, 1, 2)], -1)

    base = topks(_model_config())
    for switches in MODEL_SWITCHES:
        assert (topks(_switched(switches.values[0])) != base).any(), switches.id
