"""Many seeds in one program (DESIGN §7: "seeds of a study run together in one program where the
device has room").

N runs that differ only in their seed (parameter init and data) train as one: their models' and
optimizers' values are stacked on a leading seed axis and one `jax.jit` of `jax.vmap` over the
loop's step (`trainer._step_on_values`) updates all of them, seed i on its own batch
(cfgs[i].seed, k) — [N, B, T] tokens a step. A tiny() step is launch-bound on a GPU, so N seeds
cost little more than one. There is one compiled program per stage (dense warm-up, sparse), as
for a single run.

Each seed keeps a run directory of its own, `run_dir/seed<k>/`, holding exactly what
`trainer.run` writes for it (config.json, metrics.jsonl, checkpoints/, summary.json,
training.png): its records, evaluations and checkpoints follow the single run's schedule, and a
resume continues each seed from its own latest checkpoint. A seed trained in a group equals the
same seed trained alone within float tolerance (a vmapped product may round differently), and a
group resumed from its checkpoints ends identical to an uninterrupted group.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from v41jax.nn.model import Model
from v41jax.train import rundir, trainer
from v41jax.train import tasks as tasks_lib

SEED_DIR = "seed{seed}"
"""A seed's run directory inside a group's (`run_dir / SEED_DIR.format(seed=k)`)."""


def check_group(cfgs: Sequence[trainer.TrainConfig]) -> tuple[trainer.TrainConfig, ...]:
    """`cfgs` as a tuple, checked to be runs of one group: at least one, all `TrainConfig`s,
    distinct seeds, every other field equal to cfgs[0]'s. ValueError names what is wrong."""
    cfgs = tuple(cfgs)
    if not cfgs:
        raise ValueError("cfgs: expected at least one TrainConfig, got an empty sequence")
    for i, cfg in enumerate(cfgs):
        if not isinstance(cfg, trainer.TrainConfig):
            raise ValueError(f"cfgs[{i}]: expected a TrainConfig, got {type(cfg).__name__}")
    seeds = [cfg.seed for cfg in cfgs]
    repeated = sorted({s for s in seeds if seeds.count(s) > 1})
    if repeated:
        raise ValueError(f"cfgs: expected distinct seeds, got seeds {seeds} ({repeated} repeated)")
    for i, cfg in enumerate(cfgs[1:], 1):
        for field in dataclasses.fields(cfg):
            want, got = getattr(cfgs[0], field.name), getattr(cfg, field.name)
            if field.name != "seed" and got != want:
                raise ValueError(
                    f"cfgs[{i}].{field.name}: expected {want!r} as in cfgs[0] (the runs of a "
                    f"group differ only in their seed), got {got!r}"
                )
    return cfgs


def default_group_size(n_seeds: int) -> int:
    """How many seeds train together by default: all of them on an accelerator, where a small
    model's step is launch-bound and N seeds cost about one; one on the CPU, where a step
    already keeps the cores busy and a group would only add memory."""
    return n_seeds if jax.default_backend() != "cpu" else 1


def seed_groups(
    cfgs: Sequence[trainer.TrainConfig], group_size: int | None = None
) -> list[tuple[trainer.TrainConfig, ...]]:
    """`cfgs` (checked by `check_group`) cut in order into groups of at most `group_size`
    seeds (default: `default_group_size`): the groups `run_seeds` trains one after another."""
    cfgs = check_group(cfgs)
    if group_size is None:
        group_size = default_group_size(len(cfgs))
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size: expected an int >= 1 or None, got {group_size!r}")
    return [cfgs[i : i + group_size] for i in range(0, len(cfgs), group_size)]


def _group_step_on_values(
    values, active, tokens, targets, loss_mask, *, graphdef, paths, dense, indexer_kl_weight
):
    """`_step_on_values` of every seed at once: `values` stacked [N, ...], batches [N, B, T];
    a seed whose `active` is False keeps its values (its checkpoint lies ahead of the group)."""
    step = functools.partial(
        trainer._step_on_values,
        graphdef=graphdef,
        paths=paths,
        dense=dense,
        indexer_kl_weight=indexer_kl_weight,
    )
    new, metrics = jax.vmap(step)(values, tokens, targets, loss_mask)
    kept = [
        jnp.where(active.reshape(active.shape + (1,) * (n.ndim - 1)), n, v)
        for n, v in zip(new, values, strict=True)
    ]
    return kept, metrics


@functools.lru_cache(maxsize=32)
def _compiled_group_step(graphdef, paths: tuple) -> Callable:
    # As `trainer._compiled_step`: one jitted function per model structure (it compiles once per
    # group size and stage), the stacked values donated (updated in place on the device).
    return jax.jit(
        functools.partial(_group_step_on_values, graphdef=graphdef, paths=paths),
        static_argnames=("dense", "indexer_kl_weight"),
        donate_argnums=0,
    )


