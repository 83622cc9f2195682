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
# # 04 — The studies at 4 K tokens, seed by seed
#
# `experiments/long_context_studies.py` trains `small()` on a 16-needle passkey at 4,096 tokens:
# every seed learns the task densely first (a curriculum of 128, 512 and 4 K tokens), then each
# variant switches the candidate pool on and trains until two evaluations reach 90 %. This
# notebook reads the committed reports (no training, no GPU) and looks at them seed by seed:
# 1. the tables of `experiments/README.md` (printed by `experiments/study_tables.py`): block
#    score, pool size, main-KV format;
# 2. accuracy against how often the pool holds the answer's evidence, each seed's variants joined;
# 3. one seed's pools on one held-out example, query by query (`evaluate.pool_snapshot`): every
#    pool the reports kept, listed, then the one you pick drawn.
#
# - `V41JAX_RESULTS_DIR=<dir>`: where the reports are (default `experiments/results`).
# - `V41JAX_POOLS=<report>:<variant>` (e.g. `pool_size_4k_h200_2026-12-02_merged.json:pool256`):
#   whose kept pools to draw in section 3 (default: the first listed).
# - `V41JAX_RUN_DIR=<dir>`: a run directory of a study (e.g.
#   `runs/long_context_studies/runs/ratio16/max/seed0`) whose pools to draw when the reports
#   hold no snapshot.

# %%
import json
import os
import sys
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np

from v41jax import train
from v41jax.train import evaluate

REPO = Path(train.__file__).resolve().parents[2]  # the repository of this checkout
sys.path.insert(0, str(REPO))  # `experiments/` is a folder of the repository, not a package
from experiments import study_tables

SMOKE = os.environ.get("V41JAX_SMOKE", "0") == "1"
RESULTS_DIR = Path(os.environ.get("V41JAX_RESULTS_DIR", REPO / "experiments" / "results"))


def load(pattern: str) -> dict[Path, dict]:
    paths = sorted(RESULTS_DIR.glob(pattern), key=lambda p: p.name)
    return {p: json.loads(p.read_text()) for p in paths}


reports = load("block_score_4k_ratio*.json")
# The pool-size sweep: the merged report of its sessions where there is one (its parts repeat
# it), else each session's.
pool_sizes = load("pool_size_4k_*_merged.json") or load("pool_size_4k_*.json")
kv_formats = load("kv_format_4k_*.json")
for name, found in (("block-score", reports), ("pool-size", pool_sizes), ("KV-format", kv_formats)):
    print(f"{len(found)} {name} reports in {RESULTS_DIR}: {[p.name for p in found]}")

# %% [markdown]
# ## 1. The tables
#
# One row per variant (mean ± sample std over seeds), then each variant's difference from `max`
# on the same seed (and the same prefix instance) with its 95 % t-interval, and, where the runs
# were evaluated with a pool of one block, how much the answers depend on the pool. A report
# marked partial lacks some of its planned phases. The pool-size rows are named by the pool in
# blocks of 8 (pool8 = 1/64 of 4,096 positions); the KV-format rows pair against f32.


# %%
def show(path: Path, report: dict, title: str) -> None:
    config = report["config"]
    partial = " — PARTIAL" if config.get("partial") else ""
    print(f"{path.name}: {title}{partial}\n")
    order = None
    if config.get("experiment") == "kv_format_study":
        order = study_tables.format_order(config["formats"])
    print(study_tables.table(report, order))
    print()
    if lines := study_tables.paired(report, config.get("reference", "max"), order):
        print(lines)
        print()
    if any(r.get("pool1_accuracy") is not None for r in report["results"]):
        print(study_tables.through_the_pool(report, order))
        print()


for path, report in reports.items():
    config = report["config"]
    show(path, report, f"context/pool {config.get('ratio')}, {config.get('pool_blocks')} blocks")
for path, report in pool_sizes.items():
    show(path, report, "pool size at 4 K tokens")
for path, report in kv_formats.items():
    show(path, report, "main-KV format, QAT and PTQ")

# %% [markdown]
# ## 2. Accuracy against the evidence in the pool
#
# Each dot is one seed; a seed's variants are joined by a line (same initialization, same
# batches). "Evidence in pool": of the scored queries that see more positions than the pool
# holds, how often the position of the answer's digit is in the query's pool.

# %%
if reports:
    fig, axes = plt.subplots(1, len(reports), figsize=(5.5 * len(reports), 4.2), squeeze=False)
    for ax, report in zip(axes[0], reports.values(), strict=True):
        records = [r for r in report["results"] if r.get("evidence_in_pool") is not None]
        variants = list(dict.fromkeys(r["variant"] for r in records))
        for seed in sorted({r["seed"] for r in records}):
            mine = [
                next(r for r in records if r["seed"] == seed and r["variant"] == v)
                for v in variants
                if any(r["seed"] == seed and r["variant"] == v for r in records)
            ]
            ax.plot(
                [r["evidence_in_pool"] for r in mine],
                [r["accuracy"] for r in mine],
                "-",
                color="0.8",
                zorder=1,
            )
        for i, variant in enumerate(variants):
            mine = [r for r in records if r["variant"] == variant]
            ax.scatter(
                [r["evidence_in_pool"] for r in mine],
                [r["accuracy"] for r in mine],
                color=f"C{i}",
                label=variant,
                zorder=2,
            )
        ax.set(
            title=f"context/pool {report['config'].get('ratio')}",
            xlim=(0, 1),
            ylim=(0, 1.02),
            xlabel="evidence in the pool",
            ylabel="task accuracy",
        )
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    plt.show()
else:
    print("no block-score reports to draw")

