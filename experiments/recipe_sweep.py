"""Which optimizer recipe takes the main job past its plateau on every seed? A sweep of training
recipes for `v41jax train`'s default run (tiny(), single-needle passkey, 400 steps).

Each variant changes a few `TrainConfig` fields of the default run, and sets `learning_rate` and
`adam_b2` explicitly (so the variants keep their meaning whatever the defaults are); 'qat_late'
variants train the dense warm-up with f32 main KV, index keys and window, then switch to the
run's NVFP4/MXFP4/FP8 QAT for the sparse stage (`nnx.update` of the same parameters and
optimizer state into the QAT model). Every (variant, seed) trains all its steps; the evaluation
(8 batches of 32 from the evaluation seed) runs every 50 steps in the step's stage, and at the
end with the pool and with dense attention.

On a GPU the variants run side by side, one process each (`--parallel`): the runs are tiny and
compile-bound, and only accuracies are measured here, never time. GPU runs are not bit-for-bit
reproducible (XLA's GPU reductions), so a seed's outcome near the plateau's edge can differ
between two identical runs: 'wd0' and 'wd0_repeat' are the same recipe, run twice to show it.

    PYTHONPATH=. python3 experiments/recipe_sweep.py --parallel --out experiments/results/x.json
    PYTHONPATH=. python3 experiments/recipe_sweep.py --variants base --seeds 0 --smoke
    PYTHONPATH=. python3 experiments/recipe_sweep.py --print experiments/results/x.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import jax
import numpy as np
from flax import nnx
from scipy import stats

from v41jax import train
from v41jax.train import evaluate as evaluate_lib

F32 = dict(kv_format="f32", index_format="f32", window_format="f32")
OLD = dict(learning_rate=1e-2, adam_b2=0.999)  # the defaults before this sweep
VARIANTS: dict[str, dict] = {
    "base": OLD,
    "qat_late": OLD | dict(early_formats=F32),
    "lr2e-2": OLD | dict(learning_rate=2e-2),
    "lr3e-2": OLD | dict(learning_rate=3e-2),
    "warm100": OLD | dict(dense_warmup_steps=100),
    "wd0": OLD | dict(weight_decay=0.0),
    "f32": OLD | dict(model_changes=F32),
    "b48": OLD | dict(batch_size=48),
    "qat_late_lr2e-2": OLD | dict(early_formats=F32, learning_rate=2e-2),
    "qat_late_warm300": OLD | dict(early_formats=F32, dense_warmup_steps=300),
    "lr5e-3": OLD | dict(learning_rate=5e-3),
    "lr7e-3": OLD | dict(learning_rate=7e-3),
    "lr5e-3_wd0": OLD | dict(learning_rate=5e-3, weight_decay=0.0),
    "wd0_b2": OLD | dict(weight_decay=0.0, adam_b2=0.95),
    "lr7e-3_wd0_b2": OLD | dict(learning_rate=7e-3, weight_decay=0.0, adam_b2=0.95),
    "lrwarm100": OLD | dict(lr_warmup_steps=100),
    "lr5e-3_b2": OLD | dict(learning_rate=5e-3, adam_b2=0.95),
    "clip0.3": OLD | dict(grad_clip=0.3),
    "wd0_repeat": OLD | dict(weight_decay=0.0),
    "b2": OLD | dict(adam_b2=0.95),
}
SEEDS = (0, 1, 2, 3, 4)
EVAL_EVERY = 50
TARGET = 0.95


def run_one(name: str, seed: int, *, smoke: bool = False) -> dict:
    """Trains (variant `name`, `seed`) in memory; its accuracy curve and final evaluations."""
    fields = dict(VARIANTS[name])
    early = fields.pop("early_formats", None)
    if smoke:
        fields |= dict(steps=4, dense_warmup_steps=2, eval_every=2)
    cfg = train.make_config(seed=seed, **fields)
    task = cfg.make_task()
    every = 2 if smoke else EVAL_EVERY

    def evaluate(model, step: int, dense: bool) -> dict:
        return evaluate_lib.evaluate(
            model,
            task,
            seed=seed + train.EVAL_SEED_OFFSET,
            batches=cfg.eval_batches,
            batch_size=cfg.batch_size,
            dense=dense,
        )

    curve: dict[int, float] = {}

    def hook_for(model):
        def hook(done, _metrics):
            if done % every == 0:  # in the stage of the step just done
                curve[done] = evaluate(model, done, cfg.dense_at(done - 1))["accuracy"]

        return hook

    model, optimizer = train.build(cfg)
    start = 0
    if early is not None:
        cfg_early = cfg.with_model(**early)
        model_early, optimizer_early = train.build(cfg_early)
        end = cfg.dense_warmup_steps
        train.train_steps(
            model_early, optimizer_early, cfg_early, task, 0, end, hook_for(model_early)
        )
        nnx.update((model, optimizer), nnx.state((model_early, optimizer_early)))
        start = end
    train.train_steps(model, optimizer, cfg, task, start, cfg.steps, hook_for(model))
    final = evaluate(model, cfg.steps, cfg.dense_at(cfg.steps - 1))
    dense = evaluate(model, cfg.steps, True)
    return {
        "variant": name,
        "seed": seed,
        "accuracy": final["accuracy"],
        "dense_accuracy": dense["accuracy"],
        "accuracy_by_distance": final["accuracy_by_distance"],
        "curve": curve,
        "backend": jax.default_backend(),
    }


def steps_to(curve: dict, threshold: float) -> int | None:
    """The first evaluated step at or above `threshold` (None: never)."""
    hits = [int(s) for s, a in curve.items() if a >= threshold]
    return min(hits) if hits else None


def table(report: dict) -> str:
    """Markdown: per variant, each seed's final accuracy with the pool, the mean with a 95 %
    t-interval over seeds, seeds >= 95 %, and the median evaluated step first >= 95 %."""
    rows = report["results"]
    lines = [
        "| variant | changes from the old defaults (lr 1e-2, b2 0.999) | accuracy per seed | "
        "mean [95 % t-interval] | seeds >= 95 % | median step to 95 % |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name in dict.fromkeys(r["variant"] for r in rows):
        rs = [r for r in rows if r["variant"] == name]
        acc = np.asarray([r["accuracy"] for r in rs])
        mean = acc.mean()
        half = stats.t.ppf(0.975, len(acc) - 1) * acc.std(ddof=1) / np.sqrt(len(acc))
        lo, hi = max(mean - half, 0.0), min(mean + half, 1.0)
        hits = [steps_to(r["curve"], TARGET) for r in rs]
        reached = sorted(h for h in hits if h is not None)
        median = f"{np.median(reached):.0f}" if len(reached) > len(hits) / 2 else "—"
        changes = {k: v for k, v in VARIANTS.get(name, {}).items() if OLD.get(k) != v}
        text = ", ".join(f"{k}={v}" for k, v in changes.items()) or "—"
        text = text.replace(
            "{'kv_format': 'f32', 'index_format': 'f32', 'window_format': 'f32'}", "f32"
        )
        lines.append(
            f"| {name} | {text} | {' '.join(f'{a:.0%}' for a in acc)} | "
            f"{mean:.1%} [{lo:.1%}, {hi:.1%}] | {sum(a >= TARGET for a in acc)}/{len(acc)} | "
            f"{median} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated")
    parser.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS))
    parser.add_argument("--parallel", action="store_true", help="one process per variant")
    parser.add_argument("--smoke", action="store_true", help="4 steps: checks the script only")
    parser.add_argument("--out", type=Path, help="the JSON report")
    parser.add_argument("--print", type=argparse.FileType(), help="print a report's table")
    args = parser.parse_args(argv)
    if args.print:
        print(table(json.load(args.print)))
        return
    names = args.variants.split(",")
    unknown = sorted(set(names) - set(VARIANTS))
    if unknown:
        parser.error(f"--variants: expected names from {list(VARIANTS)}, got {unknown}")
    rows: list[dict] = []
    if args.parallel:
        env = os.environ | {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
        with tempfile.TemporaryDirectory() as tmp:
            parts = {n: Path(tmp) / f"{n}.json" for n in names}
            seeds = [str(s) for s in args.seeds]
            command = [sys.executable, __file__, "--seeds", *seeds, *(["--smoke"] * args.smoke)]
            procs = [
                subprocess.Popen([*command, "--variants", n, "--out", str(p)], env=env)
                for n, p in parts.items()
            ]
            codes = [p.wait() for p in procs]
            for p in parts.values():
                rows += json.loads(p.read_text())["results"] if p.exists() else []
            failed = [n for n, c in zip(names, codes, strict=True) if c]
    else:
        failed = []
        for name in names:
            for seed in args.seeds:
                t0 = time.perf_counter()
                rows.append(run_one(name, seed, smoke=args.smoke))
                print(json.dumps(rows[-1] | {"seconds": time.perf_counter() - t0}), flush=True)
                if args.out:  # after every run: a cut keeps what ran
                    args.out.write_text(json.dumps({"results": rows}, indent=1))
    report = {
        "commit": os.environ.get("V41JAX_COMMIT"),
        "device": jax.devices()[0].device_kind,
        "seeds": args.seeds,
        "failed_variants": failed,
        "results": rows,
    }
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    if rows:
        print(table(report))


if __name__ == "__main__":
    main()