class GroupStepRunner:
    """`trainer.StepRunner` for N (model, optimizer) pairs of one structure: their values live
    stacked on the device ([N, ...] per variable) and one jitted, vmapped step updates them.

    The models themselves are not updated by a step: `write_back` copies the stacked values
    into their variables, for an evaluation or a checkpoint (a copy per step would cost more
    than a tiny() step on a GPU).
    """

    def __init__(self, pairs: Sequence[tuple[Model, nnx.Optimizer]]):
        runners = [trainer.StepRunner(model, optimizer) for model, optimizer in pairs]
        if not runners:
            raise ValueError("pairs: expected at least one (model, optimizer), got none")
        first = runners[0]
        self.size = len(runners)
        self.variables = [runner.variables for runner in runners]
        per_seed = [[v.get_raw_value() for v in vs] for vs in self.variables]
        shapes = [[(x.shape, x.dtype) for x in values] for values in per_seed]
        for i, runner in enumerate(runners[1:], 1):
            if (runner.paths, runner.graphdef, shapes[i]) != (
                first.paths,
                first.graphdef,
                shapes[0],
            ):
                raise ValueError(
                    f"pairs[{i}]: expected a model and optimizer of the structure and shapes of "
                    "pairs[0] (one config, another seed), got another"
                )
        self.values = [jnp.stack(column) for column in zip(*per_seed, strict=True)]
        self.step = _compiled_group_step(first.graphdef, first.paths)

    def __call__(
        self,
        tokens,
        targets,
        loss_mask,
        *,
        active: jax.Array,
        dense: bool,
        indexer_kl_weight: float,
    ) -> dict[str, jax.Array]:
        """One step of every seed whose `active` ([N] bool) is True; returns the step's metrics,
        each stacked [N] (an inactive seed's are computed and meaningless)."""
        with rundir.deferred_interrupts():
            self.values, metrics = self.step(
                self.values,
                active,
                tokens,
                targets,
                loss_mask,
                dense=dense,
                indexer_kl_weight=indexer_kl_weight,
            )
        return metrics

    def write_back(self) -> None:
        """Sets every model's and optimizer's variables to their seed's current values."""
        with rundir.deferred_interrupts():
            columns = [list(stacked) for stacked in self.values]  # one unstack per variable
            for i, variables in enumerate(self.variables):
                for variable, column in zip(variables, columns, strict=True):
                    variable.set_raw_value(column[i])


GroupStepHook = Callable[[int, dict[str, jax.Array], tuple[bool, ...]], bool | None]
"""Called after each group step with (steps done, the step's metrics stacked [N] as device
arrays, which seeds stepped); returning True stops the loop after that step."""


def train_group_steps(
    runner: GroupStepRunner,
    cfgs: Sequence[trainer.TrainConfig],
    task: tasks_lib.RetrievalTask,
    starts: Sequence[int],
    end: int,
    on_step: GroupStepHook | None = None,
) -> int:
    """The group's training loop (`trainer.train_steps` for N seeds): steps min(starts)..end−1,
    seed i's step k on its batch (cfgs[i].seed, k) in the stage `cfgs[0].dense_at(k)`. Seed i
    steps from starts[i] on; before, it waits unchanged (its checkpoint lies ahead).

    Ctrl-C waits for the end of a step and its hook, so the models, records and checkpoints the
    hook keeps always agree on the steps done.

    Returns:
      the number of steps done by the last seeds to step (`end`, or where `on_step` stopped).
    """
    cfgs = check_group(cfgs)
    if len(cfgs) != runner.size or len(starts) != runner.size:
        raise ValueError(
            f"cfgs, starts: expected {runner.size} of each (the runner's seeds), got "
            f"{len(cfgs)} and {len(starts)}"
        )
    done = min(starts)
    active, active_on_device = None, None
    for step in range(min(starts), end):
        if active != (now := tuple(start <= step for start in starts)):
            active, active_on_device = now, jnp.asarray(now)
        batches = [task.batch_at(cfg.seed, step, cfg.batch_size) for cfg in cfgs]
        with rundir.deferred_interrupts():
            metrics = runner(
                *(jnp.asarray(np.stack([getattr(b, name) for b in batches])) for name in _BATCH),
                active=active_on_device,
                dense=cfgs[0].dense_at(step),
                indexer_kl_weight=cfgs[0].indexer_kl_weight,
            )
            done = step + 1
            if on_step is not None and on_step(done, metrics, active):
                break
    return done


_BATCH = ("tokens", "targets", "loss_mask")


