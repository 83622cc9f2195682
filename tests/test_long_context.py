"""Long sequences in memory linear in T (`ModelConfig.query_chunk`): the chunked pass equals the
whole-sequence mask path, values and gradients, and holds no [T, S] array."""

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from tests._models import four_layer_f32
from v41jax.nn import config as config_lib
from v41jax.nn.model import Model, indexer_kls
from v41jax.ops.attention import chunk_attention, masked_attention, sliding_window_rows
from v41jax.ops.scoring import gather_rows, index_scores, index_scores_at, indices_to_mask
from v41jax.train.trainer import loss_fn


def _config(**changes):
    """`four_layer_f32`: the pool (2 blocks of 4) bites from 8 positions on. Float32 storage:
    the fake-quant is per-sequence work that both paths share, and a value on a rounding
    boundary would turn a 1e-7 difference of summation order into a whole step."""
    return four_layer_f32(**changes)


def _batch(seed, batch, seq, vocab):
    """Random tokens, ragged: row b is valid up to its length (the rest is padding, id 0)."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(seq // 3, seq + 1, batch)
    lengths[0] = seq
    valid = np.arange(seq)[None] < lengths[:, None]
    tokens = np.where(valid, rng.integers(1, vocab, (batch, seq)), 0)
    targets = rng.integers(0, vocab, (batch, seq))
    return jnp.asarray(tokens, jnp.int32), jnp.asarray(targets, jnp.int32), jnp.asarray(valid)


def _loss_and_grads(config, tokens, targets, mask, dense):
    model = Model(config, rngs=nnx.Rngs(3))
    graphdef, state = nnx.split(model)

    def loss(state):  # the trainer's loss (`trainer.loss_fn`), keeping the trace
        logits, trace = nnx.merge(graphdef, state).run(tokens, dense=dense, indexer_loss=True)
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
        kl = jnp.mean(jnp.stack(indexer_kls(trace)))
        picks = {i: t.shared.topk for i, t in enumerate(trace) if t.shared.topk is not None}
        pool = trace[config.candidate_source_layer].shared.pool.block_ids
        return jnp.sum(ce * mask) / jnp.sum(mask) + kl, (kl, logits, picks, pool)

    return jax.jit(jax.value_and_grad(loss, has_aux=True))(state)


@pytest.mark.parametrize("dense", [False, True], ids=["sparse", "dense"])
def test_chunked_model_equals_whole_sequence(dense):
    """Training loss, indexer KL, logits, every layer's picks, the pool and every gradient of a
    ragged, padded batch: chunks of 16 over 56 tokens (a partial last chunk) against the mask
    path."""
    base = _config()
    tokens, targets, mask = _batch(int(dense), 3, 56, base.vocab_size)
    (loss0, aux0), grads0 = _loss_and_grads(base, tokens, targets, mask, dense)
    (loss1, aux1), grads1 = _loss_and_grads(
        base.replace(query_chunk=16), tokens, targets, mask, dense
    )
    (kl0, logits0, picks0, pool0), (kl1, logits1, picks1, pool1) = aux0, aux1
    assert kl0 > 0
    np.testing.assert_allclose(loss1, loss0, rtol=1e-5)
    np.testing.assert_allclose(kl1, kl0, rtol=1e-5)
    scale = float(jnp.max(jnp.abs(logits0)))
    np.testing.assert_allclose(logits1, logits0, rtol=0, atol=1e-5 * scale)
    assert picks0.keys() == picks1.keys() == {0, 1, 2, 3}  # 3: Reuse, 2's picks
    for layer in picks0:
        np.testing.assert_array_equal(picks1[layer], picks0[layer], err_msg=f"layer {layer}")
    np.testing.assert_array_equal(pool1, pool0)
    # The pool must bite: some query's pool is smaller than what it sees.
    assert int(jnp.sum(pool0 >= 0, axis=-1).min()) < int(jnp.sum(pool0 >= 0, axis=-1).max())
    flat0, flat1 = jax.tree.leaves(grads0), jax.tree.leaves(grads1)
    assert len(flat0) == len(flat1)
    for g0, g1 in zip(flat0, flat1, strict=True):
        scale = float(jnp.max(jnp.abs(g0)))
        np.testing.assert_allclose(g1, g0, rtol=0, atol=1e-4 * scale + 1e-12)
    indexer_grads = [
        g for path, g in nnx.to_flat_state(grads0) if "indexer" in path and "wq_b" in path
    ]
    assert indexer_grads and all(float(jnp.max(jnp.abs(g.get_value()))) > 0 for g in indexer_grads)


def test_chunked_pass_holds_no_sequence_by_position_array():
    """Traced through the loss and its gradient, no array of the chunked pass has both a query
    axis of T and a compressed axis of S (here T = S = 96 or S = 48): the [T, S] masks, scores
    and probabilities of the whole-sequence path are gone. The whole-sequence path has them."""
    seq = 96
    config = _config(query_chunk=16)
    tokens, targets, mask = _batch(0, 1, seq, config.vocab_size)

    def shapes(cfg):
        model = Model(cfg, rngs=nnx.Rngs(0))
        graphdef, state = nnx.split(model)

        def loss(state):
            m = nnx.merge(graphdef, state)
            return loss_fn(m, tokens, targets, mask, dense=False, indexer_kl_weight=1.0)[0]

        found = set()

        def walk(jaxpr):
            for eqn in jaxpr.eqns:
                for var in eqn.outvars:
                    found.add(tuple(getattr(var.aval, "shape", ())))
                for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                    walk(sub)

        walk(jax.make_jaxpr(jax.grad(loss))(state).jaxpr)
        return found

    def quadratic(shape):
        return any(
            shape[i] == seq and shape[j] in (seq, seq // 2)
            for i in range(len(shape))
            for j in range(i + 1, len(shape))
        )

    assert any(quadratic(s) for s in shapes(config.replace(query_chunk=0)))
    assert not [s for s in shapes(config) if quadratic(s)]


def _random_attention_case(seed, seq=20, n_kv=12, heads=2, dim=8, window=4, k=5):
    rng = np.random.default_rng(seed)
    f32 = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)
    q, window_kv, kv, sink = (
        f32(2, seq, heads, dim),
        f32(2, seq, dim),
        f32(2, n_kv, dim),
        f32(heads),
    )
    lens = np.minimum((np.arange(seq) + 1) // 2, n_kv)
    picks = np.full((2, seq, k), -1)
    for b in range(2):
        for t in range(seq):
            chosen = np.sort(rng.permutation(lens[t])[: rng.integers(0, k + 1)])
            picks[b, t, : len(chosen)] = chosen
    # Non-finite keys: kv row 3 NaN (seen by the queries that pick it), window row 9 inf.
    kv = kv.at[0, 3].set(jnp.nan)
    window_kv = window_kv.at[1, 9, 2].set(jnp.inf)
    return q, window_kv, kv, sink, jnp.asarray(picks, jnp.int32), jnp.asarray(lens)


@pytest.mark.parametrize("form", ["indices", "key_mask"])
def test_chunk_attention_equals_masked_attention(form):
    """A chunk of queries (positions 6..13 of 20) attending through gathered rows or a mask
    gives the whole sequence's rows: outputs, probabilities and lse, NaN rows included."""
    q, window_kv, kv, sink, picks, lens = _random_attention_case(7)
    window = 4
    visible = jnp.arange(kv.shape[1]) < lens[:, None]
    key_mask = indices_to_mask(picks, kv.shape[1]) if form == "indices" else visible[None]
    key_mask = jnp.broadcast_to(key_mask, (2, *key_mask.shape[-2:]))
    whole = masked_attention(q, window_kv, kv, key_mask, sink, window_size=window)
    chunk = slice(6, 14)
    rows, valid = sliding_window_rows(window_kv, window, jnp.arange(20)[chunk])
    keys = {"indices": picks[:, chunk]} if form == "indices" else {"key_mask": key_mask[:, chunk]}
    part = chunk_attention(q[:, chunk], rows, valid, kv, sink, **keys)
    poisoned = np.isnan(np.asarray(whole.out[:, chunk])).any(axis=(-1, -2))
    assert poisoned.any() and not poisoned.all()
    np.testing.assert_allclose(part.out, whole.out[:, chunk], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(part.lse, whole.lse[:, chunk], rtol=1e-5, atol=1e-6)
    probs = whole.probs[:, chunk]
    if form == "indices":  # the mask form's probabilities, read at the picks
        safe = jnp.maximum(picks[:, chunk], 0)[:, :, None, :]
        probs = jnp.take_along_axis(probs, jnp.broadcast_to(safe, (*probs.shape[:3], 5)), -1)
        probs = jnp.where(picks[:, chunk, None, :] >= 0, probs, 0.0)
        probs = jnp.where(jnp.asarray(poisoned)[..., None, None], jnp.nan, probs)
    np.testing.assert_allclose(part.probs, probs, rtol=1e-5, atol=1e-6)


def test_chunk_attention_wants_one_key_form():
    q, window_kv, kv, sink, _, _ = _random_attention_case(1)
    rows, valid = sliding_window_rows(window_kv, 4)
    with pytest.raises(ValueError, match="exactly one of indices and key_mask"):
        chunk_attention(q, rows, valid, kv, sink)


def test_index_scores_at_reads_the_scan_at_its_positions():
    rng = np.random.default_rng(5)
    q = jnp.asarray(rng.normal(size=(2, 7, 3, 8)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(2, 7, 3)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(2, 11, 8)), jnp.float32)
    lens = jnp.asarray(rng.integers(0, 12, (2, 7)))
    positions = jnp.asarray(rng.integers(-1, 11, (2, 7, 5)), jnp.int32)
    full = index_scores(q, w, k, lens)
    at = index_scores_at(q, w, gather_rows(k, positions), positions, lens)
    want = jnp.take_along_axis(full, jnp.maximum(positions, 0), axis=-1)
    want = jnp.where(positions >= 0, want, -jnp.inf)
    np.testing.assert_allclose(at, want, rtol=1e-5, atol=1e-6)
    assert bool(jnp.any(jnp.isneginf(at))) and bool(jnp.any(jnp.isfinite(at)))


def test_query_chunk_is_validated():
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match=r"ModelConfig.query_chunk: expected an int >= 0"):
            config_lib.tiny().replace(query_chunk=bad)
