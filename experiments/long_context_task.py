"""Long-context retrieval where the pool must find the evidence: `small()` on a 16-needle passkey
at 4 K tokens, the candidate pool 1/16 of the compressed positions (issue 12, target 5).

The recipe is a length curriculum, each stage a `train.run` in its own run directory:

  1. short rungs (`--ladder`, default 128 then 512 tokens): dense attention with the indexer KL
     loss. The first rung runs at each learning rate of `--short-lrs`; the run with the best
     final accuracy seeds the next rung (`TrainConfig.init_from`, a fresh optimizer, its
     learning rate). Short contexts are where the retrieval circuit forms quickly: in our runs
     `small()` found the lookup within 200 steps at 128 tokens and not in 300 at 512, and the
     circuit then carried over to longer contexts (BENCHMARKS.md);
  2. long: 4 K tokens (pool 256 of 4,096: 1/16) from the last rung's weights, a dense warm-up,
     then sparse training with the candidate pool and Reindex top-k exactly as at inference.

Every stage stops on the convergence rule (`--converge-accuracy`, its last 2 evaluations) or at
its step cap, so where it stops depends on seeds and data only; `--max-minutes` is a guard for
one call on a lent machine: running the same command again resumes each stage where the guard
stopped it and re-evaluates finished ones. The report (JSON) is rewritten after every stage,
labelled partial until the long stage is done. It holds each stage's config, summary (accuracy
with the pool and dense, accuracy by distance bucket, pool recall against random / recent /
oracle blocks) and its metrics history.

    PYTHONPATH=. python3 experiments/long_context_task.py --out long_context_task_h200.json
    PYTHONPATH=. python3 experiments/long_context_task.py --smoke --out /tmp/lct.json  # CPU
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from experiments import _common
from v41jax import train
from v41jax.ops import formats
from v41jax.train import evaluate

EXPERIMENT = "long_context_task"

# The task's fields at small()'s 512-token vocabulary. multi_passkey: 16 needles, each a fixed
# marker and a digit from the marker's own 16 ids (chance 1/16), 16 scored lookups per sequence.
# mqar: 32 key-value pairs with arbitrary keys, 16 queried (an induction circuit to learn).
TASKS = {
    "multi_passkey": dict(
        n_needles=16,
        digits_per_needle=16,
        marker_ids=(4, 20),
        digit_ids=(20, 276),
        filler_ids=(276, 512),
        vocab_size=512,
    ),
    "mqar": dict(
        n_pairs=32,
        n_queries=16,
        key_ids=(4, 132),
        value_ids=(132, 260),
        filler_ids=(260, 512),
        vocab_size=512,
    ),
}
SHORT = dict(ladder=(128, 512), batch_size=64, steps=1000, lr_warmup_steps=30, eval_every=50)
LONG = dict(
    seq_len=4096, batch_size=8, steps=3000, dense_warmup_steps=100, query_chunk=2048, eval_every=100
)

# --smoke: every stage of the plan in seconds on a CPU, on four layers of tiny()
# (`_common.SMOKE_LAYERS`; it trains nothing).
SMOKE_TASKS = {
    "multi_passkey": dict(n_needles=4, digits_per_needle=4, marker_ids=(4, 8),
                          digit_ids=(8, 24), filler_ids=(132, 256), vocab_size=256),
    "mqar": dict(n_pairs=4, n_queries=2, key_ids=(4, 68), value_ids=(68, 132),
                 filler_ids=(132, 256), vocab_size=256),
}  # fmt: skip
SMOKE_SHORT = dict(ladder=(48, 64), batch_size=2, steps=2, lr_warmup_steps=1, eval_every=1)
SMOKE_LONG = dict(
    seq_len=128, batch_size=2, steps=3, dense_warmup_steps=1, query_chunk=64, eval_every=1
)


def plan(args: argparse.Namespace) -> tuple[list[train.TrainConfig], dict]:
    """The first rung's configs (one per learning rate) and the fields of the later stages:
    `rung_fields` (one dict per later rung) and `long_fields`. A later stage's `init_from`,
    and a later rung's learning rate, are set once the stage before it has finished."""
    tasks, short, long = (
        (SMOKE_TASKS, SMOKE_SHORT, SMOKE_LONG) if args.smoke else (TASKS, SHORT, LONG)
    )
    task = tasks[args.task]
    ladder = args.ladder or short["ladder"]
    preset = "tiny" if args.smoke else args.preset
    converge = dict(converge_accuracy=args.converge_accuracy, converge_evals=2)
    base = train.make_config(
        preset=preset,
        task=args.task,
        seed=args.seeds[0],
        task_changes=dict(task, seq_len=ladder[0]),
        model_changes={"kv_format": args.kv_format, **(_common.SMOKE_LAYERS if args.smoke else {})},
        batch_size=short["batch_size"],
        steps=args.short_steps or short["steps"],
        lr_warmup_steps=short["lr_warmup_steps"],
        attention="dense",
        eval_every=short["eval_every"],
        eval_batches=1 if args.smoke else 4,
        checkpoint_every=short["eval_every"],
        **converge,
    )
    firsts = [base.replace(learning_rate=lr) for lr in args.short_lrs]
    rungs = [dict(task_changes=dict(task, seq_len=n)) for n in ladder[1:]]
    long_fields = dict(
        task_changes=dict(task, seq_len=long["seq_len"]),
        model_changes={"query_chunk": long["query_chunk"]},
        batch_size=long["batch_size"],
        steps=args.long_steps or long["steps"],
        attention=args.long_attention,
        dense_warmup_steps=long["dense_warmup_steps"] if args.long_attention == "sparse" else 0,
        learning_rate=args.long_lr,
        eval_every=long["eval_every"],
        checkpoint_every=long["eval_every"],
        eval_batches=1 if args.smoke else 8,
    )
    return firsts, {"rung_fields": rungs, "long_fields": long_fields}


