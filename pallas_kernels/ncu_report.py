"""Nsight Compute's text outputs, read back: what `scripts/ncu.sh` leaves, as one summary.

    python -m pallas_kernels.ncu_report FOLDER [--out summary.json] [--top 12]

For each profile `<name>` in FOLDER, `<name>_details.txt` (`ncu --page details`) gives the
headline metrics (`METRICS`: duration, registers, occupancy, issue slots, throughputs, launch
shape), and `<name>_sass.csv` (`ncu --page source --csv --print-source sass`) gives the warp-state
samples: their share by stall reason over the whole kernel, and the instructions with the most
samples, each with its neighbours (what a stalled instruction waits on is usually just above it:
the load a `SEL` consumes, the `HGMMA` a `WARPGROUP.DEPBAR` awaits). The summary prints as
Markdown tables; the JSON is what NOTES.md files quote.
"""

from __future__ import annotations

import argparse
import csv
import gzip
import io
import json
import re
from pathlib import Path

METRICS = (
    "Duration",
    "Elapsed Cycles",
    "SM Frequency",
    "Registers Per Thread",
    "Block Size",
    "Grid Size",
    "Waves Per SM",
    "Dynamic Shared Memory Per Block",
    "Theoretical Occupancy",
    "Achieved Occupancy",
    "Issue Slots Busy",
    "Warp Cycles Per Issued Instruction",
    "Eligible Warps Per Scheduler",
    "DRAM Throughput",
    "Memory Throughput",
    "L1/TEX Hit Rate",
    "L2 Hit Rate",
)
"""`details` keeps these rows (the first of each name: the sections repeat a few)."""

_SAMPLES = "Warp Stall Sampling (All Samples)"
_EXECUTED = "Instructions Executed"
_STALL = re.compile(r"^stall_\w+$")  # the all-samples columns; '(Not Issued)' ones are apart


def details(path: str | Path) -> dict[str, dict]:
    """`METRICS` from an `ncu --page details` text: {name: {'value': float, 'unit': str}}.

    A metric row is its name, its unit (absent for counts) and its value, apart by 2+ spaces;
    values keep ncu's thousands commas, which go."""
    found: dict[str, dict] = {}
    for line in Path(path).read_text().splitlines():
        parts = re.split(r"\s{2,}", line.strip())
        if len(parts) not in (2, 3) or parts[0] not in METRICS or parts[0] in found:
            continue
        try:
            value = float(parts[-1].replace(",", ""))
        except ValueError:
            continue
        found[parts[0]] = {"value": value, "unit": parts[1] if len(parts) == 3 else ""}
    return found


def _sass_rows(path: str | Path) -> tuple[list[str], list[list[str]]]:
    """The header and the instruction rows of an `ncu --page source --csv` SASS listing, plain
    or gzipped (`.gz`: its first line names the kernel; rows shorter than the header are not
    instructions)."""
    raw = Path(path).read_bytes()
    if str(path).endswith(".gz"):
        raw = gzip.decompress(raw)
    rows = list(csv.reader(io.StringIO(raw.decode(), newline="")))
    header_at = next((i for i, r in enumerate(rows) if _SAMPLES in r), None)
    if header_at is None:
        raise ValueError(f"path: {str(path)!r} has no {_SAMPLES!r} column (not a SASS listing)")
    header = rows[header_at]
    return header, [r for r in rows[header_at + 1 :] if len(r) >= len(header)]


def opcode(sass: str) -> str:
    """An instruction's opcode without its predicate and modifiers: `@!P2 LDG.E.128 R4, ...`
    is 'LDG'."""
    words = sass.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0].split(".")[0] if words else ""


