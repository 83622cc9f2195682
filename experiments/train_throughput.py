"""Training throughput: tokens per second of the library's training loop for a preset on this
machine, one seed alone and (with `--group N`) N seeds trained together in one program.

For each (preset, attention stage) the script builds the model and runs the library's training
loop (`train.train_steps`) for 1 + `--steps` steps on fresh batches of the task, waiting for each
step's metrics in the loop's hook: the first step's time includes compilation, the median of the
others gives tokens/s (batch x seq_len / median). Wall-clock timing is right here: a training
step is host-dispatched whole (batch generation included), and the figure a researcher plans
with is the one their loop sees. Then `--steps` more steps run without waiting between them, as
`train.run` does between its records: their mean is the pipelined step time.

With `--group N`, seeds 0..N−1 of the same config train together (`train.GroupStepRunner`, the
loop `train.train_group_steps` that `train.run_seeds` drives), timed the same way: a step then
advances N seeds, and "seed-steps/s" (N / step time) against one seed's 1 / step time is the
group's gain in throughput (issue 12's target: >= 5x for 8 tiny() seeds on the H200).

    PYTHONPATH=. python3 experiments/train_throughput.py --out results.json
    PYTHONPATH=. python3 experiments/train_throughput.py --presets tiny --attention sparse \
        --group 8 --steps 30 --out group.json
    .venv/bin/python experiments/train_throughput.py --steps 3 --batch-size 4 --out cpu.json

BENCHMARKS.md's training tables are written from the committed JSON of the GPU and CPU runs
(`experiments/bench_tables.py --throughput` and `--groups`).
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


def _config(preset: str, dense: bool, steps: int, seq_len: int, batch_size: int):
    return train.make_config(
        preset=preset,
        task="passkey",
        task_changes={"seq_len": seq_len, "n_digits": 1},
        batch_size=batch_size,
        steps=steps,
        attention="dense" if dense else "sparse",
        dense_warmup_steps=0,
    )


def _time_loop(loop, steps: int, desc: str) -> dict:
    """Times `loop(start, end, hook)` (a training loop over steps start..end−1): 1 + `steps`
    steps each waited for, then `steps` steps dispatched back to back and waited for once."""
    bar = tqdm(total=2 * steps + 1, desc=desc)
    times, clock = [], time.perf_counter()

    def timed(done: int, metrics: dict, *_) -> None:
        nonlocal clock
        jax.block_until_ready(metrics)
        now = time.perf_counter()
        times.append(now - clock)
        clock = now
        bar.update(1)

    loop(0, steps + 1, timed)
    last = []
    clock = time.perf_counter()
    loop(steps + 1, 2 * steps + 1, lambda done, metrics, *_: last.append(metrics))
    jax.block_until_ready(last[-1])
    pipelined = (time.perf_counter() - clock) / steps
    bar.update(steps)
    bar.close()
    first, times = times[0], times[1:]
    return {
        "steps_timed": steps,
        "first_step_s": first,
        "median_step_s": statistics.median(times),
        "min_step_s": min(times),
        "pipelined_step_s": pipelined,
    }


def measure(preset: str, dense: bool, steps: int, seq_len: int, batch_size: int) -> dict:
    """One seed through `train.train_steps` (see the module docstring)."""
    cfg = _config(preset, dense, 2 * steps + 1, seq_len, batch_size)
    model, optimizer = train.build(cfg)
    task = cfg.make_task()

    def loop(start, end, hook):
        train.train_steps(model, optimizer, cfg, task, start, end, hook)

    timing = _time_loop(loop, steps, f"{preset} dense={dense}")
    return {
        "preset": preset,
        "attention": cfg.attention,
        "seq_len": seq_len,
        "batch_size": batch_size,
        **timing,
        "tokens_per_s": batch_size * seq_len / timing["median_step_s"],
        "parameters": parameter_counts(model.config)["total"],
    }


def measure_group(
    preset: str, dense: bool, steps: int, seq_len: int, batch_size: int, seeds: int
) -> dict:
    """Seeds 0..`seeds`−1 through `train.train_group_steps` (see the module docstring)."""
    base = _config(preset, dense, 2 * steps + 1, seq_len, batch_size)
    cfgs = [base.replace(seed=seed) for seed in range(seeds)]
    runner = train.GroupStepRunner([train.build(cfg) for cfg in cfgs])
    task = base.make_task()

    def loop(start, end, hook):
        train.train_group_steps(runner, cfgs, task, [start] * seeds, end, hook)

    timing = _time_loop(loop, steps, f"{preset} dense={dense} {seeds} seeds")
    return {
        "preset": preset,
        "attention": base.attention,
        "seq_len": seq_len,
        "batch_size": batch_size,
        "seeds": seeds,
        **timing,
        "seed_steps_per_s": seeds / timing["median_step_s"],
        "tokens_per_s": seeds * batch_size * seq_len / timing["median_step_s"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument(
        "--attention", nargs="+", default=["sparse", "dense"], choices=["sparse", "dense"]
    )
    parser.add_argument("--steps", type=int, default=20, help="timed steps after the first")
    parser.add_argument(
        "--batch-size", type=int, help="override every preset's batch (a CPU run of small())"
    )
    parser.add_argument(
        "--group", type=int, metavar="N", help="also time N seeds trained together in one program"
    )
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    report = {
        **_common.environment(),
        "platform": jax.devices()[0].platform,
        "cpu_count": os.cpu_count(),
        "host": platform.node(),
        "results": [],
        "groups": [],
    }
    for preset in args.presets:
        for dense in (attention == "dense" for attention in args.attention):
            shape = SHAPES[preset] | ({"batch_size": args.batch_size} if args.batch_size else {})
            row = measure(preset, dense, args.steps, **shape)
            report["results"].append(row)
            print(
                f"{preset:>6} {row['attention']:>6}: {row['median_step_s'] * 1e3:8.1f} ms/step, "
                f"{row['tokens_per_s']:>10,.0f} tokens/s (first step {row['first_step_s']:.1f} s, "
                f"pipelined {row['pipelined_step_s'] * 1e3:.1f} ms/step)"
            )
            _write(args.out, report)
            if args.group:
                group = measure_group(preset, dense, args.steps, **shape, seeds=args.group)
                group["vs_one_seed"] = group["seed_steps_per_s"] * row["median_step_s"]
                group["vs_one_seed_pipelined"] = (
                    args.group * row["pipelined_step_s"] / group["pipelined_step_s"]
                )
                report["groups"].append(group)
                print(
                    f"{preset:>6} {row['attention']:>6} x{args.group} seeds: "
                    f"{group['median_step_s'] * 1e3:8.1f} ms/step, "
                    f"{group['seed_steps_per_s']:,.1f} seed-steps/s = "
                    f"{group['vs_one_seed']:.2f}x one seed (pipelined "
                    f"{group['vs_one_seed_pipelined']:.2f}x; first step "
                    f"{group['first_step_s']:.1f} s)"
                )
                _write(args.out, report)


def _write(path: Path | None, report: dict) -> None:
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
