"""The kernel benchmark of DESIGN §6, in one run on the H200: the two ceilings, then pooled
scoring, FP4 sparse attention, the top-k and the candidate source's scan against their XLA
baselines (the project's device timer, `pallas_kernels.timing.measure`: CUPTI, warm-up, medians,
fresh random data).

    PYTHONPATH=. python3 experiments/bench_kernels.py --out experiments/results/bench_kernels.json

The JSON holds every number; BENCHMARKS.md is the table written from it.
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

from experiments import _common
from pallas_kernels import timing
from pallas_kernels.pooled_scoring import bench as scoring_bench
from pallas_kernels.source_scan import bench as scan_bench
from pallas_kernels.sparse_attention import bench as attention_bench
from pallas_kernels.topk import bench as topk_bench


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--iterations", type=int, default=10)
    args = parser.parse_args()
    report = {**_common.environment(), "host": platform.node()}

    def save():
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))

    report["copy"] = timing.copy_ceiling()
    report["matmul"] = timing.matmul_ceiling(iterations=args.iterations)
    save()
    report["pooled_scoring"] = scoring_bench.run(
        iterations=args.iterations, copy_gbps=report["copy"]["GBps"]
    )
    save()
    report["sparse_attention"] = attention_bench.run(iterations=args.iterations)
    save()
    report["topk"] = topk_bench.run(iterations=args.iterations)
    save()
    report["source_scan"] = scan_bench.run(
        iterations=args.iterations, copy_gbps=report["copy"]["GBps"]
    )
    save()
    print(json.dumps({k: report[k] for k in ("copy", "matmul")}, indent=1))


if __name__ == "__main__":
    main()
