"""The kernel benchmark of DESIGN §6, in one run on the H200: the two ceilings, then pooled
scoring, FP4 sparse attention, the top-k and the candidate source's scan against their XLA
baselines (the project's device timer, `pallas_kernels.timing.measure`: CUPTI, warm-up, medians,
fresh random data).

    PYTHONPATH=. python3 experiments/bench_kernels.py --out experiments/results/bench_kernels.json
    # the parts a device call's 10 minutes cut, added to that report (the copy ceiling is kept):
    PYTHONPATH=. python3 experiments/bench_kernels.py --out experiments/results/bench_kernels.json \
        --parts topk source_scan --resume

The whole run was more than one device call's 10 minutes on the H200 (2026-12-04: the
ceilings, pooled scoring, attention and part of the top-k took 570 s; the top-k and the source
scan 4 minutes in the next call; on 2026-12-05, at 1367020, 89 s and 142 s): `--parts`
splits it, `--resume` adds parts to the report at `--out` (`scripts/h200.sh bench`, then
`bench_rest`). The JSON is written after every timing; BENCHMARKS.md is the table written
from it.
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
from pallas_kernels.topk import api
from pallas_kernels.topk import bench as topk_bench

PARTS = ("copy", "matmul", "pooled_scoring", "sparse_attention", "topk", "source_scan")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument(
        "--parts", nargs="+", choices=PARTS, default=list(PARTS), help="what to time (in order)"
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="add the parts to the report at --out, keeping its others",
    )
    args = parser.parse_args(argv)
    report = {**_common.environment(), "host": platform.node()}
    if args.resume:
        if not args.out.exists():
            parser.error(f"--resume: no report at --out {args.out}")
        earlier = json.loads(args.out.read_text())
        if earlier.get("device") != report["device"]:
            parser.error(
                f"--resume: the report at {args.out} was measured on {earlier.get('device')!r}, "
                f"this machine is {report['device']!r}"
            )
        # Each part keeps the commit it was measured at.
        commits = earlier.pop(
            "commits", {part: earlier["commit"] for part in PARTS if part in earlier}
        )
        report = {**earlier, **report, "commits": commits}
    report.setdefault("commits", {})

    def save():
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))

    def copy_gbps() -> float:
        if "copy" not in report:  # a part that needs it, run without it
            report["copy"] = timing.copy_ceiling()
            report["commits"]["copy"] = report["commit"]
        return report["copy"]["GBps"]

    def progress(part):
        def save_partial(partial: dict) -> None:
            report[part] = {**partial, "partial": True}
            save()

        return save_partial

    for part in args.parts:
        if part == "copy":
            report["copy"] = timing.copy_ceiling()
        elif part == "matmul":
            report["matmul"] = timing.matmul_ceiling(iterations=args.iterations)
        elif part == "pooled_scoring":
            report[part] = scoring_bench.run(iterations=args.iterations, copy_gbps=copy_gbps())
        elif part == "sparse_attention":
            report[part] = attention_bench.run(iterations=args.iterations)
        elif part == "topk":
            # One data set and the 1-bit passes that `topk.api` runs by default
            # (`KERNEL_DIGIT_BITS`; the bench's three widths and two data sets did not finish
            # in a call).
            report[part] = topk_bench.run(
                iterations=args.iterations,
                digit_bits=(api.KERNEL_DIGIT_BITS,),
                n_datasets=1,
                progress=progress(part),
            )
        elif part == "source_scan":
            report[part] = scan_bench.run(
                iterations=args.iterations, copy_gbps=copy_gbps(), progress=progress(part)
            )
        report["commits"][part] = report["commit"]
        save()
    print(json.dumps({k: report[k] for k in ("copy", "matmul") if k in report}, indent=1))
    return report


if __name__ == "__main__":
    main()
