"""The training layer: tasks, the trainer, evaluation and selection diagnostics (DESIGN §7).

Imports the model layer (`v41jax.nn`) and the ops; the CLI, experiments and notebooks sit on top.

| module        | what it holds                                                                  |
|---------------|--------------------------------------------------------------------------------|
| `tasks`       | synthetic retrieval tasks (MQAR, passkey), batches deterministic from a seed    |
| `trainer`     | `TrainConfig` (`make_config`), the loss (task + indexer KL), `train_step`, the   |
|               | loop (`train_steps`, with a hook) and a run that survives (`run`, `load`)       |
| `group`       | many seeds in one program: a vmapped step over stacked states (`run_seeds`)    |
| `rundir`      | the run directory: never overwrites, checkpoints and resumes exactly            |
| `evaluate`    | task accuracy and each Reindex layer's pool recall against baselines            |
| `diagnostics` | the selection-quality metrics (pool recall, within-pool recall, mass covered)   |

`from v41jax import train` gives the trainer's public names (`train.TrainConfig`, `train.run`,
`train.run_seeds`).
"""

from v41jax.train.group import (
    SEED_DIR,
    GroupStepHook,
    GroupStepRunner,
    check_group,
    default_group_size,
    run_seeds,
    seed_dir,
    seed_groups,
    train_group_steps,
)
from v41jax.train.rundir import RunDirectoryError, plot_run, read_metrics
from v41jax.train.trainer import (
    EVAL_SEED_OFFSET,
    MESH_AXES,
    StepHook,
    StepRunner,
    TrainConfig,
    build,
    check_mesh,
    initialize_from,
    load,
    loss_fn,
    make_config,
    make_mesh,
    make_optimizer,
    metrics_to_json,
    run,
    summarize,
    train_step,
    train_steps,
)

__all__ = [
    "EVAL_SEED_OFFSET",
    "MESH_AXES",
    "SEED_DIR",
    "GroupStepHook",
    "GroupStepRunner",
    "RunDirectoryError",
    "StepHook",
    "StepRunner",
    "TrainConfig",
    "build",
    "check_group",
    "check_mesh",
    "default_group_size",
    "initialize_from",
    "load",
    "loss_fn",
    "make_config",
    "make_mesh",
    "make_optimizer",
    "metrics_to_json",
    "plot_run",
    "read_metrics",
    "run",
    "run_seeds",
    "seed_dir",
    "seed_groups",
    "summarize",
    "train_group_steps",
    "train_step",
    "train_steps",
]
