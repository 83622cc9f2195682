"""Data-parallel training over a mesh equals training on one device (issue 15), for the test
model with its window and index keys unquantized (`_shared.DATA_PARALLEL`: why).

Runs on 8 devices: `tests/test_multidevice.py` starts it with 8 simulated CPU devices.
"""

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

from tests.multidevice._shared import ADAM_ATOL
from tests.multidevice._shared import DATA_PARALLEL as CFG


def _grads(mesh):
    """The first batch's gradient of the sparse-stage loss, the batch split over `mesh`."""
    model, _ = train.build(CFG)
    b = CFG.make_task().batch_at(CFG.seed, 0, CFG.batch_size)
    batch = tuple(jnp.asarray(x) for x in (b.tokens, b.targets, b.loss_mask))
    if mesh is not None:
        batch = jax.device_put(batch, NamedSharding(mesh, PartitionSpec("data")))
    graphdef, state = nnx.split(model)

    @jax.jit
    def grads(state, tokens, targets, mask):
        def loss(m):
            return train.loss_fn(m, tokens, targets, mask, dense=False, indexer_kl_weight=1.0)[0]

        return nnx.grad(loss)(nnx.merge(graphdef, state))

    flat = nnx.to_flat_state(grads(state, *batch))
    return {p: np.asarray(v.get_value()) for p, v in flat}


def test_a_data_parallel_gradient_equals_the_one_device_gradient():
    want = _grads(None)
    scale = max(np.abs(g).max() for g in want.values())
    for n_data in (2, 8):
        got = _grads(train.make_mesh({"data": n_data}))
        assert got.keys() == want.keys()
        for path, g in got.items():
            np.testing.assert_allclose(
                g, want[path], rtol=1e-4, atol=1e-5 * scale, err_msg=str(path)
            )


def _train(mesh):
    model, optimizer = train.build(CFG)
    metrics = []
    train.train_steps(
        model, optimizer, CFG, CFG.make_task(), 0, CFG.steps,
        lambda done, m: metrics.append(jax.device_get(m)), mesh=mesh,
    )  # fmt: skip
    params = nnx.to_flat_state(nnx.state(model, nnx.Param))
    return {p: np.asarray(v.get_value()) for p, v in params}, metrics, model


@pytest.fixture(scope="module")
def alone():
    return _train(None)


# 8 only: the gradient at 2 and 8 is the test above's, and a step over 4 devices of two
# processes tests/test_multidevice.py's.
@pytest.mark.parametrize("n_data", [8])
def test_a_data_parallel_step_equals_the_one_device_step(alone, n_data):
    want_params, want_metrics, _ = alone
    params, metrics, model = _train(train.make_mesh({"data": n_data}))
    for got, want in zip(metrics, want_metrics, strict=True):
        for name in ("loss", "task_loss", "indexer_kl", "grad_norm"):
            np.testing.assert_allclose(got[name], want[name], rtol=5e-4, atol=1e-6, err_msg=name)
    assert params.keys() == want_params.keys()
    for path, value in params.items():
        np.testing.assert_allclose(
            value, want_params[path], rtol=1e-4, atol=ADAM_ATOL, err_msg=str(path)
        )
    # The state stayed replicated over the mesh's devices.
    some = nnx.to_flat_state(nnx.state(model, nnx.Param))[0][1].get_value()
    assert len(some.sharding.device_set) == n_data and some.sharding.is_fully_replicated


def test_a_run_on_a_mesh_evaluates_and_checkpoints(alone, tmp_path):
    # On the 8 devices of the step test above: its programs are this run's steps.
    result = train.run(CFG, tmp_path / "run", progress=False, mesh=train.make_mesh({"data": 8}))
    single = train.run(CFG, tmp_path / "single", progress=False)
    assert result["step"] == single["step"] == CFG.steps
    np.testing.assert_allclose(result["task_loss"], single["task_loss"], rtol=1e-4)
    _, loaded = train.load(tmp_path / "run")  # the checkpoint reads back on one device
    for path, value in nnx.to_flat_state(nnx.state(loaded, nnx.Param)):
        np.testing.assert_allclose(
            value.get_value(), alone[0][path], rtol=1e-4, atol=ADAM_ATOL, err_msg=str(path)
        )


def test_meshes_the_trainer_cannot_use_are_refused():
    with pytest.raises(ValueError, match=r"mesh: expected axes among \('data', 'context'\)"):
        train.make_mesh({"model": 2})
    with pytest.raises(ValueError, match="needs 16 devices, got 8"):
        train.make_mesh({"data": 16})
    with pytest.raises(ValueError, match=r"TrainConfig.batch_size: expected a multiple .* data=8"):
        train.run(CFG.replace(batch_size=4), "unused", mesh=train.make_mesh({"data": 8}))
