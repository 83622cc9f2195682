"""The text tables of `v41jax bytes`: the seed article's tables, computed by `v41jax.accounting`
and rendered with rich (DESIGN §5).

    from v41jax import tables
    print(tables.render_seed_report(2**20))             # V4.1-Flash vs V4-Flash at 1M tokens
    print(tables.render_config("tiny", config.tiny(), 65536, per_layer=True))

Numbers are formatted the way the seed writes them (890 B, 2.8·10¹⁰, 0.87 GiB, ÷ 2.16).
"""

from __future__ import annotations

import io
import math
import textwrap
from collections.abc import Callable, Sequence
from fractions import Fraction

from rich import box
from rich.console import Console
from rich.padding import Padding
from rich.table import Table

from v41jax.accounting import (
    DEFAULT_CONTEXT,
    GIB,
    KVBytes,
    MeshPlan,
    StorageStep,
    format_context,
    index_row_bytes,
    indexer_cost,
    kv_bytes_per_token,
    main_row_bytes,
    sharded_traffic,
    storage_steps,
    window_bytes_per_sequence,
    window_row_bytes,
    without_sharing,
)
from v41jax.nn.config import ModelConfig, Role, layer_plan, v4_flash, v41_flash


def _num(x) -> str:
    """Whole numbers ≥ 100 with thousands separators; smaller values to 2 decimals, trimmed."""
    if abs(x) >= 100:
        return f"{round(x):,}"
    text = f"{float(x):.2f}".rstrip("0").rstrip(".")
    return text if text != "-0" else "0"


_SUPERSCRIPT = str.maketrans("-0123456789", "⁻⁰¹²³⁴⁵⁶⁷⁸⁹")


def _sci(x) -> str:
    """Two significant digits in the seed's style: 2.8·10¹⁰."""
    if x == 0:
        return "0"
    mantissa, exponent = f"{float(x):.1e}".split("e")
    return f"{mantissa}·10{str(int(exponent)).translate(_SUPERSCRIPT)}"


def _sig2(x) -> str:
    """Two significant digits, no exponent: 3.4, 0.87, 10, 101."""
    x = float(x)
    decimals = max(0, 1 - math.floor(math.log10(abs(x)))) if x else 0
    return f"{x:.{decimals}f}"