def stalls(path: str | Path, top: int = 12, context: int = 3) -> dict:
    """Warp-state samples of a SASS listing: {'samples', 'instructions', 'reasons': {reason:
    share of all samples, largest first}, 'top': the `top` instructions with the most samples,
    in program order, each {'index', 'sass', 'samples', 'share', 'executed', 'reasons': its two
    largest, 'before': the `context` instructions above it}, 'executed': warp-level
    instructions executed, 'opcodes': the `top` opcodes' shares of them, largest first}.

    Reasons drop ncu's `stall_` prefix. Some samples carry a reason the listing has no column
    for (an `HGMMA` waiting on the tensor core's queue is one): they count as 'unlisted'."""
    header, rows = _sass_rows(path)
    col = {name: i for i, name in enumerate(header)}
    columns = [name for name in header if _STALL.match(name)]
    samples = [int(r[col[_SAMPLES]]) for r in rows]
    total = sum(samples)
    if total == 0:
        raise ValueError(f"path: {str(path)!r} has no warp-state samples")

    def reasons_of(rs: list[list[str]], n: int) -> dict[str, float]:
        counts = {name[6:]: sum(int(r[col[name]]) for r in rs) for name in columns}
        counts["unlisted"] = n - sum(counts.values())
        return {k: c / n for k, c in sorted(counts.items(), key=lambda kv: -kv[1]) if c}

    picked = []
    for i in sorted(sorted(range(len(rows)), key=lambda i: -samples[i])[:top]):
        picked.append(
            {
                "index": i,
                "sass": rows[i][col["Source"]].strip(),
                "samples": samples[i],
                "share": samples[i] / total,
                "executed": int(rows[i][col[_EXECUTED]]),
                "reasons": dict(list(reasons_of([rows[i]], samples[i]).items())[:2]),
                "before": [r[col["Source"]].strip() for r in rows[max(0, i - context) : i]],
            }
        )
    executed: dict[str, int] = {}
    for r in rows:
        op = opcode(r[col["Source"]])
        executed[op] = executed.get(op, 0) + int(r[col[_EXECUTED]])
    n_executed = sum(executed.values())
    return {
        "samples": total,
        "instructions": len(rows),
        "reasons": reasons_of(rows, total),
        "top": picked,
        "executed": n_executed,
        "opcodes": {
            op: n / n_executed
            for op, n in sorted(executed.items(), key=lambda kv: -kv[1])[:top]
            if n_executed
        },
    }


def summarize(folder: str | Path, top: int = 12) -> dict[str, dict]:
    """Every profile in `folder` (a `<name>_details.txt`, a `<name>_sass.csv[.gz]` or both):
    {name: {'metrics': `details`, 'stalls': `stalls`}}, by name."""
    folder = Path(folder)
    found: dict[str, dict[str, Path]] = {}
    for suffix, kind in (
        ("_details.txt", "metrics"),
        ("_sass.csv", "stalls"),
        ("_sass.csv.gz", "stalls"),
    ):
        for p in folder.glob(f"*{suffix}"):
            found.setdefault(p.name.removesuffix(suffix), {})[kind] = p
    if not found:
        raise ValueError(f"folder: no *_details.txt or *_sass.csv[.gz] in {str(folder)!r}")
    summary = {}
    for name in sorted(found):
        paths = found[name]
        entry = {}
        if "metrics" in paths:
            entry["metrics"] = details(paths["metrics"])
        if "stalls" in paths:
            entry["stalls"] = stalls(paths["stalls"], top=top)
        summary[name] = entry
    return summary


def markdown(summary: dict[str, dict], reasons: int = 6) -> str:
    """The summary as Markdown: one metrics table over the profiles, then per profile its
    largest stall reasons and its top instructions."""
    names = list(summary)
    lines = ["| metric | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for metric in METRICS:
        cells = []
        for name in names:
            m = summary[name].get("metrics", {}).get(metric)
            cells.append("" if m is None else f"{m['value']:g} {m['unit']}".strip())
        if any(cells):
            lines.append(f"| {metric} | " + " | ".join(cells) + " |")
    for name in names:
        s = summary[name].get("stalls")
        if s is None:
            continue
        shares = ", ".join(f"{r} {v:.1%}" for r, v in list(s["reasons"].items())[:reasons])
        mix = ", ".join(f"{op} {v:.1%}" for op, v in list(s["opcodes"].items())[:reasons])
        lines += ["", f"**{name}**: {s['samples']} samples; {shares}", ""]
        lines += [f"Instructions executed: {s['executed']:,}; {mix}", ""]
        lines += ["| # | SASS | samples | share | stalled on |", "|---|---|---|---|---|"]
        for t in s["top"]:
            why = ", ".join(f"{r} {v:.0%}" for r, v in t["reasons"].items() if v >= 0.01)
            lines.append(
                f"| {t['index']} | `{t['sass']}` | {t['samples']} | {t['share']:.1%} | {why} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", help="where ncu.sh left <name>_details.txt and <name>_sass.csv")
    parser.add_argument("--out", help="path of the summary JSON to write")
    parser.add_argument("--top", type=int, default=12, help="instructions per profile")
    args = parser.parse_args(argv)
    if args.top < 1:
        parser.error(f"--top: expected >= 1, got {args.top}")
    summary = summarize(args.folder, top=args.top)
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=1) + "\n")
    print(markdown(summary))


if __name__ == "__main__":
    main()
