"""What several test files share: small model configs, a fake evaluation, and the check that
a compiled program hands back its results only."""

import jax
from flax import nnx

from experiments import _common
from v41jax import train
from v41jax.nn import config as config_lib
from v41jax.train import evaluate


def four_layer_f32(**changes) -> config_lib.ModelConfig:
    """Every selecting role in four layers of tiny(): Full at ratio 2; Full at ratio 1 and
    candidate source (blocks of 4; 2 blocks unless `changes` say otherwise); Reindex; Reuse.
    Index top-k 6, a window of 8. Float32 storage formats: nothing rounds unless a test asks, so
    two paths that sum in another order cannot land on opposite sides of a rounding boundary."""
    return config_lib.tiny().replace(
        **{
            "n_layers": 4,
            "compress_ratios": (2, 1, 1, 1),
            "kv_source_layers": (0, 1),
            "index_source_layers": (0, 1, 2),
            "candidate_source_layer": 1,
            "kv_format": "f32",
            "index_format": "f32",
            "window_format": "f32",
            "candidate_block_size": 4,
            "candidate_topk_blocks": 2,
            "index_topk": 6,
            "window_size": 8,
            **changes,
        }
    )


# The four-layer training model of the trainer's, group and multi-device tests (window; Full and
# candidate source; Reindex; Reuse), `TrainConfig.model_overrides` of tiny(): a pool of 2 blocks
# of 8 that bites at 64 tokens of MQAR (`TRAIN_TASK`). The studies' --smoke model, the same.
FOUR_LAYER_TRAIN = dict(_common.SMOKE_MODEL)
TRAIN_TASK = {"seq_len": 64, "n_pairs": 4, "n_queries": 2}


def fake_evaluations(monkeypatch, sparse_accuracies: dict[int, list[float]]) -> None:
    """Replaces the trainer's evaluation: dense ones score 0.95, sparse ones of seed s the next
    value of sparse_accuracies[s] (what the convergence rule reads), losses 0."""
    queues = {s: list(v) for s, v in sparse_accuracies.items()}

    def fake(model, task, *, seed, batches, batch_size, dense):
        accuracy = 0.95 if dense else queues[seed - train.EVAL_SEED_OFFSET].pop(0)
        return {"accuracy": accuracy, "task_loss": 0.0}

    monkeypatch.setattr(evaluate, "evaluate", fake)


def assert_hands_back_its_results_only(jitted, impl, args: tuple, kwargs: dict) -> None:
    """`jitted` (an `nnx.jit` of `impl`, the model first in `args`), lowered: its program's
    outputs are `impl`'s results and nothing else. With nnx.jit's default graph updates every
    Variable of the model leaves the program too, and XLA copies each parameter at every call
    (`nnx.jit(graph_updates=False)` hands back what the function returns)."""
    results = jax.tree.leaves(nnx.eval_shape(lambda m, *a: impl(m, *a, **kwargs), *args))
    outputs = jax.tree.leaves(jitted.lower(*args, **kwargs).lowered.out_info)
    assert len(outputs) == len(results), (len(outputs), len(results))
