"""What the ablation scripts share: the command line, a variant's seeds trained together
(`train.run_seeds`), mean ± std and 95 % t-interval summaries, the JSON report and the strip plots
(seeds as dots, their mean as a bar).

Every run has its own run directory (`--runs-dir`, default `runs/<experiment>/<variant>/seed<k>`)
and is resumed: running a study again continues the runs a time limit (`--max-minutes`) cut short
and re-evaluates the finished ones. The seeds of a variant share one compiled program on an
accelerator (`--group-size` seeds at a time; one at a time on the CPU). The report is rewritten
after every variant, so a study cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from scipy import stats

from v41jax import train
from v41jax.cli import name_value  # NAME=VALUE, as `v41jax train --task-set`
from v41jax.nn import config as config_lib
from v41jax.nn.model import Model
from v41jax.provenance import environment  # the one definition; report_config records it
from v41jax.train import evaluate, tasks

RESULTS_DIR = Path(__file__).resolve().parent / "results"
DEFAULT_SEEDS = (0, 1, 2)

# --smoke: seconds per run on 2 CPU cores, compile time dominating. Short sequences, a pool of 2
# blocks of 8 (16 positions) that still bites, no dense warm-up (one train step less to compile).
SMOKE_TRAIN = dict(
    steps=2,
    batch_size=2,
    lr_warmup_steps=1,
    dense_warmup_steps=0,
    eval_every=2,
    eval_batches=1,
    checkpoint_every=2,
)
# Four layers with every role a run trains (window only; Full and candidate source; Reindex;
# Reuse): about half of tiny()'s compilation.
SMOKE_LAYERS = dict(
    n_layers=4,
    compress_ratios=(0, 1, 1, 1),
    kv_source_layers=(1,),
    index_source_layers=(1, 2),
    candidate_source_layer=1,
)
SMOKE_MODEL = dict(SMOKE_LAYERS, candidate_topk_blocks=2, index_topk=8)
SMOKE_TASK = {
    "mqar": dict(seq_len=64, n_pairs=4, n_queries=2),
    "passkey": dict(seq_len=64, n_digits=3),
}
SMOKE_SEEDS = (0,)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options every study takes (defaults: `train.TrainConfig`'s)."""
    defaults = train.TrainConfig()
    parser.add_argument("--preset", choices=sorted(config_lib.PRESETS), help=f"({defaults.preset})")
    parser.add_argument("--task", choices=sorted(tasks.TASKS), help=f"({defaults.task})")
    parser.add_argument(
        "--task-set",
        action="append",
        default=[],
        type=name_value,
        metavar="NAME=VALUE",
        help="override a task field, e.g. --task-set seq_len=1024",
    )
    parser.add_argument(
        "--model-set",
        action="append",
        default=[],
        type=name_value,
        metavar="NAME=VALUE",
        help="override a ModelConfig field of the preset, e.g. --model-set candidate_topk_blocks=8",
    )
    parser.add_argument("--steps", type=int, help=f"optimizer steps per run ({defaults.steps})")
    parser.add_argument("--batch-size", type=int, help=f"({defaults.batch_size})")
    parser.add_argument("--dense-warmup-steps", type=int, help=f"({defaults.dense_warmup_steps})")
    parser.add_argument(
        "--lr", type=float, help=f"AdamW's peak learning rate ({defaults.learning_rate})"
    )
    parser.add_argument(
        "--init-from",
        metavar="RUN_DIR",
        help="start every run from this run's latest weights ({seed}: each seed's own run, e.g. "
        "runs/long_context_task/multi_passkey/short512-lr0.001/seed{seed}); fresh otherwise",
    )
    parser.add_argument("--eval-every", type=int, help=f"({defaults.eval_every})")
    parser.add_argument(
        "--eval-batches", type=int, help=f"batches per evaluation ({defaults.eval_batches})"
    )
    parser.add_argument(
        "--seeds",
        type=int,
        nargs="+",
        help=f"init and data seeds ({' '.join(map(str, DEFAULT_SEEDS))})",
    )
    parser.add_argument(
        "--out-dir",
        type=Path,
        help="where the JSON and PNG go (experiments/results; with --smoke a new temporary folder)",
    )
    parser.add_argument(
        "--runs-dir",
        type=Path,
        help="run directories (runs/<experiment>; with --smoke, in out-dir)",
    )
    parser.add_argument(
        "--max-minutes",
        type=float,
        help="stop each run after this long (with a checkpoint); running again continues it",
    )
    parser.add_argument(
        "--group-size",
        type=int,
        help="seeds of a variant trained together in one program (default: all of them on an "
        "accelerator, one at a time on the CPU; `train.run_seeds`)",
    )
    parser.add_argument(
        "--converge-accuracy",
        type=float,
        help="the convergence rule: a run stops once its last --converge-evals evaluations of "
        "the final stage reach this accuracy; --steps is then the cap (off)",
    )
    parser.add_argument("--converge-evals", type=int, help="(2)")
    parser.add_argument(
        "--threshold",
        type=float,
        default=0.9,
        help="accuracy whose first evaluation step each run reports as steps_to_threshold (0.9)",
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="tiny sizes (2 steps, batch 2, 64 tokens, one seed) to check the script end to end",
    )


