"""Prints BENCHMARKS.md's tables from the committed JSON of `bench_kernels.py`, `bench_decode.py`
and `train_throughput.py`, so the document's numbers are the JSON's, never retyped.

    python3 experiments/bench_tables.py experiments/results/bench_kernels_h200_2026-11-29.json
    python3 experiments/bench_tables.py --throughput experiments/results/train_throughput_*.json
    python3 experiments/bench_tables.py --long-context experiments/results/long_context_h200_*.json
    python3 experiments/bench_tables.py --groups experiments/results/train_throughput_group_*.json
    python3 experiments/bench_tables.py --decode experiments/results/bench_decode_h200_*.json
    python3 experiments/bench_tables.py --step-kernels experiments/results/bench_decode_h200_*.json
    python3 experiments/bench_tables.py --topk experiments/results/bench_topk_h200_*.json
    python3 experiments/bench_tables.py --targets SCAN.json POOLED.json ATTENTION.json DECODE.json
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path

from pallas_kernels import registers


def _context(n: int) -> str:
    if n % 2**20 == 0:
        return f"{n // 2**20}M"
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def _commits(report: dict) -> str:
    """'Commit c' for a report of one process, or each commit with the parts measured at it (a
    report that `bench_kernels.py --resume` completed over several calls), partial parts
    named."""
    commits = report.get("commits") or {}
    if len(set(commits.values())) <= 1:
        return f"Commit {report['commit']}"
    by_commit: dict[str, list[str]] = {}
    for part, commit in commits.items():
        partial = isinstance(report.get(part), dict) and report[part].get("partial")
        by_commit.setdefault(commit, []).append(part + (" (partial)" if partial else ""))
    return "Commits " + "; ".join(f"{c} ({', '.join(parts)})" for c, parts in by_commit.items())


def pooled_scoring(part: dict) -> str:
    """The pooled-scoring part of a kernel report, or a `pooled_scoring.bench` run: each context's
    routes, then the longest kernels of the kernel with its top-k at the longest context."""
    lines = [
        "Pooled scoring (batch 64, 2048 blocks of 8, 32 heads × 128, MXFP4 keys, top-512):",
        "",
        "| context | (a) score all, mask, top-k | (b) XLA gather + einsum + top-k | kernel + top-k "
        "| kernel, scores | Mosaic kernel alone | kernel BW / copy | vs (a) | vs (b) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for n, c in sorted(part["contexts"].items(), key=lambda kv: int(kv[0])):
        if "error" in c:
            lines.append(f"| {_context(int(n))} | {_error(c)} |" + " |" * 7)
            continue
        s = c["pallas_scores"]
        kernel = (
            f"{s['mosaic_kernel_ms']:.4f} ms | {s['kernel_GBps']:,.0f} GB/s = "
            f"{s['kernel_fraction_of_copy']:.0%}"
            if "mosaic_kernel_ms" in s
            else "— | —"
        )
        vs_a, vs_b = c.get("speedup_vs_full_scan_topk"), c.get("speedup_vs_xla_pool_topk")
        lines.append(
            f"| {_context(int(n))} | {_ms(c, 'full_scan_topk')} | {_ms(c, 'xla_pool_topk')} "
            f"| {_ms(c, 'pallas_topk')} | {_ms(c, 'pallas_scores', 4)} | {kernel} "
            f"| {'—' if vs_a is None else f'{vs_a:.0f}×'} "
            f"| {'—' if vs_b is None else f'{vs_b:.2f}×'} |"
        )
    failed = [
        f"{name} at {_context(int(n))}, {_error(c[name])}"
        for n, c in sorted(part["contexts"].items(), key=lambda kv: int(kv[0]))
        if "error" not in c
        for name in ("full_scan_topk", "xla_pool_topk", "pallas_topk", "pallas_scores")
        if "error" in c.get(name, {})
    ]
    if failed:  # a route that could not run at a context where the others did
        text = "; ".join(failed)
        lines += ["", "Not measured: " + text + ("" if text.endswith("…") else ".")]
    contexts = {n: c for n, c in part["contexts"].items() if "error" not in c}
    if not contexts:
        return "\n".join(lines)
    longest = max(contexts, key=int)
    c = contexts[longest]
    tunings = [
        (name[len("pallas_scores[") : -1].replace(",", " × "), c[name])
        for name in c
        if name.startswith("pallas_scores[") and "mosaic_kernel_ms" in c[name]
    ]
    if tunings:  # `bench --sweep`: the other tilings (tiles per CTA × stages)
        first = part.get("configs", [{}])[0]
        headline = f"{first.get('tiles_per_cta', '?')} × {first.get('num_stages', '?')}"
        lines += [
            "",
            f"Tilings at {_context(int(longest))} (tiles per CTA × stages; Mosaic kernel alone): "
            + f"{headline} (the table's) {c['pallas_scores']['mosaic_kernel_ms'] * 1000:.1f} µs, "
            + ", ".join(f"{t} {e['mosaic_kernel_ms'] * 1000:.1f} µs" for t, e in tunings)
            + ".",
        ]
    ablations = [
        ("no_fetch", "without the copies after the prologue"),
        ("no_decode", "without the decode"),
    ]
    timed = [(label, c.get(f"pallas_scores_{name}", {})) for name, label in ablations]
    timed = [(label, e) for label, e in timed if "mosaic_kernel_ms" in e]
    if timed and "mosaic_kernel_ms" in c["pallas_scores"]:  # the leave-one-out variants
        lines += [
            "",
            f"Leave-one-out at {_context(int(longest))} (Mosaic kernel alone): "
            + ", ".join(f"{label} {e['mosaic_kernel_ms'] * 1000:.1f} µs" for label, e in timed)
            + f", against {c['pallas_scores']['mosaic_kernel_ms'] * 1000:.1f} µs whole.",
        ]
    profile = sorted(c["pallas_topk"].get("kernels", []), key=lambda k: -k["ms"])[:3]
    if profile:
        lines += [
            "",
            f"Kernel + top-k at {_context(int(longest))}, its longest device kernels: "
            + ", ".join(f"{k['name']} {1000 * k['ms']:.1f} µs" for k in profile)
            + ".",
        ]
    return "\n".join(lines)


def sparse_attention(att: dict, *, longest: bool = False) -> str:
    """`pallas_kernels.sparse_attention.bench`: each implementation's time, TFLOP/s, bytes and
    error per batch, then the kernels' speed-ups over the two XLA baselines; `longest`: a
    column with the call's longest kernel (the Pallas kernel alone, for the kernel rows)."""
    shape = att["shape"]
    extra = " longest kernel |" if longest else ""
    lines = [
        f"FP4 sparse attention ({shape['heads']} heads × {shape['dim']}, {shape['topk']} "
        f"selected + {shape['window']} window keys, NVFP4 main KV, FP8 window):",
        "",
        "| batch | implementation | time | TFLOP/s | bytes | TB/s | rel. error |" + extra,
        "|---|---|---|---|---|---|---|" + "---|" * longest,
    ]
    for r in att["results"]:
        if "time_us" not in r:
            lines.append(f"| {r['batch']} | {r['implementation']} | error |")
            continue
        cell = f" {r['longest_kernel_us']:.1f} µs |" if longest else ""
        lines.append(
            f"| {r['batch']} | {r['implementation']} | {r['time_us']:.1f} µs | {r['tflops']:.1f} "
            f"| {r['bytes'] / 1e6:.1f} MB | {r['tb_per_s']:.3f} | {r['rel_err']:.1e} |" + cell
        )
    lines += ["", "| kernel @ batch | vs (a) XLA over BF16 cache | vs (b) XLA over packed FP4 |"]
    lines.append("|---|---|---|")
    for name, s in att["speedups"].items():
        if "[no_" in name:  # a leave-one-out variant computes wrong results: no speed-up
            continue
        lines.append(f"| {name} | {s['vs_xla_bf16_cache']:.2f}× | {s['vs_xla_packed']:.2f}× |")
    return "\n".join(lines)


