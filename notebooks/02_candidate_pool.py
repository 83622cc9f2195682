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
# # 02 — The candidate pool, query by query
#
# V4.1's hierarchical sparse indexer works in two stages. The **candidate source** (the last
# Full layer; layer 3 of the `tiny` preset) scores every visible compressed position, groups
# positions into blocks of 8, scores each block by its best position and keeps the best few
# blocks: the query's **candidate pool**. The later **Reindex** layers (4 and 6 in `tiny`) score
# only inside that pool with their own indexer query and take their own top-k there. If the
# pool misses what a Reindex layer would have picked on its own, that layer can never attend
# to it.
#
# This notebook trains the toy model briefly (`v41jax.train.run`), then looks at one
# example from the inside (`Model.run(..., diagnostics=True)`) and at held-out batches through
# `v41jax.train.evaluate`:
# 1. which blocks the candidate source keeps for each query;
# 2. where each Reindex layer picks, inside the pool;
# 3. the indexer's scores against the layer's own dense attention, for one query;
# 4. pool recall against random, most-recent and oracle block pools, and by distance.
#
# With `V41JAX_SMOKE=1` the run is 2 steps (the pictures then show an untrained indexer); run it
# at full size (the default `TrainConfig()`: several minutes on a CPU) to see a trained one.
#
# `V41JAX_RUN_DIR=<dir>` reads a run that exists instead of training one: any run directory of
# `v41jax train` or of a study, e.g. one seed of the block-score ablation
# (`runs/block_score_ablation/max/seed0`) or the 4 K stage of the long-context curriculum
# (`runs/long_context_task/multi_passkey/long/seed0`), so a study's pools can be looked at
# seed by seed.

# %%
import itertools
import os
import tempfile
from pathlib import Path

import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
from flax import nnx
from matplotlib.colors import ListedColormap
from matplotlib.patches import Patch

from v41jax import train
from v41jax.train import evaluate

SMOKE = os.environ.get("V41JAX_SMOKE", "0") == "1"
cfg = train.TrainConfig.smoke() if SMOKE else train.TrainConfig()
EVAL_BATCHES = 1 if SMOKE else 8
print(cfg)

# %% [markdown]
# ## Train
#
# `train.run` writes config, metrics, checkpoints and a summary into a run directory (a temporary
# one here). The run starts with `dense_warmup_steps` of dense attention (the indexers learn
# from the full attention pattern), then trains with the real pool and top-k, the same rule as
# at inference.

# %%
if os.environ.get("V41JAX_RUN_DIR"):
    run_dir = Path(os.environ["V41JAX_RUN_DIR"])
    print(f"reading the run in {run_dir}")
else:
    run_dir = Path(tempfile.mkdtemp(prefix="v41jax_nb02_")) / "run"
    summary = train.run(cfg, run_dir, progress=not SMOKE)
    print(train.summarize(cfg, run_dir, summary))

# %% [markdown]
# `train.run` returns numbers; `train.load` rebuilds the model from the run's last checkpoint.

# %%
cfg, model = train.load(run_dir)
c = model.config
cand = c.candidate_source_layer
reindex_layers = [p.layer for p in c.layers if p.uses_candidates]
print(f"candidate source: layer {cand}; Reindex layers inside the pool: {reindex_layers}")
print(
    f"pool: {c.candidate_topk_blocks} blocks x {c.candidate_block_size} positions = "
    f"{c.candidate_pool_size}; window {c.window_size}; each Reindex layer keeps "
    f"top-{c.index_topk}; block score '{c.block_score}'"
)

# %% [markdown]
# ## One example, from the inside
#
# One held-out example and the scored position whose evidence lies furthest back, so the query
# has to reach well beyond the sliding window. For the single passkey the key is placed early
# (depth 0.1); for the other tasks the example is drawn as in evaluation.

# %%
task = cfg.make_task()
eval_seed = cfg.seed + train.EVAL_SEED_OFFSET
shown = task.replace(depth=0.1) if hasattr(task, "depth") else task
example = shown.batch_at(eval_seed, 0, 1)
print(task.describe())
print(task.format_example(example, 0))

