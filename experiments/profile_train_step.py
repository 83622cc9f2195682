"""Where a training step's time goes: the step, its forward pass, and (on a GPU) every kernel.

For a preset and task shape, in both stages (dense warm-up, sparse), this times on fresh batches:
- the whole `train.train_step` (forward, backward, optimizer update), wall clock per step after
  compilation, each step waited for (what a training loop sees);
- the forward pass with the loss alone (`train.loss_fn` under `jit`), the same way;
- the compilation of the step (seconds);
- on a GPU, the step's kernels with the device timer (`pallas_kernels.timing.measure`): how many
  a step launches, their summed device time, and the heaviest by name, which tells whether the
  step is bound by launches or by work;
- on a CPU, the step's XLA operations from a `jax.profiler` trace: their summed time by kind
  (the fusion's name without its number: `ynn_fusion` = XNNPACK's fused dots, `copy_*` = layout
  copies, `dot`, ...) and the heaviest, each with the jax operation it comes from (the HLO's
  `op_name`). The CPU runs operations on several threads at once, so their sum exceeds the
  step's wall time.

    PYTHONPATH=. python3 experiments/profile_train_step.py --out profile.json
    PYTHONPATH=. python3 experiments/profile_train_step.py --preset small --seq-len 1024
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import re
import statistics
import tempfile
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


def host_ops(fn, args: list[tuple]) -> dict:
    """On a CPU: `fn(*a)` for each of `args` under `jax.profiler`; the XLA operations' time per
    call, by kind and the heaviest (with the HLO `op_name` they come from)."""
    hlo = fn.lower(*args[0]).compile().as_text()
    op_names = dict(
        re.findall(r"^\s*(?:ROOT )?%?([\w.-]+) = [^\n]*?op_name=\"([^\"]*)\"", hlo, re.M)
    )
    instructions = set(re.findall(r"^\s*(?:ROOT )?%?([\w.-]+) = ", hlo, re.M))
    with tempfile.TemporaryDirectory() as trace_dir:
        jax.profiler.start_trace(trace_dir)
        for a in args:
            jax.block_until_ready(fn(*a))
        jax.profiler.stop_trace()
        (path,) = Path(trace_dir).rglob("*.trace.json.gz")
        events = json.loads(gzip.decompress(path.read_bytes()))["traceEvents"]
    per_op = collections.Counter()
    for e in events:
        if e.get("ph") == "X" and e.get("name") in instructions:
            per_op[e["name"]] += e["dur"] / 1e3 / len(args)  # µs → ms per call
    by_kind = collections.Counter()
    for name, ms in per_op.items():
        by_kind[re.sub(r"\.\d+$", "", name)] += ms
    return {
        "ops_ms": sum(per_op.values()),
        "ops_per_step": len(per_op),
        "by_kind_ms": dict(by_kind.most_common(12)),
        "heaviest": [
            {"name": n, "ms": ms, "op_name": op_names.get(n, "")}
            for n, ms in per_op.most_common(15)
        ],
    }


def profile(cfg: train.TrainConfig, dense: bool, steps: int) -> dict:
    model, optimizer = train.build(cfg)
    batches = _batches(cfg, steps + 1)
    kl = cfg.indexer_kl_weight

    def step(tokens, targets, mask):
        return train.train_step(
            model, optimizer, tokens, targets, mask, dense=dense, indexer_kl_weight=kl
        )

    @nnx.jit(graph_updates=False)  # the forward alone: no parameter copied out (nn/model.py)
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
    elif jax.default_backend() == "cpu":
        row["host"] = host_ops(pure_step, [(state, *b) for b in batches[1:4]])
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
