"""Prints the result tables of `experiments/README.md` from a study's committed JSON
(`block_score_ablation.py`, `kv_format_study.py`, or their merge), so the document's numbers are
the JSON's, never retyped.

    python3 experiments/study_tables.py experiments/results/block_score_ablation.json
    python3 experiments/study_tables.py experiments/results/kv_format_study.json
    python3 experiments/study_tables.py --metrics accuracy evidence_in_pool -- <report.json>
    python3 experiments/study_tables.py --reference mean -- <report.json>   # pairs against mean
    python3 experiments/study_tables.py --only paired -- <report.json>      # one table of each

Each table: one row per variant with mean ± sample std over seeds (the JSON's `summary`), the
per-seed accuracies, and the steps each run trained (a run a time cap stopped short is flagged).
Where the report names a reference variant (`config["reference"]`), a second table gives each
variant's paired difference from it, seed by seed, with a 95 % t-interval (`--reference V`
pairs against variant V instead). A pair is one seed's two runs from the same starting weights:
in `long_context_studies.py`'s reports, runs from the same prefix instance (`_common.pair_key`);
a variant with no such pair says so. Where the records
hold `pool1_accuracy`, a third table asks whether the answers go through the pool: each run's
accuracy with a pool of one block against its accuracy as trained, the same weights.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Sequence
from pathlib import Path

from experiments import _common


def _pct(stat: dict | None, std: bool = True) -> str:
    if stat is None or stat["mean"] is None:
        return "—"
    if not std or stat["std"] is None:
        return f"{100 * stat['mean']:.1f}"
    return f"{100 * stat['mean']:.1f} ± {100 * stat['std']:.1f}"


def _loss(stat: dict | None) -> str:
    if stat is None or stat["mean"] is None:
        return "—"
    return f"{stat['mean']:.3f}" + ("" if stat["std"] is None else f" ± {stat['std']:.3f}")


def _per_layer(summary: dict, layers: list[str], metrics: tuple[str, ...]) -> list[str]:
    """One cell per layer: the metrics' means joined by ' / ' (— where the variant has none)."""
    cells = []
    for layer in layers:
        values = [summary.get(f"{layer}/{m}") for m in metrics]
        if all(v is None for v in values):
            cells.append("—")
        else:
            cells.append(" / ".join(_pct(v, std=False) for v in values))
    return cells


def _joined(summary: dict, layers: list[str], metric: str) -> str:
    cells = _per_layer(summary, layers, (metric,))
    return "—" if all(c == "—" for c in cells) else " / ".join(cells)


def _steps(records: list[dict]) -> str:
    steps = sorted({r["step"] for r in records})
    capped = any(r.get("stopped_early") for r in records)
    span = str(steps[0]) if len(steps) == 1 else f"{steps[0]}–{steps[-1]}"
    return span + (" (capped)" if capped else "")


def _steps_to(records: list[dict]) -> str:
    """Mean steps to the study's threshold over the seeds that reached it, and how many did."""
    reached = [r["steps_to_threshold"] for r in records if r.get("steps_to_threshold") is not None]
    if not reached:
        return "—" if all("steps_to_threshold" not in r for r in records) else f"(0/{len(records)})"
    return f"{sum(reached) / len(reached):.0f} ({len(reached)}/{len(records)})"


