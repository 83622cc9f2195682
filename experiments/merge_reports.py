"""Merges the reports of one study run as several processes (one per seed, say) into one.

The ablations train many small models; on a GPU a tiny model leaves the device mostly idle, so
running one process per seed side by side (each with its own `--out-dir` and `--runs-dir`) is
several times faster. This concatenates their results, recomputes the summary over all seeds
and draws the study's figure, exactly as one process over all seeds would have written them.

    python3 experiments/merge_reports.py block_score_ablation parts/*/block_score_ablation.json \
        --out-dir experiments/results
"""

from __future__ import annotations

import argparse
import importlib
import json
from pathlib import Path

from experiments import _common

STUDIES = ("block_score_ablation", "kv_format_study")


def merge(reports: list[dict]) -> tuple[dict, list[dict]]:
    """(config, records) of the union: the first report's config with every part's seeds and
    argv; the parts must agree on everything else in their configs."""
    if not reports:
        raise ValueError("reports: expected at least one report, got none")
    varying = ("seeds", "argv", "runs_dir", "commit")
    first = {k: v for k, v in reports[0]["config"].items() if k not in varying}
    for i, report in enumerate(reports[1:], 1):
        other = {k: v for k, v in report["config"].items() if k not in varying}
        if other != first:
            diff = sorted(k for k in first.keys() | other.keys() if first.get(k) != other.get(k))
            raise ValueError(f"reports[{i}]: its config differs from the first's in {diff}")
    config = dict(reports[0]["config"])
    config["seeds"] = sorted({s for r in reports for s in r["config"]["seeds"]})
    config["argv"] = [r["config"]["argv"] for r in reports]
    config["runs_dir"] = [r["config"]["runs_dir"] for r in reports]
    config["commit"] = sorted({r["config"]["commit"] for r in reports})
    seen, records = set(), []
    for report in reports:
        for record in report["results"]:
            key = (record["variant"], record["seed"])
            if key in seen:
                raise ValueError(f"reports: variant {key[0]!r} of seed {key[1]} appears twice")
            seen.add(key)
            records.append(record)
    records.sort(key=lambda r: (r["seed"],))
    return config, records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("study", choices=STUDIES)
    parser.add_argument("parts", nargs="+", type=Path, help="the parts' JSON reports")
    parser.add_argument("--out-dir", type=Path, required=True)
    args = parser.parse_args()
    config, records = merge([json.loads(p.read_text()) for p in args.parts])
    args.out_dir.mkdir(parents=True, exist_ok=True)
    report = _common.write_report(args.out_dir / f"{args.study}.json", config, records)
    importlib.import_module(f"experiments.{args.study}").plot(
        report, args.out_dir / f"{args.study}.png"
    )
    print(f"merged {len(args.parts)} reports ({len(records)} records) into {args.out_dir}")


if __name__ == "__main__":
    main()
