"""Issue 14's block-score study at 4 K tokens, phase by phase, from one curriculum prefix per
seed: `max` vs `mean` vs `top2` block scores, and dense attention, at context/pool ratios 16, 64
and 4.

The plan (every number below is a default of this file):
  1. prefix (`long_context_task.py`, per seed): `small()` learns the 16-needle passkey densely at
     128 then 512 tokens, then trains 100 steps densely at 4 K. That is the dense warm-up of
     V4.1's recipe, shared: every variant starts from it (the warm-up is the same program for
     every block score, so running it once per seed changes nothing but the optimizer's
     restart).
  2. one phase per (ratio, variant), each a `block_score_ablation.py` run of the variant's seeds
     at 4 K tokens: sparse from step 0 (pool and Reindex top-k as at inference), the pool
     `candidate_topk_blocks` = 4096 / ratio positions in blocks of 8 (ratio 16: 32 blocks,
     V4.1-like 1/16 of the context; 64: 8 blocks; 4: 128 blocks). Each run stops on the
     convergence rule (the last 2 evaluations, every 25 steps, at >= 90 %) or at its cap of 300
     steps; 'dense' trains with every layer attending to all compressed entries for as long.
     Ratios are set by the pool at a fixed context, so the task, its difficulty and the prefix
     are the same for every ratio.

Where a phase stops depends on seeds and data only; `--max-minutes` guards one call on a lent
machine, and running the same command again continues: finished phases are skipped (their
reports are kept in the work directory), a phase the guard cut resumes from its checkpoints.
After every phase the combined reports are written to --out-dir: `long_context_prefix.json`
and `block_score_4k_ratio<r>.json` (+ .png) per ratio, in `block_score_ablation`'s schema
(`study_tables.py` prints them), with "partial" true until every phase of the ratio is done.

    PYTHONPATH=. python3 experiments/long_context_studies.py --max-minutes 9   # again to go on
    PYTHONPATH=. python3 experiments/long_context_studies.py --status          # what is done
    PYTHONPATH=. python3 experiments/long_context_studies.py --smoke --out-dir /tmp/lcs  # CPU
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from experiments import _common, block_score_ablation, long_context_task, pool_size_sweep
from v41jax import train

NAME = "long_context_studies"
SEEDS = (0, 1, 2, 3, 4)
TASK = "multi_passkey"
# (ratio, variant) in the order they run: the question first (max vs mean at two ratios), then
# the dense baseline, the third reducer and the third ratio.
PHASES = (
    (16, "max"),
    (16, "mean"),
    (64, "max"),
    (64, "mean"),
    (16, "dense"),
    (16, "top2"),
    (64, "top2"),
    (4, "max"),
    (4, "mean"),
    (4, "top2"),
)
PREFIX = dict(ladder=(128, 512), short_lrs=(1e-3,), long_steps=100)
STUDY = dict(
    preset="small",
    seq_len=4096,
    query_chunk=2048,
    batch_size=8,
    lr=1e-3,
    steps=300,
    eval_every=25,
    eval_batches=4,
    converge_accuracy=0.9,
)
# --smoke: the same plan end to end on tiny() in a minute or two of CPU.
SMOKE_PREFIX = dict(ladder=(48,), short_lrs=(5e-3,), long_steps=2)
SMOKE_STUDY = dict(
    preset="tiny",
    seq_len=128,
    query_chunk=128,
    batch_size=2,
    lr=5e-3,
    steps=2,
    eval_every=1,
    eval_batches=1,
    converge_accuracy=0.9,
)
SMOKE_PHASES = ((16, "mean"), (4, "max"))
MIN_PHASE_SECONDS = 90  # a phase started with less would spend it compiling


def phase_name(ratio: int, variant: str) -> str:
    return f"ratio{ratio}-{variant}"


def _flags(name: str, value) -> list[str]:
    if isinstance(value, list | tuple):
        return [f"--{name}", *map(str, value)]
    return [f"--{name}", str(value)]


def task_flags(fields: dict) -> list[str]:
    """`--task-set NAME=VALUE` for each task field (JSON values, as the studies parse them)."""
    return [
        flag
        for name, value in fields.items()
        for flag in ("--task-set", f"{name}={json.dumps(value)}")
    ]


def pool_blocks(study: dict, ratio: int) -> int:
    """The pool, in blocks, that is 1/ratio of the candidate source's positions at seq_len."""
    model = train.make_config(preset=study["preset"]).model_config()
    return pool_size_sweep.pool_sizes(model, study["seq_len"], [ratio])[0]


