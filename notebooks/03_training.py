# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 03 — Training curves and ablation results
#
# A run directory written by `v41jax.train.run` (or `v41jax train`) holds `config.json`,
# `metrics.jsonl` (one JSON record per line: training records every few steps, evaluation
# records on held-out batches), `summary.json` and checkpoints. This notebook reads one and
# plots how the task, the indexer and the candidate pool learned, then shows the ablation
# studies of `experiments/` if their results exist.
#
# - `V41JAX_RUN_DIR=<dir>`: the run to read. Without it, the notebook trains a run in a
#   temporary directory (2 steps with `V41JAX_SMOKE=1`, the default `TrainConfig()` otherwise).
# - `V41JAX_RESULTS_DIR=<dir>`: where the ablation results are (default:
#   `experiments/results` of this repository).

# %%
import itertools
import json
import math
import os
import tempfile
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
from IPython.display import Image, display

from v41jax import train
from v41jax.train import evaluate

SMOKE = os.environ.get("V41JAX_SMOKE", "0") == "1"
REPO = Path(train.__file__).resolve().parents[2]  # the repository of this checkout
RESULTS_DIR = Path(os.environ.get("V41JAX_RESULTS_DIR", REPO / "experiments" / "results"))

if os.environ.get("V41JAX_RUN_DIR"):
    run_dir = Path(os.environ["V41JAX_RUN_DIR"])
    print(f"reading the run in {run_dir}")
else:
    cfg = train.TrainConfig.smoke() if SMOKE else train.TrainConfig()
    run_dir = Path(tempfile.mkdtemp(prefix="v41jax_nb03_")) / "run"
    print(f"no V41JAX_RUN_DIR given: training {cfg.steps} steps into {run_dir}")
    train.run(cfg, run_dir, progress=not SMOKE)

# %% [markdown]
# ## The run
#
# Its configuration and final summary, as written by `train.run` (either may be missing in a
# run that was interrupted or written by an older version).

# %%
# %matplotlib inline


def read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


run_config = read_json(run_dir / "config.json")
run_summary = read_json(run_dir / "summary.json")
print(json.dumps(run_config, indent=1) if run_config else "no config.json")
for k, v in run_summary.items():
    if not isinstance(v, list | dict):
        print(f"  {k:<34} {v}")

records = train.read_metrics(run_dir / "metrics.jsonl")
train_rec = [r for r in records if r.get("split") == "train"]
eval_rec = [r for r in records if r.get("split") == "eval"]
print(f"{len(train_rec)} training records, {len(eval_rec)} evaluation records")

# %% [markdown]
# ## Curves
#
# - **task loss / accuracy**: cross-entropy and accuracy on the scored (answer) positions only;
#   training records are single batches, evaluation records average held-out batches. The
#   dashed line is the final evaluation of the same weights with dense attention (every layer
#   sees every visible compressed position): the gap to it is what the pool and top-k cost.
# - **indexer KL**: how far each indexer's scores are from the attention of its layer (the
#   indexers' only training signal).
# - **pool recall**: per Reindex layer, the share of its own unrestricted top-k that falls inside
#   the candidate pool, with the random / most-recent / oracle block baselines of the same
#   evaluation (thin lines, same colour).
# - **attention mass**: the share of each Reindex layer's dense attention that its selection
#   (solid) and the whole pool (dotted) cover.
#
# The grey band is the dense warm-up, where every layer attends densely and the pool is not
# used.


# %%
def series(recs: list[dict], key: str) -> tuple[list, list]:
    """(steps, values) of the records that hold a number under `key`."""
    pts = [
        (r["step"], r[key])
        for r in recs
        if isinstance(r.get(key), int | float) and math.isfinite(r[key])
    ]
    return [p[0] for p in pts], [p[1] for p in pts]


def layer_names(suffix: str) -> list[str]:
    return sorted({k.removesuffix(suffix) for r in eval_rec for k in r if k.endswith(suffix)})


fig, axes = plt.subplots(2, 3, figsize=(16, 8))
(ax_loss, ax_acc, ax_kl), (ax_recall, ax_mass, ax_grad) = axes
for ax, key in ((ax_loss, "task_loss"), (ax_acc, "accuracy"), (ax_kl, "indexer_kl")):
    ax.plot(*series(train_rec, key), label="train", alpha=0.7)
    ax.plot(*series(eval_rec, key), "o-", label="eval")