def table(report: dict, order: Callable[[str], tuple] | None = None) -> str:
    config, summary, records = report["config"], report["summary"], report["results"]
    layers = config["reindex_layers"]
    names = [name.removeprefix("layer") for name in layers]
    variants = sorted(summary, key=order) if order else list(summary)
    header = [
        "variant",
        "steps",
        "accuracy (%)",
        "same weights, dense (%)",
        "task loss",
        *(f"layer {n} pool recall: pool / random / recent / oracle (%)" for n in names),
        f"within-pool recall L{' / L'.join(names)} (%)",
        f"mass selected L{' / L'.join(names)} (%)",
        "steps to threshold: mean (reached)",
        "evidence in pool (%)",
        f"evidence selected L{' / L'.join(names)} (%)",
        "accuracy, pool of one block (%)",
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    pool = ("pool_recall", "pool_recall_random", "pool_recall_recent", "pool_recall_oracle")
    for variant in variants:
        s = summary[variant]
        own = [r for r in records if r["variant"] == variant]
        row = [
            variant,
            _steps(own),
            _pct(s.get("accuracy")),
            _pct(s.get("dense_accuracy")),
            _loss(s.get("task_loss")),
            *_per_layer(s, layers, pool),
            _joined(s, layers, "within_pool_recall"),
            _joined(s, layers, "mass_selected"),
            _steps_to(own),
            _pct(s.get("evidence_in_pool")),
            _joined(s, layers, "evidence_selected"),
            _pct(s.get("pool1_accuracy")),
        ]
        lines.append("| " + " | ".join(row) + " |")
    seeds = sorted({r["seed"] for r in records})
    per_seed = []
    for seed in seeds:
        by_variant = {r["variant"]: r["accuracy"] for r in records if r["seed"] == seed}
        cells = " / ".join(f"{100 * by_variant[v]:.1f}" for v in variants if v in by_variant)
        per_seed.append(f"seed {seed} {cells}")
    lines += [
        "",
        f"Per seed (accuracy %, {' / '.join(variants)}): " + ", ".join(per_seed) + ".",
    ]
    if instances := _instances(records, variants):
        lines += ["", instances]
    return "\n".join(lines)


def _instances(records: list[dict], variants: Sequence[str]) -> str:
    """Where the records come from more than one prefix instance (`long_context_studies.py`):
    each variant's, so that a reader knows which rows pair ('' otherwise)."""
    names = {
        v: list(dict.fromkeys(r.get("prefix_instance") for r in records if r["variant"] == v))
        for v in variants
    }
    if len({i for found in names.values() for i in found}) < 2:
        return ""
    cells = [f"{v} {' '.join(i or '(unnamed)' for i in found)}" for v, found in names.items()]
    return (
        "Prefix instances (runs pair only within one; unnamed: a report older than instance "
        "names): " + ", ".join(cells) + "."
    )


def paired(report: dict, reference: str, order: Callable[[str], tuple] | None = None) -> str:
    """Per variant, its difference from `reference` on the same seed (same initialization and
    batches): accuracy in points and task loss, the mean over seeds with its 95 % t-interval
    (over the paired differences; '—' with one pair), and the accuracy differences' range."""
    records = report["results"]
    variants = [v for v in dict.fromkeys(r["variant"] for r in records) if v != reference]
    if not variants:
        return ""
    variants = sorted(variants, key=order) if order else variants
    metrics = [("accuracy", 100, "+.1f"), ("task_loss", 1, "+.4f")]
    header = (
        f"| variant | Δ accuracy vs {reference}, same seed (points): mean [95 % CI] | min … max "
        f"| Δ task loss vs {reference}: mean [95 % CI] "
    )
    if any(r.get("evidence_in_pool") is not None for r in records):
        metrics.append(("evidence_in_pool", 100, "+.1f"))
        header += "| Δ evidence in pool (points): mean [95 % CI] "
    lines = [header + "| seeds |", "|---" * (len(metrics) + 3) + "|"]
    for variant in variants:
        pairs = _common.pairs(records, variant, reference)
        if not pairs:
            note = f"— (no run of {reference} from the same starting weights)"
            lines.append(f"| {variant} | {' | '.join([note] + ['—'] * len(metrics))} | 0 |")
            continue
        cells = []
        for key, scale, fmt in metrics:
            d = _common.paired_differences(pairs, key, scale)
            if not d:
                cells.append("—")
                continue
            ci = _common.t_interval(d)
            interval = "—" if ci is None else f"{ci[0]:{fmt}}, {ci[1]:{fmt}}"
            cells.append(f"{sum(d) / len(d):{fmt}} [{interval}]")
            if key == "accuracy":
                cells.append(f"{min(d):{fmt}} … {max(d):{fmt}}")
        lines.append(f"| {variant} | {' | '.join(cells)} | {len(pairs)} |")
    return "\n".join(lines)


def through_the_pool(report: dict, order: Callable[[str], tuple] | None = None) -> str:
    """Per variant, the accuracy of each run's final weights with a pool of one block (the
    pinned newest block) minus its accuracy as trained, in points: mean over seeds with its
    95 % t-interval. Near zero: the answers do not depend on what the pool holds."""
    records = [r for r in report["results"] if r.get("pool1_accuracy") is not None]
    variants = list(dict.fromkeys(r["variant"] for r in records))
    variants = sorted(variants, key=order) if order else variants
    lines = [
        "| variant | accuracy as trained (%) | with a pool of one block (%) "
        "| Δ (points): mean [95 % CI] | min … max | seeds |",
        "|---|---|---|---|---|---|",
    ]
    for variant in variants:
        own = [r for r in records if r["variant"] == variant]
        d = [100 * (r["pool1_accuracy"] - r["accuracy"]) for r in own]
        ci = _common.t_interval(d)
        interval = "—" if ci is None else f"{ci[0]:+.1f}, {ci[1]:+.1f}"
        trained = sum(r["accuracy"] for r in own) / len(own)
        one = sum(r["pool1_accuracy"] for r in own) / len(own)
        lines.append(
            f"| {variant} | {100 * trained:.1f} | {100 * one:.1f} | {sum(d) / len(d):+.1f} "
            f"[{interval}] | {min(d):+.1f} … {max(d):+.1f} | {len(own)} |"
        )
    return "\n".join(lines)


def intervals(report: dict, metrics: Sequence[str], order=None) -> str:
    """Per variant, each of `metrics` as its mean over seeds with the 95 % t-interval and the
    seed count (the summary's `ci95` and `n`); fractions in 0..1 are printed in %."""
    summary = report["summary"]
    variants = sorted(summary, key=order) if order else list(summary)
    lines = [
        "| variant | " + " | ".join(f"{m}: mean [95 % CI] (seeds)" for m in metrics) + " |",
        "|---" * (len(metrics) + 1) + "|",
    ]
    for variant in variants:
        cells = []
        for metric in metrics:
            stat = summary[variant].get(metric)
            if not stat or stat["mean"] is None or isinstance(stat["mean"], list):
                cells.append("—")
                continue
            scale, fmt = (100, ".1f") if metric != "task_loss" else (1, ".4f")
            ci = stat["ci95"]
            interval = "—" if ci is None else f"{scale * ci[0]:{fmt}}, {scale * ci[1]:{fmt}}"
            cells.append(f"{scale * stat['mean']:{fmt}} [{interval}] ({stat['n']})")
        lines.append(f"| {variant} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_order(formats: Sequence[str]) -> Callable[[str], tuple]:
    """Sort key for `kv_format_study` variants: plain ones (the reference) first, then each of
    `formats` (the report's `config["formats"]`, in its order) with its QAT row above its PTQ."""

    def key(variant: str) -> tuple:
        if "/" not in variant:
            return (-1, 0)
        mode, fmt = variant.split("/")
        rank = formats.index(fmt) if fmt in formats else len(formats)
        return (rank, 0 if mode == "qat" else 1)

    return key


TABLES = ("summary", "paired", "pool-of-one")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="+", type=Path, help="study reports (JSON)")
    parser.add_argument(
        "--metrics",
        nargs="+",
        metavar="METRIC",
        help="print only these metrics of each variant, mean with its 95 %% t-interval over "
        "seeds (e.g. accuracy evidence_in_pool pool1_accuracy task_loss)",
    )
    parser.add_argument(
        "--reference",
        metavar="VARIANT",
        help="pair every variant against this one (default: the report's own reference, "
        "config['reference'])",
    )
    parser.add_argument(
        "--only",
        nargs="+",
        choices=TABLES,
        default=TABLES,
        metavar="TABLE",
        help=f"print only these of each report's tables ({', '.join(TABLES)}; default: all)",
    )
    args = parser.parse_args(argv)
    for path in args.paths:
        report = json.loads(path.read_text())
        known = {r["variant"] for r in report["results"]}
        if args.reference and args.reference not in known:
            parser.error(
                f"--reference: expected one of the variants of {path} ({sorted(known)}), "
                f"got {args.reference!r}"
            )
        experiment = report["config"]["experiment"]
        kv_study = experiment == "kv_format_study"
        order = format_order(report["config"]["formats"]) if kv_study else None
        seeds = sorted({r["seed"] for r in report["results"]})
        asked = report["config"]["seeds"]
        missing = "" if seeds == asked else f" of the {asked} asked for"
        print(f"{path} ({experiment}, seeds {seeds}{missing}, {report['config']['device']}):\n")
        if args.metrics:
            print(intervals(report, args.metrics, order))
            print()
            continue
        if "summary" in args.only:
            print(table(report, order))
            print()
        reference = args.reference or report["config"].get("reference")
        if "paired" in args.only and reference and (lines := paired(report, reference, order)):
            print(lines)
            print()
        if "pool-of-one" in args.only and any(
            r.get("pool1_accuracy") is not None for r in report["results"]
        ):
            print(through_the_pool(report, order))
            print()


if __name__ == "__main__":
    main()
