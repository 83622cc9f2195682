"""Training with training-aware candidate pools, QAT and the indexer KL loss (DESIGN §7).

Loss = task cross-entropy on the scored positions + `indexer_kl_weight` · the indexers' KL loss
(`nn.indexer.indexer_kl`: target = the main attention over the keys the layer attended to, summed
over heads, detached; the indexer reads its inputs through `stop_gradient`, so only indexer
parameters receive this loss and nothing else does; the task loss cannot reach the indexer,
whose output is an integer selection).

Stages:
  1. dense warm-up (`dense_warmup_steps`): every layer attends to all visible compressed entries
     while the indexers learn the dense attention distribution (KL over all visible keys);
  2. sparse: the real selection — candidate pool at the candidate source, top-k inside it at
     the Reindex layers — exactly the rule used at inference (training-aware pools), with the
     KL over each layer's own selection.
The formats of the config (main KV, index keys, window) are fake-quantized in every forward pass
with straight-through gradients: QAT is the default; train with `kv_format='f32'` (or 'bf16')
and evaluate with another format for post-training quantization.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from tqdm.auto import tqdm

from v41jax.nn import config as config_lib
from v41jax.nn import sharding
from v41jax.nn.model import Model, indexer_kls, with_fields
from v41jax.train import evaluate as evaluate_lib
from v41jax.train import rundir
from v41jax.train import tasks as tasks_lib

Overrides = tuple[tuple[str, Any], ...]
"""Field changes as sorted (name, value) pairs: hashable, comparable, JSON-able as a dict."""


def _overrides(name: str, value: Mapping[str, Any] | Iterable[tuple[str, Any]]) -> Overrides:
    """`value` (a mapping or (name, value) pairs) as sorted pairs; ValueError names `name`."""
    try:
        pairs = dict(value.items() if isinstance(value, Mapping) else value)
    except (TypeError, ValueError):
        raise ValueError(
            f"TrainConfig.{name}: expected a mapping or (name, value) pairs, got {value!r}"
        ) from None
    if not all(isinstance(k, str) for k in pairs):
        raise ValueError(f"TrainConfig.{name}: expected field names as keys, got {list(pairs)}")
    return tuple(sorted((k, _as_tuples(v)) for k, v in pairs.items()))


def _as_tuples(value: Any) -> Any:
    """Lists (as JSON reads a saved tuple back) as tuples, nested ones too: the config's own
    form, so that a config read from config.json equals the one saved and stays hashable."""
    if isinstance(value, list | tuple):
        return tuple(_as_tuples(v) for v in value)
    return value


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """One training run. Validated on construction.

    The model and the task are nested, not re-declared: a preset plus `model_overrides` (any
    `ModelConfig` fields) gives the model, a task name plus `task_overrides` (any field of the
    task) the data. `make_config` builds one from a base and changes; the CLI and the studies
    build theirs through it.

    Args:
      preset: model preset (`nn.config.PRESETS`).
      model_overrides: `ModelConfig` fields changed on the preset, e.g. {'kv_format': 'mxfp4',
        'candidate_topk_blocks': 8} (a mapping or (name, value) pairs; stored sorted).
      task: task name (`tasks.make_task`).
      task_overrides: task fields changed, e.g. {'seq_len': 512}.
      steps: optimizer steps.
      batch_size: sequences per step.
      learning_rate: peak AdamW learning rate (linear warm-up, then cosine decay to 10 %).
      adam_b2: AdamW's second-moment decay. The default pair (5e-3, 0.95) is the one of twenty
        recipes that took every seed of the main job to 100 % by its step 200 on the H200; at
        (1e-2, 0.999), the previous default, seeds stall at about 90 % (one digit of ten
        confused) or on the plateau, and 2e-2 does not learn (`experiments/recipe_sweep.py`).
      lr_warmup_steps: steps of linear learning-rate warm-up.
      weight_decay: AdamW weight decay.
      grad_clip: global gradient-norm clip.
      attention: 'sparse' (the pool and top-k after the dense warm-up) or 'dense' (every layer
        attends to all visible compressed entries for the whole run: the baseline).
      dense_warmup_steps: steps of stage 1 (ignored when attention='dense').
      indexer_kl_weight: weight of the indexer KL loss (0 disables it).
      seed: parameter init and data seed; step k's batch depends only on (seed, k).
      eval_every: steps between evaluations (and at the end).
      eval_batches: batches per evaluation (drawn from a seed disjoint from training's).
      checkpoint_every: steps between checkpoints (and at the end).
      keep_checkpoints: checkpoints kept on disk.
      converge_accuracy: 0 (off: the run trains all `steps`) or the convergence rule's
        accuracy: the run stops after the evaluation that makes the last `converge_evals`
        evaluations of its final stage (sparse after the warm-up, or dense for attention='dense')
        all reach it; `steps` is then the cap. A rule on the run's own evaluations, so where it
        stops depends on seeds and data, never on the machine.
      converge_evals: consecutive evaluations the rule asks for.
      init_from: '' (a fresh initialization from `seed`) or a run directory whose latest
        checkpoint's model weights start this run, with a fresh optimizer and schedule: a stage
        of a curriculum (the same model on a shorter task first) or a fine-tune. `{seed}` in it
        is replaced by the run's seed (`runs/stage1/seed{seed}` for the seeds of a group). The
        model must have the same parameters (shapes and dtypes); the task, the steps and
        the model's non-parameter fields (`query_chunk`, formats) may differ.
    """

    preset: str = "tiny"
    model_overrides: Overrides = ()
    task: str = "passkey"
    task_overrides: Overrides = ()
    steps: int = 400
    batch_size: int = 32
    learning_rate: float = 5e-3
    adam_b2: float = 0.95
    lr_warmup_steps: int = 30
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    attention: str = "sparse"
    dense_warmup_steps: int = 200
    indexer_kl_weight: float = 1.0
    seed: int = 0
    eval_every: int = 100
    eval_batches: int = 8
    checkpoint_every: int = 100
    keep_checkpoints: int = 2
    converge_accuracy: float = 0.0
    converge_evals: int = 2
    init_from: str = ""

    def __post_init__(self):
        for name in ("model_overrides", "task_overrides"):
            object.__setattr__(self, name, _overrides(name, getattr(self, name)))
        for name in (
            "steps",
            "batch_size",
            "eval_every",
            "eval_batches",
            "checkpoint_every",
            "converge_evals",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"TrainConfig.{name}: expected a positive int, got {value!r}")
        for name in ("lr_warmup_steps", "dense_warmup_steps", "keep_checkpoints", "seed"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"TrainConfig.{name}: expected an int >= 0, got {value!r}")
        accuracy = self.converge_accuracy
        if isinstance(accuracy, bool) or not (
            isinstance(accuracy, int | float) and 0.0 <= accuracy <= 1.0
        ):
            raise ValueError(
                "TrainConfig.converge_accuracy: expected 0 (off) or an accuracy in (0, 1], "
                f"got {accuracy!r}"
            )
        if not isinstance(self.init_from, str):
            raise ValueError(
                "TrainConfig.init_from: expected a run directory (str) or '', "
                f"got {self.init_from!r}"
            )
        b2 = self.adam_b2
        if isinstance(b2, bool) or not (isinstance(b2, int | float) and 0.0 <= b2 < 1.0):
            raise ValueError(
                f"TrainConfig.adam_b2: expected a number in [0, 1), got {self.adam_b2!r}"
            )
        if self.attention not in ("sparse", "dense"):
            raise ValueError(
                f"TrainConfig.attention: expected 'sparse' or 'dense', got {self.attention!r}"
            )
        for name in ("learning_rate", "indexer_kl_weight", "weight_decay", "grad_clip"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"TrainConfig.{name}: expected a finite number >= 0, got {value}")
        model = self.model_config()  # validates the preset and the overrides
        task = self.make_task()
        if task.vocab_size > model.vocab_size:
            raise ValueError(
                f"TrainConfig.task_overrides: the task's ids reach vocab_size={task.vocab_size}, "
                f"expected at most the model's vocab_size={model.vocab_size} (an id outside the "
                "vocabulary embeds as NaN)"
            )

    def replace(self, **changes) -> TrainConfig:
        """A copy with training fields changed (validated again); see `with_model` and
        `with_task` for the nested configs, `make_config` for all three at once."""
        return dataclasses.replace(self, **changes)

    def with_model(self, **changes) -> TrainConfig:
        """A copy whose model overrides also hold `changes` (`ModelConfig` fields)."""
        return self.replace(model_overrides=dict(self.model_overrides) | changes)

    def with_task(self, **changes) -> TrainConfig:
        """A copy whose task overrides also hold `changes` (task fields)."""
        return self.replace(task_overrides=dict(self.task_overrides) | changes)

    def make_task(self) -> tasks_lib.RetrievalTask:
        return tasks_lib.make_task(self.task, **dict(self.task_overrides))

    def model_config(self) -> config_lib.ModelConfig:
        """The preset with `model_overrides` applied (validated by `ModelConfig`)."""
        base = config_lib.preset(self.preset)
        fields = {f.name for f in dataclasses.fields(base)}
        unknown = sorted(set(dict(self.model_overrides)) - fields)
        if unknown:
            raise ValueError(
                f"TrainConfig.model_overrides: expected ModelConfig fields, got {unknown}"
            )
        return base.replace(**dict(self.model_overrides))

    def dense_at(self, step: int) -> bool:
        """Whether step `step` (0-based) attends densely."""
        return self.attention == "dense" or step < self.dense_warmup_steps

    def converged(self, evals: Iterable[tuple[int, float]]) -> bool:
        """The convergence rule (`converge_accuracy`) on (step, accuracy) evaluations in order:
        whether the last `converge_evals` of the final stage all reach the accuracy."""
        if not self.converge_accuracy:
            return False
        final = self.dense_at(self.steps)  # the mode of the final evaluations
        last = [a for step, a in evals if self.dense_at(step) == final][-self.converge_evals :]
        return len(last) == self.converge_evals and min(last) >= self.converge_accuracy

    def to_json(self) -> dict:
        """The config as JSON-able data (overrides as objects); `from_json` reads it back."""
        data = dataclasses.asdict(self)
        for name in ("model_overrides", "task_overrides"):
            data[name] = dict(getattr(self, name))
        return data

    @classmethod
    def from_json(cls, data: dict) -> TrainConfig:
        unknown = sorted(set(data) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(f"TrainConfig: unknown fields {unknown} (saved by another version?)")
        return cls(**(LEGACY_FIELDS | data))  # a field the saved run predates: its old value

    @classmethod
    def smoke(cls, **changes) -> TrainConfig:
        """Two steps at batch 2, one evaluation and one checkpoint: every stage of a run in
        seconds on a CPU (what the notebooks run in CI). It trains nothing: not a result."""
        return cls(
            steps=2,
            batch_size=2,
            lr_warmup_steps=0,
            dense_warmup_steps=0,
            eval_every=2,
            eval_batches=1,
            checkpoint_every=2,
        ).replace(**changes)


LEGACY_FIELDS = {"adam_b2": 0.999, "converge_accuracy": 0.0, "converge_evals": 2, "init_from": ""}
"""`TrainConfig` fields added after run directories were written, with the value such a run
trained with (optax's b2, no convergence rule, a fresh initialization): a saved config.json
without them resumes under a config that holds these values (`rundir.check`)."""


def make_config(
    base: TrainConfig | None = None,
    *,
    model_changes: Mapping[str, Any] | None = None,
    task_changes: Mapping[str, Any] | None = None,
    **fields,
) -> TrainConfig:
    """`base` (default `TrainConfig()`) with training `fields` replaced and `model_changes` /
    `task_changes` merged over its model and task overrides: the one way the CLI and the studies
    build a run's config.

    Values that are None are left as they are (unset command-line options)."""
    cfg = (base or TrainConfig()).replace(**{k: v for k, v in fields.items() if v is not None})
    model = {k: v for k, v in (model_changes or {}).items() if v is not None}
    task = {k: v for k, v in (task_changes or {}).items() if v is not None}
    return cfg.replace(
        model_overrides=dict(cfg.model_overrides) | model,
        task_overrides=dict(cfg.task_overrides) | task,
    )


def make_optimizer(model: Model, cfg: TrainConfig) -> nnx.Optimizer:
    """AdamW with linear warm-up and cosine decay, global-norm clipping; over `nnx.Param`s."""
    tx = _transformation(
        cfg.learning_rate,
        cfg.adam_b2,
        cfg.lr_warmup_steps,
        cfg.steps,
        cfg.weight_decay,
        cfg.grad_clip,
    )
    return nnx.Optimizer(model, tx, wrt=nnx.Param)


@functools.cache
def _transformation(
    learning_rate: float, b2: float, warmup: int, steps: int, weight_decay: float, grad_clip: float
) -> optax.GradientTransformation:
    # One object per hyperparameter set: the transformation is static data of the optimizer's
    # graph, so a new (equal but not identical) one per run would make `train_step` recompile.
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=learning_rate,
        warmup_steps=warmup,
        decay_steps=max(steps, warmup + 1),
        end_value=learning_rate * 0.1,
    )
    return optax.chain(
        optax.clip_by_global_norm(grad_clip),
        optax.adamw(schedule, b2=b2, weight_decay=weight_decay),
    )


def loss_fn(
    model: Model,
    tokens: jax.Array,
    targets: jax.Array,
    loss_mask: jax.Array,
    *,
    dense: bool,
    indexer_kl_weight: float,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Task cross-entropy on the scored positions + weighted mean indexer KL over index sources.

    Returns (loss, metrics) with metrics 'loss', 'task_loss', 'indexer_kl', 'accuracy'.
    """
    logits, trace = model.run(tokens, dense=dense, indexer_loss=indexer_kl_weight > 0)
    mask = loss_mask.astype(jnp.float32)
    n_scored = jnp.maximum(mask.sum(), 1.0)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)
    task_loss = jnp.sum(ce * mask) / n_scored
    accuracy = jnp.sum((jnp.argmax(logits, -1) == targets) * mask) / n_scored
    kls = indexer_kls(trace)
    indexer_kl = jnp.mean(jnp.stack(kls)) if kls else jnp.zeros(())
    loss = task_loss + indexer_kl_weight * indexer_kl
    metrics = {
        "loss": loss,
        "task_loss": task_loss,
        "indexer_kl": indexer_kl,
        "accuracy": accuracy,
    }
    return loss, metrics


def _train_step(
    model: Model,
    optimizer: nnx.Optimizer,
    tokens: jax.Array,
    targets: jax.Array,
    loss_mask: jax.Array,
    *,
    dense: bool,
    indexer_kl_weight: float,
) -> dict[str, jax.Array]:
    def loss(m):
        return loss_fn(
            m, tokens, targets, loss_mask, dense=dense, indexer_kl_weight=indexer_kl_weight
        )

    (_, metrics), grads = nnx.value_and_grad(loss, has_aux=True)(model)
    optimizer.update(model, grads)
    metrics["grad_norm"] = optax.tree.norm(grads)
    return metrics


train_step = nnx.jit(_train_step, static_argnames=("dense", "indexer_kl_weight"))
train_step.__doc__ = """One optimizer step on (model, optimizer), updated in place; returns the
step's metrics (before the update). The training loop uses `StepRunner`, the same step without
nnx.jit's per-call traversal of the model graph."""


def _step_on_values(
    values, tokens, targets, loss_mask, *, graphdef, paths, dense, indexer_kl_weight
):
    """`_train_step` as a function of the variables' values (in `paths` order)."""
    model, optimizer = nnx.merge(
        graphdef, nnx.from_flat_state(list(zip(paths, values, strict=True)))
    )
    metrics = _train_step(
        model,
        optimizer,
        tokens,
        targets,
        loss_mask,
        dense=dense,
        indexer_kl_weight=indexer_kl_weight,
    )
    flat = nnx.to_flat_state(nnx.state((model, optimizer)))
    if tuple(flat.paths) != paths:
        raise AssertionError("StepRunner: the step changed the structure of the model's state")
    return [v.get_value() for v in flat.leaves], metrics


@functools.lru_cache(maxsize=32)
def _compiled_step(graphdef, paths: tuple) -> Callable:
    # One jitted function per model structure, hashed once per runner rather than at every call
    # (hashing the graph definition costs milliseconds); equal configs share its compilations.
    return jax.jit(
        functools.partial(_step_on_values, graphdef=graphdef, paths=paths),
        static_argnames=("dense", "indexer_kl_weight"),
        donate_argnums=0,
    )


MESH_AXES = (sharding.DATA, sharding.CONTEXT)
"""The training mesh's axes: 'data' splits the batch; 'context' splits each sequence into
contiguous slices (context parallelism: each device computes its own queries against the
all-gathered compressed KV and index keys; `v41jax.nn.sharding`)."""


def make_mesh(shape: Mapping[str, int], devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A training mesh of `shape` ({'data': N, 'context': M}; missing axes are 1) over the
    first data·context devices of `devices` (default `jax.devices()`): a sequence's slices lie
    on neighbouring devices."""
    unknown = sorted(set(shape) - set(MESH_AXES))
    if unknown:
        raise ValueError(f"mesh: expected axes among {MESH_AXES}, got {unknown}")
    sizes = tuple(shape.get(axis, 1) for axis in MESH_AXES)
    for axis, size in zip(MESH_AXES, sizes, strict=True):
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"mesh: expected a positive int for {axis}, got {size!r}")
    devices = list(jax.devices() if devices is None else devices)
    if math.prod(sizes) > len(devices):
        raise ValueError(
            f"mesh: {dict(zip(MESH_AXES, sizes, strict=True))} needs {math.prod(sizes)} devices, "
            f"got {len(devices)}"
        )
    grid = np.array(devices[: math.prod(sizes)], dtype=object).reshape(sizes)
    return check_mesh(Mesh(grid, MESH_AXES))


def check_mesh(mesh: Mesh | None, cfg: TrainConfig | None = None) -> Mesh | None:
    """`mesh` if the trainer can use it for `cfg` (when given), else ValueError: axes
    `MESH_AXES`; the batch a multiple of 'data'; with 'context' > 1, the sequence a multiple of
    context × window_size (the chunked attention, `ModelConfig.query_chunk`, loops over each
    device's own slice)."""
    if mesh is None:
        return None
    if tuple(mesh.axis_names) != MESH_AXES:
        raise ValueError(f"mesh: expected axes {MESH_AXES}, got {tuple(mesh.axis_names)}")
    if cfg is None:
        return mesh
    n_data, n_context = mesh.shape["data"], mesh.shape["context"]
    if cfg.batch_size % n_data:
        raise ValueError(
            f"TrainConfig.batch_size: expected a multiple of the mesh's data={n_data}, "
            f"got {cfg.batch_size}"
        )
    if n_context > 1:
        seq_len, window = cfg.make_task().seq_len, cfg.model_config().window_size
        if seq_len % (n_context * window):
            # Each device holds whole windows. With shorter slices (8 and 16 tokens under a
            # window of 32, 8 CPU devices) the partitioned step came out ~1e-3 off the
            # one-device result, with or without the model's layout constraints (cause not
            # found); slices of whole windows agree to float rounding.
            raise ValueError(
                f"task seq_len: expected a multiple of context × window_size = {n_context} × "
                f"{window} = {n_context * window} (each device holds whole windows), got "
                f"{seq_len}"
            )
    return mesh


class StepRunner:
    """`train_step` on a fixed (model, optimizer) with the graph traversed once.

    nnx.jit flattens the model and the optimizer at every call (about 20 ms of host time for
    tiny(), more than its whole step on a GPU); the runner keeps references to their variables,
    hands their values to a plain `jax.jit` step (donated: updated in place on the device) and
    writes the new values back. Writing back holds Ctrl-C until every variable has its new
    value, so an interruption never leaves a model half a step ahead.
    """

    def __init__(self, model: Model, optimizer: nnx.Optimizer, mesh: Mesh | None = None):
        self.mesh = check_mesh(mesh)
        self.window = model.config.window_size
        self.graphdef, state = nnx.split((model, optimizer))
        flat = nnx.to_flat_state(state)
        self.paths = tuple(flat.paths)
        by_path = {
            path: node
            for path, node in nnx.iter_graph((model, optimizer))
            if isinstance(node, nnx.Variable)
        }
        self.variables = [by_path[path] for path in self.paths]
        self.step = _compiled_step(self.graphdef, self.paths)
        if self.mesh is not None:
            # The state replicated on every device of the mesh; each batch split over 'data'
            # (its sequences) and 'context' (each sequence's tokens); jit partitions the step
            # under the mesh (the gradient's mean becomes an all-reduce, the model's layout
            # follows `v41jax.nn.sharding`) and keeps the donated state where it is.
            self.replicated = NamedSharding(self.mesh, PartitionSpec())
            self.split = NamedSharding(self.mesh, PartitionSpec(*MESH_AXES))
            for variable in self.variables:
                value = variable.get_raw_value()
                if isinstance(value, jax.Array):
                    variable.set_raw_value(jax.device_put(value, self.replicated))

    def __call__(
        self, tokens, targets, loss_mask, *, dense: bool, indexer_kl_weight: float
    ) -> dict[str, jax.Array]:
        if self.mesh is not None:
            n_data = self.mesh.shape["data"]
            if tokens.shape[0] % n_data:
                raise ValueError(
                    f"batch: expected a batch size divisible by the mesh's data={n_data}, got "
                    f"{tokens.shape[0]}"
                )
            n_context = self.mesh.shape["context"]
            window = self.window if n_context > 1 else 1
            if tokens.shape[1] % (n_context * window):
                raise ValueError(
                    f"batch: expected a sequence length divisible by the mesh's context × "
                    f"window_size = {n_context * window}, got {tokens.shape[1]}"
                )
            tokens, targets, loss_mask = jax.device_put((tokens, targets, loss_mask), self.split)
        in_mesh = jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext()
        with rundir.deferred_interrupts(), in_mesh:
            values, metrics = self.step(
                [v.get_raw_value() for v in self.variables],
                tokens,
                targets,
                loss_mask,
                dense=dense,
                indexer_kl_weight=indexer_kl_weight,
            )
            for variable, value in zip(self.variables, values, strict=True):
                variable.set_raw_value(value)
        return metrics


StepHook = Callable[[int, dict[str, jax.Array]], bool | None]
"""Called after each step with (steps done, the step's metrics as device arrays); returning
True stops the loop after that step. Reading a metric waits for the step to finish."""


def train_steps(
    model: Model,
    optimizer: nnx.Optimizer,
    cfg: TrainConfig,
    task: tasks_lib.RetrievalTask,
    start: int,
    end: int,
    on_step: StepHook | None = None,
    *,
    mesh: Mesh | None = None,
) -> int:
    """The training loop: steps `start`..`end`−1, step k on batch (cfg.seed, k) in its stage
    (`cfg.dense_at(k)`), so a resumed run sees exactly the data of an uninterrupted one.

    `run` drives it with logging, evaluation and checkpoints in `on_step`; a study that needs
    another loop (timing every step, evaluating on its own schedule) passes its own hook.
    `mesh` (`make_mesh`): train data-parallel over its devices.

    Returns:
      the number of steps done (`end`, or where `on_step` stopped the loop).
    """
    done = start
    step_fn = StepRunner(model, optimizer, mesh)
    for step in range(start, end):
        batch = task.batch_at(cfg.seed, step, cfg.batch_size)
        metrics = step_fn(
            jnp.asarray(batch.tokens),
            jnp.asarray(batch.targets),
            jnp.asarray(batch.loss_mask),
            dense=cfg.dense_at(step),
            indexer_kl_weight=cfg.indexer_kl_weight,
        )
        done = step + 1
        if on_step is not None and on_step(done, metrics):
            break
    return done


def build(cfg: TrainConfig) -> tuple[Model, nnx.Optimizer]:
    """A freshly initialized model (from `cfg.seed`) and its optimizer; `cfg.init_from` is
    applied by `initialize_from`, not here."""
    model = Model(cfg.model_config(), rngs=nnx.Rngs(cfg.seed))
    return model, make_optimizer(model, cfg)


def initialize_from(model: Model, cfg: TrainConfig) -> Path | None:
    """Copies the weights of `cfg.init_from`'s latest checkpoint into `model` (nothing when it
    is ''); returns the run directory read, or None.

    Raises `RunDirectoryError` when there is no run there, and ValueError naming the first
    parameter whose shape or dtype differs from `model`'s."""
    if not cfg.init_from:
        return None
    source_dir = Path(cfg.init_from.format(seed=cfg.seed))
    _, source = load(source_dir)
    ours = nnx.to_flat_state(nnx.state(model, nnx.Param))
    theirs = dict(nnx.to_flat_state(nnx.state(source, nnx.Param)))
    if set(theirs) != set(ours.paths):
        missing = sorted(set(ours.paths) ^ set(theirs), key=str)[:3]
        raise ValueError(
            f"TrainConfig.init_from: the model of {source_dir} has other parameters than this "
            f"run's (first differences: {missing}); expected the same preset and shape fields"
        )
    for path, variable in ours:
        want, got = variable.get_value(), theirs[path].get_value()
        if (want.shape, want.dtype) != (got.shape, got.dtype):
            raise ValueError(
                f"TrainConfig.init_from: parameter {'/'.join(map(str, path))} of {source_dir} "
                f"is {got.dtype}{list(got.shape)}, expected {want.dtype}{list(want.shape)} "
                "(this run's model)"
            )
    nnx.update(model, nnx.state(source, nnx.Param))
    return source_dir


def metrics_to_json(metrics: dict) -> dict:
    """Device scalars → Python floats (for metrics.jsonl)."""
    return {k: float(v) for k, v in jax.device_get(metrics).items()}


EVAL_SEED_OFFSET = 1_000_003  # evaluation batches come from a seed training never uses


def _check_int(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value!r}")


def check_run_arguments(*, log_every, stop_after, max_seconds) -> None:
    """`run`'s loop arguments; ValueError names the one that is wrong."""
    _check_int("log_every", log_every, 1)
    if stop_after is not None:
        _check_int("stop_after", stop_after, 0)
    if max_seconds is not None and not (isinstance(max_seconds, int | float) and max_seconds > 0):
        raise ValueError(f"max_seconds: expected a positive number or None, got {max_seconds!r}")


class _Run:
    """The state of one `run` call: the model, its checkpoints and its records.

    The records of step k are written before checkpoint k, in the order of an uninterrupted run
    (train, then eval), so a checkpoint never lies behind its records; what Ctrl-C leaves
    unwritten is written before the checkpoint (the train record) or by the resume (the eval).
    """

    def __init__(self, cfg: TrainConfig, run_dir: Path, manager, *, progress: bool):
        self.cfg, self.run_dir, self.manager = cfg, run_dir, manager
        self.metrics_path = run_dir / rundir.METRICS
        self.model, self.optimizer = build(cfg)
        self.task = cfg.make_task()
        self.start = self.trained = manager.latest_step() or 0  # updates the model holds
        if self.start:
            rundir.restore(manager, self.start, self.model, self.optimizer)
        else:
            initialize_from(self.model, cfg)
        rundir.truncate_metrics(self.metrics_path, self.start)
        records = rundir.read_metrics(self.metrics_path) if self.metrics_path.exists() else []
        recorded = [r for r in records if r["split"] == "eval"]
        # (step, accuracy) of the recorded evaluations: what the convergence rule reads.
        self.evals = [(r["step"], r["accuracy"]) for r in recorded]
        self.unwritten = None  # the train metrics of the latest step, until recorded
        # The eval record of the step a resumed run continues from, if it holds one.
        self.result = next(
            (
                {k: v for k, v in r.items() if k not in ("step", "split")}
                for r in recorded
                if self.start and r["step"] == self.start
            ),
            None,
        )
        self.evaluated_at = self.start
        if self.result is None:
            self.evaluated_at = None
            if self.start and self.scheduled("eval", self.start):
                self.evaluate(self.start)
        self.bar = tqdm(
            total=cfg.steps, initial=self.start, disable=not progress, desc=run_dir.name
        )

    def scheduled(self, what: str, done: int, log_every: int = 0) -> bool:
        every = {"eval": self.cfg.eval_every, "train": log_every}[what]
        return done % every == 0 or done == self.cfg.steps

    def evaluate(self, step: int, *, dense: bool | None = None, record: bool = True) -> dict:
        """Evaluates in the step's attention mode (kept as the run's result, and recorded when
        `record`), or in the mode `dense` asks (returned only)."""
        result = self._evaluate(self.model, self.cfg.dense_at(step) if dense is None else dense)
        if dense is None:
            self.result, self.evaluated_at = result, step
            if record:
                rundir.append_metrics(self.metrics_path, {"step": step, "split": "eval", **result})
                self.evals.append((step, result["accuracy"]))
        return result

    @property
    def converged(self) -> bool:
        """Whether the recorded evaluations meet the config's convergence rule."""
        return self.cfg.converged(self.evals)

    def _write_train_record(self, done: int) -> None:
        record = metrics_to_json(self.unwritten)
        rundir.append_metrics(self.metrics_path, {"step": done, "split": "train", **record})
        self.bar.set_postfix(loss=f"{record['task_loss']:.3f}", acc=f"{record['accuracy']:.2f}")
        self.unwritten = None

    def saves_at(self, done: int, end: int, out_of_time: bool) -> bool:
        return done % self.cfg.checkpoint_every == 0 or done == end or out_of_time

    def uses_model(self, done: int, end: int, out_of_time: bool) -> bool:
        """Whether `after_step(done, ...)` reads the model (an evaluation or a checkpoint)."""
        return self.scheduled("eval", done) or self.saves_at(done, end, out_of_time)

    def after_step(
        self, done: int, metrics: dict | None, *, end: int, log_every: int, out_of_time: bool
    ) -> None:
        """The records, evaluation and checkpoint of step `done`, in that order. `metrics` (the
        step's train metrics) is read only at a train record; a caller may pass None between."""
        self.trained = done
        if self.scheduled("train", done, log_every):
            self.unwritten = metrics
            self._write_train_record(done)
        if self.scheduled("eval", done):
            self.evaluate(done)
        if self.saves_at(done, end, out_of_time or self.converged):
            rundir.save(self.manager, done, self.model, self.optimizer)
        self.bar.update(1)

    def train(
        self, end: int, *, log_every: int, max_seconds: float | None, mesh: Mesh | None = None
    ) -> int:
        """Steps start..end−1 with their records and checkpoints; returns the steps done."""
        clock = time.perf_counter()

        def after_step(done: int, metrics: dict) -> bool:
            out_of_time = max_seconds is not None and time.perf_counter() - clock > max_seconds
            self.after_step(done, metrics, end=end, log_every=log_every, out_of_time=out_of_time)
            return out_of_time or self.converged

        try:
            done = train_steps(
                self.model,
                self.optimizer,
                self.cfg,
                self.task,
                self.start,
                end,
                after_step,
                mesh=mesh,
            )
        except KeyboardInterrupt:
            self.save_interrupted()
            raise
        finally:
            self.bar.close()
        self.seconds = time.perf_counter() - clock
        return done

    def save_interrupted(self) -> None:
        if self.trained == self.start:
            return
        if self.manager.latest_step() != self.trained:
            if self.unwritten is not None:
                self._write_train_record(self.trained)
            rundir.save(self.manager, self.trained, self.model, self.optimizer)
        print(f"\ninterrupted: saved step {self.trained} in {self.run_dir}; continue with resume")

    def evaluate_pool_of_one(self, result: dict) -> dict | None:
        """The model evaluated as the run evaluates itself (`result`, its sparse evaluation),
        but with a candidate pool of one block (the pinned newest): how much its answers depend
        on what the pool holds. `result` itself where the pool is one block already; None where
        no layer is restricted to the pool."""
        config = self.model.config
        if not any(plan.uses_candidates for plan in config.layers):
            return None
        if config.candidate_topk_blocks == 1:
            return result
        return self._evaluate(with_fields(self.model, candidate_topk_blocks=1), dense=False)

    def _evaluate(self, model: Model, dense: bool) -> dict:
        """`model` on the run's held-out batches (those of every evaluation of the run)."""
        return evaluate_lib.evaluate(
            model,
            self.task,
            seed=self.cfg.seed + EVAL_SEED_OFFSET,
            batches=self.cfg.eval_batches,
            batch_size=self.cfg.batch_size,
            dense=dense,
        )

    def summary(self, step: int) -> dict:
        """The run's final evaluation; when sparse, also the same weights with dense attention
        and with a pool of one block."""
        result = self.result
        if self.evaluated_at != step:
            # A run stopped short of its schedule: this evaluation is the summary's, not a
            # record (the uninterrupted run has none here, and a resume must write the same file).
            result = self.evaluate(step, record=False)
        if self.cfg.attention == "sparse" and not self.cfg.dense_at(step):
            # The same parameters with every layer attending to all visible entries: what the
            # pool and the top-k cost this model.
            dense = self.evaluate(step, dense=True)
            result = {
                **result,
                "dense_accuracy": dense["accuracy"],
                "dense_task_loss": dense["task_loss"],
            }
            # And with a pool of one block: whether the answers go through the pool at all (the
            # layers before the Reindex layers select over every position).
            if (one := self.evaluate_pool_of_one(result)) is not None:
                result |= {"pool1_accuracy": one["accuracy"], "pool1_task_loss": one["task_loss"]}
        return {
            "step": step,
            "train_seconds": self.seconds,
            "resumed_from": self.start,
            "stopped_early": step < self.cfg.steps and not self.converged,
            "converged": self.converged,
            **result,
        }

    def finish(self, step: int) -> dict:
        """Writes summary.json and training.png of a run that ended at `step`; returns the
        summary (`summary`)."""
        summary = self.summary(step)
        rundir.plot_run(self.metrics_path, self.run_dir / "training.png")
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
        return summary


def run(
    cfg: TrainConfig,
    run_dir: str | Path,
    *,
    resume: bool = False,
    progress: bool = True,
    stop_after: int | None = None,
    max_seconds: float | None = None,
    log_every: int = 10,
    mesh: Mesh | None = None,
) -> dict:
    """Trains `cfg` in `run_dir` (config.json, metrics.jsonl, checkpoints/, training.png).

    The run directory keeps the guarantees of `v41jax.train.rundir`: it never overwrites a
    user's files, Ctrl-C checkpoints the steps the model holds, and a resume continues from the
    latest checkpoint so that metrics.jsonl ends byte-identical to an uninterrupted run's
    (batches depend only on (seed, step)).

    Args:
      cfg: the run's configuration.
      run_dir: its directory: new, empty, or (with `resume`) holding a run of `cfg`.
      resume: continue the run in `run_dir` from its latest checkpoint. A run directory without
        a checkpoint (or none at all) starts at step 0, and says so.
      progress: show a progress bar.
      stop_after: stop (with a checkpoint) after this many steps, as an interruption would.
      max_seconds: a guard, not a budget: stop (with a checkpoint) once training has taken
        this long; `resume` continues from there. The result then depends on the machine's
        speed, which `stopped_early` reports.
      log_every: steps between training-metric records.
      mesh: train data-parallel over this mesh's devices (`make_mesh`); the result equals the
        one-device run's within float tolerance (the gradient's sum is taken in another order).

    Returns:
      the final evaluation (see `evaluate.evaluate`); for a run that ends sparse, the same
      weights' 'dense_accuracy' and 'dense_task_loss' (every layer attending to everything) and
      'pool1_accuracy' and 'pool1_task_loss' (a candidate pool of one block: near the accuracy,
      the answers do not go through the pool); plus 'step', 'stopped_early' (the step or
      time limit ended the run before `cfg.steps`), 'converged' (its evaluations meet the
      convergence rule, `TrainConfig.converge_accuracy`; it then stops before `cfg.steps`),
      'resumed_from' (the checkpoint step this call continued from, 0 for a fresh run) and
      'train_seconds' (the training time of this call alone: a resumed run counts only the
      steps it trained now).
    """
    check_run_arguments(log_every=log_every, stop_after=stop_after, max_seconds=max_seconds)
    check_mesh(mesh, cfg)
    run_dir = Path(run_dir)
    held = rundir.prepare(run_dir, cfg.to_json(), resume, LEGACY_FIELDS)
    with rundir.checkpoint_manager(run_dir, cfg.keep_checkpoints) as manager:
        state = _Run(cfg, run_dir, manager, progress=progress)
        if held and not state.start:
            print(f"nothing to resume in {run_dir} (no checkpoint yet): training from step 0")
        end = cfg.steps if stop_after is None else min(cfg.steps, stop_after)
        if state.converged:  # a resumed run that had met its convergence rule: nothing to train
            end = state.start
        step = state.train(end, log_every=log_every, max_seconds=max_seconds, mesh=mesh)
    return state.finish(step)


RunDirectoryError = rundir.RunDirectoryError


def summarize(cfg: TrainConfig, run_dir: str | Path, result: dict) -> str:
    """A short text summary of `run`'s result: accuracy with the pool vs dense attention, pool
    recall against the random, most-recent and oracle block baselines, where things are."""
    trained = f"{result['step']}/{cfg.steps} steps"
    resumed = result.get("resumed_from", 0)
    if resumed == result["step"]:
        trained += ", all trained before: evaluated again"
    else:
        since = f" from step {resumed}" if resumed else ""
        trained += f", {result['train_seconds']:.0f} s of training{since} in this call"
    lines = [
        "",
        f"run: {run_dir}  ({trained}"
        + ("; stopped early: --resume continues)" if result["stopped_early"] else ")")
        + (
            f"; converged: the last {cfg.converge_evals} evaluations >= {cfg.converge_accuracy:.0%}"
            if result.get("converged")
            else ""
        ),
        f"task accuracy (scored positions): {result['accuracy']:.1%} with "
        + ("dense attention" if cfg.attention == "dense" else "the candidate pool"),
    ]
    if "dense_accuracy" in result:
        lines.append(
            f"  same weights, dense attention:  {result['dense_accuracy']:.1%}  "
            f"(gap {result['dense_accuracy'] - result['accuracy']:+.1%})"
        )
    if "pool1_accuracy" in result:
        lines.append(
            f"  same weights, a pool of one block: {result['pool1_accuracy']:.1%}  "
            f"(gap {result['pool1_accuracy'] - result['accuracy']:+.1%}: how much the answers "
            "need the pool)"
        )
    layers = sorted({k.split("/")[0] for k in result if k.endswith("/pool_recall")})
    if layers:
        lines.append(
            "pool recall of each Reindex layer's own top-k (queries beyond the pool), against "
            "random / most-recent / oracle blocks; within-pool recall of the dense attention's "
            "top-k; attention mass kept by the selection:"
        )
        headers = ("pool", "random", "recent", "oracle", "within", "mass")
        lines.append(f"  {'layer':<8} " + "   ".join(f"{h:>6}" for h in headers))
        for layer in layers:
            names = ("", "_random", "_recent", "_oracle")
            cells = [result.get(f"{layer}/pool_recall{n}") for n in names]
            cells += [
                result.get(f"{layer}/within_pool_recall"),
                result.get(f"{layer}/mass_selected"),
            ]
            text = ["   n/a" if v is None else f"{v:6.1%}" for v in cells]
            lines.append(f"  {layer:<8} " + "   ".join(text))
    lines.append(f"curves: {Path(run_dir) / 'training.png'}; numbers: metrics.jsonl, summary.json")
    return "\n".join(lines)


def load(run_dir: str | Path, step: int | None = None) -> tuple[TrainConfig, Model]:
    """The config and the model of a run directory, at checkpoint `step` (default: the latest).

    Raises `RunDirectoryError` when the directory holds no run or the checkpoint is unreadable.
    """
    run_dir = Path(run_dir)
    config_path = run_dir / rundir.CONFIG
    if not config_path.exists():
        raise RunDirectoryError(
            f"run_dir: expected a run directory with config.json, got {run_dir}"
        )
    cfg = TrainConfig.from_json(json.loads(config_path.read_text()))
    model, optimizer = build(cfg)
    manager = rundir.checkpoint_manager(run_dir, cfg.keep_checkpoints)
    try:
        step = manager.latest_step() if step is None else step
        if step is None or step not in manager.all_steps():
            raise RunDirectoryError(
                f"step: expected one of the checkpoints {sorted(manager.all_steps())} in "
                f"{run_dir}, got {step}"
            )
        rundir.restore(manager, step, model, optimizer)
    finally:
        manager.close()
    return cfg, model
