"""The kernel benchmark of DESIGN §6, in one run on the H200: the two ceilings, then pooled
scoring and FP4 sparse attention against their XLA baselines (device-side CUPTI timing through
`jax.experimental.mosaic.gpu.profiler.measure`, warm-up, medians, fresh random data).

    PYTHONPATH=. python3 experiments/bench_kernels.py --out experiments/results/bench_kernels.json

The JSON holds every number; BENCHMARKS.md is the table written from it.
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import jax
import jax.numpy as jnp

from experiments import _common
from pallas_kernels.pooled_scoring import bench as scoring_bench
from pallas_kernels.sparse_attention import bench as attention_bench


def matmul_ceiling(n: int = 8192, iterations: int = 10) -> dict:
    """bf16 n³ product on random data (DESIGN §6 measured 811 TFLOP/s at 8192³)."""
    ka, kb = jax.random.split(jax.random.key(1))
    a = jax.random.normal(ka, (n, n), jnp.bfloat16)
    b = jax.random.normal(kb, (n, n), jnp.bfloat16)
    timing = scoring_bench._measure(jax.jit(jnp.matmul), [(a, b)], iterations)
    return {"n": n, **timing, "TFLOPs": 2 * n**3 / timing["median_ms"] / 1e9}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--iterations", type=int, default=10)
    args = parser.parse_args()
    report = {**_common.environment(), "host": platform.node()}

    def save():
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))

    report["copy"] = scoring_bench._copy_bandwidth()
    report["matmul"] = matmul_ceiling(iterations=args.iterations)
    save()
    report["pooled_scoring"] = scoring_bench.run(
        iterations=args.iterations, copy_gbps=report["copy"]["GBps"]
    )
    save()
    report["sparse_attention"] = attention_bench.run(iterations=args.iterations)
    save()
    print(json.dumps({k: report[k] for k in ("copy", "matmul")}, indent=1))


if __name__ == "__main__":
    main()
