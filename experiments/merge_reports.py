"""Merges the reports of one study run as several processes, or over several sessions, into one.

The ablations train many small models; on a GPU a tiny model leaves the device mostly idle, so
running one process per seed side by side (each with its own `--out-dir` and `--runs-dir`) is
several times faster. This concatenates their results, recomputes the summary over all seeds
and draws the study's figure, exactly as one process over all seeds would have written them.

It also joins the combined reports of `long_context_studies.py` that different sessions wrote
for one study (each session ran some of its phases from its own prefix instance), e.g. the
pool-size sweep's six pools from two sessions. Every record keeps its `phase` and
`prefix_instance`: the summary's per-variant statistics are unchanged, and paired differences
still pair only within an instance (`_common.pair_key`). "partial" stays in the config until
every phase of the plan has all its seeds.

    python3 experiments/merge_reports.py block_score_ablation parts/*/block_score_ablation.json \
        --out-dir experiments/results
    python3 experiments/merge_reports.py pool_size_sweep \
        experiments/results/pool_size_4k_h200_2026-12-02_run{2,4}.json \
        --out-dir experiments/results --name pool_size_4k_h200_2026-12-02_merged
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
from pathlib import Path

from experiments import _common

STUDIES = ("block_score_ablation", "kv_format_study", "pool_size_sweep")
# What a seed's process of one study writes differently from another's.
VARYING = ("seeds", "argv", "runs_dir", "commit")
# What a session's combined report of a long_context_studies plan must share with another's to
# be merged: the study, its plan and the protocol. The rest of its config is the first phase's
# (`long_context_studies._combined`) or says what the session did (guard, commits, instances).
PLAN_FIELDS = (
    "experiment",
    "plan",
    "phases",
    "reference",
    "fractions",
    "formats",
    "source_positions",
    "prefix",
    "device",
    "jax",
    "smoke",
    "reindex_layers",
    "train_config",
    "model_config",
)
PHASE_FIELDS = ("candidate_topk_blocks", "block_score", "kv_format")  # what a phase sets


def _comparable(config: dict) -> dict:
    """The part of a report's config that every part must share."""
    if "plan" not in config:
        return {k: v for k, v in config.items() if k not in VARYING}
    own = {k: config.get(k) for k in PLAN_FIELDS}
    own["model_config"] = {k: v for k, v in own["model_config"].items() if k not in PHASE_FIELDS}
    overrides = own["train_config"]["model_overrides"]
    own["train_config"] = dict(
        own["train_config"],
        model_overrides={k: v for k, v in overrides.items() if k not in PHASE_FIELDS},
    )
    return own


def _partial(config: dict, records: list[dict]) -> bool:
    """Whether a plan's phase lacks a seed among the merged records."""
    seeds = set(config["seeds"])
    found: dict[str, set] = {}
    for record in records:
        found.setdefault(record["phase"], set()).add(record["seed"])
    return any(found.get(phase, set()) != seeds for phase in config["phases"])


def merge(reports: list[dict]) -> tuple[dict, list[dict]]:
    """(config, records) of the union: the first report's config with every part's seeds and
    argv; the parts must agree on everything else in their configs (for the sessions of a
    `long_context_studies` plan, on `PLAN_FIELDS` less what a phase sets, `PHASE_FIELDS`)."""
    if not reports:
        raise ValueError("reports: expected at least one report, got none")
    first = _comparable(reports[0]["config"])
    for i, report in enumerate(reports[1:], 1):
        other = _comparable(report["config"])
        if other != first:
            diff = sorted(k for k in first.keys() | other.keys() if first.get(k) != other.get(k))
            raise ValueError(f"reports[{i}]: its config differs from the first's in {diff}")
    config = dict(reports[0]["config"])
    config["seeds"] = sorted({s for r in reports for s in r["config"]["seeds"]})
    config["argv"] = [r["config"]["argv"] for r in reports]
    config["runs_dir"] = [r["config"]["runs_dir"] for r in reports]
    config["commit"] = sorted({c for r in reports for c in _common.commits(r["config"])})
    seen, records = set(), []
    for report in reports:
        for record in report["results"]:
            key = (record["variant"], record["seed"])
            if key in seen:
                raise ValueError(f"reports: variant {key[0]!r} of seed {key[1]} appears twice")
            seen.add(key)
            records.append(record)
    # By pool size where the records have one (the sweep's order), then by seed; a stable sort,
    # so each seed's variants keep their order otherwise.
    records.sort(key=lambda r: (r.get("pool_fraction", math.inf), r["seed"]))
    if "plan" in config:
        config["prefix_instances"] = {
            k: v for r in reports for k, v in r["config"].get("prefix_instances", {}).items()
        }
        config.pop("commit_note", None)
        if note := _common.commit_note(r["config"] for r in reports):
            config["commit_note"] = note
        config["partial"] = _partial(config, records)
        edges = {tuple(r["config"]["distance_edges"] or ()) for r in reports}
        if len(edges) > 1:  # each phase's own (window and pool sizes): no one value holds
            config["distance_edges"] = None
        for key in ("max_minutes", "restored_from", "ratio", "pool_blocks"):
            config.pop(key, None)  # a phase's or a session's, not the merged report's
    return config, records


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("study", choices=STUDIES)
    parser.add_argument("parts", nargs="+", type=Path, help="the parts' JSON reports")
    parser.add_argument("--out-dir", type=Path, required=True)
    parser.add_argument(
        "--name", help="the merged files' name, without .json/.png (default: the study's name)"
    )
    args = parser.parse_args(argv)
    config, records = merge([json.loads(p.read_text()) for p in args.parts])
    args.out_dir.mkdir(parents=True, exist_ok=True)
    name = args.name or args.study
    report = _common.write_report(args.out_dir / f"{name}.json", config, records)
    importlib.import_module(f"experiments.{args.study}").plot(report, args.out_dir / f"{name}.png")
    print(f"merged {len(args.parts)} reports ({len(records)} records) into {args.out_dir}/{name}")


if __name__ == "__main__":
    main()
