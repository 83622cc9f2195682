"""A run directory that survives: it never overwrites a user's files, checkpoints atomically under
the step the model really holds, refuses a damaged checkpoint, and resumes exactly.

    run_dir/
      config.json      the `TrainConfig` (a resume must ask for the same one)
      metrics.jsonl    one JSON record per line: {"step", "split": "train" | "eval", ...}
      checkpoints/     orbax: model and optimizer state of the latest `keep` steps
      summary.json     the final evaluation (written at the end of each call)
      training.png     the curves

Guarantees (tests/test_hardening.py checks each):
- A directory that exists and holds anything but a run is refused before anything is written;
  so is a run of another config, a resume whose metrics file is unreadable, and a damaged
  checkpoint (`RunDirectoryError`), each leaving every file as it was.
- A checkpoint is saved under the number of updates the model holds, also when Ctrl-C arrives
  during an evaluation or a save; further Ctrl-Cs during a save wait until it is complete, and
  an interrupted save leaves no temporary folder behind after the next start.
- Resuming truncates `metrics.jsonl` to the checkpoint's step and replays the same batches, so
  the file ends byte-identical to an uninterrupted run's.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from flax import nnx

from v41jax.nn.model import Model

CONFIG = "config.json"
_PARTIAL_CONFIG = ".config.json.partial"
METRICS = "metrics.jsonl"
CHECKPOINTS = "checkpoints"


class RunDirectoryError(ValueError):
    """The run directory cannot be used as asked (holds other files, another run's config, an
    unreadable metrics file or checkpoint); nothing in it was changed."""


def _records(path: str | Path) -> list[tuple[str, dict]]:
    """(line, record) of every line of a metrics.jsonl; RunDirectoryError names the first line
    that is not a record. A last line without its newline is an append that a kill cut short:
    it is left out (its step lies after the latest checkpoint, which is saved after it)."""
    text = Path(path).read_text()
    lines = text.split("\n")[:-1]  # the piece after the last newline is empty or cut short
    pairs = []
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            record = None
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            raise RunDirectoryError(
                f"{path}: line {number} is not a metrics record ({line[:60]!r}); "
                "nothing in the run directory was changed"
            )
        pairs.append((line, record))
    return pairs


def read_metrics(path: str | Path) -> list[dict]:
    """The records of a metrics.jsonl (RunDirectoryError names the first line that is not one)."""
    return [record for _, record in _records(path)]


def append_metrics(path: Path, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def truncate_metrics(path: Path, step: int) -> None:
    """Drops records after `step`: a resumed run writes them again, exactly."""
    if path.exists():
        kept = [line for line, record in _records(path) if record["step"] <= step]
        path.write_text("".join(line + "\n" for line in kept))


def check(run_dir: Path, config: dict, resume: bool, legacy: dict | None = None) -> bool:
    """`prepare`'s checks alone, writing nothing: whether `run_dir` holds a run of `config`
    (its JSON); RunDirectoryError when it cannot be used as asked. `legacy` maps fields added
    after some runs were written to the value those runs trained with: a saved config without
    such a field matches a requested one holding that value."""
    config_path, partial = run_dir / CONFIG, run_dir / _PARTIAL_CONFIG
    config = json.loads(json.dumps(config))  # as saved: a tuple reads back as a list
    if run_dir.exists() and not run_dir.is_dir():
        raise RunDirectoryError(f"run directory {run_dir} is a file; choose a directory")
    if not config_path.exists():
        others = (
            sorted(p.name for p in run_dir.iterdir() if p != partial) if run_dir.exists() else []
        )
        if others:
            raise RunDirectoryError(
                f"run directory {run_dir} exists and holds files that are not a run "
                f"({', '.join(others[:5])}); a run never writes into them: choose a new or "
                "empty directory"
            )
        return False
    if not resume:
        raise RunDirectoryError(
            f"run directory {run_dir} already holds a run; pass resume=True (--resume) to "
            "continue it, or choose another directory"
        )
    try:
        saved = json.loads(config_path.read_text())
    except json.JSONDecodeError:
        raise RunDirectoryError(f"{config_path} is not JSON; nothing was changed") from None
    for key, value in (legacy or {}).items():
        saved.setdefault(key, value)
    if saved != config:
        diff = {k: (saved.get(k), config.get(k)) for k in config if saved.get(k) != config[k]}
        raise RunDirectoryError(
            f"run directory {run_dir} was trained with another config; differing fields "
            f"(saved, requested): {diff}"
        )
    if (run_dir / METRICS).exists():
        read_metrics(run_dir / METRICS)
    return True


def prepare(run_dir: Path, config: dict, resume: bool, legacy: dict | None = None) -> bool:
    """Checks `run_dir` for a run of `config` (its JSON), then creates it if it is new.

    Returns whether it already held that run. Every check runs before anything is written:
    a directory holding other files, a run of another config, a run without `resume`, or an
    unreadable metrics file raise `RunDirectoryError` and leave the directory untouched.
    """
    if check(run_dir, config, resume, legacy):
        return True
    partial = run_dir / _PARTIAL_CONFIG
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        # Written whole or not at all: a kill here leaves no half config behind.
        partial.write_text(json.dumps(config, indent=2))
        os.replace(partial, run_dir / CONFIG)
    except OSError as err:
        raise RunDirectoryError(f"run directory {run_dir} cannot be written: {err}") from None
    return False


@contextlib.contextmanager
def deferred_interrupts():
    """Ctrl-C (SIGINT) inside the block waits until the block is done, then raises
    KeyboardInterrupt: a save is never cut in half. Only the main thread can hold signals, and
    only Python's own Ctrl-C handler is replaced (a process that ignores SIGINT, or handles it
    itself, keeps its way); otherwise the block runs as is."""
    main = threading.current_thread() is threading.main_thread()
    if not main or signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield
        return
    pending = []
    previous = signal.signal(signal.SIGINT, lambda *_: pending.append(True))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if pending:
        raise KeyboardInterrupt


def checkpoint_manager(run_dir: Path, keep: int) -> ocp.CheckpointManager:
    """Orbax's manager of run_dir/checkpoints, keeping the latest `keep` (at least 1) and
    removing the temporary folders an interrupted save may have left."""
    options = ocp.CheckpointManagerOptions(
        max_to_keep=max(keep, 1), create=True, cleanup_tmp_directories=True
    )
    return ocp.CheckpointManager(run_dir.absolute() / CHECKPOINTS, options=options)


def save(manager, step: int, model: Model, optimizer: nnx.Optimizer) -> None:
    """Saves model and optimizer as checkpoint `step`, whole (Ctrl-C waits, see
    `deferred_interrupts`)."""
    state = {
        "model": nnx.to_pure_dict(nnx.state(model)),
        "opt": nnx.to_pure_dict(nnx.state(optimizer)),
    }
    with deferred_interrupts():
        manager.save(step, args=ocp.args.StandardSave(state), force=True)
        manager.wait_until_finished()


def restore(manager, step: int, model: Model, optimizer: nnx.Optimizer) -> None:
    """Loads checkpoint `step` into `model` and `optimizer`; RunDirectoryError if it is damaged
    or of another model."""
    model_state, opt_state = nnx.state(model), nnx.state(optimizer)
    target = {"model": nnx.to_pure_dict(model_state), "opt": nnx.to_pure_dict(opt_state)}
    try:
        restored = manager.restore(step, args=ocp.args.StandardRestore(target))
    except Exception as err:  # orbax raises many types for a damaged or foreign checkpoint
        reason = str(err).splitlines()[0] if str(err) else ""
        raise RunDirectoryError(
            f"checkpoint {step} in {manager.directory} could not be restored "
            f"({type(err).__name__}: {reason[:200]}); nothing in the run directory was changed. "
            "Remove that step's folder to fall back to an older checkpoint, or start a new run "
            "in another directory."
        ) from None
    # Uncommitted, as a freshly built model's arrays are: jit keys its compilations on whether
    # an argument is committed to a device, so restored arrays as orbax returns them (committed)
    # would compile the train step and the evaluation once more in every resumed run.
    restored = jax.tree.map(lambda x: jnp.asarray(jax.device_get(x)), restored)
    nnx.replace_by_pure_dict(model_state, restored["model"])
    nnx.replace_by_pure_dict(opt_state, restored["opt"])
    nnx.update(model, model_state)
    nnx.update(optimizer, opt_state)


def plot_run(metrics_path: Path, out: Path) -> None:
    """Training curves: task loss and accuracy (train and eval), indexer KL, pool recall."""
    # A bare Figure (no pyplot): saving it never changes the caller's matplotlib backend.
    from matplotlib.figure import Figure

    records = read_metrics(metrics_path) if metrics_path.exists() else []
    train_rec = [r for r in records if r["split"] == "train"]
    eval_rec = [r for r in records if r["split"] == "eval"]
    fig = Figure(figsize=(14, 3.8))
    axes = fig.subplots(1, 3)
    steps = [r["step"] for r in train_rec]
    axes[0].plot(steps, [r["task_loss"] for r in train_rec], label="train")
    axes[0].plot(
        [r["step"] for r in eval_rec], [r["task_loss"] for r in eval_rec], "o-", label="eval"
    )
    axes[0].set(title="task loss", xlabel="step", yscale="log")
    axes[1].plot(steps, [r["accuracy"] for r in train_rec], label="train")
    axes[1].plot(
        [r["step"] for r in eval_rec], [r["accuracy"] for r in eval_rec], "o-", label="eval"
    )
    axes[1].set(title="accuracy on scored positions", xlabel="step", ylim=(0, 1.02))
    axes[2].plot(steps, [r["indexer_kl"] for r in train_rec], label="indexer KL (train)")
    recall_keys = sorted({k for r in eval_rec for k in r if k.endswith("/pool_recall")})
    for k in recall_keys:
        axes[2].plot(
            [r["step"] for r in eval_rec if k in r],
            [r[k] for r in eval_rec if k in r],
            "o-",
            label=k,
        )
    axes[2].set(title="indexer KL and pool recall", xlabel="step")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