# %% [markdown]
# ## 3. One seed's pools, query by query
#
# The finished sparse phases keep seed 0's final pools on one held-out example
# (`pool_snapshot` in its record). Reports from before that (the first H200 calls) hold none;
# then a run directory (`V41JAX_RUN_DIR`) is read instead, or, without one, an untrained tiny
# model shows what the picture looks like. First every kept snapshot: how many of its queries
# have the evidence in their pool, and the rank of the evidence's block among the source's
# block scores (0: the best block; the pool keeps about the ranks below its size, its newest
# block pinned).

# %%
kept = {}  # "<report>:<variant>" -> its record holding the snapshot
for path, report in {**reports, **pool_sizes, **kv_formats}.items():
    for record in report["results"]:
        if record.get("pool_snapshot"):
            kept.setdefault(f"{path.name}:{record['variant']}", record)
if kept:
    print("| report:variant | seed | pool blocks | evidence in pool | evidence rank: median |")
    print("|---|---|---|---|---|")
    for name, record in kept.items():
        shot = record["pool_snapshot"]
        held = [q["evidence_block"] in q["pool_blocks"] for q in shot["queries"]]
        ranks = [q["evidence_block_rank"] for q in shot["queries"]]
        print(
            f"| {name} | {record['seed']} | {shot['pool_blocks']} | "
            f"{sum(held)}/{len(held)} | {np.median(ranks):.0f} |"
        )
wanted = os.environ.get("V41JAX_POOLS") or next(iter(kept), None)
if wanted is not None and wanted not in kept:
    raise ValueError(f"V41JAX_POOLS: expected one of {sorted(kept)}, got {wanted!r}")
snapshot, source = None, None
if wanted is not None:
    snapshot = kept[wanted]["pool_snapshot"]
    source = f"{wanted}, seed {kept[wanted]['seed']}"
if snapshot is None and os.environ.get("V41JAX_RUN_DIR"):
    run_dir = Path(os.environ["V41JAX_RUN_DIR"])
    cfg, model = train.load(run_dir)
    snapshot = evaluate.pool_snapshot(
        model, cfg.make_task(), seed=cfg.seed + train.EVAL_SEED_OFFSET
    )
    source = f"the run in {run_dir}"
if snapshot is None:
    cfg = train.make_config(
        train.TrainConfig(),
        task="multi_passkey",
        task_changes=dict(seq_len=256 if SMOKE else 1024),
        model_changes=dict(candidate_topk_blocks=2 if SMOKE else 4),
    )
    model = train.build(cfg)[0]
    snapshot = evaluate.pool_snapshot(model, cfg.make_task(), seed=train.EVAL_SEED_OFFSET)
    source = "an UNTRAINED tiny() (no report holds a snapshot yet)"
print(
    f"pools of {source}: block score '{snapshot['block_score']}', "
    f"{snapshot['pool_blocks']} blocks of {snapshot['block_size']}"
)

# %%
queries = snapshot["queries"]
layers = snapshot["reindex_layers"]
n_blocks = max(q["visible"] for q in queries) // snapshot["block_size"] + 1
fig, (grid_ax, score_ax) = plt.subplots(
    1, 2, figsize=(15, 0.35 * len(queries) + 2.5), gridspec_kw={"width_ratios": [3, 2]}
)
for row, q in enumerate(queries):
    grid_ax.scatter(
        q["pool_blocks"],
        [row] * len(q["pool_blocks"]),
        marker="s",
        s=30,
        color="0.75",
        label="pool" if row == 0 else None,
    )
    for i, layer in enumerate(layers):
        picked = q[f"{layer}/selected_blocks"]
        grid_ax.scatter(
            picked,
            [row + 0.15 * (i + 1)] * len(picked),
            marker=".",
            s=12,
            color=f"C{i}",
            label=f"{layer} selection" if row == 0 else None,
        )
    hit = q["evidence_block"] in q["pool_blocks"]
    grid_ax.scatter(
        [q["evidence_block"]],
        [row],
        marker="x",
        s=60,
        color="C3" if hit else "k",
        label="evidence (red: in the pool)" if row == 0 else None,
        zorder=3,
    )
grid_ax.set(
    xlim=(-1, n_blocks),
    ylim=(len(queries), -1),
    xlabel="block (compressed position / block size)",
    ylabel="scored query",
    title="pool and selections per query",
)
grid_ax.legend(fontsize=7, loc="lower left")
ranks = [q["evidence_block_rank"] for q in queries]
held = np.mean([q["evidence_block"] in q["pool_blocks"] for q in queries])
print(
    f"evidence in the pool for {held:.0%} of the queries; rank of the evidence's block among "
    f"the block scores: {ranks}"
)

q = next(q for q in queries if "block_scores" in q)
scores = np.array([np.nan if v is None else v for v in q["block_scores"]])
score_ax.plot(scores, lw=0.8, color="0.4", label="block score (−inf and the pin: gaps)")
score_ax.scatter(q["pool_blocks"], scores[q["pool_blocks"]], s=14, color="0.2", label="in the pool")
score_ax.axvline(q["evidence_block"], color="C3", lw=1, label="evidence's block")
score_ax.set(xlabel="block", title=f"the candidate source's block scores, query at t = {q['t']}")
score_ax.legend(fontsize=7)
fig.tight_layout()
plt.show()