def train_config(args: argparse.Namespace) -> train.TrainConfig:
    """The study's base run: library defaults, then --smoke sizes, then the explicit options
    (all through `train.make_config`, as the CLI builds its runs)."""
    base = train.TrainConfig()
    if args.smoke:
        task = args.task or "mqar"
        base = train.make_config(
            base,
            task=task,
            model_changes=SMOKE_MODEL,
            task_changes=SMOKE_TASK[task],
            **SMOKE_TRAIN,
        )
    return train.make_config(
        base,
        preset=args.preset,
        task=args.task,
        steps=args.steps,
        batch_size=args.batch_size,
        dense_warmup_steps=args.dense_warmup_steps,
        learning_rate=args.lr,
        init_from=args.init_from,
        eval_every=args.eval_every,
        eval_batches=args.eval_batches,
        converge_accuracy=args.converge_accuracy,
        converge_evals=args.converge_evals,
        model_changes=dict(args.model_set),
        task_changes=dict(args.task_set),
    )


def resolve_paths(args: argparse.Namespace, experiment: str) -> None:
    """Fills `args.seeds`, `args.out_dir` and `args.runs_dir`; smoke outputs never go to
    experiments/results (they are not results)."""
    if args.seeds is None:
        args.seeds = list(SMOKE_SEEDS if args.smoke else DEFAULT_SEEDS)
    if args.out_dir is None:
        args.out_dir = (
            Path(tempfile.mkdtemp(prefix=f"{experiment}-smoke-")) if args.smoke else RESULTS_DIR
        )
    if args.smoke and args.out_dir.resolve().is_relative_to(RESULTS_DIR):
        raise SystemExit(
            f"--smoke: smoke outputs are not results; choose an --out-dir outside {RESULTS_DIR}"
        )
    if args.runs_dir is None:
        args.runs_dir = args.out_dir / "runs" if args.smoke else Path("runs") / experiment
    args.out_dir.mkdir(parents=True, exist_ok=True)


def train_seeds(cfgs: Sequence[train.TrainConfig], run_dir: Path, args) -> list[dict]:
    """`train.run_seeds` of one variant's seeds in `run_dir/seed<k>/` (continuing those that
    exist), grouped by `--group-size`, with the study's time limit; each result gains
    'steps_to_threshold' (`steps_to`)."""
    results = train.run_seeds(
        cfgs,
        run_dir,
        group_size=args.group_size,
        resume=True,
        progress=not args.smoke,
        max_seconds=None if args.max_minutes is None else 60 * args.max_minutes,
    )
    for cfg, result in zip(cfgs, results, strict=True):
        seed_dir = train.seed_dir(run_dir, cfg.seed)
        print(train.summarize(cfg, seed_dir, result), flush=True)
        result["steps_to_threshold"] = steps_to(seed_dir, args.threshold)
    return results


def steps_to(run_dir: Path, threshold: float) -> int | None:
    """The first evaluation step of `run_dir` whose accuracy is >= `threshold` (None if none):
    steps-to-threshold, as precise as the run's `eval_every`. A run the guard stopped before
    its first record has no metrics.jsonl: None."""
    metrics = Path(run_dir) / "metrics.jsonl"
    for record in train.read_metrics(metrics) if metrics.exists() else []:
        if record["split"] == "eval" and record["accuracy"] >= threshold:
            return record["step"]
    return None


