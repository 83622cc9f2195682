"""Long-context training on one GPU: tokens/s, peak memory and model FLOP utilization of the
sparse-stage training step of a preset (default `small()`) at sequence lengths 1 K … 64 K.

Each configuration runs in its own process (so `memory_stats()['peak_bytes_in_use']` is that
configuration's peak, and one that runs out of memory does not stop the others): the library's
training step (`train.StepRunner`: forward, backward, AdamW) on fresh random tokens each step,
sparse attention with the indexer KL loss, `ModelConfig.query_chunk` set (0 = the whole-sequence
mask path, the "before" figure). The first step includes compilation; tokens/s is batch × seq_len
over the median of the timed steps (host clock after `block_until_ready`: one step is tens to
hundreds of milliseconds, far above dispatch).

Model FLOPs per token (`flops_per_token`), stated here once:
  6 · P                                       matmul parameters (all but the embedding table),
                                              forward + backward
+ 3 · Σ_layers 4 · H · D · (W + k_l)          core attention, QK and PV, forward + backward;
                                              k_l = index_topk for sparse layers (0 for
                                              window-only layers), the attended keys nominal
+ Σ_full scans 2 · Hi · Di · S / 2            index scan of every Full layer (forward only: the
                                              indexer's gradient reads the k picks alone),
                                              S = T / ratio, half visible on average
+ Σ_Reindex 2 · Hi · Di · pool_size           Reindex scoring inside the pool (forward)
MFU = flops_per_token · tokens/s / 989 TFLOP/s (H200 dense bf16 peak).

    PYTHONPATH=. python3 experiments/long_context_memory.py --out long_context_h200.json
    PYTHONPATH=. python3 experiments/long_context_memory.py --preset tiny --seq-lens 256 \\
        --tokens-per-step 512 --out /tmp/lc.json          # a CPU smoke run

`experiments/bench_tables.py --long-context FILE` prints BENCHMARKS.md's table from the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from v41jax import train
from v41jax.nn.config import ModelConfig, Role
from v41jax.nn.model import parameter_counts

PEAK_BF16_FLOPS = 989e12


def flops_per_token(config: ModelConfig, seq_len: int) -> float:
    """Model FLOPs of one training token (the module docstring's formula)."""
    c = config
    params = parameter_counts(c)["total"] - c.vocab_size * c.dim
    attention = index = 0.0
    for plan in c.layers:
        keys = c.window_size + (c.index_topk if plan.role is not Role.WINDOW else 0)
        attention += 4 * c.n_heads * c.head_dim * keys
        if plan.role is Role.FULL:
            index += 2 * c.index_n_heads * c.index_head_dim * seq_len / plan.compress_ratio / 2
        elif plan.role is Role.REINDEX and plan.uses_candidates:
            index += 2 * c.index_n_heads * c.index_head_dim * c.candidate_pool_size
        elif plan.role is Role.REINDEX:
            index += 2 * c.index_n_heads * c.index_head_dim * seq_len / plan.compress_ratio / 2
    return 6 * params + 3 * attention + index


def auto_chunk(batch: int, seq_len: int, budget: int) -> int:
    """Queries per chunk: the largest power of two with batch · chunk · seq_len <= budget (the
    index scan holds [B, chunk, S] scores per head), at least 64, at most seq_len."""
    chunk = 64
    while chunk * 2 * batch * seq_len <= budget and chunk * 2 <= seq_len:
        chunk *= 2
    return min(chunk, seq_len)


def run_one(args: dict, barrier: str | None = None) -> dict:
    """One configuration, in this process: build, compile ahead of time, then (once `barrier`
    says go, so that no other configuration uses the GPU meanwhile) run 1 + `steps` steps."""
    cfg = train.make_config(
        preset=args["preset"],
        model_changes={"query_chunk": args["query_chunk"]},
        batch_size=args["batch"],
        steps=1000,
        dense_warmup_steps=0,
    )
    model, optimizer = train.build(cfg)
    step = train.StepRunner(model, optimizer)
    c = model.config
    rng = np.random.default_rng(0)
    shape = (args["batch"], args["seq_len"])

    def batch():
        tokens = jnp.asarray(rng.integers(0, c.vocab_size, shape), jnp.int32)
        targets = jnp.asarray(rng.integers(0, c.vocab_size, shape), jnp.int32)
        return tokens, targets, jnp.ones(shape, bool)

    options = dict(dense=False, indexer_kl_weight=cfg.indexer_kl_weight)
    began = time.perf_counter()
    values = [v.get_raw_value() for v in step.variables]
    compiled = step.step.lower(values, *batch(), **options).compile()
    compile_s = time.perf_counter() - began
    memory = compiled.memory_analysis()
    temp_gib = getattr(memory, "temp_size_in_bytes", float("nan")) / 2**30
    if barrier:
        Path(f"{barrier}.compiled").touch()
        while not Path(f"{barrier}.go").exists():
            time.sleep(0.2)
    times = []
    for _ in range(1 + args["steps"]):
        data = batch()
        jax.block_until_ready(data)
        start = time.perf_counter()
        metrics = step(*data, **options)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - start)
    first, times = times[0], times[1:]
    median = statistics.median(times)
    tokens_per_s = args["batch"] * args["seq_len"] / median
    fpt = flops_per_token(c, args["seq_len"])
    stats = jax.devices()[0].memory_stats() or {}
    return {
        **args,
        "device": jax.devices()[0].device_kind,
        "compile_s": compile_s,
        "compiled_temp_gib": temp_gib,
        "first_step_s": first,
        "step_s": times,
        "median_step_s": median,
        "tokens_per_s": tokens_per_s,
        "peak_gib": stats.get("peak_bytes_in_use", float("nan")) / 2**30,
        "flops_per_token": fpt,
        "mfu": fpt * tokens_per_s / PEAK_BF16_FLOPS,
        "loss": float(metrics["loss"]),
    }