def run_seeds(
    cfgs: Sequence[trainer.TrainConfig],
    run_dir: str | Path,
    *,
    group_size: int | None = None,
    resume: bool = False,
    progress: bool = True,
    stop_after: int | None = None,
    max_seconds: float | None = None,
    log_every: int = 10,
) -> list[dict]:
    """Trains the runs `cfgs` (one config, several seeds) in `run_dir/seed<k>/`, the seeds of a
    group in one program (see the module docstring).

    Every seed's run directory is checked before anything is written (`trainer.run`'s rules:
    RunDirectoryError, nothing changed). Groups of at most `group_size` seeds train one after
    another; a group of one is `trainer.run` itself.

    Args:
      cfgs: the runs; they differ only in `seed` (ValueError names the field otherwise).
      run_dir: the group's directory (the seeds' directories go inside; it must not itself hold
        a single run).
      group_size: seeds trained together (default `default_group_size`: all of them on an
        accelerator, one at a time on the CPU). Smaller groups need less device memory.
      resume, progress, stop_after, log_every: as for `trainer.run`, for every seed.
      max_seconds: a guard on the whole call's training, not each group's: a group starts with
        what the groups before it left (at least one step; `resume` continues it).

    Returns:
      each seed's summary (`trainer.run`'s result), in the order of `cfgs`.
    """
    groups = seed_groups(cfgs, group_size)
    trainer.check_run_arguments(log_every=log_every, stop_after=stop_after, max_seconds=max_seconds)
    run_dir = Path(run_dir)
    if (run_dir / rundir.CONFIG).exists():
        raise rundir.RunDirectoryError(
            f"run_dir: expected a directory for the seeds' run directories, got {run_dir}, "
            "which holds a single run; choose another directory"
        )
    for cfg in (cfg for group in groups for cfg in group):
        rundir.check(seed_dir(run_dir, cfg.seed), cfg.to_json(), resume, trainer.LEGACY_FIELDS)
    options = dict(
        resume=resume,
        progress=progress,
        stop_after=stop_after,
        max_seconds=max_seconds,
        log_every=log_every,
    )
    results, clock = [], time.perf_counter()
    for group in groups:
        if max_seconds is not None:
            # A spent guard still lets a group take one step (and checkpoint it): the result of
            # every seed is reported, stopped early.
            options["max_seconds"] = max(1e-9, max_seconds - (time.perf_counter() - clock))
        if len(group) == 1:
            results.append(trainer.run(group[0], seed_dir(run_dir, group[0].seed), **options))
        else:
            results += _run_group(group, run_dir, **options)
    return results


def seed_dir(run_dir: str | Path, seed: int) -> Path:
    """The run directory of seed `seed` in a group's directory `run_dir`."""
    return Path(run_dir) / SEED_DIR.format(seed=seed)


def _run_group(
    cfgs: tuple[trainer.TrainConfig, ...],
    run_dir: Path,
    *,
    resume: bool,
    progress: bool,
    stop_after: int | None,
    max_seconds: float | None,
    log_every: int,
) -> list[dict]:
    dirs = [seed_dir(run_dir, cfg.seed) for cfg in cfgs]
    held = [
        rundir.prepare(d, cfg.to_json(), resume, trainer.LEGACY_FIELDS)
        for cfg, d in zip(cfgs, dirs, strict=True)
    ]
    end = cfgs[0].steps if stop_after is None else min(cfgs[0].steps, stop_after)
    with contextlib.ExitStack() as stack:
        states = []
        for cfg, d, was_held in zip(cfgs, dirs, held, strict=True):
            manager = stack.enter_context(rundir.checkpoint_manager(d, cfg.keep_checkpoints))
            states.append(trainer._Run(cfg, d, manager, progress=False))
            if was_held and not states[-1].start:
                print(f"nothing to resume in {d} (no checkpoint yet): training from step 0")
        if all(state.converged for state in states):  # resumed after meeting the rule
            end = min(state.start for state in states)
        _train_group(states, end, log_every=log_every, max_seconds=max_seconds, progress=progress)
    return [state.finish(state.trained) for state in states]


def _train_group(
    states: list[trainer._Run],
    end: int,
    *,
    log_every: int,
    max_seconds: float | None,
    progress: bool,
) -> None:
    """Trains the seeds of `states` to `end` together, each with the records, evaluations and
    checkpoints of `trainer._Run.train`; Ctrl-C saves every seed at the step it holds."""
    runner = GroupStepRunner([(state.model, state.optimizer) for state in states])
    starts = [state.start for state in states]
    seeds = ", ".join(str(state.cfg.seed) for state in states)
    bar = tqdm(total=end, initial=min(starts), disable=not progress, desc=f"seeds {seeds}")
    clock = time.perf_counter()

    def after_step(done: int, metrics: dict, active: tuple[bool, ...]) -> bool:
        out_of_time = max_seconds is not None and time.perf_counter() - clock > max_seconds
        live = [state for state, stepped in zip(states, active, strict=True) if stepped]
        if any(state.uses_model(done, end, out_of_time) for state in live):
            runner.write_back()
        # The host waits for the step only where a train record is written.
        host = jax.device_get(metrics) if live[0].scheduled("train", done, log_every) else None
        for i, state in enumerate(states):
            if active[i]:
                seed_metrics = None if host is None else {k: v[i] for k, v in host.items()}
                state.after_step(
                    done, seed_metrics, end=end, log_every=log_every, out_of_time=out_of_time
                )
        bar.update(1)
        # The convergence rule stops a group once every seed meets it at the same time.
        return out_of_time or all(state.converged for state in states)

    task = states[0].task
    try:
        train_group_steps(runner, [s.cfg for s in states], task, starts, end, after_step)
    except KeyboardInterrupt:
        runner.write_back()
        for state in states:
            state.save_interrupted()
        raise
    finally:
        bar.close()
    runner.write_back()  # the summary evaluates the final models
    seconds = time.perf_counter() - clock
    for state in states:
        state.seconds = seconds
