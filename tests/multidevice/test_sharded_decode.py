"""Sequence-sharded decode (issue 15): the pooled top-k equals `pooled_topk` bit for bit, and the
sparse attention equals `packed_sparse_attention` to float tolerance, on caches sharded by
position over a mesh axis.

Runs on 8 devices: `tests/test_multidevice.py` starts it with JAX_NUM_CPU_DEVICES=8.
"""

import functools
import itertools

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from v41jax.ops import formats
from v41jax.ops.attention import packed_sparse_attention, sharded_packed_sparse_attention
from v41jax.ops.pool import pooled_scores, pooled_topk, sharded_pooled_topk
from v41jax.ops.scoring import NEGINF_PICKS, SCORE_DTYPES, TIE_ORDERS

if jax.device_count() < 8:
    pytest.skip(
        "needs 8 devices (tests/test_multidevice.py provides them)", allow_module_level=True
    )

MESHES = {  # name: (mesh shape, axis names, positions axis, rows axis); rows × positions
    "8": ((8,), ("context",), "context", None),
    "1x8": ((1, 8), ("data", "context"), "context", "data"),
    "2x4": ((2, 4), ("data", "context"), "context", "data"),
    "4x2": ((4, 2), ("data", "context"), "context", "data"),
}
BATCH, HEADS, N_POS, BLOCK = 8, 2, 64, 4

# The sharded attention differs from the unsharded one only in the order of float operations:
# each device sums its own keys, then the devices' sums are rescaled by e^{m_d − M} and added,
# where the unsharded op sums every key in one pass (and e^{s − m_d}·e^{m_d − M} rounds twice
# where e^{s − M} rounds once). The output is a weighted mean of value rows with weights summing
# to at most 1, so the difference is a few float32 ulps of the largest value: measured ≤ 2 ulps
# (3.8e-6 at values up to ~30); allowed 2^-20 (8 ulps at 2^-23 relative) of max |v|.
ATOL_OF_MAX_VALUE = 2.0**-20

POOL_STATIC = ("k", "mesh", "axis", "batch_axis", "block_size", "fmt", "score_dtype")
POOL_STATIC += ("tie_order", "neginf_picks")
sharded_topk = jax.jit(sharded_pooled_topk, static_argnames=POOL_STATIC)
reference_topk = jax.jit(pooled_topk, static_argnames=POOL_STATIC[:1] + POOL_STATIC[4:])
reference_scores = jax.jit(pooled_scores, static_argnames=("block_size", "fmt", "score_dtype"))
ATT_STATIC = ("mesh", "axis", "batch_axis", "kv_fmt", "window_fmt", "scale")
sharded_attention = jax.jit(sharded_packed_sparse_attention, static_argnames=ATT_STATIC)
reference_attention = jax.jit(packed_sparse_attention, static_argnames=ATT_STATIC[3:])


def _mesh(name):
    shape, names, axis, rows = MESHES[name]
    return Mesh(np.array(jax.devices()[:8]).reshape(shape), names), axis, rows


