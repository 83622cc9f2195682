"""Where a training step's time goes: the step, its forward pass, and (on a GPU) every kernel.

For a preset and task shape, in both stages (dense warm-up, sparse), this times on fresh batches:
- the whole `train.train_step` (forward, backward, optimizer update), wall clock per step after
  compilation, each step waited for (what a training loop sees);
- the forward pass with the loss alone (`train.loss_fn` under `jit`), the same way;
- the compilation of the step (seconds);
- on a GPU, the step's kernels with the device timer (`pallas_kernels.timing.measure`): how many
  a step launches, their summed device time, and the heaviest by name, which tells whether the
  step is bound by launches or by work.

    PYTHONPATH=. python3 experiments/profile_train_step.py --out profile.json
    PYTHONPATH=. python3 experiments/profile_train_step.py --preset small --seq-len 1024
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from experiments import _common
from pallas_kernels import timing
from v41jax import train
from v41jax.cli import name_value


def _batches(cfg: train.TrainConfig, n: int) -> list[tuple[jax.Array, ...]]:
    task = cfg.make_task()
    out = []
    for k in range(n):
        b = task.batch_at(cfg.seed, k, cfg.batch_size)
        out.append(tuple(jnp.asarray(x) for x in (b.tokens, b.targets, b.loss_mask)))
    return out


def _wall(fn, batches) -> dict:
    """Median wall seconds of fn(*batch) over `batches`, each waited for; the first call
    (compilation) timed apart."""
    clock = time.perf_counter()
    jax.block_until_ready(fn(*batches[0]))
    first = time.perf_counter() - clock
    times = []
    for batch in batches[1:]:
        clock = time.perf_counter()
        jax.block_until_ready(fn(*batch))
        times.append(time.perf_counter() - clock)
    return {"first_s": first, "median_s": statistics.median(times), "min_s": min(times)}


def profile(cfg: train.TrainConfig, dense: bool, steps: int) -> dict:
    model, optimizer = train.build(cfg)
    batches = _batches(cfg, steps + 1)
    kl = cfg.indexer_kl_weight

    def step(tokens, targets, mask):
        return train.train_step(
            model, optimizer, tokens, targets, mask, dense=dense, indexer_kl_weight=kl
        )

    @nnx.jit
    def forward(model, tokens, targets, mask):
        return train.loss_fn(model, tokens, targets, mask, dense=dense, indexer_kl_weight=kl)[0]

    row = {
        "attention": "dense" if dense else "sparse",
        "train_step": _wall(step, batches),
        "forward": _wall(lambda *b: forward(model, *b), batches),
    }
    tokens = cfg.batch_size * cfg.make_task().seq_len
    row["tokens_per_s"] = tokens / row["train_step"]["median_s"]
    # The same step as a pure function of (state, batch), which the device timer can jit.
    graphdef, state = nnx.split((model, optimizer))

    @jax.jit
    def pure_step(state, tokens, targets, mask):
        model, optimizer = nnx.merge(graphdef, state)
        metrics = train.train_step(
            model, optimizer, tokens, targets, mask, dense=dense, indexer_kl_weight=kl
        )
        return nnx.state((model, optimizer)), metrics

    jax.block_until_ready(pure_step(state, *batches[0]))
    if jax.default_backend() == "gpu":
        args = [(state, *b) for b in batches[1:4]]
        timed, _ = timing.measure(pure_step, args, iterations=5)
        names = collections.Counter()
        for k in timed["kernels"]:
            names[k["name"].split(".")[0].split("_")[0]] += k["ms"]
        row["device"] = {
            "median_ms": timed["median_ms"],
            "kernels_per_step": len(timed["kernels"]),
            "heaviest": sorted(timed["kernels"], key=lambda k: -k["ms"])[:15],
            "by_kind_ms": dict(names.most_common(15)),
        }
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=10, help="timed steps after the first")
    parser.add_argument(
        "--model-set",
        type=name_value,
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a ModelConfig field of the preset, e.g. query_chunk=2048",
    )
    parser.add_argument(
        "--stages", choices=("both", "dense", "sparse"), default="both", help="which to profile"
    )
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    cfg = train.make_config(
        preset=args.preset,
        batch_size=args.batch_size,
        task_changes={"seq_len": args.seq_len},
        model_changes=dict(args.model_set),
    )
    report = {**_common.environment(), "config": cfg.to_json(), "results": []}
    for dense in {"both": (True, False), "dense": (True,), "sparse": (False,)}[args.stages]:
        row = profile(cfg, dense, args.steps)
        report["results"].append(row)
        print(json.dumps(row, indent=1), flush=True)
        if args.out:
            args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
