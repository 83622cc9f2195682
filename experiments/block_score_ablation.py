"""Max vs mean (vs top-2) block score of the candidate pool, against dense attention (DESIGN §7
ablations).

Per seed, four runs from the same initialization on the same batches (a variant's seeds trained
together, `train.run_seeds`: in one program on an accelerator):
  - 'max':   the candidate pool scores each block of 8 positions by its best position (V4.1);
  - 'mean':  by the mean of its visible positions (MoBA-like);
  - 'top2':  by the mean of its two best positions (`ops.pool.block_top2_mean`; none of the
             anchors tried it);
  - 'dense': every layer attends to all visible compressed entries for the whole run (the
             baseline, same steps, batch and learning rate).
Reported per variant and seed (the keys of `train.run`'s result): task accuracy and loss, the
same weights evaluated with dense attention (`dense_accuracy`), and for each Reindex layer the
pool recall of its own unrestricted top-k (`layerN/pool_recall`) next to random, most-recent and
oracle blocks (`_random`, `_recent`, `_oracle`: the pool rule, with the variant's reducer,
applied to random scores, to recency and to the layer's dense attention), within-pool recall,
attention mass kept by the selection and by the pool, pool recall and accuracy by distance.
The numpy simulation of `experiments_anchors.md` §2 (untrained scores) has max well ahead of
mean on single needles (passkey) and the two close when the evidence fills a block; whether a
trained indexer keeps that gap is the question. The dense run says what the pool costs at all.

    PYTHONPATH=. python3 experiments/block_score_ablation.py            # 3 seeds, tiny, passkey
    PYTHONPATH=. python3 experiments/block_score_ablation.py --preset small --task mqar \
        --task-set seq_len=1024 --steps 2000                             # a larger toy
    PYTHONPATH=. python3 experiments/block_score_ablation.py --smoke    # 1-2 min on 2 CPU cores

Writes `block_score_ablation.json` ({"config", "results": one record per variant and seed,
"summary": per variant, mean ± std and 95 % t-interval over seeds}) and `block_score_ablation.png`
to --out-dir (experiments/results); the run directories go to
runs/block_score_ablation/<variant>/seed<k>/. Each record also holds `steps_to_threshold`, the
first evaluation step at `--threshold` accuracy.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import numpy as np

from experiments import _common
from v41jax import train

NAME = "block_score_ablation"
VARIANTS = {  # `train.make_config` changes of each variant
    "max": {"model_changes": {"block_score": "max"}},
    "mean": {"model_changes": {"block_score": "mean"}},
    "top2": {"model_changes": {"block_score": "top2"}},
    "dense": {"attention": "dense"},
}
SPARSE = ("max", "mean", "top2")
REFERENCE = "max"  # V4.1's reducer: study_tables.py prints every variant's paired difference
COLORS = {"max": "C0", "mean": "C2", "top2": "C1", "dense": "C7"}
BASELINES = {  # evaluate's block baselines: metric suffix -> (legend, colour)
    "random": ("random blocks", "C7"),
    "recent": ("recent blocks", "C3"),
    "oracle": ("oracle blocks", "k"),
}


def main(argv: Sequence[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    _common.add_arguments(parser)
    parser.add_argument(
        "--variants",
        nargs="+",
        choices=list(VARIANTS),
        help=f"the variants to run, in this order (all: {' '.join(VARIANTS)})",
    )
    args = parser.parse_args(argv)
    _common.resolve_paths(args, NAME)
    base = _common.train_config(args)
    variants = {v: VARIANTS[v] for v in args.variants or VARIANTS}
    config = {
        **_common.report_config(NAME, args, argv, base),
        "variants": variants,
        "reference": REFERENCE,
    }
    json_path, png_path = args.out_dir / f"{NAME}.json", args.out_dir / f"{NAME}.png"
    records: list[dict] = []
    for variant, changes in variants.items():
        cfgs = [train.make_config(base, seed=seed, **changes) for seed in args.seeds]
        run_dir = args.runs_dir / variant
        for cfg, result in zip(cfgs, _common.train_seeds(cfgs, run_dir, args), strict=True):
            seed_dir = train.seed_dir(run_dir, cfg.seed)
            records.append(
                {"variant": variant, "seed": cfg.seed, "run_dir": str(seed_dir), **result}
            )
        report = _common.write_report(json_path, config, records)
    plot(report, png_path)
    print(f"wrote {json_path} and {png_path}")
    return report


def plot(report: dict, path) -> None:
    """Accuracy per variant, pool recall per Reindex layer against the baselines, pool recall by
    distance; seeds as dots, means as bars or ticks."""
    records, config = report["results"], report["config"]
    layers = config["reindex_layers"]
    variants = [v for v in VARIANTS if _common.values(records, v, "accuracy")]
    sparse = [v for v in SPARSE if v in variants]
    evidence = any(r.get("evidence_in_pool") is not None for r in records)
    fig, axes = _common.subplots(4 if evidence else 3, 21 if evidence else 16)
    acc_ax, recall_ax, dist_ax = axes[:3]

    for x, variant in enumerate(variants):
        first = x == 0
        _common.strip(
            acc_ax,
            x,
            _common.values(records, variant, "accuracy"),
            color=COLORS[variant],
            label="as trained" if first else None,
        )
        _common.strip(
            acc_ax,
            x + 0.3,
            _common.values(records, variant, "dense_accuracy"),
            color=COLORS[variant],
            marker="s",
            label="same weights, dense attention" if variant in sparse[:1] else None,
        )
    dense = [v for v in _common.values(records, "dense", "accuracy") if v is not None]
    if dense:
        acc_ax.axhline(np.mean(dense), color="C7", ls="--", lw=1, label="dense baseline")
    acc_ax.set(
        title="task accuracy (scored positions)",
        xticks=range(len(variants)),
        xticklabels=variants,
        ylim=(0, 1.02),
    )

    ticks = []
    for i, layer in enumerate(layers):
        for j, variant in enumerate(sparse):
            x = i * (len(sparse) + 1) + j
            ticks.append((x, f"{variant}\n{layer}"))
            _common.strip(
                recall_ax,
                x,
                _common.values(records, variant, f"{layer}/pool_recall"),
                color=COLORS[variant],
            )
            for name, (label, color) in BASELINES.items():
                _common.baseline_tick(
                    recall_ax,
                    x,
                    _common.values(records, variant, f"{layer}/pool_recall_{name}"),
                    color=color,
                    label=label if x == 0 else None,
                )
    recall_ax.set(
        title="pool recall of the Reindex top-k",
        xticks=[t[0] for t in ticks],
        xticklabels=[t[1] for t in ticks],
        ylim=(0, 1.02),
    )

    labels = _common.bucket_labels(config["distance_edges"])
    for variant in sparse:
        for layer, style in zip(layers, ("-o", "--s", ":^", "-.v"), strict=False):
            summary = report["summary"][variant].get(f"{layer}/pool_recall_by_distance")
            if summary is None:
                continue
            means = [np.nan if m is None else m for m in summary["mean"]]
            dist_ax.plot(labels, means, style, color=COLORS[variant], label=f"{variant} {layer}")
    dist_ax.set(
        title="pool recall by distance (mean over seeds)",
        xlabel="distance t − s (compressed positions)",
        ylim=(0, 1.02),
    )
    if evidence:
        evidence_plot(axes[3], records, sparse, layers)
    for ax in axes:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.suptitle(
        f"block score: {config['train_config']['preset']} on {config['train_config']['task']}, "
        f"{_common.steps_note(config['train_config'])}, {_common.figure_note(report)}",
        fontsize=10,
    )
    _common.save_figure(fig, path)


def evidence_plot(ax, records: list[dict], sparse: list[str], layers: list[str]) -> None:
    """Per sparse variant: how often the answer's evidence is in the candidate pool, and in
    each Reindex layer's selection (seeds as dots)."""
    ticks = []
    for i, variant in enumerate(sparse):
        for j, (metric, label) in enumerate(
            [("evidence_in_pool", "pool")] + [(f"{la}/evidence_selected", la) for la in layers]
        ):
            x = i * (len(layers) + 2) + j
            ticks.append((x, f"{variant}\n{label}"))
            _common.strip(ax, x, _common.values(records, variant, metric), color=COLORS[variant])
    ax.set(
        title="evidence in the pool / selected (queries beyond the pool)",
        xticks=[t[0] for t in ticks],
        xticklabels=[t[1] for t in ticks],
        ylim=(0, 1.02),
    )


if __name__ == "__main__":
    main()