def load_model(cfg: train.TrainConfig, run_dir: Path) -> Model:
    """The model of `run_dir`'s latest checkpoint (`train.load`), checked against `cfg`."""
    saved, model = train.load(run_dir)
    if saved != cfg:
        raise ValueError(f"run_dir: {run_dir} holds a run of another config")
    return model


def reindex_layers(model_config: config_lib.ModelConfig) -> list[str]:
    """Metric prefixes ('layerN') of the Reindex layers restricted to the candidate pool."""
    return [f"layer{plan.layer}" for plan in model_config.layers if plan.uses_candidates]


def bucket_labels(edges: Sequence[int]) -> list[str]:
    """Labels of the distance buckets of `evaluate.distance_edges`: <e0, e0–e1, ..., ≥ e_last."""
    inner = [f"{a}–{b}" for a, b in itertools.pairwise(edges)]
    return [f"<{edges[0]}", *inner, f"≥{edges[-1]}"]


def report_config(
    experiment: str, args: argparse.Namespace, argv: Sequence[str], base: train.TrainConfig
) -> dict:
    """The report's "config": the command, the base run, the model and the seeds."""
    model_config = base.model_config()
    return {
        "experiment": experiment,
        "argv": list(argv),
        "smoke": args.smoke,
        "seeds": list(args.seeds),
        "max_minutes": args.max_minutes,
        "runs_dir": str(args.runs_dir),
        "train_config": base.to_json(),
        "model_config": dataclasses.asdict(model_config),
        "reindex_layers": reindex_layers(model_config),
        "distance_edges": list(evaluate.distance_edges(model_config)),
        **environment(),
    }


def _is_number(v) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def t_interval(values: Sequence[float]) -> list[float] | None:
    """The 95 % t-interval of the mean of `values` (None for fewer than two)."""
    xs = np.asarray(values, np.float64)
    if xs.size < 2:
        return None
    half = float(stats.t.ppf(0.975, xs.size - 1) * xs.std(ddof=1) / np.sqrt(xs.size))
    return [float(xs.mean()) - half, float(xs.mean()) + half]


def commits(config: dict) -> list[str]:
    """A report's commit: one (a process's report) or several (a combined or merged one)."""
    commit = config["commit"]
    return [commit] if isinstance(commit, str) else list(commit)


def commit_note(configs) -> str | None:
    """The `commit_note`s of several reports' configs joined in order, each once (None if none
    has one): what a combined or merged report says about the commits it ran at."""
    notes = dict.fromkeys(n for c in configs if (n := c.get("commit_note")))
    return " ".join(notes) or None


def pair_key(record: dict) -> tuple:
    """What makes two records of a study a pair: the seed and the weights the runs started from
    (`prefix_instance`; None where a report has one starting point for all)."""
    return record["seed"], record.get("prefix_instance")


def pairs(records: list[dict], variant: str, reference: str) -> list[tuple[dict, dict]]:
    """(record of `variant`, record of `reference`) for every run of `variant` that has a run of
    `reference` from the same starting weights (`pair_key`), in the order of `records`."""
    ref = {pair_key(r): r for r in records if r["variant"] == reference}
    own = [r for r in records if r["variant"] == variant]
    return [(r, ref[pair_key(r)]) for r in own if pair_key(r) in ref]


def paired_differences(
    pairs_: list[tuple[dict, dict]], key: str, scale: float = 1.0
) -> list[float]:
    """scale · (variant − reference) of `key` per pair, leaving out pairs where either run has
    no value."""
    return [scale * (r[key] - f[key]) for r, f in pairs_ if None not in (r.get(key), f.get(key))]


def _mean_std(values: list) -> dict:
    """Mean, sample std and 95 % t-interval (None for one value) and count of the non-None
    numbers."""
    xs = np.asarray([v for v in values if v is not None], np.float64)
    if not xs.size:
        return {"mean": None, "std": None, "ci95": None, "n": 0}
    std = float(xs.std(ddof=1)) if xs.size > 1 else None
    return {"mean": float(xs.mean()), "std": std, "ci95": t_interval(xs), "n": int(xs.size)}