class Plan:
    """The phases of this call: their directories, commands and what is done."""

    def __init__(self, args: argparse.Namespace):
        self.smoke, self.seeds = args.smoke, list(args.seeds)
        self.prefix = SMOKE_PREFIX if args.smoke else PREFIX
        self.study = SMOKE_STUDY if args.smoke else STUDY
        self.phases = SMOKE_PHASES if args.smoke else PHASES
        self.task = (long_context_task.SMOKE_TASKS if args.smoke else long_context_task.TASKS)[TASK]
        self.work = args.work_dir
        self.prefix_runs = self.work / "prefix"
        self.prefix_report = self.work / "reports" / "prefix.json"

    def prefix_argv(self, minutes: float) -> list[str]:
        p = self.prefix
        argv = ["--task", TASK, "--preset", self.study["preset"], "--long-attention", "dense"]
        argv += [*_flags("seeds", self.seeds), "--group-size", "1"]
        argv += _flags("ladder", p["ladder"]) + _flags("short-lrs", p["short_lrs"])
        argv += ["--long-steps", str(p["long_steps"]), "--max-minutes", f"{minutes:.2f}"]
        argv += ["--out", str(self.prefix_report), "--runs-dir", str(self.prefix_runs)]
        return argv + (["--smoke"] if self.smoke else [])

    def prefix_done(self) -> bool:
        if not self.prefix_report.exists():
            return False
        return not json.loads(self.prefix_report.read_text())["partial"]

    def report_path(self, ratio: int, variant: str) -> Path:
        return (
            self.work / "reports" / phase_name(ratio, variant) / f"{block_score_ablation.NAME}.json"
        )

    def phase_argv(self, ratio: int, variant: str, minutes: float) -> list[str]:
        s = self.study
        init = self.prefix_runs / "long" / train.SEED_DIR
        argv = [
            "--preset",
            s["preset"],
            "--task",
            TASK,
            *task_flags(dict(self.task, seq_len=s["seq_len"])),
        ]
        argv += ["--model-set", f"candidate_topk_blocks={pool_blocks(s, ratio)}"]
        argv += ["--model-set", f"query_chunk={s['query_chunk']}"]
        argv += ["--batch-size", str(s["batch_size"]), "--dense-warmup-steps", "0"]
        argv += ["--lr", str(s["lr"]), "--steps", str(s["steps"]), "--init-from", str(init)]
        argv += ["--eval-every", str(s["eval_every"]), "--eval-batches", str(s["eval_batches"])]
        argv += ["--converge-accuracy", str(s["converge_accuracy"]), "--group-size", "1"]
        argv += [*_flags("seeds", self.seeds), "--variants", variant]
        argv += ["--out-dir", str(self.report_path(ratio, variant).parent)]
        argv += ["--runs-dir", str(self.work / "runs" / f"ratio{ratio}")]
        return [*argv, "--max-minutes", f"{minutes:.2f}"]

    def phase_report(self, ratio: int, variant: str) -> dict | None:
        path = self.report_path(ratio, variant)
        return json.loads(path.read_text()) if path.exists() else None

    def phase_done(self, ratio: int, variant: str) -> bool:
        report = self.phase_report(ratio, variant)
        if report is None:
            return False
        records = report["results"]
        return sorted(r["seed"] for r in records) == sorted(self.seeds) and not any(
            r.get("stopped_early") for r in records
        )


