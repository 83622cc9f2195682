"""Debug-mode value invariants: they pass on real runs and catch each kind of corruption."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.experimental import checkify

from v41jax.nn import config, model
from v41jax.ops.checks import check_finite
from v41jax.ops.invariants import check_selection
from v41jax.ops.pool import select_candidate_blocks
from v41jax.ops.scoring import topk_indices

BLOCK = 4


def _case(seed=0, rows=6, n_pos=40, k=6, topk_blocks=3):
    rng = np.random.default_rng(seed)
    lens = jnp.asarray(rng.integers(0, n_pos + 1, rows))
    scores = jnp.asarray(rng.standard_normal((rows, n_pos)), jnp.float32)
    scores = jnp.where(jnp.arange(n_pos) < lens[:, None], scores, -jnp.inf)
    pool = select_candidate_blocks(scores, lens, topk_blocks, BLOCK)
    return topk_indices(scores, k, pool.mask), lens, pool


def _run(topk, lens, pool, restricted=True, publishes_pool=True):
    def f(topk, lens, pool):
        check_selection(
            7,
            topk,
            lens,
            pool,
            block_size=BLOCK,
            restricted=restricted,
            publishes_pool=publishes_pool,
        )

    error, _ = jax.jit(checkify.checkify(f))(topk, lens, pool)
    return error.get()


def test_real_selections_pass():
    assert _run(*_case()) is None


@pytest.mark.parametrize(
    ("corrupt", "message"),
    [
        (lambda t, n, p: (t.at[0, 0].set(n[0] + 1), n, p), "not < the visible length"),
        (lambda t, n, p: (t.at[:, 1].set(t[:, 0]), n, p), "not ascending and distinct"),
        (
            lambda t, n, p: (t, n, p._replace(mask=p.mask.at[:, -1].set(True))),
            "cannot see",
        ),
        (
            lambda t, n, p: (t, n, p._replace(block_ids=jnp.full_like(p.block_ids, -1))),
            "newest block",
        ),
        (
            lambda t, n, p: (t, n, p._replace(mask=jnp.zeros_like(p.mask))),
            "outside the pool",
        ),
    ],
)
def test_corruption_is_reported(corrupt, message):
    topk, lens, pool = _case()
    lens = jnp.maximum(lens, 12)  # every row sees something, so every check has work to do
    pool = select_candidate_blocks(
        jnp.where(jnp.arange(40) < lens[:, None], 1.0, -jnp.inf), lens, 3, BLOCK
    )
    topk = topk_indices(jnp.where(pool.mask, 1.0, -jnp.inf), 6)
    assert _run(topk, lens, pool) is None
    err = _run(*corrupt(topk, lens, pool))
    assert err is not None and message in err and "layer 7" in err


def test_check_finite():
    error, _ = jax.jit(checkify.checkify(lambda x: check_finite(x, "logits")))(
        jnp.array([1.0, jnp.nan])
    )
    assert "logits: expected finite values, got 1 non-finite" in error.get()


def test_debug_mode_runs_prefill_and_decode():
    cfg = config.tiny()
    m = model.Model(cfg, rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(0), (2, 70), 0, cfg.vocab_size)
    plain = model.prefill(m, tokens, jnp.array([70, 9]), max_len=72)
    checked = model.prefill(m, tokens, jnp.array([70, 9]), max_len=72, debug=True)
    np.testing.assert_array_equal(plain[0], checked[0])  # checks observe, never change results
    model.decode_step(m, jnp.array([1, 2]), checked[1], debug=True)