def _pool_inputs(rng, n_blocks=6, dim=32):
    """Small-integer keys, queries and head weights (scores tie often, ReLU zeros of both signs),
    a NaN key row, ±inf head weights (+inf, −inf and NaN scores); ragged lengths (0, S, > S);
    pools with −1 padding, ids past the cache end, an empty pool, an unsorted one and a repeated
    block."""
    keys = rng.integers(-2, 3, size=(BATCH, N_POS, dim)).astype(np.float32)
    k_packed = np.array(formats.pack(keys, "mxfp4"))
    nan_rows = rng.random((BATCH, N_POS)) < 0.05
    k_packed[nan_rows, dim // 2] = 0xFF  # E8M0 scale NaN: the whole group unpacks to NaN
    q = rng.integers(-1, 2, size=(BATCH, HEADS, dim)).astype(np.float32)
    weights = rng.choice([0.5, 1.0, -1.0], size=(BATCH, HEADS)).astype(np.float32)
    weights[1, 0], weights[2, 1] = np.inf, -np.inf
    n_cache = N_POS // BLOCK
    ids = np.full((BATCH, n_blocks), -1, np.int32)
    for b in range(BATCH):
        count = rng.integers(1, n_blocks + 1)
        ids[b, :count] = np.sort(rng.choice(n_cache + 2, size=count, replace=False))
    ids[1] = np.arange(n_blocks)
    ids[3] = -1
    ids[4, :3] = [9, 2, 5]
    ids[5, :2] = [7, 7]
    lengths = rng.integers(1, N_POS + 1, size=BATCH).astype(np.int32)
    lengths[0], lengths[6], lengths[7] = 0, N_POS, N_POS + 5
    return k_packed, q, weights, ids, lengths


def _half_of_the_options(parity: int):
    """Half of the 2 × 2 × 2 option combinations ((k, score dtype), tie order, −inf picks):
    those whose level indices sum to `parity` mod 2. Each half meets both levels of every
    option, and every pair of levels of two options once; the two halves make the whole."""
    combos = itertools.product(zip((5, 40), SCORE_DTYPES, strict=True), TIE_ORDERS, NEGINF_PICKS)
    levels = itertools.product(range(2), repeat=3)
    return [c for c, i in zip(combos, levels, strict=True) if sum(i) % 2 == parity]


# Each mesh runs half of the combinations (each is a compilation of both programs), the meshes
# alternating halves: every combination still runs on two meshes, at least one with data rows.
@pytest.mark.parametrize("mesh_name", sorted(MESHES))
def test_sharded_pooled_topk_is_pooled_topk_bit_for_bit(mesh_name):
    mesh, axis, rows = _mesh(mesh_name)
    rng = np.random.default_rng(list(MESHES).index(mesh_name))
    seen = []
    for (k, score_dtype), tie_order, neginf_picks in _half_of_the_options(
        sorted(MESHES).index(mesh_name) % 2
    ):
        args = _pool_inputs(rng)
        options = dict(
            block_size=BLOCK,
            score_dtype=score_dtype,
            tie_order=tie_order,
            neginf_picks=neginf_picks,
        )
        want = reference_topk(*args, k, **options)
        got = sharded_topk(*args, k, mesh=mesh, axis=axis, batch_axis=rows, **options)
        case = f"{k=} {score_dtype=} {tie_order=} {neginf_picks=}"
        np.testing.assert_array_equal(got.indices, want.indices, err_msg=case)
        np.testing.assert_array_equal(got.scores, want.scores, err_msg=case)
        scores = np.asarray(reference_scores(*args[:5], block_size=BLOCK))
        seen += [np.isnan(scores).any(), np.isposinf(scores).any(), np.isneginf(want.scores).any()]
    # The cases exercise what they claim: NaN and +inf scores, dropped picks.
    assert np.asarray(seen).reshape(-1, 3).any(axis=0).all()


def test_sharded_pooled_topk_without_picks_or_slots():
    """k = 0, an empty pool ([B, 0] block ids), k beyond the pool (padding, 'keep' filling
    from outside the pool), an empty cache (S = 0) and an empty batch."""
    mesh, axis, rows = _mesh("2x4")
    k_packed, q, weights, ids, lengths = _pool_inputs(np.random.default_rng(3))
    cases = ((0, 6, N_POS, BATCH), (5, 0, N_POS, BATCH), (70, 6, N_POS, BATCH))
    cases += ((5, 6, 0, BATCH), (5, 6, N_POS, 0))
    for (k, n_blocks, n_pos, batch), neginf_picks in itertools.product(cases, NEGINF_PICKS):
        args = (k_packed[:batch, :n_pos], q[:batch], weights[:batch], ids[:batch, :n_blocks])
        args += (lengths[:batch], k)
        options = dict(block_size=BLOCK, neginf_picks=neginf_picks)
        want = reference_topk(*args, **options)
        got = sharded_topk(*args, mesh=mesh, axis=axis, batch_axis=rows, **options)
        np.testing.assert_array_equal(got.indices, want.indices)
        np.testing.assert_array_equal(got.scores, want.scores)


def _wrong_merge(scores, k, n_dev, tie_order):
    """A deliberately wrong merge: each device's top k by (score, slot in `tie_order`), then the
    first k of their concatenation by score alone, ties going to the lower device."""
    n_slot = scores.shape[-1]
    owner = np.repeat(np.arange(n_dev), n_slot // n_dev)  # every slot of this pool lies in order
    picks = []
    for d in range(n_dev):
        slots = np.flatnonzero(owner == d)
        order = slots if tie_order == "oldest" else slots[::-1]
        picks += sorted(order, key=lambda s: -scores[s])[:k]
    return sorted(sorted(picks, key=lambda s: -scores[s])[:k])


def test_a_wrong_tie_merge_would_be_caught():
    """Every visible slot scores 0 (q = 0): the picks are decided by the tie rule alone. A merge
    that breaks ties by device order instead of the global slot gets 'newest' wrong; the
    sharded op gets it right."""
    mesh, axis, rows = _mesh("2x4")
    k_packed, _, _, _, _ = _pool_inputs(np.random.default_rng(7))
    weights = np.ones((BATCH, HEADS), np.float32)
    q = np.zeros((BATCH, HEADS, 32), np.float32)
    ids = np.tile(np.arange(N_POS // BLOCK, dtype=np.int32), (BATCH, 1))  # the whole cache
    lengths = np.full(BATCH, N_POS, np.int32)
    k_packed[..., 32 // 2] = 0x7F  # a finite scale everywhere: no NaN rows here
    for tie_order in TIE_ORDERS:
        options = dict(block_size=BLOCK, tie_order=tie_order)
        want = reference_topk(k_packed, q, weights, ids, lengths, 5, **options)
        got = sharded_topk(
            k_packed, q, weights, ids, lengths, 5, mesh=mesh, axis=axis, batch_axis=rows, **options
        )
        np.testing.assert_array_equal(got.indices, want.indices)
        scores = np.asarray(reference_scores(k_packed, q, weights, ids, lengths, block_size=BLOCK))
        assert (scores == 0).all()
        wrong = _wrong_merge(scores[0], 5, mesh.shape[axis], tie_order)
        assert (list(np.asarray(want.indices[0])) == wrong) == (tie_order == "oldest")


def _attention_inputs(rng, n_window, dim=32, n_topk=12):
    """Packed NVFP4 cache rows with per-group scales and NaN rows (a NaN E4M3 scale), selected
    by query 3 only; FP8 window rows with a NaN row in an invalid slot; indices with −1, ≥ S and
    duplicates; an empty row (no index, no valid window slot) and one whose window is invalid."""
    kv = rng.normal(size=(BATCH, N_POS, dim)) * np.exp2(rng.integers(-2, 3, (BATCH, N_POS, 1)))
    kv_packed = np.array(formats.pack(kv.astype(np.float32), "nvfp4"))
    kv_packed[:, 5, dim // 2] = 0x7F
    q = rng.normal(size=(BATCH, HEADS, dim)).astype(np.float32)
    indices = rng.integers(-1, N_POS + 3, size=(BATCH, n_topk)).astype(np.int32)
    indices[indices == 5] = 6
    indices[3, 0] = 5
    indices[1, :3] = indices[1, 3]
    indices[2] = -1
    window = rng.normal(size=(BATCH, n_window, dim)).astype(np.float32)
    window_packed = np.array(formats.pack(window, "fp8"))
    window_valid = rng.random((BATCH, n_window)) < 0.7
    window_valid[2] = window_valid[4] = False
    if n_window:
        window_packed[0, 0, 0] = 0x7F  # an E4M3 NaN in a slot nobody reads
        window_valid[0, 0] = False
    return q, kv_packed, indices, window_packed, window_valid


@pytest.mark.parametrize("mesh_name", sorted(MESHES))
def test_sharded_attention_is_packed_sparse_attention(mesh_name):
    mesh, axis, rows = _mesh(mesh_name)
    rng = np.random.default_rng(10 + list(MESHES).index(mesh_name))
    sinks = {
        "finite": rng.normal(size=HEADS).astype(np.float32),
        "one -inf": np.array([-np.inf, 0.5], np.float32),
        "all -inf": np.full(HEADS, -np.inf, np.float32),
    }
    for n_window, sink_name, scale in itertools.product((4, 0), sinks, (None, 8.0)):
        q, kv_packed, indices, window_packed, window_valid = _attention_inputs(rng, n_window)
        args = (q, kv_packed, indices, window_packed, window_valid, sinks[sink_name])
        want = np.asarray(reference_attention(*args, scale=scale))
        got = np.asarray(
            sharded_attention(*args, mesh=mesh, axis=axis, batch_axis=rows, scale=scale)
        )
        case = f"{n_window=} {sink_name=} {scale=}"
        nan = np.isnan(want)
        np.testing.assert_array_equal(np.isnan(got), nan, err_msg=case)
        assert nan[3].all() and not nan[np.arange(BATCH) != 3].any(), case
        values = [formats.unpack(kv_packed, "nvfp4", 32), formats.unpack(window_packed, "fp8", 32)]
        atol = ATOL_OF_MAX_VALUE * max(np.nanmax(np.abs(v), initial=0.0) for v in values)
        np.testing.assert_allclose(got[~nan], want[~nan], rtol=0, atol=atol, err_msg=case)
        np.testing.assert_array_equal(got[2], 0.0, err_msg=case)  # nothing to attend to


def test_sharded_attention_of_an_empty_cache_or_batch():
    mesh, axis, rows = _mesh("2x4")
    args = list(_attention_inputs(np.random.default_rng(4), 4))
    args.append(np.array([-np.inf, 0.5], np.float32))
    for n_pos, batch in ((0, BATCH), (N_POS, 0)):
        case = [x[:batch] for x in args[:5]] + args[5:]
        case[1] = case[1][:, :n_pos]
        want = np.asarray(reference_attention(*case))
        got = np.asarray(sharded_attention(*case, mesh=mesh, axis=axis, batch_axis=rows))
        np.testing.assert_array_equal(got, want)


def test_sharded_decode_names_what_does_not_fit():
    mesh, axis, rows = _mesh("2x4")
    k_packed, q, weights, ids, lengths = _pool_inputs(np.random.default_rng(0))
    topk = functools.partial(sharded_pooled_topk, k=5, block_size=BLOCK, mesh=mesh)
    with pytest.raises(ValueError, match=r"k_packed: expected S to split .* 32\), got 24"):
        topk(k_packed[:, :24], q, weights, ids, lengths, block_size=2 * BLOCK, axis=axis)
    with pytest.raises(ValueError, match=r"axis: expected one of the mesh axes"):
        topk(k_packed, q, weights, ids, lengths, axis="sequence")
    with pytest.raises(ValueError, match=r"batch_axis: expected one of the mesh axes"):
        topk(k_packed, q, weights, ids, lengths, axis=axis, batch_axis="rows")
    with pytest.raises(ValueError, match=r"k_packed: expected B divisible by the 2 devices"):
        topk(*(x[:3] for x in (k_packed, q, weights, ids, lengths)), axis=axis, batch_axis=rows)
    with pytest.raises(ValueError, match=r"weights: expected shape \(8, 2\)"):
        topk(k_packed, q, weights[:, :1], ids, lengths, axis=axis)

    attention = functools.partial(sharded_packed_sparse_attention, mesh=mesh)
    q, kv_packed, indices, window_packed, window_valid = _attention_inputs(
        np.random.default_rng(0), 4
    )
    args = [q, kv_packed, indices, window_packed, window_valid, np.zeros(HEADS, np.float32)]
    with pytest.raises(ValueError, match=r"kv_packed: expected S to split .* 4\), got 62"):
        attention(q, kv_packed[:, :62], *args[2:], axis=axis)
    with pytest.raises(ValueError, match=r"axis: expected one of the mesh axes"):
        attention(*args, axis="sequence")
    with pytest.raises(ValueError, match=r"kv_packed: expected B divisible by the 2 devices"):
        attention(*(x[:3] for x in args[:5]), args[5], axis=axis, batch_axis=rows)
    with pytest.raises(ValueError, match=r"sink: expected shape \(2,\)"):
        attention(*args[:5], np.zeros(3, np.float32), axis=axis)


@pytest.mark.parametrize(("mesh_name", "formats_"), [("8", "f32"), ("2x4", "packed")])
def test_a_model_decodes_from_a_sequence_sharded_cache_as_from_one_device(mesh_name, formats_):
    """`model.decode_step` on a cache sharded by position (`sharding.shard_cache`, under
    `jax.set_mesh`): every layer's picks and the pool as on one device, bit for bit, and the
    logits to float tolerance (the attention's partial softmaxes combine in another order)."""
    from flax import nnx

    from tests._models import four_layer_f32
    from v41jax.nn import model
    from v41jax.nn.sharding import shard_cache

    changes = {} if formats_ == "f32" else dict(kv_format="nvfp4", index_format="mxfp4")
    cfg = four_layer_f32(**changes)
    m = model.Model(cfg, rngs=nnx.Rngs(0))
    mesh, _, _ = _mesh(mesh_name)
    rng = np.random.default_rng(7)
    # 64 positions: the ratio-2 layer's 32 entries split over 8 devices, one block of 4 each.
    tokens = rng.integers(0, cfg.vocab_size, size=(BATCH, 64)).astype(np.int32)
    lengths = rng.integers(1, 56, size=BATCH).astype(np.int32)
    lengths[0], lengths[1] = 1, 55  # a sequence of one token and a nearly full one
    _, cache, _ = model.prefill(m, tokens, lengths, max_len=64)
    sharded = shard_cache(cache, mesh)
    assert sharded.layers[1].main_kv.sharding.spec[1] == "context"
    for step in range(3):
        token = rng.integers(0, cfg.vocab_size, size=BATCH).astype(np.int32)
        want_logits, cache, want = model.decode_step(m, token, cache)
        with jax.set_mesh(mesh):
            got_logits, sharded, got = model.decode_step(m, token, sharded)
        for layer in want.topk:
            np.testing.assert_array_equal(got.topk[layer], want.topk[layer], err_msg=f"{step=}")
        np.testing.assert_array_equal(got.pool_blocks, want.pool_blocks, err_msg=f"{step=}")
        scale = float(np.abs(want_logits).max())
        np.testing.assert_allclose(got_logits, want_logits, rtol=1e-5, atol=1e-5 * scale)
    np.testing.assert_array_equal(sharded.lengths, cache.lengths)


def test_a_sequence_sharded_cache_refuses_the_kernels():
    from flax import nnx

    from tests._models import four_layer_f32
    from v41jax.nn import model
    from v41jax.nn.cache import init_cache
    from v41jax.nn.sharding import shard_cache

    cfg = four_layer_f32()
    m = model.Model(cfg, rngs=nnx.Rngs(0))
    mesh, _, _ = _mesh("8")
    cache = shard_cache(init_cache(cfg, BATCH, 64), mesh)
    with jax.set_mesh(mesh), pytest.raises(ValueError, match=r"implementation: expected 'xla'"):
        model.decode_step(m, np.zeros(BATCH, np.int32), cache, implementation="pallas_interpret")