dense_key = {"task_loss": "dense_task_loss", "accuracy": "dense_accuracy"}
for ax, key in ((ax_loss, "task_loss"), (ax_acc, "accuracy")):
    if isinstance(run_summary.get(dense_key[key]), int | float):
        ax.axhline(run_summary[dense_key[key]], ls="--", color="k", lw=1, label="dense (final)")
ax_loss.set(title="task loss", yscale="log")
ax_acc.set(title="accuracy on scored positions", ylim=(0, 1.02))
ax_kl.set(title="indexer KL", yscale="log")

baseline_styles = {"_random": ":", "_recent": "-.", "_oracle": "--"}
for i, layer in enumerate(layer_names("/pool_recall")):
    color = f"C{i}"
    ax_recall.plot(*series(eval_rec, f"{layer}/pool_recall"), "o-", color=color, label=layer)
    for suffix, style in baseline_styles.items():
        steps, values = series(eval_rec, f"{layer}/pool_recall{suffix}")
        label = suffix.removeprefix("_") if i == 0 else None
        ax_recall.plot(steps, values, style, color=color, lw=1, alpha=0.7, label=label)
ax_recall.set(title="pool recall (baselines: thin lines)", ylim=(0, 1.02))
for i, layer in enumerate(layer_names("/mass_selected")):
    ax_mass.plot(*series(eval_rec, f"{layer}/mass_selected"), "o-", color=f"C{i}", label=layer)
    ax_mass.plot(*series(eval_rec, f"{layer}/mass_pool"), "o:", color=f"C{i}", alpha=0.7)
ax_mass.set(title="dense attention mass: selection (solid), pool (dotted)", ylim=(0, 1.02))
ax_grad.plot(*series(train_rec, "grad_norm"))
ax_grad.set(title="gradient norm (before clipping)", yscale="log")

warmup = run_config.get("dense_warmup_steps", 0)
if run_config.get("attention") == "dense":
    warmup = run_config.get("steps", 0)
for ax in axes.flat:
    if warmup:
        ax.axvspan(0, warmup, color="gray", alpha=0.15, lw=0)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
fig.tight_layout()
plt.show()

# %% [markdown]
# The last evaluation split by distance: accuracy by the distance from each answer to its
# evidence, and pool recall by the distance of each unrestricted pick (buckets at the window
# size and the pool size of the model's config).

# %%
last = eval_rec[-1] if eval_rec else {}
by_distance = {k: v for k, v in last.items() if k.endswith("by_distance") and isinstance(v, list)}
if by_distance:
    fig, ax = plt.subplots(figsize=(8, 3.5))
    n_buckets = max(len(v) for v in by_distance.values())
    width = 0.8 / len(by_distance)
    for i, (k, v) in enumerate(sorted(by_distance.items())):
        heights = [np.nan if x is None else x for x in v]
        ax.bar(np.arange(len(v)) + i * width, heights, width, label=k)
    labels = [f"bucket {b}" for b in range(n_buckets)]
    try:  # name the buckets after the edges of the run's model config
        edges = evaluate.distance_edges(train.TrainConfig.from_json(run_config).model_config())
    except (TypeError, ValueError):
        edges = None
    if edges is not None and len(edges) + 1 == n_buckets:
        labels = [f"< {edges[0]}"] + [f"{a}–{b - 1}" for a, b in itertools.pairwise(edges)]
        labels += [f"≥ {edges[-1]}"]
    ax.set_xticks(np.arange(n_buckets) + width * (len(by_distance) - 1) / 2, labels)
    ax.set_xlabel("distance (tokens for accuracy, compressed positions for pool recall)")
    ax.set_xlim(-0.5, n_buckets - 0.5 + width * (len(by_distance) - 1))
    ax.set(ylim=(0, 1.05), title=f"last evaluation (step {last.get('step')}), by distance")
    ax.legend(fontsize=7)
    ax.grid(axis="y", alpha=0.3)
    plt.show()
else:
    print("no per-distance metrics in the last evaluation record")

# %% [markdown]
# ## Ablations
#
# The studies in `experiments/` each write a JSON report whose `"results"` list holds one record
# per (variant, seed): the variant's name, the seed and the final metrics of that run (the keys
# of `train.run`'s result). Two are shown here when present:
# - `block_score_ablation.json`: the block score of the candidate pool, max (V4.1) vs mean;
# - `kv_format_study.json`: the main-KV format (NVFP4 / MXFP4 / FP8 / BF16), trained with it
#   (QAT) vs quantized only after training (PTQ).
#
# Per variant, bars are the mean over seeds and black dots the single seeds, so the spread
# between seeds is visible next to the difference between variants. Accuracy panels add the same
# weights evaluated with dense attention (hollow diamonds); pool-recall panels add the random /
# most-recent / oracle baselines of the same runs (short horizontal ticks at their means). Each
# study's own figure, when it was saved next to its JSON, follows.

