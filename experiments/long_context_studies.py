"""Issue 14's three studies at 4 K tokens, phase by phase, each from a curriculum prefix per
seed: the block score (`max` vs `mean` vs `top2`, and dense attention) at context/pool ratios 16,
64 and 4; the pool size from 1/64 to 1/2 of the context; the main KV format, QAT vs PTQ.

The plan (every number below is a default of this file):
  1. a prefix per seed (`long_context_task.py`): `small()` learns the 16-needle passkey densely
     at 128 then 512 tokens, then trains 100 steps densely at 4 K. That is the dense warm-up of
     V4.1's recipe, shared: every variant starts from it (the warm-up is the same program for
     every block score and pool size, so running it once per seed changes nothing but the
     optimizer's restart). The block-score and pool-size phases start from a prefix with the
     preset's main-KV format (NVFP4, as V4.1 trains); the KV-format phases from one trained
     unquantized (f32), so that post-training quantization reads weights that never saw a
     format.
  2. one phase per variant, each a `block_score_ablation.py` run of the variant's seeds at 4 K
     tokens: sparse from step 0 (pool and Reindex top-k as at inference), the pool
     `candidate_topk_blocks` = 4096 / ratio positions in blocks of 8 (ratio 16: 32 blocks; 64: 8;
     4: 128). Each run stops on the convergence rule (the last 2 evaluations, every 25 steps, at
     >= 90 %) or at its cap of 300 steps; 'dense' trains with every layer attending to all
     compressed entries on the same rule. Ratios are set by the pool at a fixed context, so
     the task, its difficulty and the prefix are the same at every ratio. The pool-size study
     is the `max` phases at ratios 64, 32, 16, 8, 4 and 2; the KV-format study trains `max` at
     ratio 16 with the main KV in each format (QAT) and evaluates the f32 runs' final weights
     in each format (PTQ, `kv_format_study.evaluate_like_run`).

Where a phase stops depends on seeds and data only; `--max-minutes` guards one call on a lent
machine, and running the same command again continues: finished phases are skipped (their
reports are kept in the work directory), a phase the guard cut resumes from its checkpoints.
After every phase the combined reports are written to --out-dir, each with "partial" in its
config until all its phases are done: `long_context_prefix*.json`, per ratio
`block_score_4k_ratio<r>.json` (`block_score_ablation`'s schema), `pool_size_4k.json`
(`pool_size_sweep`'s) and `kv_format_4k.json` (`kv_format_study`'s), each with its figure;
`study_tables.py` prints them. Each record of a sparse phase also holds the accuracy of its
final weights with a pool of one block (`pool1_accuracy`, from the run's summary: does the
answer go through the pool?), and seed 0's final pools on one held-out example
(`pool_snapshot`, `evaluate.pool_snapshot`), which notebook 04 draws.

    PYTHONPATH=. python3 experiments/long_context_studies.py --max-minutes 9   # again to go on
    PYTHONPATH=. python3 experiments/long_context_studies.py --study kv_format --max-minutes 9
    PYTHONPATH=. python3 experiments/long_context_studies.py --status          # what is done

A lent machine's work directory goes with it; on a fresh one, `--restore` the committed
combined reports so that their finished phases count as done (the prefix trains again: the
same seeds, data and steps):

    PYTHONPATH=. python3 experiments/long_context_studies.py --max-minutes 9 \
        --restore experiments/results/block_score_4k_ratio*_h200_*.json
    PYTHONPATH=. python3 experiments/long_context_studies.py --smoke --out-dir /tmp/lcs  # CPU

A prefix trained again is another instance (its weights differ), and paired differences pair
runs of one instance only: a session that cannot reuse the committed phases' prefix runs a
whole comparison on its own, restoring only what it does not pair with, e.g.

    PYTHONPATH=. python3 experiments/long_context_studies.py --max-minutes 26 \
        --restore experiments/results/block_score_4k_ratio{16,64}_h200_2026-12-01.json \
        --phases ratio4-max ratio4-mean ratio4-top2 ratio16-dense

(`bash scripts/h200.sh studies_start` runs it in the background across the device's calls).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from experiments import (
    _common,
    block_score_ablation,
    kv_format_study,
    long_context_task,
    pool_size_sweep,
)
from v41jax import train
from v41jax.nn.model import with_fields
from v41jax.train import evaluate

NAME = "long_context_studies"
SEEDS = (0, 1, 2, 3, 4)
TASK = "multi_passkey"
MIDDLE = 16  # the ratio of the KV-format study and of the dense baseline
KV_FORMATS = ("f32", "bf16", "fp8", "mxfp4", "nvfp4")  # f32 first: PTQ reads its runs


@dataclasses.dataclass(frozen=True)
class Phase:
    """One variant's seeds at one context/pool ratio with the main KV in `kv_format`, from the
    prefix trained in `prefix_kv` (None: the preset's format)."""

    ratio: int
    variant: str  # a `block_score_ablation` variant, or 'ptq' (evaluations of the f32 runs)
    kv_format: str | None = None
    prefix_kv: str | None = None

    @property
    def name(self) -> str:
        return f"ratio{self.ratio}-{self.variant}" + (
            f"-kv{self.kv_format}" if self.kv_format else ""
        )


def _block_score(ratios: Sequence[int]) -> tuple[Phase, ...]:
    # The question first (max vs mean at every ratio), then the dense baseline (at the first
    # ratio: it has no pool), then the third reducer at every ratio.
    order = [(r, v) for r in ratios for v in ("max", "mean")]
    order += [(ratios[0], "dense")] + [(r, "top2") for r in ratios]
    return tuple(Phase(r, v) for r, v in order)


def _kv(formats: Sequence[str], ratio: int) -> tuple[Phase, ...]:
    """f32 (the reference), its PTQ evaluations, then QAT in every other format: all from the
    f32 prefix."""
    reference = formats[0]
    phases = [Phase(ratio, "max", f, reference) for f in formats]
    return (phases[0], Phase(ratio, "ptq", reference, reference), *phases[1:])


STUDIES = {
    "block_score": _block_score((MIDDLE, 64, 4)),
    "pool_size": (*(Phase(r, "max") for r in (64, 32, 16, 8, 4, 2)), Phase(MIDDLE, "dense")),
    "kv_format": _kv(KV_FORMATS, MIDDLE),
}
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
# --smoke: the same machinery end to end on four layers of tiny() (`_common.SMOKE_LAYERS`) in a
# minute or two of CPU.
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
SMOKE_STUDIES = {
    "block_score": (Phase(16, "mean"), Phase(4, "max")),
    "pool_size": (Phase(4, "max"), Phase(16, "dense")),
    "kv_format": _kv(("f32", "mxfp4"), 16),
}
MIN_PHASE_SECONDS = 90  # a phase started with less would spend it compiling
SNAPSHOT_SEEDS = (0,)  # whose final pools each sparse phase keeps (`after_phase`)


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
    """The phases of the studies asked for: their directories, commands and what is done."""

    def __init__(self, args: argparse.Namespace):
        self.smoke, self.seeds = args.smoke, list(args.seeds)
        self.group_size = args.group_size
        self.prefix = SMOKE_PREFIX if args.smoke else PREFIX
        self.study = SMOKE_STUDY if args.smoke else STUDY
        studies = SMOKE_STUDIES if args.smoke else STUDIES
        self.studies = {name: studies[name] for name in args.study}
        self.phases = tuple(dict.fromkeys(p for ps in self.studies.values() for p in ps))
        if args.phases:
            self.phases = self.ordered(args.phases)
        self.task = (long_context_task.SMOKE_TASKS if args.smoke else long_context_task.TASKS)[TASK]
        self.work = args.work_dir

    def ordered(self, names: Sequence[str]) -> tuple[Phase, ...]:
        """The phases named, in that order, then the studies' other phases in theirs: a
        session's prefix instance serves the comparisons it should pair (e.g. one ratio's every
        variant and the dense baseline) before the phases that pair with nothing it holds."""
        by_name = {p.name: p for p in self.phases}
        unknown = [n for n in names if n not in by_name]
        if unknown:
            raise ValueError(
                f"--phases: expected phases of the studies asked for ({', '.join(by_name)}), "
                f"got {', '.join(unknown)}"
            )
        first = [by_name[n] for n in dict.fromkeys(names)]
        return (*first, *(p for p in self.phases if p not in first))

    # The prefixes, one per main-KV format the phases start from.
    def prefixes(self) -> list[str | None]:
        return list(dict.fromkeys(p.prefix_kv for p in self.phases))

    def prefix_name(self, kv_format: str | None) -> str:
        return "prefix" + (f"-kv{kv_format}" if kv_format else "")

    def prefix_runs(self, kv_format: str | None) -> Path:
        return self.work / self.prefix_name(kv_format)

    def prefix_report(self, kv_format: str | None) -> Path:
        return self.work / "reports" / f"{self.prefix_name(kv_format)}.json"

    def prefix_argv(self, kv_format: str | None, minutes: float) -> list[str]:
        p = self.prefix
        argv = ["--task", TASK, "--preset", self.study["preset"], "--long-attention", "dense"]
        argv += [*_flags("seeds", self.seeds), "--group-size", str(self.group_size)]
        argv += _flags("ladder", p["ladder"]) + _flags("short-lrs", p["short_lrs"])
        argv += ["--long-steps", str(p["long_steps"]), "--max-minutes", f"{minutes:.2f}"]
        argv += ["--out", str(self.prefix_report(kv_format))]
        argv += ["--runs-dir", str(self.prefix_runs(kv_format))]
        argv += ["--kv-format", kv_format] if kv_format else []
        return argv + (["--smoke"] if self.smoke else [])

    def prefix_done(self, kv_format: str | None) -> bool:
        path = self.prefix_report(kv_format)
        return path.exists() and not json.loads(path.read_text())["partial"]

    def init_from(self, kv_format: str | None) -> Path:
        return self.prefix_runs(kv_format) / "long" / train.SEED_DIR

    def report_path(self, phase: Phase) -> Path:
        name = "kv_format_ptq" if phase.variant == "ptq" else block_score_ablation.NAME
        return self.work / "reports" / phase.name / f"{name}.json"

    def runs_dir(self, phase: Phase) -> Path:
        kv = f"kv{phase.kv_format}-" if phase.kv_format else ""
        return self.work / "runs" / f"{kv}ratio{phase.ratio}"

    def phase_argv(self, phase: Phase, minutes: float) -> list[str]:
        s = self.study
        argv = ["--preset", s["preset"], "--task", TASK]
        argv += task_flags(dict(self.task, seq_len=s["seq_len"]))
        argv += ["--model-set", f"candidate_topk_blocks={pool_blocks(s, phase.ratio)}"]
        argv += ["--model-set", f"query_chunk={s['query_chunk']}"]
        if phase.kv_format:
            argv += ["--model-set", f"kv_format={json.dumps(phase.kv_format)}"]
        if self.smoke:  # the model of the prefix's --smoke (long_context_task)
            for field, value in _common.SMOKE_LAYERS.items():
                argv += ["--model-set", f"{field}={json.dumps(value)}"]
        argv += ["--batch-size", str(s["batch_size"]), "--dense-warmup-steps", "0"]
        argv += ["--lr", str(s["lr"]), "--steps", str(s["steps"])]
        argv += ["--init-from", str(self.init_from(phase.prefix_kv))]
        argv += ["--eval-every", str(s["eval_every"]), "--eval-batches", str(s["eval_batches"])]
        argv += ["--converge-accuracy", str(s["converge_accuracy"])]
        argv += ["--group-size", str(self.group_size)]
        argv += [*_flags("seeds", self.seeds), "--variants", phase.variant]
        argv += ["--out-dir", str(self.report_path(phase).parent)]
        argv += ["--runs-dir", str(self.runs_dir(phase))]
        return [*argv, "--max-minutes", f"{minutes:.2f}"]

    def phase_report(self, phase: Phase) -> dict | None:
        path = self.report_path(phase)
        return json.loads(path.read_text()) if path.exists() else None

    def phase_done(self, phase: Phase) -> bool:
        report = self.phase_report(phase)
        if report is None:
            return False
        records = report["results"]
        return sorted({r["seed"] for r in records}) == sorted(self.seeds) and not any(
            r.get("stopped_early") for r in records
        )

    def prefix_instance(self, kv_format: str | None) -> str:
        """Which training of the prefix this is: a hash of its seeds' final 4 K losses. GPU
        training is not bit-reproducible (scatter-adds), so a prefix trained again on a fresh
        machine is another instance; paired differences are only paired within one."""
        stages = json.loads(self.prefix_report(kv_format).read_text())["stages"]
        losses = [(s["train_config"]["seed"], s["summary"]["task_loss"]) for s in stages if
                  s["stage"] == "long"]  # fmt: skip
        return hashlib.sha1(json.dumps(sorted(losses)).encode()).hexdigest()[:10]

    def instance_path(self, phase: Phase) -> Path:
        return self.report_path(phase).parent / "prefix_instance.json"

    def extras_path(self, phase: Phase) -> Path:
        return self.report_path(phase).parent / "after_phase.json"

    def trained_phase(self, ptq: Phase) -> Phase:
        """The phase whose final weights a PTQ phase evaluates."""
        return Phase(ptq.ratio, "max", ptq.kv_format, ptq.prefix_kv)


def after_phase(plan: Plan, phase: Phase) -> None:
    """What a finished sparse phase adds to its records, kept beside the phase's report
    (`extras_path`): the `SNAPSHOT_SEEDS`' final pools on the first held-out example of the
    run's evaluation batches (`pool_snapshot`, `evaluate.pool_snapshot`). Nothing when the runs
    are not on this machine (a report from elsewhere). (The accuracy of the final weights with a
    pool of one block, `pool1_accuracy`, is in every sparse run's own summary: `train.run`.)"""
    if phase.variant in ("dense", "ptq") or plan.extras_path(phase).exists():
        return
    extras = {}
    for record in plan.phase_report(phase)["results"]:
        run_dir = Path(record["run_dir"])
        if not (run_dir / "config.json").exists():
            return
        cfg = train.TrainConfig.from_json(json.loads((run_dir / "config.json").read_text()))
        if cfg.seed in SNAPSHOT_SEEDS:
            model = _common.load_model(cfg, run_dir)
            seed = cfg.seed + train.EVAL_SEED_OFFSET
            snapshot = evaluate.pool_snapshot(model, cfg.make_task(), seed=seed)
            extras[str(cfg.seed)] = {"pool_snapshot": snapshot}
    plan.extras_path(phase).write_text(json.dumps(extras))


def run_ptq(plan: Plan, phase: Phase) -> None:
    """Each seed's final weights of the f32 phase evaluated with the main KV in every other
    format of `KV_FORMATS`, as its run evaluated itself (`kv_format_study.evaluate_like_run`)."""
    trained = plan.phase_report(plan.trained_phase(phase))
    formats = [
        p.kv_format
        for p in plan.phases
        if p.variant == "max" and p.kv_format and p.kv_format != phase.kv_format
    ]
    records = []
    for source in trained["results"]:
        cfg = train.TrainConfig.from_json(
            json.loads((Path(source["run_dir"]) / "config.json").read_text())
        )
        model = _common.load_model(cfg, Path(source["run_dir"]))
        for fmt in formats:
            result = kv_format_study.evaluate_like_run(
                with_fields(model, kv_format=fmt), cfg, source["step"]
            )
            print(f"ptq/{fmt}, seed {cfg.seed}: accuracy {result['accuracy']:.1%}", flush=True)
            records.append(
                {
                    "variant": f"ptq/{fmt}",
                    "seed": cfg.seed,
                    "run_dir": source["run_dir"],
                    "step": source["step"],
                    "stopped_early": source["stopped_early"],
                    **result,
                }
            )
    config = dict(trained["config"], experiment="kv_format_ptq", formats=formats)
    path = plan.report_path(phase)
    path.parent.mkdir(parents=True, exist_ok=True)
    _common.write_report(path, config, records)


def restore(plan: Plan, combined: Path) -> list[str]:
    """Phase reports, in the work directory, from a committed combined report (`_combined`'s
    output, e.g. one a lent machine wrote before it was given back), so that its finished
    phases are not trained again on a fresh machine; returns the phases restored. A phase
    whose report is already there, or that is not done in `combined`, is left alone. The
    restored records keep their `run_dir`: `after_phase` finds no run there and adds nothing.
    """
    report = json.loads(combined.read_text())
    config = report["config"]
    if config.get("plan") != f"experiments/{NAME}.py":
        raise ValueError(
            f"--restore: expected a combined report of experiments/{NAME}.py (its 'plan' in "
            f"the config), got {combined} (plan {config.get('plan')!r})"
        )

    def phase_of(record: dict) -> str:
        # Block-score reports of 2026-12-01 name no phase: it is their ratio and variant.
        return record.get("phase") or f"ratio{config['ratio']}-{record['variant']}"

    records = [dict(r, phase=phase_of(r)) for r in report["results"]]
    by_name = {p.name: p for p in plan.phases}
    found = list(dict.fromkeys(r["phase"] for r in records))
    if len(config["argv"]) != len(found):
        # experiments/merge_reports.py keeps one argv per joined report, not one per phase.
        raise ValueError(
            f"--restore: expected one argv per phase in {combined} ({len(found)} phases: "
            f"{', '.join(found)}), got {len(config['argv'])}: a report that merge_reports.py "
            "joined from several sessions; restore the reports it was merged from"
        )
    restored = []
    for name, argv in zip(found, config["argv"], strict=True):
        phase = by_name.get(name)
        if phase is None or plan.phase_report(phase) is not None:
            continue
        own = dict(config, argv=argv, restored_from=str(combined))
        own["prefix_instance"] = config.get("prefix_instances", {}).get(name)
        for key in ("phases", "plan", "partial", "variants", "prefix_instances"):
            own.pop(key, None)
        path = plan.report_path(phase)
        path.parent.mkdir(parents=True, exist_ok=True)
        mine = [
            {k: v for k, v in r.items() if k not in ("phase", "prefix_instance")}
            for r in records
            if r["phase"] == name
        ]
        _common.write_report(path, own, mine)
        if plan.phase_done(phase):
            restored.append(name)
        else:
            path.unlink()
    return restored


def _combined(
    plan: Plan,
    phases: Sequence[Phase],
    experiment: str,
    relabel: Callable[[Phase], dict] | None = None,
    **fields,
) -> dict | None:
    """The records of `phases`' reports as one report of `experiment` (None before any),
    "partial" in its config until every phase is done. Each record names its phase and the
    prefix instance it started from (`prefix_instance`: paired differences pair within one),
    and takes the fields `relabel(phase)` gives (its variant in the study's own terms) before
    the summary groups the records by variant."""
    found = [(p, rep) for p in phases if (rep := plan.phase_report(p)) is not None]
    if not found:
        return None
    config = dict(found[0][1]["config"])
    config["experiment"] = experiment
    config["argv"] = [rep["config"]["argv"] for _, rep in found]
    config["commit"] = sorted({c for _, rep in found for c in _common.commits(rep["config"])})
    if note := _common.commit_note(rep["config"] for _, rep in found):
        config["commit_note"] = note
    config["phases"] = [p.name for p in phases]
    config["plan"] = f"experiments/{NAME}.py"
    config["partial"] = not all(plan.phase_done(p) for p in phases)
    config |= fields
    config["prefix_instances"] = {
        p.name: (
            json.loads(plan.instance_path(p).read_text())
            if plan.instance_path(p).exists()
            else rep["config"].get("prefix_instance")
        )
        for p, rep in found
    }
    records = []
    for phase, report in found:
        path = plan.extras_path(phase)
        extras = json.loads(path.read_text()) if path.exists() else {}
        own = dict(phase=phase.name, prefix_instance=config["prefix_instances"][phase.name])
        own |= relabel(phase) if relabel else {}
        for record in report["results"]:
            records.append(dict(record, **extras.get(str(record["seed"]), {}), **own))
    return {"config": config, "results": records, "summary": _common.summarize(records)}


def block_score_report(plan: Plan, ratio: int) -> dict | None:
    phases = [p for p in plan.studies.get("block_score", ()) if p.ratio == ratio]
    phases += [p for p in plan.phases if p.variant == "dense" and p not in phases]
    return _combined(
        plan,
        phases,
        block_score_ablation.NAME,
        variants={p.variant: block_score_ablation.VARIANTS[p.variant] for p in phases},
        ratio=ratio,
        pool_blocks=pool_blocks(plan.study, ratio),
        prefix=str(plan.init_from(None)),
    )


def pool_size_report(plan: Plan) -> dict | None:
    phases = plan.studies["pool_size"]
    model = train.make_config(preset=plan.study["preset"]).model_config()
    positions = pool_size_sweep.source_positions(model, plan.study["seq_len"])

    def relabel(phase: Phase) -> dict:
        if phase.variant == "dense":
            return {}
        blocks = pool_blocks(plan.study, phase.ratio)
        return dict(
            variant=pool_size_sweep.variant_name(blocks),
            pool_blocks=blocks,
            pool_fraction=blocks * model.candidate_block_size / positions,
        )

    return _combined(
        plan,
        phases,
        pool_size_sweep.NAME,
        relabel,
        reference=pool_size_sweep.REFERENCE,
        fractions=sorted({p.ratio for p in phases if p.variant != "dense"}),
        source_positions=positions,
        prefix=str(plan.init_from(None)),
    )


def kv_format_report(plan: Plan) -> dict | None:
    phases = plan.studies["kv_format"]
    reference = phases[0].kv_format

    def relabel(phase: Phase) -> dict:
        if phase.variant != "max":
            return {}  # the PTQ records name their formats
        return {"variant": "f32" if phase.kv_format == reference else f"qat/{phase.kv_format}"}

    return _combined(
        plan,
        phases,
        kv_format_study.NAME,
        relabel,
        reference=kv_format_study.REFERENCE,
        formats=[p.kv_format for p in phases if p.variant == "max" and p.kv_format != reference],
        prefix=str(plan.init_from(phases[0].prefix_kv)),
    )


def write_outputs(plan: Plan, out_dir: Path) -> list[Path]:
    """The prefixes' reports and the combined study reports (with figures) in `out_dir`;
    returns the paths written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for kv_format in plan.prefixes():
        if plan.prefix_report(kv_format).exists():
            name = "long_context_" + plan.prefix_name(kv_format).replace("-", "_") + ".json"
            path = out_dir / name
            path.write_text(plan.prefix_report(kv_format).read_text())
            written.append(path)
    outputs = []
    if "block_score" in plan.studies:
        ratios = dict.fromkeys(p.ratio for p in plan.studies["block_score"])
        outputs += [
            (f"block_score_4k_ratio{r}", block_score_report(plan, r), block_score_ablation)
            for r in ratios
        ]
    if "pool_size" in plan.studies:
        outputs.append(("pool_size_4k", pool_size_report(plan), pool_size_sweep))
    if "kv_format" in plan.studies:
        outputs.append(("kv_format_4k", kv_format_report(plan), kv_format_study))
    for name, report, module in outputs:
        if report is None:
            continue
        path = out_dir / f"{name}.json"
        path.write_text(json.dumps(report, indent=1))
        module.plot(report, path.with_suffix(".png"))
        written += [path, path.with_suffix(".png")]
    return written


def status(plan: Plan) -> str:
    lines = [
        f"{plan.prefix_name(kv)}: {'done' if plan.prefix_done(kv) else 'to do'}"
        for kv in plan.prefixes()
    ]
    for phase in plan.phases:
        report = plan.phase_report(phase)
        state = "done" if plan.phase_done(phase) else "to do"
        if report is not None and state != "done":
            state = f"partial ({len(report['results'])} records, some stopped early)"
        lines.append(f"{phase.name}: {state}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--study",
        nargs="+",
        choices=list(STUDIES),
        default=list(STUDIES),
        help="the studies whose phases run, in this order (all)",
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS))
    parser.add_argument(
        "--group-size",
        type=int,
        default=1,
        help="seeds trained together in one program, in the prefix and in every phase (1: one "
        "after another in one process, as every committed phase was trained; a group stops on "
        "the convergence rule when all its seeds meet it)",
    )
    parser.add_argument(
        "--phases",
        nargs="+",
        default=[],
        metavar="PHASE",
        help="run these phases first, in this order (names as --status prints them)",
    )
    parser.add_argument(
        "--work-dir",
        type=Path,
        default=Path("runs") / NAME,
        help="the prefixes' and the phases' runs and reports (runs/long_context_studies)",
    )
    parser.add_argument(
        "--out-dir",
        type=Path,
        help="where the combined reports go (experiments/results; --smoke: required)",
    )
    parser.add_argument("--max-minutes", type=float, help="a guard for this call (none)")
    parser.add_argument(
        "--restore",
        type=Path,
        nargs="+",
        default=[],
        metavar="REPORT",
        help="combined reports (experiments/results) whose finished phases count as done here",
    )
    parser.add_argument("--status", action="store_true", help="print what is done and exit")
    parser.add_argument(
        "--smoke", action="store_true", help="the plan on four layers of tiny(), on a CPU"
    )
    args = parser.parse_args(argv)
    if args.group_size < 1:
        parser.error(f"--group-size: expected a positive number of seeds, got {args.group_size}")
    if args.smoke and args.out_dir is None:
        parser.error("--out-dir: --smoke outputs are not results; name a folder for them")
    out_dir = args.out_dir or _common.RESULTS_DIR
    try:
        plan = Plan(args)
    except ValueError as error:
        parser.error(str(error))
    for path in args.restore:
        if not path.is_file():
            parser.error(f"--restore: no such report: {path}")
        try:
            names = restore(plan, path)
        except ValueError as error:
            parser.error(str(error))
        if names:
            print(f"restored from {path}: {', '.join(names)}", flush=True)
    if args.status:
        print(status(plan))
        return 0
    began = time.perf_counter()

    def seconds_left() -> float:
        if args.max_minutes is None:
            return float("inf")
        return 60 * args.max_minutes - (time.perf_counter() - began)

    for phase in plan.phases:
        if plan.phase_done(phase):
            after_phase(plan, phase)  # phases done before it was taken
            continue
        if not plan.prefix_done(phase.prefix_kv):
            name = plan.prefix_name(phase.prefix_kv)
            if seconds_left() < MIN_PHASE_SECONDS:
                print(f"{name}: not started, the guard is nearly spent", flush=True)
                break
            print(f"== {name}", flush=True)
            long_context_task.main(plan.prefix_argv(phase.prefix_kv, seconds_left() / 60))
            write_outputs(plan, out_dir)
            if not plan.prefix_done(phase.prefix_kv):
                print(f"{name} is not finished: run the same command again", flush=True)
                break
        if seconds_left() < MIN_PHASE_SECONDS:
            print(f"{phase.name}: not started, the guard is nearly spent", flush=True)
            break
        print(f"== {phase.name}", flush=True)
        plan.instance_path(phase).parent.mkdir(parents=True, exist_ok=True)
        plan.instance_path(phase).write_text(json.dumps(plan.prefix_instance(phase.prefix_kv)))
        if phase.variant == "ptq":
            run_ptq(plan, phase)
        else:
            block_score_ablation.main(plan.phase_argv(phase, seconds_left() / 60))
            if plan.phase_done(phase):
                after_phase(plan, phase)
        write_outputs(plan, out_dir)
    written = write_outputs(plan, out_dir)
    print(status(plan))
    print("wrote " + ", ".join(str(p) for p in written))
    return 0


if __name__ == "__main__":
    sys.exit(main())
