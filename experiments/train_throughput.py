"""Training throughput: tokens per second of `train.train_step` for a preset on this machine.

For each (preset, attention stage) the script builds the model and runs the library's training
loop (`train.train_steps`) for 1 + `--steps` steps on fresh batches of the task, waiting for each
step's metrics in the loop's hook: the first step's time includes compilation, the median of the
others gives tokens/s (batch x seq_len / median). Wall-clock timing is right here: a training
step is host-dispatched whole (batch generation included), and the figure a researcher plans
with is the one their loop sees.

    PYTHONPATH=. python3 experiments/train_throughput.py --out results.json
    .venv/bin/python experiments/train_throughput.py --steps 3 --batch-size 4 --out cpu.json

BENCHMARKS.md's training table is written from the committed JSON of the GPU and CPU runs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import jax
from tqdm import tqdm

from experiments import _common
from v41jax import train
from v41jax.nn.model import parameter_counts

# Per preset: the task length (several times the pool) and batch of its throughput run.
SHAPES = {"tiny": dict(seq_len=128, batch_size=32), "small": dict(seq_len=1024, batch_size=32)}


def measure(preset: str, dense: bool, steps: int, seq_len: int, batch_size: int) -> dict:
    cfg = train.make_config(
        preset=preset,
        task="passkey",
        task_changes={"seq_len": seq_len, "n_digits": 1},
        batch_size=batch_size,
        steps=steps + 1,
        attention="dense" if dense else "sparse",
        dense_warmup_steps=0,
    )
    model, optimizer = train.build(cfg)
    bar = tqdm(total=steps + 1, desc=f"{preset} dense={dense}")
    times, clock = [], time.perf_counter()

    def timed(done: int, metrics: dict) -> None:
        nonlocal clock
        jax.block_until_ready(metrics)
        now = time.perf_counter()
        times.append(now - clock)
        clock = now
        bar.update(1)

    train.train_steps(model, optimizer, cfg, cfg.make_task(), 0, steps + 1, timed)
    bar.close()
    first, times = times[0], times[1:]
    median = statistics.median(times)
    return {
        "preset": preset,
        "attention": "dense" if dense else "sparse",
        "seq_len": seq_len,
        "batch_size": batch_size,
        "steps_timed": steps,
        "first_step_s": first,
        "median_step_s": median,
        "min_step_s": min(times),
        "tokens_per_s": batch_size * seq_len / median,
        "parameters": parameter_counts(model.config)["total"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--steps", type=int, default=20, help="timed steps after the first")
    parser.add_argument(
        "--batch-size", type=int, help="override every preset's batch (a CPU run of small())"
    )
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    report = {
        **_common.environment(),
        "platform": jax.devices()[0].platform,
        "cpu_count": os.cpu_count(),
        "host": platform.node(),
        "results": [],
    }
    for preset in args.presets:
        for dense in (False, True):
            shape = SHAPES[preset] | ({"batch_size": args.batch_size} if args.batch_size else {})
            row = measure(preset, dense, args.steps, **shape)
            report["results"].append(row)
            print(
                f"{preset:>6} {row['attention']:>6}: {row['median_step_s'] * 1e3:8.1f} ms/step, "
                f"{row['tokens_per_s']:>10,.0f} tokens/s (first step {row['first_step_s']:.1f} s)"
            )
            if args.out:
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