def _mosaic_us(r: dict) -> float | None:
    """An attention bench row's Mosaic kernel time (`longest_kernel_us`), None where the row
    has none; raises ValueError where the last call's longest kernel is not a Mosaic one."""
    if "longest_kernel_us" not in r:
        return None
    name, _ = max(r["kernels_us"], key=lambda kernel: kernel[1])
    if "mosaic" not in name:
        raise ValueError(
            f"reports: batch {r['batch']} {r['implementation']}: expected the Mosaic GPU "
            f"kernel to be the call's longest, got {name!r}"
        )
    return r["longest_kernel_us"]


def _mgpu_rows(report: dict) -> dict[tuple, dict]:
    """An attention bench report's timed Mosaic GPU rows by (batch, implementation)."""
    return {
        (r["batch"], r["implementation"]): r
        for r in report["results"]
        if r["implementation"].startswith("pallas_mgpu") and "time_us" in r
    }


def _paired(deltas: list[float]) -> str:
    return f"{statistics.median(deltas):+.2f} ({min(deltas):+.2f} … {max(deltas):+.2f})"


def _pairs(
    before: list[dict], after: list[dict], before_paths: list[Path], after_paths: list[Path]
) -> tuple[str, str]:
    """The "Pairs: ..." and "Device: ..." of two versions' runs, paired in order.

    Raises:
      ValueError: unless there are as many runs of each version, at least one."""
    if len(before) != len(after) or not before:
        raise ValueError(
            f"--against: expected as many runs before as after (at least one), got "
            f"{len(before)} and {len(after)}"
        )
    names = ", ".join(
        f"({i + 1}) `{b.name}` then `{a.name}`"
        for i, (b, a) in enumerate(zip(before_paths, after_paths, strict=True))
    )
    devices = sorted({r["device"] for r in before + after})
    return f"Pairs: {names}.", f"Device: {', '.join(devices)}."


def attention_versions(
    before: list[dict], after: list[dict], before_paths: list[Path], after_paths: list[Path]
) -> str:
    """Two versions of the code, each run several times, alternating on one machine (run i of
    `after` right after run i of `before`): per batch and label that both timed, the Mosaic
    kernel's median over the runs of each version, and the difference after − before paired
    run by run (median and range), of the kernel and of the whole call.

    Raises:
      ValueError: as many runs of each version are needed, and rows whose longest kernel is
        the Mosaic one (`_mosaic_us`)."""
    pairs_line, device_line = _pairs(before, after, before_paths, after_paths)
    lines = [
        pairs_line,
        device_line,
        "",
        "| batch | implementation | before | after | paired Δ, kernel | paired Δ, whole call |",
        "|---|---|---|---|---|---|",
    ]

    pairs = [(_mgpu_rows(b), _mgpu_rows(a)) for b, a in zip(before, after, strict=True)]
    keys = sorted(set.intersection(*(set(b) & set(a) for b, a in pairs)))
    for key in keys:
        was = [_mosaic_us(b[key]) for b, _ in pairs]
        now = [_mosaic_us(a[key]) for _, a in pairs]
        if None in was or None in now:
            continue
        deltas = [n - w for w, n in zip(was, now, strict=True)]
        calls = [a[key]["time_us"] - b[key]["time_us"] for b, a in pairs]
        lines.append(
            f"| {key[0]} | {key[1]} | {statistics.median(was):.2f} | "
            f"{statistics.median(now):.2f} | {_paired(deltas)} | {_paired(calls)} |"
        )
    lines += [
        "",
        "Times in µs: the Mosaic kernel, median over each version's runs; Δ: after − before, "
        "median (range) over the pairs.",
    ]
    return "\n".join(lines)