# graph_updates=False: the program hands back only the logits and the trace, no parameter.
run_with_diagnostics = nnx.jit(
    lambda model, tokens: model.run(tokens, diagnostics=True), graph_updates=False
)
logits, trace = run_with_diagnostics(model, jnp.asarray(example.tokens))

seq = example.tokens.shape[1]
scored = np.flatnonzero(example.loss_mask[0])
query = int(max(scored, key=lambda t: t - example.evidence[0, t]))  # the longest reach back
evidence = int(example.evidence[0, query])
predicted = task.token_name(int(jnp.argmax(logits[0, query])))
print(
    f"query at position {query}, evidence at {evidence}: distance "
    f"{query - evidence}; target {task.token_name(int(example.targets[0, query]))}, "
    f"predicted {predicted}"
)

# %% [markdown]
# ### 1. Which blocks the candidate source keeps
#
# Each row is a query position, each column a block of 8 compressed positions. White blocks are
# not visible yet (causality), grey ones are visible but left out, blue ones are in the pool.
# The newest block is always kept (it is pinned: it is only partly filled and would otherwise
# lose to older full blocks). The dashed line is the oldest position the sliding window still
# covers; the red line is the block holding the evidence; the black ticks on the right mark the
# scored positions (every answer of the example).

# %%
ratio = c.layers[cand].compress_ratio
block = c.candidate_block_size
n_pos = trace[cand].shared.pool.mask.shape[-1]
n_blocks = -(-n_pos // block)
positions = np.arange(seq)
compress_lens = (positions + 1) // ratio  # visible compressed positions per query
block_ids = np.asarray(trace[cand].shared.pool.block_ids[0])  # [T, topk_blocks], −1 padded
blocks_img = np.where(np.arange(n_blocks) * block < compress_lens[:, None], 1, 0)
rows = np.repeat(positions[:, None], block_ids.shape[1], axis=1)
kept = block_ids >= 0
blocks_img[rows[kept], block_ids[kept]] = 2
evidence_block = evidence // ratio // block
window_edge = np.maximum(positions - c.window_size + 1, 0) // ratio / block

fig, ax = plt.subplots(figsize=(7, 7))
cmap = ListedColormap(["white", "lightgray", "tab:blue"])
ax.imshow(blocks_img, cmap=cmap, vmin=0, vmax=2, aspect="auto", interpolation="nearest")
ax.plot(window_edge - 0.5, positions, "k--", lw=1, label="window's oldest position")
ax.axvline(evidence_block, color="crimson", lw=1.5, label="block holding the evidence")
for t in scored:
    ax.plot([n_blocks - 0.5, n_blocks + 0.2], [t, t], "k-", lw=1.5, clip_on=False)
ax.set(
    xlabel=f"block ({block} compressed positions each)",
    ylabel="query position",
    title=f"Candidate pool of layer {cand}: {c.candidate_topk_blocks} blocks per query",
)
handles = [
    Patch(color="lightgray", label="visible, not kept"),
    Patch(color="tab:blue", label="in the pool"),
    *ax.get_legend_handles_labels()[0],
]
ax.legend(handles=handles, loc="lower left", fontsize=8)
plt.show()

# %% [markdown]
# ### 2. Where each Reindex layer picks
#
# Query position × compressed position, for each Reindex layer: light blue is the pool (from the
# candidate source), dark blue the layer's own top-k inside it, and orange the positions the
# layer would have picked without the pool but cannot reach (its unrestricted top-k outside the
# pool). The red line is the evidence.

# %%
categories = ["invisible", "visible", "in pool", "picked", "wanted, outside pool"]
colors = ["white", "whitesmoke", "lightsteelblue", "navy", "darkorange"]
pool_mask = np.asarray(trace[cand].shared.pool.mask[0])
fig, axes = plt.subplots(1, len(reindex_layers), figsize=(6.5 * len(reindex_layers), 6))
for ax, layer in zip(np.atleast_1d(axes), reindex_layers, strict=True):
    lens = (positions + 1) // c.layers[layer].compress_ratio
    img = np.where(np.arange(n_pos) < lens[:, None], 1, 0)
    img[pool_mask] = 2
    unrestricted = np.asarray(trace[layer].aux["unrestricted_topk"][0])
    rows_u = np.repeat(positions[:, None], unrestricted.shape[1], axis=1)
    valid = unrestricted >= 0
    outside = valid & ~pool_mask[rows_u, np.maximum(unrestricted, 0)]
    img[rows_u[outside], unrestricted[outside]] = 4
    picks = np.asarray(trace[layer].shared.topk[0])
    valid = picks >= 0
    img[rows_u[valid], picks[valid]] = 3
    ax.imshow(img, cmap=ListedColormap(colors), vmin=0, vmax=4, aspect="auto")
    ax.axvline(evidence // c.layers[layer].compress_ratio, color="crimson", lw=1)
    ax.set(xlabel="compressed position", ylabel="query position", title=f"layer {layer}")
fig.legend(
    handles=[
        Patch(facecolor=col, edgecolor="gray", label=lab)
        for col, lab in zip(colors, categories, strict=True)
    ],
    loc="lower center",
    ncol=len(categories),
    fontsize=8,
)
fig.suptitle(f"Reindex picks (top-{c.index_topk}) inside the candidate pool")
fig.tight_layout(rect=(0, 0.05, 1, 1))
plt.show()

# %% [markdown]
# ### 3. Indexer scores versus the layer's dense attention, for one query
#
# For the query above: the indexer score of every visible position (blue, left axis) and the
# layer's own attention when it is allowed to see every visible position (orange, right axis;
# summed over heads). The indexer is trained to predict that attention (the KL loss), so a
# good indexer puts its high scores where the orange peaks are. Shaded: the blocks of the
# candidate pool; ticks at the bottom: the layer's actual picks; red: the evidence's position. The
# first row is the candidate source itself, whose scores choose the pool.

# %%
layers_shown = [cand, *reindex_layers]
fig, axes = plt.subplots(len(layers_shown), 1, figsize=(11, 2.6 * len(layers_shown)), sharex=True)
for ax, layer in zip(axes, layers_shown, strict=True):
    r = c.layers[layer].compress_ratio
    visible = np.arange(n_pos) < (query + 1) // r
    scores = np.where(visible, np.asarray(trace[layer].aux["scores"][0, query]), np.nan)
    attention = np.where(visible, np.asarray(trace[layer].aux["dense_probs"][0, query]), np.nan)
    for b in block_ids[query]:
        if b >= 0:
            ax.axvspan(b * block - 0.5, (b + 1) * block - 0.5, color="lightsteelblue", alpha=0.5)
    ax.plot(scores, color="tab:blue", lw=1)
    ax.set_ylabel(f"layer {layer}\nindex score", color="tab:blue")
    picks = np.asarray(trace[layer].shared.topk[0, query])
    picks = picks[picks >= 0]
    ax.plot(picks, np.full(picks.shape, np.nanmin(scores)), "|", color="navy", ms=12)
    ax.axvline(evidence // r, color="crimson", lw=1)
    twin = ax.twinx()
    twin.plot(attention, color="tab:orange", lw=1)
    twin.set_ylabel("dense attention", color="tab:orange")
axes[0].set_title(f"query at position {query}; evidence at {evidence}")
axes[-1].set_xlabel("compressed position")
fig.tight_layout()
plt.show()

# %% [markdown]
# ## 4. Pool recall on held-out batches
#
# `evaluate.evaluate` runs held-out batches (a seed training never uses) and reports, for each
# Reindex layer, **pool recall**: the fraction of the layer's unrestricted top-k (its picks
# without a pool) that lie inside the pool, counted over queries that see more positions than
# a pool holds. Three baselines use the same pool rule with other block scores: **random**
# blocks, the **most recent** blocks, and **oracle** blocks (scored by the layer's own dense
# attention: the best any block pool can do for that layer).
#
# `evaluate` also splits the trained pool's recall by the distance t − s of each pick (buckets
# at the window size and the pool size) and the task accuracy by the distance to the evidence;
# it does not split the baselines by distance.

# %%
sparse = evaluate.evaluate(
    model, task, seed=eval_seed, batches=EVAL_BATCHES, batch_size=cfg.batch_size, dense=False
)
dense = evaluate.evaluate(
    model, task, seed=eval_seed, batches=EVAL_BATCHES, batch_size=cfg.batch_size, dense=True
)
print(f"accuracy with the pool {sparse['accuracy']:.1%}, dense {dense['accuracy']:.1%}")
for key in sorted(k for k in sparse if k.startswith("layer")):
    print(f"  {key:<34} {sparse[key]}")

# %%
edges = evaluate.distance_edges(c)
bucket_names = [f"< {edges[0]}"]
bucket_names += [f"{a}–{b - 1}" for a, b in itertools.pairwise(edges)]
bucket_names += [f"≥ {edges[-1]}"]
pools = {"trained pool": "", **{f"{b} blocks": f"_{b}" for b in evaluate.BASELINES}}
pool_colors = ["tab:blue", "lightgray", "tab:green", "tab:purple"]


def value(x):
    return np.nan if x is None else x


fig, axes = plt.subplots(1, 3, figsize=(16, 4))
width = 0.8 / len(pools)
for i, ((name, suffix), color) in enumerate(zip(pools.items(), pool_colors, strict=True)):
    recall = [value(sparse.get(f"layer{layer}/pool_recall{suffix}")) for layer in reindex_layers]
    bars = axes[0].bar(
        np.arange(len(reindex_layers)) + i * width, recall, width, label=name, color=color
    )
    axes[0].bar_label(bars, fmt="%.2f", fontsize=7)
axes[0].set_xticks(
    np.arange(len(reindex_layers)) + width * (len(pools) - 1) / 2,
    [f"layer {layer}" for layer in reindex_layers],
)
axes[0].set(ylabel="pool recall", ylim=(0, 1.25), title="pool recall vs baselines")
axes[0].legend(fontsize=8, loc="upper center", ncol=2)

width = 0.8 / len(reindex_layers)
for i, layer in enumerate(reindex_layers):
    by_distance = [value(v) for v in sparse[f"layer{layer}/pool_recall_by_distance"]]
    bars = axes[1].bar(
        np.arange(len(bucket_names)) + i * width, by_distance, width, label=f"layer {layer}"
    )
    axes[1].bar_label(bars, fmt="%.2f", fontsize=7)
axes[1].set_xticks(np.arange(len(bucket_names)) + width * (len(reindex_layers) - 1) / 2)
axes[1].set_xticklabels(bucket_names)
axes[1].set(
    xlabel="distance t − s of the unrestricted pick (compressed positions)",
    ylabel="pool recall",
    ylim=(0, 1.05),
    title="trained pool recall by distance",
)
axes[1].legend(fontsize=8)

for i, (name, result) in enumerate((("with the pool", sparse), ("dense", dense))):
    accuracy = [value(v) for v in result["accuracy_by_distance"]]
    bars = axes[2].bar(np.arange(len(bucket_names)) + i * 0.4, accuracy, 0.4, label=name)
    axes[2].bar_label(bars, fmt="%.2f", fontsize=7)
axes[2].set_xticks(np.arange(len(bucket_names)) + 0.2, bucket_names)
axes[2].set(
    xlabel="distance from the answer to its evidence (tokens)",
    ylabel="accuracy",
    ylim=(0, 1.05),
    title="task accuracy by evidence distance",
)
axes[2].legend(fontsize=8)
for ax in axes:
    ax.grid(axis="y", alpha=0.3)
fig.tight_layout()
plt.show()

# %% [markdown]
# How to read it: a trained pool should sit well above the random and most-recent baselines and
# close to the oracle; by distance, recall is near 1 for picks inside the window span (the
# newest blocks are nearly always kept) and the interesting number is the far bucket. Empty
# bars are buckets with nothing counted (e.g. too few queries at that distance in a smoke run).
