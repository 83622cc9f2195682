"""Candidate-pool size at a fixed context: where does the pool start to cost accuracy (issue 14,
study 3)?

Per seed, one run per pool size and one dense run, from the same initialization on the same
batches (a variant's seeds trained together, `train.run_seeds`: in one program on an
accelerator). The pool sizes are fractions of the candidate source's compressed positions at
the task's `seq_len` (`--fractions 64 32 16 8 4 2`: 1/64 ... 1/2), each rounded down to whole
blocks of `candidate_block_size` and at least one block; fractions that round to the same block
count run once. V4.1 keeps 2,048 blocks of 8 = 16,384 positions, 1/64 of a 1 M-token context at
the candidate source's ratio 1.

Reported per variant and seed (the keys of `train.run`'s result, as in `block_score_ablation`):
task accuracy and loss, the same weights with dense attention, each Reindex layer's pool recall
against random / most-recent / oracle blocks, within-pool recall, attention mass kept by the
pool (`layerN/mass_pool`) and by the selection, and steps to `--threshold`. Each record also
holds `pool_blocks` and `pool_fraction` (of the source's positions at the last position). The
summary gives each metric's mean, std and 95 % t-interval over seeds; `study_tables.py` prints
the table and each pool size's paired difference from the dense run.

    PYTHONPATH=. python3 experiments/pool_size_sweep.py --preset tiny --task passkey \
        --task-set seq_len=2048 --seeds 0 1 2 3 4                       # 1/64 = 1 block
    PYTHONPATH=. python3 experiments/pool_size_sweep.py --smoke          # 1-2 min on 2 CPU cores

Writes `pool_size_sweep.json` and `pool_size_sweep.png` to --out-dir (experiments/results);
run directories go to runs/pool_size_sweep/<variant>/seed<k>/.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import numpy as np

from experiments import _common
from v41jax import train
from v41jax.nn.config import ModelConfig

NAME = "pool_size_sweep"
REFERENCE = "dense"
FRACTIONS = (64, 32, 16, 8, 4, 2)
SMOKE_FRACTIONS = (8, 2)


def source_positions(model_config: ModelConfig, seq_len: int) -> int:
    """Compressed positions of the candidate source at the last of `seq_len` tokens."""
    ratio = model_config.compress_ratios[model_config.candidate_source_layer]
    return seq_len // ratio


def pool_sizes(model_config: ModelConfig, seq_len: int, fractions: Sequence[int]) -> list[int]:
    """Distinct pool sizes in blocks, largest fraction's denominator first (smallest pool
    first): 1/d of the source's positions, rounded down to whole blocks, at least one."""
    positions = source_positions(model_config, seq_len)
    blocks = [max(1, positions // (d * model_config.candidate_block_size)) for d in fractions]
    return sorted(set(blocks))


def variant_name(blocks: int) -> str:
    return f"pool{blocks}"


def main(argv: Sequence[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    _common.add_arguments(parser)
    parser.add_argument(
        "--fractions",
        type=int,
        nargs="+",
        help="pool sizes as 1/d of the candidate source's positions: the d's "
        f"({' '.join(map(str, FRACTIONS))}; with --smoke {' '.join(map(str, SMOKE_FRACTIONS))})",
    )
    args = parser.parse_args(argv)
    fractions = args.fractions or (SMOKE_FRACTIONS if args.smoke else FRACTIONS)
    if any(d < 1 for d in fractions):
        parser.error(f"--fractions: expected denominators >= 1, got {list(fractions)}")
    _common.resolve_paths(args, NAME)
    base = _common.train_config(args)
    model_config, seq_len = base.model_config(), base.make_task().seq_len
    positions = source_positions(model_config, seq_len)
    sizes = pool_sizes(model_config, seq_len, fractions)
    variants = {variant_name(b): {"model_changes": {"candidate_topk_blocks": b}} for b in sizes}
    variants[REFERENCE] = {"attention": "dense"}
    config = {
        **_common.report_config(NAME, args, argv, base),
        "variants": variants,
        "reference": REFERENCE,
        "fractions": list(fractions),
        "source_positions": positions,
    }
    json_path, png_path = args.out_dir / f"{NAME}.json", args.out_dir / f"{NAME}.png"
    records: list[dict] = []
    for variant, changes in variants.items():
        cfgs = [train.make_config(base, seed=seed, **changes) for seed in args.seeds]
        run_dir = args.runs_dir / variant
        blocks = cfgs[0].model_config().candidate_topk_blocks
        pool = {}
        if variant != REFERENCE:
            fraction = blocks * model_config.candidate_block_size / positions
            pool = {"pool_blocks": blocks, "pool_fraction": fraction}
        for cfg, result in zip(cfgs, _common.train_seeds(cfgs, run_dir, args), strict=True):
            seed_dir = train.seed_dir(run_dir, cfg.seed)
            records.append(
                {"variant": variant, "seed": cfg.seed, "run_dir": str(seed_dir), **pool, **result}
            )
        report = _common.write_report(json_path, config, records)
    plot(report, png_path)
    print(f"wrote {json_path} and {png_path}")
    return report


def _instances(records: list[dict], fractions: Sequence[float]) -> list[tuple[str, ...]]:
    """Per pool fraction, the prefix instances its runs started from (empty where the records
    name none: one starting point for all)."""
    return [
        tuple(
            dict.fromkeys(
                r["prefix_instance"]
                for r in records
                if r.get("pool_fraction") == f and r.get("prefix_instance")
            )
        )
        for f in fractions
    ]


def plot(report: dict, path) -> None:
    """Against the pool's fraction of the source's positions (log scale): accuracy with the pool
    (seeds as dots), the same weights with a pool of one block where the records have it, and
    the dense run's mean; each Reindex layer's pool recall; the attention mass the pool keeps;
    where the records have it, how often the answer's evidence is in the pool, beside the
    pool's own share of the positions (about what a random pool of that size holds)."""
    records, config = report["results"], report["config"]
    layers = config["reindex_layers"]
    sized = sorted({r["pool_fraction"] for r in records if "pool_fraction" in r})
    evidence = any(r.get("evidence_in_pool") is not None for r in records)
    fig, axes = _common.subplots(4 if evidence else 3, 20 if evidence else 15)
    acc_ax, recall_ax, mass_ax = axes[:3]

    def per_fraction(metric: str) -> tuple[list[float], list[list[float]]]:
        ys = [
            [
                r[metric]
                for r in records
                if r.get("pool_fraction") == f and r.get(metric) is not None
            ]
            for f in sized
        ]
        return sized, ys

    for metric, color, marker, label in (
        ("accuracy", "C0", "o", "with the pool"),
        ("pool1_accuracy", "C3", "x", "same weights, a pool of one block"),
    ):
        xs, ys = per_fraction(metric)
        first = next((x for x, y in zip(xs, ys, strict=True) if y), None)
        for x, y in zip(xs, ys, strict=True):
            shown = label if x == first else None
            _common.strip(acc_ax, x, y, color=color, marker=marker, log=True, label=shown)
    dense = [r["accuracy"] for r in records if r["variant"] == REFERENCE]
    if dense:
        acc_ax.axhline(np.mean(dense), color="C7", ls="--", lw=1, label="dense run (mean)")
    for i, layer in enumerate(layers):
        for ax, metric, style, label in (
            (recall_ax, "pool_recall", "-o", layer),
            (recall_ax, "pool_recall_random", ":", f"{layer}, random blocks"),
            (recall_ax, "pool_recall_oracle", "--", f"{layer}, oracle blocks"),
            (mass_ax, "mass_pool", "-o", layer),
        ):
            xs, ys = per_fraction(f"{layer}/{metric}")
            means = [np.mean(y) if y else np.nan for y in ys]
            ax.plot(xs, means, style, color=f"C{i}", label=label)
    panels = [
        (acc_ax, "task accuracy (scored positions)"),
        (recall_ax, "pool recall of the Reindex top-k (mean)"),
        (mass_ax, "dense attention mass inside the pool (mean)"),
    ]
    if evidence:
        xs, ys = per_fraction("evidence_in_pool")
        for x, y in zip(xs, ys, strict=True):
            _common.strip(
                axes[3], x, y, color="C0", log=True, label="seeds" if x == xs[0] else None
            )
        axes[3].plot(sized, sized, ":", color="C7", label="the pool's share of the positions")
        panels.append((axes[3], "answer's evidence in the pool (queries beyond it)"))
    ticks = [f"1/{1 / f:.3g}" if f < 1 else "1" for f in sized]
    instances = _instances(records, sized)
    several = len(set(instances)) > 1
    if several:  # pools of several prefix instances: say which is which
        names = [" ".join(n[:6] for n in i) or "?" for i in instances]
        ticks = [f"{t}\n{n}" for t, n in zip(ticks, names, strict=True)]
    for ax, title in panels:
        ax.set(title=title, xscale="log", xlabel="pool / source positions", ylim=(0, 1.02))
        ax.set_xlim(sized[0] / 1.5, sized[-1] * 1.5)
        ax.set_xticks(sized, ticks)
        ax.minorticks_off()
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.suptitle(
        f"pool size: {config['train_config']['preset']} on {config['train_config']['task']}, "
        f"{config['source_positions']} source positions, {_common.figure_note(report)}"
        + (
            "\nunder each pool: its prefix instance, first 6 hex digits ('?': a report older "
            "than instance names); pools of different instances are not paired"
            if several
            else ""
        ),
        fontsize=10,
    )
    _common.save_figure(fig, path)


if __name__ == "__main__":
    main()