def attention_runs(reports: list[dict], paths: list[Path]) -> str:
    """Several `sparse_attention.bench` runs side by side, for the Mosaic GPU rows: per batch
    and label, the Mosaic kernel alone in each run (`longest_kernel_us`: the median over the
    run's calls of each call's longest kernel, the Mosaic kernel in these rows; the call in
    parentheses), then the median kernel over the runs and its difference to the same run's
    default (`pallas_mgpu`) paired run by run, and the same difference for the whole call (a
    variant may move work into or out of the kernel: the split merge in XLA against the one in
    the kernel). Labels name the config the run's code gave them; the paths say which code.

    Raises:
      ValueError: a row whose last call's longest kernel is not a Mosaic GPU kernel (then
        `longest_kernel_us` would time something else).

    A row a run could not time (its compile or call raised) is named below the table with the
    first line of its error, never left out silently."""
    devices = sorted({r["device"] for r in reports})
    lines = [
        "Runs: " + ", ".join(f"({i + 1}) `{p.name}`" for i, p in enumerate(paths)) + ".",
        f"Device: {', '.join(devices)}.",
        "",
        "| batch | implementation | "
        + " | ".join(f"({i + 1})" for i in range(len(reports)))
        + " | median | paired Δ to default | paired Δ, whole call |",
        "|---|---|" + "---|" * (len(reports) + 3),
    ]

    by_run = [_mgpu_rows(report) for report in reports]
    keys = [key for run in by_run for key in run]

    for key in dict.fromkeys(sorted(keys)):
        cells, kernels, deltas, call_deltas = [], [], [], []
        for run in by_run:
            r = run.get(key)
            if r is None or _mosaic_us(r) is None:
                cells.append("")
                continue
            cells.append(f"{_mosaic_us(r):.2f} ({r['time_us']:.2f})")
            kernels.append(_mosaic_us(r))
            base = run.get((key[0], "pallas_mgpu"))
            if base is not None and _mosaic_us(base) is not None:
                deltas.append(_mosaic_us(r) - _mosaic_us(base))
                call_deltas.append(r["time_us"] - base["time_us"])
        median = f"{statistics.median(kernels):.2f}" if kernels else ""
        delta = call_delta = ""
        if deltas and key[1] != "pallas_mgpu":
            delta, call_delta = _paired(deltas), _paired(call_deltas)
        row = f"| {key[0]} | {key[1]} | " + " | ".join(cells)
        lines.append(row + f" | {median} | {delta} | {call_delta} |")
    lines += [
        "",
        "Times in µs: the Mosaic kernel, median over the run's calls (the whole call, "
        "median); Δ: median (range) over runs, of the kernel and of the whole call.",
    ]
    failed: dict[tuple, dict[str, list[int]]] = {}  # (batch, label) -> error -> runs
    for i, report in enumerate(reports):
        for r in report["results"]:
            if r["implementation"].startswith("pallas_mgpu") and "error" in r:
                errors = failed.setdefault((r["batch"], r["implementation"]), {})
                errors.setdefault(r["error"].splitlines()[0], []).append(i + 1)
    for (batch, label), errors in sorted(failed.items()):
        for error, runs in errors.items():
            which = ", ".join(f"({run})" for run in runs)
            runs_word = "run" if len(runs) == 1 else "runs"
            lines.append(f"Not timed: {label} at batch {batch}, {runs_word} {which}: {error}")
    return "\n".join(lines)


def kernels(report: dict) -> str:
    copy, matmul = report["copy"], report["matmul"]
    lines = [
        f"Ceilings (same process): copy {copy['GBps']:,.0f} GB/s (read + written, "
        f"{copy['bytes'] / 2**30:.0f} GiB); bf16 matmul {matmul['TFLOPs']:.0f} TFLOP/s "
        f"({matmul['n']}³). {_commits(report)}, {report['device']}, jax {report['jax']}.",
        "",
        pooled_scoring(report["pooled_scoring"]),
    ]

    lines += ["", sparse_attention(report["sparse_attention"])]
    for key, table in (("topk", topk), ("source_scan", source_scan)):
        if key in report:  # runs from 2026-12-02 on
            lines += ["", table(report[key])]
    return "\n".join(lines)


def _ms(entry: dict, name: str, digits: int = 3) -> str:
    """An entry's median in ms, or why there is none."""
    timing = entry.get(name)
    if timing is None:
        return "—"
    if "median_ms" not in timing:
        return "error" if "error" in timing else "ran"
    return f"{timing['median_ms']:.{digits}f} ms"


def _error(entry: dict) -> str:
    """Why a context has no figures: the benchmark's error (the repr of the exception), without
    the exception's name, its first line cut at 80 characters (an out-of-memory names the
    allocation: a 1 M context on an 80 GB card)."""
    text = entry["error"].strip()
    text = re.sub(r"^\w+\(['\"](.*?)['\"]?\)?$", r"\1", text, flags=re.S) or "?"
    first = text.splitlines()[0]
    return "error: " + (first if len(first) <= 80 else first[:79] + "…").replace("|", "/")