def plan(args) -> list[dict]:
    configs = []
    for seq_len in args.seq_lens:
        batch = max(1, args.tokens_per_step // seq_len)
        chunk = auto_chunk(batch, seq_len, args.chunk_budget)
        configs.append(dict(seq_len=seq_len, batch=batch, query_chunk=chunk))
    for seq_len in args.before:
        configs.append(
            dict(seq_len=seq_len, batch=max(1, args.tokens_per_step // seq_len), query_chunk=0)
        )
    return [dict(c, preset=args.preset, steps=args.steps) for c in configs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument(
        "--seq-lens", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384, 32768, 65536]
    )
    parser.add_argument(
        "--before", type=int, nargs="*", default=[4096], help="seq_lens also run unchunked"
    )
    parser.add_argument("--tokens-per-step", type=int, default=32768)
    parser.add_argument("--chunk-budget", type=int, default=2**26, help="batch·chunk·seq_len")
    parser.add_argument("--steps", type=int, default=5, help="timed steps after the first")
    parser.add_argument("--deadline-s", type=float, default=240.0, help="then stop compiling")
    parser.add_argument("--run-timeout-s", type=float, default=60.0)
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--barrier", help=argparse.SUPPRESS)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run_one(json.loads(args.one), args.barrier)), flush=True)
        return

    # Every configuration compiles at once in its own process (compilation is CPU work, most of
    # a minute each for small()); the compiled ones run one at a time, each alone on the GPU
    # (others may still be compiling on the CPU: `compiling_meanwhile`). This process never
    # touches the GPU, so each child's peak is its own.
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    report = {
        "jax": jax.__version__,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "commit": os.environ.get("V41JAX_COMMIT", "unknown"),
        "date": time.strftime("%Y-%m-%d"),
        "peak_flops": PEAK_BF16_FLOPS,
        "chunk_budget": args.chunk_budget,
        "results": [],
    }
    work = Path(tempfile.mkdtemp())
    pending = []
    for i, config in enumerate(plan(args)):
        barrier = str(work / str(i))
        out, err = open(f"{barrier}.out", "w"), open(f"{barrier}.err", "w")
        command = [sys.executable, __file__, "--one", json.dumps(config), "--out", "-"]
        child = subprocess.Popen([*command, "--barrier", barrier], env=env, stdout=out, stderr=err)
        pending.append((config, barrier, child))
    began = time.perf_counter()
    while pending:
        out_of_time = time.perf_counter() - began > args.deadline_s
        ready = [p for p in pending if Path(f"{p[1]}.compiled").exists() or p[2].poll() is not None]
        if not ready and not out_of_time:
            time.sleep(0.5)
            continue
        config, barrier, child = ready[0] if ready else pending[0]
        pending.remove((config, barrier, child))
        result = dict(config, compiling_meanwhile=len(pending))
        if Path(f"{barrier}.compiled").exists():
            Path(f"{barrier}.go").touch()
            try:
                child.wait(timeout=args.run_timeout_s)
            except subprocess.TimeoutExpired:
                result["error"] = "run timeout"
        else:
            result["error"] = "compile timeout" if child.poll() is None else None
        if child.poll() is None:
            child.kill()
            child.wait()
        lines = [x for x in Path(f"{barrier}.out").read_text().splitlines() if x.startswith("{")]
        text = Path(f"{barrier}.err").read_text()
        if child.returncode == 0 and lines and not result.get("error"):
            result = dict(json.loads(lines[-1]), compiling_meanwhile=result["compiling_meanwhile"])
        else:
            oom = "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()
            tail = " | ".join(text.strip().splitlines()[-2:])
            result["error"] = f"{result.get('error') or ''} {'out of memory' if oom else ''} {tail}"
        report["results"].append(result)
        print(_summary(result), flush=True)
        Path(args.out).write_text(json.dumps(report, indent=1))
    Path(args.out).write_text(json.dumps(report, indent=1))


def _summary(r: dict) -> str:
    head = f"T={r['seq_len']:>6} B={r['batch']:>3} chunk={r['query_chunk']:>5}"
    if "error" in r:
        return f"{head}  ERROR {r['error'][:300]}"
    return (
        f"{head}  {r['tokens_per_s']:>10,.0f} tok/s  {r['median_step_s'] * 1e3:8.1f} ms  "
        f"peak {r['peak_gib']:6.1f} GiB  MFU {r['mfu']:.1%}  compile {r['compile_s']:.0f} s"
    )


if __name__ == "__main__":
    main()