def combined(plan: Plan, ratio: int) -> dict | None:
    """The ratio's phase reports as one `block_score_ablation` report (None before any)."""
    parts = [(variant, plan.phase_report(r, variant)) for r, variant in plan.phases if r == ratio]
    found = [(v, rep) for v, rep in parts if rep is not None]
    if not found:
        return None
    config = dict(found[0][1]["config"])
    config["variants"] = {v: block_score_ablation.VARIANTS[v] for v, _ in parts}
    config["argv"] = [rep["config"]["argv"] for _, rep in found]
    config["commit"] = sorted({rep["config"]["commit"] for _, rep in found})
    config["ratio"] = ratio
    config["pool_blocks"] = pool_blocks(plan.study, ratio)
    config["prefix"] = str(plan.prefix_runs / "long" / train.SEED_DIR)
    config["plan"] = f"experiments/{NAME}.py"
    config["partial"] = not all(plan.phase_done(ratio, v) for v, _ in parts)
    records = [r for _, rep in found for r in rep["results"]]
    return {"config": config, "results": records, "summary": _common.summarize(records)}


def write_outputs(plan: Plan, out_dir: Path) -> list[Path]:
    """The combined reports (and figures) in `out_dir`; returns the paths written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    if plan.prefix_report.exists():
        path = out_dir / "long_context_prefix.json"
        path.write_text(plan.prefix_report.read_text())
        written.append(path)
    for ratio in dict.fromkeys(r for r, _ in plan.phases):
        report = combined(plan, ratio)
        if report is None:
            continue
        path = out_dir / f"block_score_4k_ratio{ratio}.json"
        path.write_text(json.dumps(report, indent=1))
        block_score_ablation.plot(report, path.with_suffix(".png"))
        written += [path, path.with_suffix(".png")]
    return written


def status(plan: Plan) -> str:
    lines = [f"prefix: {'done' if plan.prefix_done() else 'to do'} ({plan.prefix_runs})"]
    for ratio, variant in plan.phases:
        report = plan.phase_report(ratio, variant)
        state = "done" if plan.phase_done(ratio, variant) else "to do"
        if report is not None and state != "done":
            state = f"partial ({len(report['results'])} records, some stopped early)"
        lines.append(f"{phase_name(ratio, variant)}: {state}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS))
    parser.add_argument(
        "--work-dir",
        type=Path,
        default=Path("runs") / NAME,
        help="the prefix's and the phases' runs and reports (runs/long_context_studies)",
    )
    parser.add_argument(
        "--out-dir",
        type=Path,
        help="where the combined reports go (experiments/results; --smoke: required)",
    )
    parser.add_argument("--max-minutes", type=float, help="a guard for this call (none)")
    parser.add_argument("--status", action="store_true", help="print what is done and exit")
    parser.add_argument("--smoke", action="store_true", help="the plan on tiny(), on a CPU")
    args = parser.parse_args(argv)
    if args.smoke and args.out_dir is None:
        parser.error("--out-dir: --smoke outputs are not results; name a folder for them")
    out_dir = args.out_dir or _common.RESULTS_DIR
    plan = Plan(args)
    if args.status:
        print(status(plan))
        return 0
    began = time.perf_counter()

    def minutes_left() -> float:
        if args.max_minutes is None:
            return 1e9
        return args.max_minutes - (time.perf_counter() - began) / 60

    if not plan.prefix_done():
        long_context_task.main(plan.prefix_argv(minutes_left()))
        write_outputs(plan, out_dir)
        if not plan.prefix_done():
            print("the prefix is not finished: run the same command again", flush=True)
            return 0
    for ratio, variant in plan.phases:
        if plan.phase_done(ratio, variant):
            continue
        if 60 * minutes_left() < MIN_PHASE_SECONDS:
            print(f"{phase_name(ratio, variant)}: not started, the guard is nearly spent")
            break
        print(f"== {phase_name(ratio, variant)}", flush=True)
        block_score_ablation.main(plan.phase_argv(ratio, variant, minutes_left()))
        write_outputs(plan, out_dir)
    written = write_outputs(plan, out_dir)
    print(status(plan))
    print("wrote " + ", ".join(str(p) for p in written))
    return 0


if __name__ == "__main__":
    sys.exit(main())