def summarize(records: list[dict], by: str = "variant") -> dict:
    """Per `by` value, mean ± std and 95 % t-interval over seeds of every numeric metric; list
    metrics (per distance bucket) element by element:
    {variant: {metric: {"mean", "std", "ci95", "n"}}}."""
    groups: dict[str, list[dict]] = {}
    for record in records:
        groups.setdefault(record[by], []).append(record)
    summary = {}
    for name, group in groups.items():
        metrics = {}
        for key in dict.fromkeys(k for r in group for k in r):
            values = [r.get(key) for r in group]
            present = [v for v in values if v is not None]
            if key in ("seed", "resumed_from") or not present:
                continue
            if all(_is_number(v) for v in present):
                metrics[key] = _mean_std(values)
            elif all(isinstance(v, list) for v in present):
                columns = [_mean_std(list(c)) for c in zip(*present, strict=True)]
                metrics[key] = {k: [c[k] for c in columns] for k in ("mean", "std", "ci95", "n")}
        summary[name] = metrics
    return summary


def steps_note(train_config: dict) -> str:
    """'400 steps', or '≤ 300 steps (until 2 evaluations ≥ 90 %)' under a convergence rule."""
    steps = train_config["steps"]
    if not train_config.get("converge_accuracy"):
        return f"{steps} steps"
    evals, accuracy = train_config.get("converge_evals", 2), train_config["converge_accuracy"]
    return f"≤ {steps} steps (until {evals} evaluations ≥ {accuracy:.0%})"


def figure_note(report: dict) -> str:
    """The end of a study figure's title: the seeds that reported (and those asked for, where
    some did not), the device, and a warning on smoke runs and on runs a time cap cut short."""
    config, records = report["config"], report["results"]
    seeds = sorted({r["seed"] for r in records})
    note = f"seeds {seeds}" + ("" if seeds == config["seeds"] else f" of {config['seeds']}")
    note += f", {config['device']}"
    if any(r.get("stopped_early") for r in records):
        note += " — some runs stopped early (see 'step')"
    if config["smoke"]:
        note += " — SMOKE RUN, not a result"
    if config.get("partial"):
        note += " — PARTIAL (phases missing)"
    return note


def write_report(path: Path, config: dict, records: list[dict]) -> dict:
    """Writes {"config", "results", "summary"} to `path` and returns it."""
    report = {"config": config, "results": records, "summary": summarize(records)}
    path.write_text(json.dumps(report, indent=1))
    return report


def values(records: list[dict], variant: str, key: str) -> list[float]:
    """`key` of every seed of `variant` (None where the run did not report it)."""
    return [r.get(key) for r in records if r["variant"] == variant]


def layer_mean(record: dict, layers: Sequence[str], metric: str) -> float | None:
    """Mean of `layerN/<metric>` over `layers`, None when no layer reported it."""
    found = [record.get(f"{layer}/{metric}") for layer in layers]
    found = [v for v in found if v is not None]
    return float(np.mean(found)) if found else None


def strip(
    ax,
    x: float,
    ys: list,
    *,
    color,
    label: str | None = None,
    marker: str = "o",
    log: bool = False,
) -> None:
    """Seeds as dots spread around `x`, their mean as a short horizontal bar; on a log x axis
    (`log`) the spread is a factor, so the dots stay beside their own x at every scale."""
    ys = [y for y in ys if y is not None]
    if not ys:
        return
    offsets = np.linspace(-0.06, 0.06, len(ys)) if len(ys) > 1 else np.zeros(1)
    xs, bar = (
        (x * 2 ** (2 * offsets), (x / 2**0.24, x * 2**0.24))
        if log
        else (x + offsets, (x - 0.12, x + 0.12))
    )
    ax.scatter(xs, ys, color=color, marker=marker, s=22, zorder=3, label=label)
    ax.hlines(np.mean(ys), *bar, color=color, lw=2, zorder=2)


def baseline_tick(ax, x: float, ys: list, *, color, label: str | None = None) -> None:
    """A baseline's mean over seeds as a wide horizontal tick at `x`, behind the seed dots."""
    ys = [y for y in ys if y is not None]
    if ys:
        ax.hlines(np.mean(ys), x - 0.35, x + 0.35, color=color, lw=1.5, zorder=1, label=label)


def subplots(ncols: int, width: float):
    """(figure, axes) of one row of `ncols` panels, drawn with the file-only backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(1, ncols, figsize=(width, 4.2))


def save_figure(fig, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