def _stage_record(name: str, cfg: train.TrainConfig, run_dir: Path, result: dict) -> dict:
    # A seed the guard stopped within its first steps may have no records yet.
    metrics = run_dir / "metrics.jsonl"
    return {
        "stage": name,
        "run_dir": str(run_dir),
        "train_config": cfg.to_json(),
        "done": result["step"] == cfg.steps or bool(result.get("converged")),
        "summary": result,
        "history": train.read_metrics(metrics) if metrics.exists() else [],
    }


def wilson(p: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """95 % Wilson interval of a proportion `p` observed over `n` independent answers."""
    if n <= 0:
        return (float("nan"), float("nan"))
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * (p * (1 - p) / n + z * z / (4 * n * n)) ** 0.5
    return (max(0.0, centre - half), min(1.0, centre + half))


def _scored(cfg: train.TrainConfig) -> int:
    """Answers one evaluation scores: eval_batches × batch_size × scored per example."""
    return cfg.eval_batches * cfg.batch_size * cfg.make_task().scored_per_example


def _pct(p) -> str:
    return "n/a" if p is None else f"{p:.1%}"


def table(reports: list[dict]) -> str:
    """One row per stage of each report: accuracy with the pool (95 % Wilson interval over the
    evaluation's answers: one seed, so not an interval over seeds), dense, by distance bucket,
    the evaluation curve, and each Reindex layer's pool recall against its baselines. 'train s'
    is the stage's training time and, after '/', the report's total up to it (every stage,
    the learning rates not chosen included); 'steps' ends in ' c' where the stage converged."""
    lines = [
        "| report | seed | stage | task | seq_len × batch | lr | steps | train s / total | "
        "accuracy [95 % CI] | dense | by distance | eval curve (step: accuracy) | "
        "pool recall: pool / random / recent / oracle |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for report in reports:
        name, total = report.get("name") or report["commit"], 0.0
        for stage in report["stages"]:
            cfg = train.TrainConfig.from_json(stage["train_config"])
            s, task = stage["summary"], cfg.make_task()
            lo, hi = wilson(s["accuracy"], _scored(cfg))
            edges = evaluate.distance_edges(cfg.model_config())
            buckets = ", ".join(
                f"{label} {_pct(v)}"
                for label, v in zip(
                    _common.bucket_labels(edges), s.get("accuracy_by_distance", []), strict=True
                )
            )
            curve = " ".join(
                f"{r['step']}: {r['accuracy']:.0%}"
                for r in stage["history"]
                if r["split"] == "eval"
            )
            total += s["train_seconds"]
            steps = f"{s['step']}/{cfg.steps}" + (" c" if s.get("converged") else "")
            recall = "; ".join(
                f"{layer} "
                + " / ".join(
                    _pct(s.get(f"{layer}/pool_recall{n}"))
                    for n in ("", "_random", "_recent", "_oracle")
                )
                for layer in _common.reindex_layers(cfg.model_config())
                if f"{layer}/pool_recall" in s
            )
            lines.append(
                f"| {name} | {cfg.seed} | {stage['stage']} | {cfg.task} "
                f"| {task.seq_len} × {cfg.batch_size} "
                f"| {cfg.learning_rate:g} | {steps} | {s['train_seconds']:.0f} / {total:.0f} "
                f"| {s['accuracy']:.1%} [{lo:.1%}, {hi:.1%}] | {_pct(s.get('dense_accuracy'))} "
                f"| {buckets} | {curve} | {recall or 'dense stage'} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="the report (JSON)")
    parser.add_argument(
        "--table", type=Path, nargs="+", help="print the table of these reports and exit"
    )
    parser.add_argument(
        "--runs-dir",
        type=Path,
        help="default runs/long_context_task/<task>; each stage's runs in <stage>/seed<k>",
    )
    parser.add_argument("--preset", default="small")
    parser.add_argument("--task", choices=sorted(TASKS), default="multi_passkey")
    parser.add_argument(
        "--seeds",
        type=int,
        nargs="+",
        default=[0],
        help="seeds trained through the same stages (0); a rung's learning rate is chosen by "
        "the seeds' mean accuracy, so every seed climbs the same ladder",
    )
    parser.add_argument(
        "--group-size",
        type=int,
        help="seeds of a stage trained together in one program (`train.run_seeds`; default: "
        "all of them on an accelerator, one at a time on the CPU)",
    )
    parser.add_argument(
        "--ladder",
        type=int,
        nargs="+",
        help=f"the short rungs' seq_len, in order (default {' '.join(map(str, SHORT['ladder']))})",
    )
    parser.add_argument("--short-lrs", type=float, nargs="+", default=[1e-3, 2e-3])
    parser.add_argument("--long-lr", type=float, default=1e-3)
    parser.add_argument("--short-steps", type=int, help=f"each rung's cap ({SHORT['steps']})")
    parser.add_argument("--long-steps", type=int, help=f"the long stage's cap ({LONG['steps']})")
    parser.add_argument(
        "--long-attention",
        choices=("sparse", "dense"),
        default="sparse",
        help="the long stage: a dense warm-up then the pool (sparse), or dense attention only "
        "(dense: a shared prefix for the studies, whose variants start from it; sparse)",
    )
    parser.add_argument(
        "--kv-format",
        choices=formats.formats_for("kv"),
        help="the main KV's format in every stage (the preset's)",
    )
    parser.add_argument(
        "--converge-accuracy",
        type=float,
        default=0.9,
        help="every stage stops once its last 2 evaluations reach it (0: train every step)",
    )
    parser.add_argument("--max-minutes", type=float, default=None, help="a guard for this call")
    parser.add_argument(
        "--short-only", action="store_true", help="the short rungs alone (a learning-rate probe)"
    )
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args(argv)
    if args.table:
        print(table([json.loads(p.read_text()) for p in args.table]))
        return 0
    if args.out is None:
        parser.error("--out: expected the report's path (or --table FILE ...)")
    if len(set(args.seeds)) != len(args.seeds):
        parser.error(f"--seeds: expected distinct seeds, got {args.seeds}")
    args.runs_dir = args.runs_dir or Path("runs") / EXPERIMENT / args.task
    began = time.perf_counter()

    def left() -> float | None:
        if args.max_minutes is None:
            return None
        return 60 * args.max_minutes - (time.perf_counter() - began)

    firsts, later = plan(args)
    report = {
        "experiment": EXPERIMENT,
        "argv": list(sys.argv if argv is None else argv),
        "smoke": args.smoke,
        "seeds": list(args.seeds),
        "distance_edges": None,
        "partial": True,
        "stages": [],
        **_common.environment(),
    }

    def write() -> None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))

    def run_stage(name: str, cfg: train.TrainConfig) -> list[dict] | None:
        """The stage `name` of every seed (`cfg` with each seed), one record per seed."""
        budget = left()
        if budget is not None and budget < 30:
            print(f"{name}: not started, the guard has {budget:.0f} s left", flush=True)
            return None
        stage_dir = args.runs_dir / name
        cfgs = [cfg.replace(seed=seed) for seed in args.seeds]
        results = train.run_seeds(
            cfgs,
            stage_dir,
            group_size=args.group_size,
            resume=True,
            progress=False,
            max_seconds=budget,
        )
        records = []
        for seed_cfg, result in zip(cfgs, results, strict=True):
            seed_dir = train.seed_dir(stage_dir, seed_cfg.seed)
            print(train.summarize(seed_cfg, seed_dir, result), flush=True)
            records.append(_stage_record(name, seed_cfg, seed_dir, result))
        report["stages"] += records
        write()
        return records

    def choose(stages: list[list[dict]]) -> tuple[str, train.TrainConfig] | None:
        """The stage (of one rung's learning rates) with the best mean accuracy over the
        seeds (the first on a tie): its directory, every seed's `{seed}` in it, and config."""
        if not all(r["done"] for records in stages for r in records):
            print("a stage is not finished: run the same command again", flush=True)
            return None
        best = max(stages, key=lambda rs: sum(r["summary"]["accuracy"] for r in rs) / len(rs))
        name = best[0]["stage"]
        cfg = train.TrainConfig.from_json(best[0]["train_config"]).replace(seed=args.seeds[0])
        return str(args.runs_dir / name / train.SEED_DIR), cfg

    def rung_name(cfg: train.TrainConfig) -> str:
        return f"short{cfg.make_task().seq_len}-lr{cfg.learning_rate:g}"

    stages = []
    for cfg in firsts:
        if (records := run_stage(rung_name(cfg), cfg)) is None:
            return 0
        stages.append(records)
    for fields in later["rung_fields"]:
        if (chosen := choose(stages)) is None:
            return 0
        best_dir, best_cfg = chosen
        cfg = train.make_config(best_cfg, init_from=best_dir, **fields)
        if (records := run_stage(rung_name(cfg), cfg)) is None:
            return 0
        stages = [records]
    if args.short_only or (chosen := choose(stages)) is None:
        return 0
    best_dir, best_cfg = chosen
    long_cfg = train.make_config(best_cfg, init_from=best_dir, **later["long_fields"])
    report["chosen_short"] = {"run_dir": best_dir, "learning_rate": best_cfg.learning_rate}
    report["distance_edges"] = list(evaluate.distance_edges(long_cfg.model_config()))
    if (records := run_stage("long", long_cfg)) is None:
        return 0
    report["partial"] = not all(r["done"] for r in records)
    write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