def _si_bytes(n) -> str:
    """Decimal units, two significant digits, as the seed writes window KV: 2.7 MB."""
    for unit, size in (("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if n >= size:
            return f"{_sig2(n / size)} {unit}"
    return f"{_num(n)} B"


def _binary_bytes(n) -> str:
    """Binary units, two significant digits, as the seed writes KV per sequence: 0.87 GiB."""
    for unit, size in (("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size / 2:
            return f"{_sig2(n / size)} {unit}"
    return f"{_num(n)} B"


def _percent(x) -> str:
    return f"{float(x) * 100:.0f} %"


def _fraction(x: Fraction) -> str:
    return f"1/{x.denominator}" if x.numerator == 1 else f"{float(x):.3g}"


def _layers(layers: Sequence[int]) -> str:
    """'2, 8, 14' or, for long lists, '2, 4, …, 42'."""
    if len(layers) <= 4:
        return ", ".join(map(str, layers))
    return f"{layers[0]}, {layers[1]}, …, {layers[-1]}"


def _text(renderable) -> str:
    """A rich renderable as plain text (no colour, no wrapping, trailing spaces cut)."""
    console = Console(file=io.StringIO(), width=240, color_system=None, soft_wrap=True)
    with console.capture() as capture:
        console.print(renderable)
    return "\n".join(line.rstrip() for line in capture.get().splitlines())


def _table(header: Sequence[str], rows: Sequence[Sequence[str]], align: str = "") -> str:
    """A table with a rule under the header: `align` has 'l' or 'r' per column (default: first
    left, others right)."""
    align = align or "l" + "r" * (len(header) - 1)
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 1))
    for name, a in zip(header, align, strict=True):
        table.add_column(name, justify="left" if a == "l" else "right", no_wrap=True)
    for row in rows:
        table.add_row(*row)
    return _text(Padding(table, (0, 0, 0, 2)))


def _groups(items, key: Callable) -> list[list]:
    """Items grouped by `key` (layers of one kind, in order of first appearance)."""
    groups: dict = {}
    for item in items:
        groups.setdefault(key(item), []).append(item)
    return list(groups.values())


def _group_label(group) -> str:
    first = group[0]
    role = str(first.role).capitalize()
    name = f"{len(group)} {role}" if len(group) > 1 else role
    label = f"{name} ({_layers([x.layer for x in group])}), ratio {first.compress_ratio}"
    if first.is_candidate_source:
        label += ", candidate source"
    if getattr(first, "uses_candidates", False):
        label += ", in the pool"
    return label


def _fields(pairs: Sequence[tuple[str, Sequence[str]]]) -> str:
    """'label:  value' rows with the values aligned; a value may span several lines."""
    grid = Table.grid(padding=(0, 2), pad_edge=True)
    grid.add_column(no_wrap=True)
    grid.add_column(no_wrap=True)
    for label, values in pairs:
        grid.add_row(f"{label}:", "\n".join(values))
    return _text(grid)


def render_kv_sources(title: str, config: ModelConfig) -> str:
    """The seed's per-source table: entries per token, main KV and indexer K bytes per token."""
    kv = kv_bytes_per_token(config)
    rows = []
    for group in _groups(
        kv.sources,
        lambda s: (s.role, s.compress_ratio, s.is_candidate_source, s.index_row_bytes),
    ):
        sub = KVBytes(tuple(group))
        rows.append(
            [
                _group_label(group),
                _num(sub.entries_per_token),
                f"{_num(sub.main_bytes)} B",
                f"{_num(sub.index_bytes)} B" if sub.index_bytes else "—",
                f"{_num(sub.total)} B",
            ]
        )
    rows.append(
        [
            "total",
            _num(kv.entries_per_token),
            f"{_num(kv.main_bytes)} B",
            f"{_num(kv.index_bytes)} B",
            f"{_num(kv.total)} B",
        ]
    )
    return "\n".join(
        [
            f"{title}: global KV per token = main KV {_num(kv.main_bytes)} B + indexer K "
            f"{_num(kv.index_bytes)} B = {_num(kv.total)} B",
            f"  one entry: main KV {main_row_bytes(config)} B ({config.kv_format}, "
            f"D = {config.head_dim}), indexer K {index_row_bytes(config)} B "
            f"({config.index_format}, D = {config.index_head_dim})",
            _table(["KV source layers", "entries/token", "main KV", "indexer K", "total"], rows),
        ]
    )


def _row_bytes_label(kv: KVBytes) -> str:
    main = sorted({s.main_row_bytes for s in kv.sources})
    index = sorted({s.index_row_bytes for s in kv.sources if s.index_row_bytes})
    return " + ".join("/".join(map(str, b)) for b in (main, index) if b)


def render_storage_steps(steps: Sequence[StorageStep], context: int) -> str:
    """The seed's "two steps" table, with the size of the global KV at `context`."""
    rows = [
        [
            s.name,
            _num(s.kv.entries_per_token),
            _row_bytes_label(s.kv),
            f"{_num(s.kv.total)} B",
            "—" if s.factor is None else f"÷ {float(s.factor):.3g}",
            _binary_bytes(s.kv.bytes_at(context)),
        ]
        for s in steps
    ]
    header = ["step", "entries/token", "bytes/entry", "bytes/token", "vs previous"]
    overall = steps[0].kv.total / steps[-1].kv.total
    return "\n".join(
        [
            f"{steps[0].name} → {steps[-1].name}: {_num(steps[0].kv.total)} B → "
            f"{_num(steps[-1].kv.total)} B per token (÷ {_sig2(overall)}), one factor at a time",
            _table([*header, f"at {_context_short(context)}"], rows),
        ]
    )


def _context_short(context: int) -> str:
    text = format_context(context)
    return text[text.index("(") + 1 : -1] if "(" in text else text


def _bytes_approx(n) -> str:
    """'10,324 B ≈ 10 kB'; just '318 B' below a kilobyte."""
    return f"{_num(n)} B" + (f" ≈ {_si_bytes(n)}" if n >= 1000 else "")


def render_kv_extras(name: str, config: ModelConfig, context: int) -> str:
    """Global KV at `context`, what no cross-layer sharing would cost, and the window KV."""
    kv = kv_bytes_per_token(config)
    unshared = kv_bytes_per_token(without_sharing(config))
    window = window_bytes_per_sequence(config)
    at_context = kv.bytes_at(context)
    fields = [
        (
            f"global KV at {_context_short(context)} tokens",
            [f"{_num(at_context)} B ≈ {_binary_bytes(at_context)} per sequence"],
        ),
        (
            "without cross-layer sharing",
            [
                f"{len(unshared.sources)} layers with ratio > 0 each store their own entries",
                f"→ {_num(unshared.entries_per_token)} entries/token, "
                f"{_bytes_approx(unshared.total)} per token, "
                f"{float(unshared.total / kv.total):.3g}× {name}",
            ],
        ),
        (
            "window KV (not included)",
            [
                f"{config.n_layers} layers × {config.window_size} × {window_row_bytes(config)} B "
                f"({config.window_format}) = {_bytes_approx(window)} per sequence,",
                "independent of context",
            ],
        ),
    ]
    return f"{name}: KV per sequence, without sharing, window KV\n" + _fields(fields)


def render_indexer(title: str, config: ModelConfig, context: int) -> str:
    """The seed's indexer table: multiply-adds per decoded token, without and with the pool."""
    cost = indexer_cost(config, context)
    rows = []
    for group in _groups(
        cost.layers,
        lambda x: (x.role, x.compress_ratio, x.is_candidate_source, x.uses_candidates),
    ):
        first, n = group[0], len(group)
        times = f"{n} × " if n > 1 else ""
        each = " each" if n > 1 else ""
        rows.append(
            [
                _group_label(group),
                f"{first.visible_entries:,}{each}",
                f"{times}{_sci(first.macs_without_pool)}",
                f"{first.scored_with_pool:,}{each}",
                f"{times}{_sci(first.macs_with_pool)}",
            ]
        )
    rows.append(["total", "", _sci(cost.total_without_pool), "", _sci(cost.total_with_pool)])
    header = ["index source layers", "visible entries", "MACs", "scored with pool", "with pool"]
    fields = []
    n_reindex = sum(1 for x in cost.layers if x.role is Role.REINDEX)
    if n_reindex:
        fields.append(
            (
                "without the pool",
                [
                    f"{_sci(cost.total_without_pool)}, of which the {n_reindex} Reindex layers "
                    f"{_sci(cost.reindex_without_pool)} "
                    f"({_percent(cost.reindex_share_without_pool)})"
                ],
            )
        )
    pooled = [x for x in cost.layers if x.uses_candidates]
    if pooled:
        fields.append(
            (
                "with the pool",
                [
                    f"{_sci(cost.total_with_pool)} ({_percent(cost.with_pool_fraction)} of the "
                    f"above); Reindex layers {_sci(cost.reindex_without_pool)} → "
                    f"{_sci(cost.reindex_with_pool)}",
                    f"one Reindex layer: {pooled[0].scored_with_pool:,} × "
                    f"{cost.macs_per_entry:,} ≈ {_sci(pooled[0].macs_with_pool)}, "
                    f"{_fraction(cost.pool_layer_fraction)} of its full scan",
                ],
            )
        )
    fields.append(
        (
            "core attention",
            [
                f"2 × {config.n_heads} heads × ({config.index_topk} + {config.window_size}) keys "
                f"× {config.head_dim} = {cost.core_attention_macs_per_layer:,} "
                f"≈ {_sci(cost.core_attention_macs_per_layer)} per layer,",
                "independent of context",
            ],
        )
    )
    return "\n".join(
        [
            f"{title}: indexer multiply-adds (MACs) per decoded token at "
            f"{format_context(context)} tokens of context",
            f"  per scored entry: {config.index_n_heads} heads × {config.index_head_dim} dims = "
            f"{cost.macs_per_entry:,}; candidate pool: {config.candidate_topk_blocks:,} blocks × "
            f"{config.candidate_block_size} = {cost.candidate_pool_size:,} positions",
            _table(header, rows),
            _fields(fields),
        ]
    )


def render_sharded_traffic(title: str, config: ModelConfig, context: int, devices: int) -> str:
    """Bytes a device receives with every sequence sharded by position over `devices` devices:
    per decoded token (the query's device) and per training step (each device), by layer kind
    (`accounting.sharded_traffic`)."""
    traffic = sharded_traffic(config, context, devices)

    def b(x) -> str:
        return _si_bytes(x) if x else "0"

    rows = []
    for group in _groups(
        traffic.layers,
        lambda x: (x.role, x.compress_ratio, x.decode_topk, x.decode_rows, x.train_total),
    ):
        first, n = group[0], len(group)
        each = " each" if n > 1 else ""
        rows.append(
            [
                _group_label(group),
                b(first.decode_topk) + each,
                b(first.decode_rows) + each,
                b(first.train_gather) + each,
                b(first.train_scatter) + each,
                b(first.train_halo) + each,
            ]
        )
    decode_topk = sum(x.decode_topk for x in traffic.layers)
    decode_rows = sum(x.decode_rows for x in traffic.layers)
    rows.append(
        [
            "total",
            b(decode_topk),
            b(decode_rows),
            b(sum(x.train_gather for x in traffic.layers)),
            b(sum(x.train_scatter for x in traffic.layers)),
            b(sum(x.train_halo for x in traffic.layers)),
        ]
    )
    header = [
        "layers",
        "decode: top-k merge",
        "decode: remote rows",
        "train: all-gather",
        "train: reduce-scatter",
        "train: halo",
    ]
    return "\n".join(
        [
            f"{title}: bytes one device receives, sequences sharded by position over {devices} "
            f"devices, at {format_context(context)} tokens of context",
            "  decode: per decoded token and sequence; train: per step and sequence "
            "(accounting.LayerTraffic says what each column counts)",
            _table(header, rows),
            _fields(
                [
                    ("decode", [f"{_si_bytes(traffic.decode_total)} per token and sequence"]),
                    ("train", [f"{_si_bytes(traffic.train_total)} per step and sequence"]),
                ]
            ),
        ]
    )


def render_per_layer(title: str, config: ModelConfig, context: int) -> str:
    """Every layer: role, sources, global KV bytes per token it stores, indexer entries scored."""
    sources = {s.layer: s for s in kv_bytes_per_token(config).sources}
    costs = {x.layer: x for x in indexer_cost(config, context).layers}

    def cell(x, fmt: str = "") -> str:
        return "—" if x is None else format(x, fmt)

    rows = []
    for p in layer_plan(config):
        s, c = sources.get(p.layer), costs.get(p.layer)
        pool = "publishes" if p.is_candidate_source else "scores in" if p.uses_candidates else ""
        rows.append(
            [
                str(p.layer),
                str(p.role).capitalize(),
                str(p.compress_ratio),
                cell(p.kv_source),
                cell(p.topk_source),
                pool,
                "—" if s is None else f"{_num(s.main_bytes)} B",
                "—" if s is None or not s.index_bytes else f"{_num(s.index_bytes)} B",
                cell(None if c is None else c.scored_without_pool, ","),
                cell(None if c is None else c.scored_with_pool, ","),
            ]
        )
    header = [
        "layer",
        "role",
        "ratio",
        "KV from",
        "top-k from",
        "pool",
        "main KV/token",
        "indexer K/token",
        "scored",
        "scored with pool",
    ]
    return f"{title}: every layer at {format_context(context)} tokens of context\n" + _table(
        header, rows, align="rlrrrlrrrr"
    )


def render_config(title: str, config: ModelConfig, context: int, per_layer: bool = False) -> str:
    """All of one config's tables."""
    parts = [
        render_kv_sources(title, config),
        render_kv_extras(title, config, context),
        render_indexer(title, config, context),
    ]
    if per_layer:
        parts.append(render_per_layer(title, config, context))
    return "\n\n".join(parts)


def render_seed_report(context: int = DEFAULT_CONTEXT, per_layer: bool = False) -> str:
    """The seed article's tables: V4.1-Flash's 890 B, V4-Flash's 3514 B, the two steps between
    them, V4.1-Flash's KV at `context` and without sharing, and its indexer cost at `context`."""
    parts = [
        render_kv_sources("V4.1-Flash", v41_flash()),
        render_kv_sources("V4-Flash", v4_flash()),
        render_storage_steps(storage_steps(), context),
        render_kv_extras("V4.1-Flash", v41_flash(), context),
        render_indexer("V4.1-Flash", v41_flash(), context),
    ]
    if per_layer:
        parts += [
            render_per_layer("V4.1-Flash", v41_flash(), context),
            render_per_layer("V4-Flash", v4_flash(), context),
        ]
    return "\n\n".join(parts)


def _parameter_row_order(key: str) -> tuple[int, str]:
    order = {"attention": 0, "ffn": 2, "embed_and_head": 3, "total": 4}
    return (order.get(key, 1), key)


def render_parameter_counts(counts: dict[str, dict[str, int]]) -> str:
    """`v41jax params`: {preset: `nn.model.parameter_counts(...)`} as one column per preset."""
    names = list(counts)
    keys = sorted({k for c in counts.values() for k in c}, key=_parameter_row_order)
    rows = [[key, *(f"{counts[n].get(key, 0):,}" for n in names)] for key in keys]
    return "\n".join(
        [
            "parameters (counted abstractly with nnx.eval_shape; nothing is allocated)",
            _table(["", *names], rows),
            "  v41_flash's FFN is a dense placeholder: the real model's MoE is out of scope.",
        ]
    )


def _s(x) -> str:
    """Seconds in s, ms or µs, two significant digits."""
    x = float(x)
    for unit, size in (("s", 1), ("ms", 1e-3), ("µs", 1e-6)):
        if x >= size:
            return f"{_sig2(x / size)} {unit}"
    return "0" if x == 0 else f"{_sig2(x * 1e9)} ns"


def render_mesh_plan(title: str, plans: Sequence[MeshPlan], n_params: int) -> str:
    """Per number of GPUs: every data × context mesh with its memory per device, the bytes a
    device sends over NVLink and InfiniBand and the time bounds, for a training step and for a
    decoded token, then the chosen meshes and why (`accounting.plan_mesh`); `n_params` is the
    parameter count the plans were made with."""
    if not plans:
        return ""
    first = plans[0].candidates[0]
    cluster = first.cluster

    def gb(x) -> str:
        return _si_bytes(x) if x else "0"

    lines = [
        f"{title}: data × context meshes at {format_context(first.tokens)} tokens per sequence "
        f"(accounting.plan_mesh; MeshCost says what is counted)",
        f"  per GPU: {gb(cluster.hbm_bytes)} HBM, {_percent(1 - cluster.hbm_reserve)} usable "
        f"({gb(cluster.usable_bytes)}); {_sci(cluster.peak_flops)} FLOP/s bf16; NVLink "
        f"{gb(cluster.nvlink_bandwidth)}/s and InfiniBand {gb(cluster.ib_bandwidth)}/s sent; "
        f"{cluster.gpus_per_node} GPUs per node",
        "  train: one sequence per data replica per step; weights and bf16 gradients replicated, "
        "AdamW state sharded over all GPUs, residuals of every layer kept",
        "  decode: one sequence per data replica, per decoded token; bounds count bandwidth, "
        "not latency",
        f"  parameters: {n_params:,}, counted on the model (`v41jax params`)",
    ]
    if title == "v41_flash":
        lines.append(
            "  v41_flash's FFN is a dense placeholder (the real model's MoE is out of scope): its "
            "experts, and the expert parallelism they would call for, are not in these numbers."
        )
    header = [
        "data × context",
        "train memory",
        "fits",
        "NVLink/step",
        "IB/step",
        "NVLink time",
        "IB time",
        "compute",
        "decode memory",
        "NVLink/token",
        "IB/token",
        "cache read",
        "link time",
    ]
    for plan in plans:
        rows = []
        for m in plan.candidates:
            mark = " *" if m is plan.train else ""
            mark += " †" if m is plan.decode else ""
            rows.append(
                [
                    f"{m.data} × {m.context}{mark}",
                    gb(m.train_memory),
                    "yes" if m.train_fits else "no",
                    gb(m.train_intra),
                    gb(m.train_inter),
                    _s(m.train_nvlink_s),
                    _s(m.train_ib_s),
                    _s(m.train_compute_s),
                    gb(m.decode_memory),
                    gb(m.decode_intra),
                    gb(m.decode_inter),
                    _s(m.decode_hbm_s),
                    _s(m.decode_link_s),
                ]
            )
        lines += [
            "",
            f"{plan.n_devices} GPUs (* chosen for training, † for decode)",
            _table(header, rows),
        ]
        for what, chosen, reason in (
            ("train", plan.train, plan.train_reason),
            ("decode", plan.decode, plan.decode_reason),
        ):
            mesh = "none" if chosen is None else f"data={chosen.data} × context={chosen.context}"
            lines.append(
                textwrap.fill(
                    f"{what}: {mesh}: {reason}",
                    width=110,
                    initial_indent="  ",
                    subsequent_indent="    ",
                )
            )
    return "\n".join(lines)