def _natural(label: str) -> list:
    """A sort key under which the numbers in a label sort as numbers (kernel_1bit_8w before
    kernel_1bit_16w)."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", label)]


_SCORES = {
    "relu": "ReLU-like scores, a third 0",
    "distinct": "distinct normal scores, as a full pool's",
}


def topk(report: dict) -> str:
    """`pallas_kernels.topk.bench`: the sort against the selection through the best blocks, the
    radix select and the radix-select kernel at each pass width."""
    shapes = report["shapes"]
    names = {name for e in shapes.values() for name in e}
    widths = ["blocks"] * ("blocks" in names)
    widths += sorted((n for n in names if n.startswith("radix_")), key=_natural)
    widths += sorted((n for n in names if n.startswith("kernel_")), key=_natural)
    lines = [
        f"Top-k of the decode step (batch {report['batch']}; "
        + _SCORES[report.get("scores", "relu")]
        + "):",
        "",
        "| selection | n | k | XLA sort | " + " | ".join(widths) + " | best vs sort | same picks |",
        "|---|---|---|---|" + "---|" * len(widths) + "---|---|",
    ]
    for name, e in shapes.items():
        timed = [e[w] for w in widths if "median_ms" in e.get(w, {})]
        best = max((t.get("speedup_vs_sort", 0.0) for t in timed), default=None)
        same = all(t.get("equal_to_sort") for t in timed) if timed else None
        lines.append(
            f"| {name} | {e['n']:,} | {e['k']:,} | {_ms(e, 'xla_sort')} | "
            + " | ".join(_ms(e, w) for w in widths)
            + f" | {'—' if best is None else f'{best:.1f}×'} | {'—' if same is None else same} |"
        )
    return "\n".join(lines)


def source_scan(report: dict) -> str:
    """`pallas_kernels.source_scan.bench`: the XLA scan against the kernel route, and the route's
    parts."""
    sizes = report["sizes"]
    lines = [
        f"Candidate source's scan (batch {sizes['batch']}, pool {sizes['topk_blocks']} blocks, "
        f"top-{sizes['index_topk']}, {report['heads']} heads × {report['dim']}, MXFP4 keys):",
        "",
        "| context | XLA scan | route, max | route vs XLA | route, mean | kernel block maxima "
        "(BW / copy) | kernel scores (BW / copy) | selections, XLA sort | selections, route |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for n, c in sorted(report["contexts"].items(), key=lambda kv: int(kv[0])):
        if "error" in c:
            lines.append(f"| {_context(int(n))} | {_error(c)} |" + " |" * 7)
            continue
        speedup = c.get("speedup_route_vs_xla_scan")
        lines.append(
            f"| {_context(int(n))} | {_ms(c, 'xla_scan')} | {_ms(c, 'pallas_route')} "
            f"| {'—' if speedup is None else f'{speedup:.1f}×'} | {_ms(c, 'pallas_route_mean')} "
            f"| {_kernel(c, 'pallas_block_max')} | {_kernel(c, 'pallas_scores')} "
            f"| {_ms(c, 'selections_xla')} | {_ms(c, 'selections_pallas')} |"
        )
    for n, c in sorted(report["contexts"].items(), key=lambda kv: int(kv[0])):
        if "pallas_block_max_listed_ids" in c:  # the kernel reading every block's id (pool form)
            lines += [
                "",
                f"Kernel block maxima at {_context(int(n))} with the blocks' ids read from memory "
                f"(`every_block`'s, as a pool hands them): "
                f"{_kernel(c, 'pallas_block_max_listed_ids')}.",
            ]
        if "pallas_route_ragged" in c:  # lengths spread evenly over (0, S]
            lines += [
                "",
                f"A ragged batch at {_context(int(n))} (lengths spread evenly over (0, S]): "
                f"route, max {_ms(c, 'pallas_route_ragged')}; kernel block maxima "
                f"{_ms(c, 'pallas_block_max_ragged')}, with the ids listed "
                f"{_ms(c, 'pallas_block_max_ragged_listed_ids')}.",
            ]
    measured = [n for n, c in report["contexts"].items() if "error" not in c]
    if not measured:
        return "\n".join(lines)
    longest = max(measured, key=int)
    route = report["contexts"][longest].get("pallas_route", {}).get("kernels", [])
    if big := [k for k in route if k["ms"] >= 0.005]:
        lines += [
            "",
            f"Route, max, at {_context(int(longest))}: its kernels of 5 µs or more, in launch "
            "order: " + ", ".join(f"{k['name']} {1000 * k['ms']:.1f} µs" for k in big) + ".",
        ]
    return "\n".join(lines)


def _kernel(entry: dict, key: str) -> str:
    """A kernel's time with its bandwidth as a share of the copy ceiling."""
    timing = entry.get(key, {})
    if "kernel_GBps" not in timing:
        return _ms(entry, key)
    share = f"{timing['kernel_GBps']:,.0f} GB/s = {timing['kernel_fraction_of_copy']:.0%}"
    return f"{_ms(entry, key)} ({share})"


def decode(report: dict) -> str:
    """`bench_decode.py`: the decode step, whole and per op, per implementation and context."""
    lines = [
        f"Decode step of {report['config']} (pool {report['pool_blocks']} blocks, "
        f"top-{report['index_topk']}; commit {report['commit']}, {report['device']}):",
        "",
    ]
    for n, c in sorted(report["contexts"].items(), key=lambda kv: int(kv[0])):
        ops = list(c["counts"])
        lines += [
            f"{_context(int(n))} tokens, batch {c['batch']} (per step: "
            + ", ".join(f"{op} ×{count}" for op, count in c["counts"].items())
            + "):",
            "",
            "| implementation | step | tokens/s | "
            + " | ".join(ops)
            + " | rest | indexer stack / source scan |",
            "|---|---|---|" + "---|" * len(ops) + "---|---|",
        ]
        for impl in (k for k in c if isinstance(c[k], dict) and "step" in c[k]):
            e = c[impl]
            per_step = e.get("per_step_ms", {})
            cells = [f"{per_step[op]:.3f} ms" if op in per_step else _ms(e, op) for op in ops]
            rest, ratio = e.get("rest_ms"), e.get("indexer_stack_over_source_scan")
            rate = e.get("tokens_per_s")
            lines.append(
                f"| {impl} | {_ms(e, 'step')} | {'—' if rate is None else f'{rate:,.0f}'} | "
                + " | ".join(cells)
                + f" | {'—' if rest is None else f'{rest:.3f} ms'}"
                + f" | {'—' if ratio is None else f'{ratio:.2f}'} |"
            )
        lines.append("")
    return "\n".join(lines).rstrip("\n")


