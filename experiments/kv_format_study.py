"""Main-KV format (NVFP4, MXFP4, FP8, BF16) with QAT vs post-training quantization (DESIGN §7).

Per seed, from the same initialization on the same batches (a variant's seeds trained together,
`train.run_seeds`: in one program on an accelerator):
  - 'f32':        trained and evaluated with the main KV unquantized (the reference);
  - 'qat/<fmt>':  trained with the main KV fake-quantized in <fmt> (straight-through gradients)
                  and evaluated in <fmt>;
  - 'ptq/<fmt>':  the 'f32' run's parameters evaluated with the main KV in <fmt> (no training
                  with it), on the same held-out batches as `train.run`'s own evaluation.
Only the main (compressed) KV changes: index keys and the window keep the preset's formats
(MXFP4, FP8). Reported per variant and seed: task accuracy and loss, the same weights with
dense attention, and each Reindex layer's pool recall (with its random / recent / oracle
baselines), within-pool recall and attention mass — the keys of `train.run`'s result.
`experiments_anchors.md` §4: NVFP4's relative MSE is about 0.009 on Gaussian data against
MXFP4's 0.013 (0.03 with outlier channels); the literature puts an NVFP4 KV cache within 1 % of
BF16 and ahead of MXFP4.

    PYTHONPATH=. python3 experiments/kv_format_study.py                 # 3 seeds, tiny, passkey
    PYTHONPATH=. python3 experiments/kv_format_study.py --formats nvfp4 mxfp4 --seeds 0 1 2 3
    PYTHONPATH=. python3 experiments/kv_format_study.py --smoke         # 1-2 min on 2 CPU cores

Writes `kv_format_study.json` ({"config", "results": one record per variant and seed,
"summary": per variant, mean ± std and 95 % t-interval over seeds}) and `kv_format_study.png` to
--out-dir (experiments/results); the run directories go to runs/kv_format_study/<variant>/seed<k>/.
Each trained record also holds `steps_to_threshold`, the first evaluation step at `--threshold`
accuracy.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import numpy as np

from experiments import _common
from v41jax import train
from v41jax.nn.model import Model, with_fields
from v41jax.ops import formats
from v41jax.train import evaluate

NAME = "kv_format_study"
REFERENCE = "f32"
FORMATS = tuple(f for f in formats.formats_for("kv", quantizable=True) if f != REFERENCE)
SMOKE_FORMATS = ("nvfp4",)


def evaluate_like_run(model: Model, cfg: train.TrainConfig, step: int) -> dict:
    """What `train.run(cfg)` reports after `step` steps, for a model it did not train: its
    held-out batches, with the pool once past the dense warm-up, plus the same weights with
    dense attention (`dense_accuracy`, `dense_task_loss`)."""
    task = cfg.make_task()
    batches = dict(
        seed=cfg.seed + train.EVAL_SEED_OFFSET,
        batches=cfg.eval_batches,
        batch_size=cfg.batch_size,
    )
    result = evaluate.evaluate(model, task, dense=cfg.dense_at(step), **batches)
    if cfg.dense_at(step):
        return result
    dense = evaluate.evaluate(model, task, dense=True, **batches)
    return {**result, "dense_accuracy": dense["accuracy"], "dense_task_loss": dense["task_loss"]}


def main(argv: Sequence[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    _common.add_arguments(parser)
    parser.add_argument(
        "--formats",
        nargs="+",
        choices=FORMATS,
        help=f"main-KV formats to compare with {REFERENCE} ({' '.join(FORMATS)}; "
        f"with --smoke {' '.join(SMOKE_FORMATS)})",
    )
    args = parser.parse_args(argv)
    if args.formats is None:
        args.formats = list(SMOKE_FORMATS if args.smoke else FORMATS)
    _common.resolve_paths(args, NAME)
    base = _common.train_config(args)
    config = {
        **_common.report_config(NAME, args, argv, base),
        "formats": args.formats,
        "reference": REFERENCE,
    }
    json_path, png_path = args.out_dir / f"{NAME}.json", args.out_dir / f"{NAME}.png"
    records: list[dict] = []

    def record(variant: str, seed: int, run_dir, result: dict) -> None:
        records.append({"variant": variant, "seed": seed, "run_dir": str(run_dir), **result})
        _common.write_report(json_path, config, records)

    reference_cfgs = [base.replace(seed=s).with_model(kv_format=REFERENCE) for s in args.seeds]
    reference_dir = args.runs_dir / REFERENCE
    references = _common.train_seeds(reference_cfgs, reference_dir, args)
    for cfg, reference in zip(reference_cfgs, references, strict=True):
        record(REFERENCE, cfg.seed, train.seed_dir(reference_dir, cfg.seed), reference)
    for fmt in args.formats:
        cfgs = [base.replace(seed=s).with_model(kv_format=fmt) for s in args.seeds]
        run_dir = args.runs_dir / f"qat-{fmt}"
        for cfg, result in zip(cfgs, _common.train_seeds(cfgs, run_dir, args), strict=True):
            record(f"qat/{fmt}", cfg.seed, train.seed_dir(run_dir, cfg.seed), result)
    # PTQ: each seed's f32 reference read through every format, evaluated as its run was.
    for reference_cfg, reference in zip(reference_cfgs, references, strict=True):
        seed, seed_dir = reference_cfg.seed, train.seed_dir(reference_dir, reference_cfg.seed)
        trained = _common.load_model(reference_cfg, seed_dir)
        for fmt in args.formats:
            step = reference["step"]
            ptq = evaluate_like_run(with_fields(trained, kv_format=fmt), reference_cfg, step)
            print(
                f"ptq/{fmt} (the {REFERENCE} run, seed {seed}): accuracy {ptq['accuracy']:.1%}, "
                f"task loss {ptq['task_loss']:.4f}",
                flush=True,
            )
            record(
                f"ptq/{fmt}",
                seed,
                seed_dir,
                {"step": step, "stopped_early": reference["stopped_early"], **ptq},
            )
    report = _common.write_report(json_path, config, records)
    plot(report, png_path)
    print(f"wrote {json_path} and {png_path}")
    return report


def _once(seen: set, key: str, label: str) -> str | None:
    """`label` the first time `key` comes (then `key` is in `seen`), None after: each legend
    entry once."""
    if key in seen:
        return None
    seen.add(key)
    return label


def plot(report: dict, path) -> None:
    """Accuracy, task loss and pool recall (mean over the Reindex layers) per format, QAT beside
    PTQ, the f32 reference as its own column and a dashed line; then each variant's accuracy
    minus the f32 run's of the same seed, in points, with its 95 % t-interval (the question the
    study asks, at a scale where the differences show). Seeds as dots."""
    records, config = report["results"], report["config"]
    layers = config["reindex_layers"]
    panels = (
        ("accuracy", "task accuracy (scored positions)", lambda r: r.get("accuracy")),
        ("task_loss", "task loss", lambda r: r.get("task_loss")),
        (
            "pool_recall",
            "pool recall (mean over Reindex layers)",
            lambda r: _common.layer_mean(r, layers, "pool_recall"),
        ),
    )
    fig, axes = _common.subplots(len(panels) + 1, 21)
    formats = config["formats"]
    modes = ((-0.17, "qat", "C0"), (0.17, "ptq", "C1"))
    for ax, (key, title, metric) in zip(axes[:-1], panels, strict=True):
        labelled = set()
        for x, fmt in enumerate(formats):
            for dx, mode, color in modes:
                ys = [metric(r) for r in records if r["variant"] == f"{mode}/{fmt}"]
                shown = any(y is not None for y in ys)
                label = _once(labelled, mode, mode.upper()) if shown else None
                _common.strip(ax, x + dx, ys, color=color, label=label)
        reference = [metric(r) for r in records if r["variant"] == REFERENCE]
        _common.strip(ax, len(formats), reference, color="C7", label=f"{REFERENCE} reference")
        reference = [y for y in reference if y is not None]
        if reference:
            ax.axhline(np.mean(reference), color="C7", ls="--", lw=1)
        ax.set(title=title, xticks=range(len(formats) + 1), xticklabels=[*formats, REFERENCE])
        if key != "task_loss":
            ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)

    ax = axes[-1]
    ax.axhline(0, color="C7", ls="--", lw=1)
    labelled = set()
    for x, fmt in enumerate(formats):
        for dx, mode, color in modes:
            pairs = _common.pairs(records, f"{mode}/{fmt}", REFERENCE)
            d = _common.paired_differences(pairs, "accuracy", 100)
            _common.strip(ax, x + dx, d, color=color)
            ci = _common.t_interval(d)
            if ci is not None:
                label = _once(labelled, mode, f"{mode.upper()}: mean, 95 % t-interval")
                ax.errorbar(
                    x + dx + 0.1,
                    np.mean(d),
                    yerr=[[np.mean(d) - ci[0]], [ci[1] - np.mean(d)]],
                    color=color,
                    capsize=3,
                    lw=1.5,
                    label=label,
                )
    ax.set(
        title=f"accuracy − {REFERENCE} run of the same seed (points)",
        xticks=range(len(formats)),
        xticklabels=formats,
    )
    ax.grid(alpha=0.3)
    if labelled:
        ax.legend(fontsize=7)
    train_config = config["train_config"]
    fig.suptitle(
        f"main-KV format: {train_config['preset']} on {train_config['task']}, "
        f"{_common.steps_note(train_config)}, {_common.figure_note(report)}",
        fontsize=10,
    )
    _common.save_figure(fig, path)


if __name__ == "__main__":
    main()