# %%
SKIPPED_KEYS = {"seed", "step", "train_seconds", "resumed_from"}
BASELINE_MARKERS = {
    "_random": ("gray", "random"),
    "_recent": ("g", "recent"),
    "_oracle": ("m", "oracle"),
}


def load_results(path: Path) -> list[dict] | None:
    """The "results" records of an ablation report, or None (with a note) if unusable."""
    if not path.exists():
        print(f"{path.name}: not found in {path.parent} (run its script in experiments/ first)")
        return None
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        print(f"{path.name}: not valid JSON ({err})")
        return None
    results = data.get("results") if isinstance(data, dict) else None
    if not isinstance(results, list) or not all(isinstance(r, dict) for r in results):
        print(f"{path.name}: expected an object with a 'results' list of records; skipped")
        return None
    return results


def is_number(v) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def metrics_to_plot(results: list[dict]) -> list[str]:
    """Accuracy and pool recall (one key per Reindex layer, or a plain 'pool_recall'), then the
    task loss; only keys with a number in some record."""
    found = {k for r in results for k, v in r.items() if is_number(v) and k not in SKIPPED_KEYS}
    recall = sorted(k for k in found if k == "pool_recall" or k.endswith("/pool_recall"))
    wanted = ["accuracy", *recall, "task_loss"]
    return [k for k in wanted if k in found]


def metric_values(results: list[dict], variant: str, metric: str) -> list[float]:
    return [
        r[metric]
        for r in results
        if str(r.get("variant", "?")) == variant and is_number(r.get(metric))
    ]


def mean_std(values: list[float]) -> str:
    return f"{np.mean(values):.3f} ± {np.std(values):.3f} (n={len(values)})" if values else "—"


def plot_ablation(name: str, results: list[dict]) -> None:
    """Prints mean ± std over seeds per variant and metric, then plots them."""
    variants = list(dict.fromkeys(str(r.get("variant", "?")) for r in results))
    metrics = metrics_to_plot(results)
    if not metrics:
        print(f"{name}: no numeric metrics to plot")
        return
    print(f"{name}: {len(results)} records, variants {variants}")
    print(f"  {'variant':<16}" + "".join(f"{m:>28}" for m in metrics))
    for variant in variants:
        cells = [mean_std(metric_values(results, variant, m)) for m in metrics]
        print(f"  {variant:<16}" + "".join(f"{c:>28}" for c in cells))

    fig, axes = plt.subplots(1, len(metrics), figsize=(4.5 * len(metrics), 3.8), squeeze=False)
    for ax, metric in zip(axes[0], metrics, strict=True):
        for i, variant in enumerate(variants):
            values = metric_values(results, variant, metric)
            if values:
                ax.bar(i, np.mean(values), color=f"C{i}", alpha=0.6)
                ax.plot(np.full(len(values), i), values, "ko", ms=4)
            dense = metric_values(results, variant, "dense_accuracy")
            if metric == "accuracy" and dense:
                label = "dense attention" if i == 0 else None
                ax.plot(np.full(len(dense), i + 0.25), dense, "kD", mfc="none", ms=5, label=label)
            for suffix, (color, label) in BASELINE_MARKERS.items():
                baseline = metric_values(results, variant, metric + suffix)
                if metric.endswith("pool_recall") and baseline:
                    ax.hlines(
                        np.mean(baseline),
                        i - 0.4,
                        i + 0.4,
                        color=color,
                        lw=2,
                        label=label if i == 0 else None,
                    )
        ax.set_xticks(range(len(variants)), variants, rotation=30, ha="right")
        ax.set_title(metric)
        ax.grid(axis="y", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.suptitle(name)
    fig.tight_layout()
    plt.show()


for name in ("block_score_ablation", "kv_format_study"):
    results = load_results(RESULTS_DIR / f"{name}.json")
    if results:
        plot_ablation(name, results)
        if (RESULTS_DIR / f"{name}.png").exists():
            print(f"the study's own figure, {name}.png:")
            display(Image(filename=str(RESULTS_DIR / f"{name}.png")))