def _kind(name: str) -> str:
    """A device kernel's kind: its name without XLA's numbering (`gemm_fusion_dot.12`,
    `topk_radix_select__3`, `loop_add_fusion_2` → `gemm_fusion_dot`, `topk_radix_select`, ...)."""
    return re.sub(r"(_{1,2}|\.)\d+$", "", name)


def step_kernels(report: dict, shown: int = 12) -> str:
    """`bench_decode.py`: what a decode step launched, by kernel kind (the step's last timed
    call, `measure_chain`'s kernel list): per kind the kernels, their summed time and share of
    the call, the `shown` largest kinds and the rest summed."""
    lines = [f"Decode steps' kernels by kind (commit {report['commit']}, {report['device']}):"]
    for n, c in sorted(report["contexts"].items(), key=lambda kv: int(kv[0])):
        for impl in (
            k for k in c if isinstance(c[k], dict) and c[k].get("step", {}).get("kernels")
        ):
            kernels = c[impl]["step"]["kernels"]
            total = sum(k["ms"] for k in kernels)
            kinds: dict[str, list[float]] = {}
            for k in kernels:
                kinds.setdefault(_kind(k["name"]), []).append(k["ms"])
            ranked = sorted(kinds.items(), key=lambda kv: -sum(kv[1]))
            lines += [
                "",
                f"{_context(int(n))} tokens, batch {c['batch']}, {impl}: {len(kernels)} kernels, "
                f"{total:.3f} ms:",
                "",
                "| kind | kernels | µs | share |",
                "|---|---|---|---|",
            ]
            for kind, ms in ranked[:shown]:
                lines.append(
                    f"| {kind} | {len(ms)} | {sum(ms) * 1e3:.1f} | {sum(ms) / total:.1%} |"
                )
            rest = [ms for _, group in ranked[shown:] for ms in group]
            if rest:
                lines.append(
                    f"| {len(ranked) - shown} other kinds | {len(rest)} | {sum(rest) * 1e3:.1f} | "
                    f"{sum(rest) / total:.1%} |"
                )
    return "\n".join(lines)


def _copies(step: dict) -> str:
    """The device copies among a step's kernels (`measure`'s list of its last call): count and
    summed time."""
    copies = [k["ms"] for k in step.get("kernels", []) if k["name"].startswith("memcpy")]
    return f"{len(copies)} ({sum(copies) * 1e3:.1f} µs)"


