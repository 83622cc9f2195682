"""Context-parallel training equals training on one device (issue 15): each sequence split into
contiguous slices over the mesh's 'context' axis (`v41jax.nn.sharding`), alone (1 × 8) and with
data parallelism (2 × 4).

Runs on 8 devices: `tests/test_multidevice.py` starts it with 8 simulated CPU devices.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from v41jax import train

if jax.device_count() < 8:
    raise RuntimeError(
        "tests/multidevice needs 8 devices: run it through tests/test_multidevice.py"
    )

from tests.multidevice._shared import ADAM_ATOL, CFG, UNQUANTIZED

# A window of 8: on 8 devices each of the 64 tokens' slices is one whole window
# (`train.check_mesh`).
CP = CFG.replace(model_overrides={**dict(CFG.model_overrides), "window_size": 8})
# The Full layer compressing pairs of tokens.
RATIO2 = CP.replace(model_overrides={**dict(CP.model_overrides), "compress_ratios": (0, 2, 2, 2)})
# The gradient comparison reads the window and the index keys unquantized (`UNQUANTIZED`: here
# the quantizers moved the gradient up to 1.3e-4 of its largest element on an AVX-512 CPU,
# against 2e-6 unquantized). The steps test below keeps the quantizers.
MESHES = {"1x8": {"context": 8}, "2x4": {"data": 2, "context": 4}}


def _loss_and_grads(cfg, mesh, *, dense=False):
    """The first batch's loss and gradient (sparse stage unless `dense`), the batch split over
    `mesh` (None: one device)."""
    model, _ = train.build(cfg)
    b = cfg.make_task().batch_at(cfg.seed, 0, cfg.batch_size)
    batch = tuple(jnp.asarray(x) for x in (b.tokens, b.targets, b.loss_mask))
    graphdef, state = nnx.split(model)

    @jax.jit
    def loss_and_grads(state, tokens, targets, mask):
        def loss(m):
            return train.loss_fn(m, tokens, targets, mask, dense=dense, indexer_kl_weight=1.0)[0]

        return nnx.value_and_grad(loss)(nnx.merge(graphdef, state))

    if mesh is None:
        value, grads = loss_and_grads(state, *batch)
    else:
        batch = jax.device_put(batch, NamedSharding(mesh, PartitionSpec("data", "context")))
        with jax.set_mesh(mesh):
            value, grads = loss_and_grads(state, *batch)
    flat = nnx.to_flat_state(grads)
    return float(value), {p: np.asarray(v.get_value()) for p, v in flat}


@functools.cache
def _one_device(cfg, dense):
    """The one-device loss and gradient, computed once per (config, stage): cases that differ
    only in their mesh or chunking compare against the same one (query_chunk=0)."""
    return _loss_and_grads(cfg, None, dense=dense)


def _chunked(cfg, query_chunk):
    return cfg.replace(model_overrides={**dict(cfg.model_overrides), "query_chunk": query_chunk})


@pytest.mark.parametrize(
    ("mesh_name", "cfg", "dense", "query_chunk"),
    [
        ("1x8", RATIO2, False, 0),
        ("1x8", RATIO2, True, 0),
        ("2x4", CP, False, 0),
        # Chunked: each device loops over its own slice (8 or 16 queries) in chunks of 3 or 6,
        # the last one padded; against the one-device whole-sequence pass.
        ("1x8", RATIO2, False, 3),
        ("2x4", RATIO2, True, 6),
    ],
    ids=[
        "1x8-ratio2-sparse",
        "1x8-ratio2-dense",
        "2x4-ratio1-sparse",
        "1x8-ratio2-sparse-chunk3",
        "2x4-ratio2-dense-chunk6",
    ],
)
def test_a_context_parallel_gradient_equals_the_one_device_gradient(
    mesh_name, cfg, dense, query_chunk
):
    cfg = cfg.replace(model_overrides={**dict(cfg.model_overrides), **UNQUANTIZED})
    want_loss, want = _one_device(cfg, dense)
    mesh = train.make_mesh(MESHES[mesh_name])
    got_loss, got = _loss_and_grads(_chunked(cfg, query_chunk), mesh, dense=dense)
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)
    scale = max(np.abs(g).max() for g in want.values())
    assert got.keys() == want.keys()
    for path, g in got.items():
        np.testing.assert_allclose(g, want[path], rtol=1e-4, atol=1e-5 * scale, err_msg=str(path))


# Two steps: the dense warm-up's and a sparse one. On a third, the parameters' float-level
# differences (Adam turns them into up to 2·lr per element, `_shared`) moved one pick of a
# top-8 and the loss by 0.4 %: a discrete flip, not a layout error.
STEPS = 2


def _train(mesh):
    model, optimizer = train.build(CP)
    metrics = []
    train.train_steps(
        model, optimizer, CP, CP.make_task(), 0, STEPS,
        lambda done, m: metrics.append(jax.device_get(m)), mesh=mesh,
    )  # fmt: skip
    params = nnx.to_flat_state(nnx.state(model, nnx.Param))
    return {p: np.asarray(v.get_value()) for p, v in params}, metrics


@pytest.fixture(scope="module")
def alone():
    return _train(None)


def test_context_parallel_steps_equal_the_one_device_steps(alone):
    want_params, want_metrics = alone
    params, metrics = _train(train.make_mesh(MESHES["2x4"]))
    for got, want in zip(metrics, want_metrics, strict=True):
        for name in ("loss", "task_loss", "indexer_kl", "grad_norm"):
            np.testing.assert_allclose(got[name], want[name], rtol=5e-4, atol=1e-6, err_msg=name)
    # Adam's per-element normalization turns a float-level gradient difference of an element
    # whose gradient is near 0 into an update difference of up to 2·lr a step (`_shared`): a few
    # elements in a thousand may move that far (3 of 2,048 measured), the rest agree to
    # ADAM_ATOL; a layout error would move most of them.
    bound = 2 * CP.learning_rate * STEPS
    for path, value in params.items():
        diff = np.abs(value - want_params[path])
        assert diff.max() <= bound, (path, diff.max())
        assert np.mean(diff > ADAM_ATOL + 1e-4 * np.abs(want_params[path])) <= 1e-2, path


def test_meshes_context_parallelism_cannot_use_are_refused():
    mesh = train.make_mesh({"context": 8})
    with pytest.raises(ValueError, match=r"task seq_len: expected a multiple of context × window"):
        train.check_mesh(mesh, CFG)  # 64 tokens: slices of 8 under tiny()'s window of 32


def _compiled_step(mesh, cfg=CP):
    model, _ = train.build(cfg)
    b = cfg.make_task().batch_at(cfg.seed, 0, cfg.batch_size)
    batch = tuple(jnp.asarray(x) for x in (b.tokens, b.targets, b.loss_mask))
    graphdef, state = nnx.split(model)

    def loss_and_grads(state, tokens, targets, mask):
        def loss(m):
            return train.loss_fn(m, tokens, targets, mask, dense=False, indexer_kl_weight=1.0)[0]

        return nnx.value_and_grad(loss)(nnx.merge(graphdef, state))

    if mesh is None:
        return jax.jit(loss_and_grads).lower(state, *batch).compile()
    batch = jax.device_put(batch, NamedSharding(mesh, PartitionSpec("data", "context")))
    with jax.set_mesh(mesh):
        return jax.jit(loss_and_grads).lower(state, *batch).compile()


@pytest.mark.parametrize("query_chunk", [0, 4], ids=["whole", "chunk4"])
def test_a_context_parallel_step_gathers_the_compressed_rows_not_the_query_rows(query_chunk):
    """What the devices exchange: the compressed KV and index keys (and their gradients), O(S·d)
    values each (chunked, the window rows too: O(T·d)); never an array of all queries × all
    positions ([B, T, S]: scores, masks, probabilities), which would make the exchange grow with
    T·S. And each device's working memory is a fraction of the one-device step's."""
    cfg = _chunked(CP, query_chunk)
    compiled = _compiled_step(train.make_mesh({"context": 8}), cfg)
    text = compiled.as_text()
    b, t = CP.batch_size, CP.make_task().seq_len
    s = t // min(r for r in CP.model_config().compress_ratios if r)
    gathered = [
        int(np.prod([int(d) for d in dims.split(",") if d]))
        for dims in re.findall(r"= \w+\[([\d,]*)\]\{[\d,]*\} all-gather", text)
    ]
    assert gathered, "expected the compressed KV to be all-gathered"
    assert max(gathered) < b * t * s, sorted(gathered)
    # Two arrays are gathered whole, the main KV and the index keys of the one source each;
    # the window reaches a device as a halo of its W − 1 preceding rows.
    assert len(gathered) == 2, sorted(gathered)
    halo = CP.model_config().window_size - 1
    assert re.search(rf"= \w+\[{b},{halo}(,\d+)*\]\{{[\d,]*\}} collective-permute", text)
    alone = _compiled_step(None, cfg).memory_analysis().temp_size_in_bytes
    split = compiled.memory_analysis().temp_size_in_bytes
    assert split * 4 < alone, (split, alone)  # 8 devices: about 1/8 measured
