"""How many steps do tiny models need to solve the retrieval tasks? (choosing `v41jax train`'s
default task and budget).

Trains each candidate setting for a fixed number of steps (no checkpoints) and records the eval
accuracy curve; the step at which a setting first reaches 95 % tells what fits the main job's
5-minute CPU budget at the measured CPU step time.

    PYTHONPATH=. python3 experiments/learning_speed.py --out experiments/results/learning_speed.json
    PYTHONPATH=. python3 experiments/learning_speed.py --smoke   # seconds, for CI
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax

from v41jax import train
from v41jax.train import evaluate

SETTINGS = {  # `train.make_config` changes of each setting
    "passkey128": dict(task="passkey"),  # `v41jax train`'s default: 1 digit, 4x the pool
    "passkey256": dict(task="passkey", task_changes={"seq_len": 256}),
    "passkey512": dict(task="passkey", task_changes={"seq_len": 512}),
    "passkey128_5digits": dict(task="passkey", task_changes={"n_digits": 5}),
    "mqar128_p8q8": dict(task="mqar", task_changes={"n_pairs": 8, "n_queries": 8}),
}


def run_setting(
    name: str, overrides: dict, steps: int, batch: int, lr: float, every: int, warmup: float
) -> dict:
    cfg = train.make_config(
        steps=steps,
        batch_size=batch,
        learning_rate=lr,
        dense_warmup_steps=int(steps * warmup),
        **overrides,
    )
    model, optimizer = train.build(cfg)
    task = cfg.make_task()
    curve, clock = [], time.perf_counter()

    def record(done: int, metrics: dict) -> None:
        if done % every:
            return
        result = evaluate.evaluate(
            model, task, seed=99, batches=2, batch_size=batch, dense=cfg.dense_at(done - 1)
        )
        point = {
            "step": done,
            "seconds": time.perf_counter() - clock,
            "train_loss": float(metrics["task_loss"]),
            "accuracy": result["accuracy"],
        }
        curve.append(point)
        print(name, lr, point, flush=True)

    train.train_steps(model, optimizer, cfg, task, 0, steps, record)
    reached = next((p["step"] for p in curve if p["accuracy"] >= 0.95), None)
    return {"setting": name, "lr": lr, "batch": batch, "curve": curve, "steps_to_95": reached}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, nargs="+", default=[1e-2])
    parser.add_argument(
        "--warmup", type=float, default=0.4, help="dense warm-up as a fraction of the steps"
    )
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS))
    parser.add_argument("--every", type=int, default=100)
    parser.add_argument("--smoke", action="store_true", help="a few steps of one setting")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.smoke:
        args.steps, args.batch, args.lr, args.settings, args.every = (
            4,
            2,
            [3e-3],
            ["passkey128"],
            2,
        )
    results = []
    for name in args.settings:
        for lr in args.lr:
            results.append(
                run_setting(
                    name, SETTINGS[name], args.steps, args.batch, lr, args.every, args.warmup
                )
            )
            if args.out:  # after every setting, so a run cut short keeps what it measured
                args.out.parent.mkdir(parents=True, exist_ok=True)
                report = {"device": str(jax.devices()[0]), "results": results}
                args.out.write_text(json.dumps(report, indent=1))
    for r in results:
        print(f"{r['setting']:>22} lr={r['lr']:.0e}: steps to 95 % = {r['steps_to_95']}")


if __name__ == "__main__":
    main()