def _lower_median_run(entries: list[dict]) -> dict:
    """The run whose median step is the lower median of the runs'."""
    ranked = sorted(entries, key=lambda e: e["step"]["median_ms"])
    return ranked[(len(ranked) - 1) // 2]


def decode_versions(
    before: list[dict], after: list[dict], before_paths: list[Path], after_paths: list[Path]
) -> str:
    """Two versions of the code's decode step, each run several times, alternating on one
    machine (run i of `after` right after run i of `before`): per context and implementation
    that both timed, the step's median over the runs of each version, the difference after −
    before paired run by run (median and range), tokens/s and the rest at the median run's
    step, and the step's device copies (`memcpy` kernels) in each version's first run.

    Raises:
      ValueError: unless there are as many runs of each version, at least one."""
    pairs_line, device_line = _pairs(before, after, before_paths, after_paths)
    commits = [sorted({r["commit"] for r in runs}) for runs in (before, after)]
    lines = [
        pairs_line,
        f"{device_line} Commits: before {', '.join(commits[0])}; after {', '.join(commits[1])}.",
        "",
        "| context | batch | implementation | step before | step after | paired Δ | "
        "tokens/s before | tokens/s after | rest before | rest after | copies before | "
        "copies after |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def timed(report, n, impl):
        e = report["contexts"].get(n, {}).get(impl, {})
        return e if "median_ms" in e.get("step", {}) else None

    contexts = sorted(set.intersection(*(set(r["contexts"]) for r in before + after)), key=int)
    for n in contexts:
        impls = [k for k in after[0]["contexts"][n] if isinstance(after[0]["contexts"][n][k], dict)]
        for impl in impls:
            pairs = [
                (timed(b, n, impl), timed(a, n, impl)) for b, a in zip(before, after, strict=True)
            ]
            if any(b is None or a is None for b, a in pairs):
                continue
            was = [b["step"]["median_ms"] for b, _ in pairs]
            now = [a["step"]["median_ms"] for _, a in pairs]
            deltas = [w - v for v, w in zip(was, now, strict=True)]
            mb, ma = (_lower_median_run([pair[i] for pair in pairs]) for i in (0, 1))
            deltas_text = (
                f"{statistics.median(deltas):+.3f} ({min(deltas):+.3f} … {max(deltas):+.3f})"
            )
            lines.append(
                f"| {_context(int(n))} | {before[0]['contexts'][n]['batch']} | {impl} | "
                f"{statistics.median(was):.3f} | {statistics.median(now):.3f} | {deltas_text} | "
                f"{mb['tokens_per_s']:,.0f} | {ma['tokens_per_s']:,.0f} | "
                f"{mb.get('rest_ms', float('nan')):.3f} | {ma.get('rest_ms', float('nan')):.3f} | "
                f"{_copies(pairs[0][0]['step'])} | {_copies(pairs[0][1]['step'])} |"
            )
    lines += [
        "",
        "Times in ms: each run's median step (chained, donated), median over the runs; Δ: after "
        "− before, median (range) over the pairs; tokens/s and rest at the lower median run; "
        "copies: `memcpy` kernels of one step (count, summed time).",
    ]
    return "\n".join(lines)


def _where(report: dict) -> str:
    return report["device"] if report["platform"] == "gpu" else f"CPU ({report['cpu_count']} cores)"


def _shape(report: dict, r: dict) -> tuple:
    return (_where(report), r["preset"], r["attention"], r["batch_size"], r["seq_len"])


def throughput(reports: list[dict], before: list[dict] = ()) -> str:
    """The training-throughput table; with `before` (earlier runs), a column with the speed-up
    of each row over the earlier run of the same device, preset, stage and shape."""
    earlier = {_shape(rep, r): r for rep in before for r in rep["results"]}
    head = "| device | preset | attention | batch × seq | median step | tokens/s | first step |"
    rule = "|---|---|---|---|---|---|---|"
    if before:
        head += " before | speed-up |"
        rule += "---|---|"
    lines = [head, rule]
    for report in reports:
        for r in report["results"]:
            line = (
                f"| {_where(report)} | {r['preset']} | {r['attention']} | {r['batch_size']} × "
                f"{r['seq_len']} | {r['median_step_s'] * 1e3:,.1f} ms | {r['tokens_per_s']:,.0f} "
                f"| {r['first_step_s']:.1f} s |"
            )
            if before:
                old = earlier.get(_shape(report, r))
                line += (
                    " n/a | n/a |"
                    if old is None
                    else f" {old['median_step_s'] * 1e3:,.1f} ms | "
                    f"{old['median_step_s'] / r['median_step_s']:.2f}× |"
                )
            lines.append(line)
    return "\n".join(lines)


def long_context(report: dict) -> str:
    """`long_context_memory.py`'s table: one row per configuration, by sequence length."""
    lines = [
        f"Commit {report['commit']}, {report['date']}, jax {report['jax']}, XLA_FLAGS "
        f"'{report['xla_flags']}'; MFU against {report['peak_flops'] / 1e12:.0f} TFLOP/s.",
        "",
        "| seq_len | batch | query_chunk | step | tokens/s | peak GiB | MFU | compile |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(report["results"], key=lambda r: (r["seq_len"], -r["query_chunk"])):
        head = f"| {_context(r['seq_len'])} | {r['batch']} | {r['query_chunk'] or 'off'} |"
        if "error" in r:
            lines.append(f"{head} {r['error'].strip()[:60]} | | | | |")
            continue
        lines.append(
            f"{head} {r['median_step_s'] * 1e3:,.0f} ms | {r['tokens_per_s']:,.0f} "
            f"| {r['peak_gib']:.1f} | {r['mfu']:.2%} | {r['compile_s']:.0f} s |"
        )
    return "\n".join(lines)


def profile(report: dict) -> str:
    """`profile_train_step.py`'s table: per stage, the step and forward wall times, tokens/s,
    and on a GPU the device time, kernel count and the device time by kernel kind (the name's
    first word: gemm, loop/input fusions, sort, ...); on a CPU the XLA operations' summed time
    and count and their time by kind, then each stage's heaviest operations with the jax
    operation they come from."""
    cfg = report["config"]
    seq = dict(cfg["task_overrides"]).get("seq_len")
    lines = [
        f"Commit {report['commit']}, jax {report['jax']}, {report['device']}; {cfg['preset']} "
        f"on {cfg['task']}, batch {cfg['batch_size']} × {seq} tokens, model overrides "
        f"{dict(cfg['model_overrides']) or 'none'}.",
        "",
        "| stage | train step (median) | forward (median) | tokens/s | device (or CPU ops) ms | "
        "kernels (or ops) | ms by kind |",
        "|---|---|---|---|---|---|---|",
    ]
    heaviest = []
    for r in report["results"]:
        d = r.get("device") or r.get("host") or {}
        kinds = ", ".join(f"{k} {v:.1f}" for k, v in d.get("by_kind_ms", {}).items())
        total = d.get("median_ms", d.get("ops_ms", float("nan")))
        count = d.get("kernels_per_step", d.get("ops_per_step", "n/a"))
        lines.append(
            f"| {r['attention']} | {r['train_step']['median_s'] * 1e3:,.0f} ms "
            f"| {r['forward']['median_s'] * 1e3:,.0f} ms | {r['tokens_per_s']:,.0f} "
            f"| {total:,.0f} | {count} | {kinds or 'n/a'} |"
        )
        if "host" in r:
            heaviest += [(r["attention"], op) for op in r["host"]["heaviest"][:10]]
    if heaviest:
        lines += ["", "| stage | operation | ms | from (HLO op_name) |", "|---|---|---|---|"]
        for stage, op in heaviest:
            source = op["op_name"].replace("jit(pure_step)/jit(_train_step)/", "")
            lines.append(f"| {stage} | {op['name']} | {op['ms']:.1f} | `{source}` |")
    return "\n".join(lines)


def groups(reports: list[dict]) -> str:
    """The many-seeds table: one seed alone against N seeds in one program (`--group N` runs),
    per step waited for (median) and dispatched back to back (pipelined mean)."""
    lines = [
        "| device | preset | attention | batch × seq | seeds | median step | seed-steps/s | "
        "tokens/s | × one seed | pipelined step | × one seed, pipelined | first step |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for report in reports:
        alone = {(r["preset"], r["attention"]): r for r in report["results"]}
        for g in report["groups"]:
            one = alone[(g["preset"], g["attention"])]
            for seeds, r, ratio, pipelined in (
                (1, one, 1.0, 1.0),
                (g["seeds"], g, g["vs_one_seed"], g["vs_one_seed_pipelined"]),
            ):
                lines.append(
                    f"| {_where(report)} | {g['preset']} | {g['attention']} | {g['batch_size']} × "
                    f"{g['seq_len']} | {seeds} | {r['median_step_s'] * 1e3:,.1f} ms | "
                    f"{seeds / r['median_step_s']:,.1f} | {r['tokens_per_s']:,.0f} | "
                    f"{ratio:.2f}× | {r['pipelined_step_s'] * 1e3:,.1f} ms | {pipelined:.2f}× | "
                    f"{r['first_step_s']:.1f} s |"
                )
    return "\n".join(lines)


def source_scan_tune(report: dict, path: Path) -> str:
    """A `source_scan.bench --tune` run: the 'max' route's kernel under each tuning, then its
    leave-one-out variants, as time and fraction of the copy ceiling."""
    n_gb = report["bytes"] / 1e9
    lines = [
        f"{path.name}: block-max kernel over every block, {report['n_pos']:,} keys × "
        f"batch {report['batch']} ({n_gb:.2f} GB), {report['device']}:",
        "",
        "| variant | kernel | of copy |",
        "|---|---|---|",
    ]
    for group in ("configs", "ablations"):
        for name, r in report[group].items():
            label = f"tiles×stages {name}" if group == "configs" else f"default, {name}"
            if "error" in r:
                lines.append(f"| {label} | error | |")
                continue
            lines.append(
                f"| {label} | {r['mosaic_kernel_ms']:.3f} ms | "
                f"{100 * r['kernel_fraction_of_copy']:.1f} % |"
            )
    return "\n".join(lines)


def _report_kind(report: dict) -> str | None:
    """Which benchmark wrote `report`: 'attention', 'decode', 'source_scan', 'pooled' or None."""
    if "results" in report and "speedups" in report:
        return "attention"
    first = next(iter(report.get("contexts", {}).values()), {})
    if "counts" in first:
        return "decode"
    if "pallas_route" in first:
        return "source_scan"
    if "pallas_topk" in first:
        return "pooled"
    return None


_MILLION = "1048576"  # the context of issue 16's targets


def _absent(r) -> str:
    """Why a report has no figure at 1 M: the context's error, or that it was not run."""
    c = r["contexts"].get(_MILLION)
    if c is None:
        return "— (1 M not run)"
    return f"— (1 M: {_error(c)})" if "error" in c else "—"


def _scan_speedup(r):
    c = r["contexts"].get(_MILLION, {})
    s = c.get("speedup_route_vs_xla_scan")
    if s is None:
        return None, _absent(r)
    return s, f"{s:.1f}× (route {_ms(c, 'pallas_route')} against {_ms(c, 'xla_scan')})"


def _kernel_share(key, label):
    def read(r):
        t = r["contexts"].get(_MILLION, {}).get(key, {})
        if "kernel_fraction_of_copy" not in t:
            return None, _absent(r)
        share, ms = t["kernel_fraction_of_copy"], t["mosaic_kernel_ms"]
        time = f"{ms:.3f} ms" if ms >= 1 else f"{ms * 1000:.1f} µs"
        return share, f"{share:.0%} ({label} {time})"

    return read


def _pooled_topk(r):
    t = r["contexts"].get(_MILLION, {}).get("pallas_topk", {})
    if "median_ms" not in t:
        return None, _absent(r)
    spread = ""
    if "min_ms" in t and "runs" in t:  # the median's calls: how close to the bound they fall
        spread = (
            f" (median of {t['runs']} calls, {t['min_ms'] * 1000:.1f}–{t['max_ms'] * 1000:.1f})"
        )
    return t["median_ms"] * 1000, f"{t['median_ms'] * 1000:.1f} µs{spread}"


def _attention(batch):
    def read(r):
        for e in r["results"]:
            if e["batch"] == batch and e["implementation"] == "pallas_mgpu" and "tflops" in e:
                return e["tflops"], f"{e['tflops']:.1f} TFLOP/s ({e['time_us']:.1f} µs)"
        return None, "—"

    return read


def _indexer_stack(r):
    e = r["contexts"].get(_MILLION, {}).get("pallas", {})
    ratio = e.get("indexer_stack_over_source_scan")
    if ratio is None:
        return None, "—"
    return ratio, f"{ratio:.2f}× (batch {r['contexts'][_MILLION]['batch']})"


TARGETS = (
    ("source_scan", "source scan ≥ 30× the XLA full scan at 1 M × 64", _scan_speedup, 30, 1),
    ("source_scan", "source-scan kernel ≥ 60 % of copy at 1 M × 64",
     _kernel_share("pallas_block_max", "block maxima"), 0.6, 1),
    ("pooled", "pooled scoring with its top-k ≤ 90 µs at 1 M × 64", _pooled_topk, 90, -1),
    ("pooled", "pooled-scoring kernel alone ≥ 50 % of copy at 1 M × 64",
     _kernel_share("pallas_scores", "kernel"), 0.5, 1),
    ("attention", "FP4 sparse attention ≥ 250 TFLOP/s at batch 64", _attention(64), 250, 1),
    ("attention", "FP4 sparse attention ≥ 300 TFLOP/s at batch 128", _attention(128), 300, 1),
    ("decode", "decoder indexer stack ≤ 1.3× the source scan at 1 M", _indexer_stack, 1.3, -1),
)  # fmt: skip
"""Issue 16's targets, each read from the benchmark report of its kind: (report kind, target,
the reader of its figure, its bound, 1 for at least the bound or −1 for at most)."""


_COMBINED_PARTS = ("source_scan", "pooled_scoring", "sparse_attention")
"""The parts of a combined run (`bench_kernels.py`) that hold issue 16's targets."""


def targets(reports: list[dict], paths: list[Path]) -> str:
    """Issue 16's targets as measured in the given reports (each target from the last report
    of its benchmark; a combined `bench_kernels.py` run gives its source-scan, pooled and
    attention parts), whether each is met, and the file its figure comes from."""
    latest = {}
    for report, path in zip(reports, paths, strict=True):
        # A combined run (`bench_kernels.py`) holds each benchmark's report as a part.
        parts = [report[part] for part in _COMBINED_PARTS if part in report] or [report]
        for part in parts:
            kind = _report_kind(part)
            if kind is None:
                raise ValueError(
                    f"paths: {path} is not a source-scan, pooled, attention, decode or combined"
                    " (bench_kernels) run"
                )
            latest[kind] = (part, path, _card(part.get("device") or report.get("device")))
    lines = ["| target (issue 16) | measured | met | from |", "|---|---|---|---|"]
    other_cards = set()
    for kind, target, read, bound, sign in TARGETS:
        if kind not in latest:
            lines.append(f"| {target} | no {kind} report given | — | — |")
            continue
        report, path, card = latest[kind]
        value, text = read(report)
        met = "—" if value is None else ("yes" if sign * (value - bound) >= 0 else "no")
        if value is not None and card not in (None, "H200"):
            met += f" ({card})"
            other_cards.add(card)
        lines.append(f"| {target} | {text} | {met} | `{path.name}` |")
    if other_cards:
        lines += [
            "",
            f"({', '.join(sorted(other_cards))}): measured on that card. Issue 16's targets are "
            "the H200's: a share of the copy ceiling is the share of that card's ceiling.",
        ]
    return "\n".join(lines)


def _card(device: str | None) -> str | None:
    """'H200', 'H100', ... from a report's device name (the name itself where it holds no such
    word); None for a report that names no device."""
    if not device:
        return None
    match = re.search(r"\b([A-Z]\d{2,3})\b", device)
    return match.group(1) if match else device


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="+", type=Path)
    parser.add_argument("--throughput", action="store_true", help="the paths are throughput runs")
    parser.add_argument(
        "--long-context", action="store_true", help="the paths are long_context_memory runs"
    )
    parser.add_argument(
        "--groups", action="store_true", help="the paths are throughput runs with --group N"
    )
    parser.add_argument(
        "--profile", action="store_true", help="the paths are profile_train_step runs"
    )
    parser.add_argument(
        "--before", nargs="+", type=Path, default=[], help="earlier throughput runs to compare"
    )
    parser.add_argument("--decode", action="store_true", help="the paths are bench_decode runs")
    parser.add_argument(
        "--step-kernels",
        action="store_true",
        help="the paths are bench_decode runs: each step's kernels by kind",
    )
    parser.add_argument(
        "--topk", action="store_true", help="the paths are pallas_kernels.topk.bench runs"
    )
    parser.add_argument(
        "--source-scan",
        action="store_true",
        help="the paths are pallas_kernels.source_scan.bench runs",
    )
    parser.add_argument(
        "--tune", action="store_true", help="the paths are source_scan.bench --tune runs"
    )
    parser.add_argument(
        "--pooled", action="store_true", help="the paths are pooled_scoring.bench runs"
    )
    parser.add_argument(
        "--attention",
        action="store_true",
        help="the paths are sparse_attention.bench runs (with each call's longest kernel)",
    )
    parser.add_argument(
        "--attention-runs",
        action="store_true",
        help="the paths are sparse_attention.bench runs to set side by side (Mosaic GPU rows)",
    )
    parser.add_argument(
        "--against",
        nargs="+",
        type=Path,
        default=[],
        help="with --attention-runs or --decode: the runs of the code before, paired in order "
        "with the paths",
    )
    parser.add_argument(
        "--targets",
        action="store_true",
        help="issue 16's targets from source-scan, pooled, attention and decode runs",
    )
    parser.add_argument(
        "--registers",
        action="store_true",
        help="the paths are pallas_kernels.registers reports (ptxas at each register split)",
    )
    args = parser.parse_args(argv)
    if args.against and not (args.attention_runs or args.decode):
        parser.error("--against: pairs runs of --attention-runs or --decode; give one of them")
    reports = [json.loads(p.read_text()) for p in args.paths]
    if args.registers:
        print(registers.table([row for report in reports for row in report]))
    elif args.targets:
        print(targets(reports, args.paths))
    elif args.tune:
        for path, report in zip(args.paths, reports, strict=True):
            print(source_scan_tune(report, path) + "\n")
    elif args.attention_runs and args.against:
        before = [json.loads(p.read_text()) for p in args.against]
        print(attention_versions(before, reports, args.against, args.paths))
    elif args.attention_runs:
        print(attention_runs(reports, args.paths))
    elif args.attention:
        print("\n\n".join(sparse_attention(report, longest=True) for report in reports))
    elif args.pooled:
        for report in reports:
            print(pooled_scoring(report))
    elif args.topk:
        for report in reports:
            print(topk(report))
    elif args.source_scan:
        print("\n\n".join(source_scan(report) for report in reports))
    elif args.step_kernels:
        print("\n\n".join(step_kernels(report) for report in reports))
    elif args.decode and args.against:
        before = [json.loads(p.read_text()) for p in args.against]
        print(decode_versions(before, reports, args.against, args.paths))
    elif args.decode:
        print("\n\n".join(decode(report) for report in reports))
    elif args.long_context:
        for report in reports:
            print(long_context(report))
    elif args.profile:
        for report in reports:
            print(profile(report))
    elif args.groups:
        print(groups(reports))
    elif args.throughput:
        before = [json.loads(p.read_text()) for p in args.before]
        print(throughput(reports, before))
    else:
        for report in reports:
            print(kernels(report))


if __name__ == "__main__":
    main()
