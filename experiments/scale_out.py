"""Issue 15 item 5: what a second GPU buys, on a machine with two (or more) of them.

Three measurements, each in this one process over the first `--devices` devices:

  dp    data parallelism: the sparse-stage training step (forward, backward, AdamW, indexer
        KL) of `--preset` at `--dp-seq-len` tokens, batch `--dp-batch` on one device against
        `--dp-batch` per device on a mesh data=N (the same work per device): tokens/s of each
        and their ratio (target >= 1.8x on two GPUs).
  cp    context parallelism: the longest context one device holds (batch 1, `query_chunk`
        set), found from the compiled step's memory (`memory_analysis`: arguments + outputs +
        temporaries − aliased, against the device's memory), doubling from `--cp-start`; then
        the step at N times that context on a mesh context=N, timed, with each device's peak.
  scan  the decode candidate-source scan over MXFP4 index keys (unpack, score every position
        Σ_h w·ReLU(q_h·k), keep the best `--scan-blocks` blocks of 8 by their max): one device
        at `--scan-context` positions against N devices at N times that, the keys sharded by
        position (`ops.pool.sharded_candidate_blocks`; target: <= 1.2x the one-device time).
        The sharded pool is checked equal to the one-device pool of the same keys.

Steps and scans are timed with the host clock around `block_until_ready` (each is milliseconds
to seconds, far above dispatch; a multi-device call has no single device timer), medians over
`--steps` timed calls after one untimed call, fresh random data each call.

    PYTHONPATH=. NCCL_NVLS_ENABLE=0 python3 experiments/scale_out.py --out scale_out.json
    PYTHONPATH=. python3 experiments/scale_out.py --parts scan --out scan.json
    JAX_NUM_CPU_DEVICES=2 JAX_PLATFORMS=cpu PYTHONPATH=. python3 experiments/scale_out.py \\
        --smoke --out /tmp/scale_out.json                     # the machinery, on CPU devices

`python3 experiments/scale_out.py --print FILE` prints BENCHMARKS.md's table from the JSON.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from experiments import _common
from pallas_kernels.source_scan.bench import random_inputs
from v41jax import train
from v41jax.ops import formats, pool
from v41jax.ops.scoring import index_scores

PARTS = ("dp", "cp", "scan")
DEFAULTS = dict(
    preset="small",
    dp_seq_len=4096,
    dp_batch=8,
    cp_start=65536,
    cp_max=4194304,
    cp_chunk=2048,
    scan_context=1048576,
    scan_batch=64,
    scan_blocks=2048,
    index_heads=64,
    index_dim=128,
    steps=5,
)
SMOKE = dict(
    preset="tiny",
    dp_seq_len=128,
    dp_batch=2,
    cp_start=128,
    cp_max=1024,
    cp_chunk=64,
    scan_context=4096,
    scan_batch=2,
    scan_blocks=16,
    index_heads=4,
    index_dim=64,
    steps=2,
)
MEMORY_FRACTION = 0.9  # of the device's memory a compiled step may plan to use


def _timed(prepare: Callable[[], Callable[[], object]], steps: int) -> dict:
    """Times 1 + `steps` calls with the host clock around `block_until_ready`: each call's
    fresh data is made (and placed) by `prepare` before its clock starts; the first call
    (compilation, warm-up) is reported apart from the median of the others."""
    times = []
    for _ in range(1 + steps):
        call = prepare()
        start = time.perf_counter()
        jax.block_until_ready(call())
        times.append(time.perf_counter() - start)
    return {"first_s": times[0], "times_s": times[1:], "median_s": statistics.median(times[1:])}


# --------------------------------------------------------------------------- training steps


def _model(args) -> dict:
    """The trained model: `--preset`; with `--smoke`, tiny() on the four layers of the studies'
    smoke runs (every role a run trains; half of tiny()'s compilation)."""
    return {"preset": args.preset, "changes": dict(_common.SMOKE_LAYERS) if args.smoke else {}}


def _step(model: dict, seq_len: int, batch: int, query_chunk: int, mesh, seed: int = 0):
    """(compiled step runner, a batch maker, options) for the sparse-stage training step of
    `model` (`_model`)."""
    cfg = train.make_config(
        preset=model["preset"],
        model_changes={**model["changes"], "query_chunk": query_chunk},
        batch_size=batch,
        steps=1000,
        dense_warmup_steps=0,
    )
    model, optimizer = train.build(cfg)
    runner = train.StepRunner(model, optimizer, mesh)
    rng = np.random.default_rng(seed)
    vocab = model.config.vocab_size

    def make_batch():
        shape = (batch, seq_len)
        tokens = jnp.asarray(rng.integers(0, vocab, shape), jnp.int32)
        targets = jnp.asarray(rng.integers(0, vocab, shape), jnp.int32)
        return tokens, targets, jnp.ones(shape, bool)

    return runner, make_batch, dict(dense=False, indexer_kl_weight=cfg.indexer_kl_weight)


def planned_bytes(runner, make_batch, options) -> int:
    """What the compiled step plans to hold on one device: arguments + outputs + temporaries −
    the donated (aliased) bytes."""
    values = [v.get_raw_value() for v in runner.variables]
    tokens, targets, mask = make_batch()
    if runner.mesh is not None:
        tokens, targets, mask = jax.device_put((tokens, targets, mask), runner.split)
        with jax.set_mesh(runner.mesh):
            compiled = runner.step.lower(values, tokens, targets, mask, **options).compile()
    else:
        compiled = runner.step.lower(values, tokens, targets, mask, **options).compile()
    m = compiled.memory_analysis()
    return int(
        m.argument_size_in_bytes
        + m.output_size_in_bytes
        + m.temp_size_in_bytes
        - m.alias_size_in_bytes
    )


def _train_timing(model, seq_len, batch, query_chunk, mesh, steps) -> dict:
    runner, make_batch, options = _step(model, seq_len, batch, query_chunk, mesh)
    planned = planned_bytes(runner, make_batch, options)
    losses = []

    def prepare():
        data = jax.block_until_ready(make_batch())

        def call():
            metrics = runner(*data, **options)
            losses.append(metrics["loss"])
            return metrics

        return call

    timing = _timed(prepare, steps)
    n_devices = 1 if mesh is None else mesh.size
    return {
        "seq_len": seq_len,
        "batch": batch,
        "query_chunk": query_chunk,
        "devices": n_devices,
        "mesh": None if mesh is None else dict(mesh.shape),
        "planned_gib_per_device": planned / 2**30,
        "peak_gib_per_device": _peaks(n_devices),
        "tokens_per_s": batch * seq_len / timing["median_s"],
        "final_loss": float(losses[-1]),
        **timing,
    }


def _peaks(n_devices: int) -> list[float | None]:
    """Each device's peak bytes in use (GiB) since the process started; None where the
    platform does not say (CPU)."""
    peaks = []
    for device in jax.devices()[:n_devices]:
        stats = device.memory_stats() or {}
        peak = stats.get("peak_bytes_in_use")
        peaks.append(None if peak is None else peak / 2**30)
    return peaks


def device_memory(override_gib: float | None) -> int:
    if override_gib is not None:
        return int(override_gib * 2**30)
    limit = (jax.devices()[0].memory_stats() or {}).get("bytes_limit")
    if limit is None:
        raise ValueError("--memory-gib: this platform does not report its device memory; give it")
    return int(limit)


def data_parallel(args, n: int) -> dict:
    model = _model(args)
    one = _train_timing(model, args.dp_seq_len, args.dp_batch, 0, None, args.steps)
    mesh = train.make_mesh({"data": n})
    many = _train_timing(model, args.dp_seq_len, n * args.dp_batch, 0, mesh, args.steps)
    return {"one": one, "sharded": many, "speedup": many["tokens_per_s"] / one["tokens_per_s"]}


def context_parallel(args, n: int) -> dict:
    """The longest context one device plans to hold, then N times it over N devices."""
    memory = int(device_memory(args.memory_gib) * MEMORY_FRACTION)
    ladder, fits, seq_len, model = [], None, args.cp_start, _model(args)
    while seq_len <= args.cp_max:
        runner, make_batch, options = _step(model, seq_len, 1, args.cp_chunk, None)
        planned = planned_bytes(runner, make_batch, options)
        ladder.append({"seq_len": seq_len, "planned_gib": planned / 2**30})
        print(f"cp: {seq_len} tokens on one device plan {planned / 2**30:.1f} GiB", flush=True)
        del runner
        if planned > memory:
            break
        fits, seq_len = seq_len, 2 * seq_len
    result = {"memory_gib": memory / 2**30, "one_device_ladder": ladder, "longest_one": fits}
    if fits is None or fits == args.cp_max:
        result["error"] = (
            f"no boundary found in {args.cp_start}..{args.cp_max} tokens: widen --cp-start/--cp-max"
        )
        return result
    result["one"] = _train_timing(model, fits, 1, args.cp_chunk, None, args.steps)
    mesh = train.make_mesh({"context": n})
    result["sharded"] = _train_timing(model, n * fits, 1, args.cp_chunk, mesh, args.steps)
    return result


# --------------------------------------------------------------------------- decode scan


def _scores(keys, q, weights, lengths):
    unpacked = formats.unpack(keys, "mxfp4", q.shape[-1])
    return index_scores(q[:, None], weights[:, None], unpacked, lengths[:, None])[:, 0]


def candidate_scan(keys, q, weights, lengths, *, blocks: int):
    """The one-device scan: every position scored, the pool's block ids."""
    scores = _scores(keys, q, weights, lengths)
    return pool.select_candidate_blocks(scores, lengths, blocks, 8).block_ids


def sharded_candidate_scan(keys, q, weights, lengths, *, blocks: int, mesh, axis: str):
    """The scan with the keys sharded by position over `axis`: each device scores its own
    positions; `sharded_candidate_blocks` merges the devices' top blocks."""
    scores = jax.lax.with_sharding_constraint(
        _scores(keys, q, weights, lengths), NamedSharding(mesh, P(None, axis))
    )
    return pool.sharded_candidate_blocks(scores, lengths, blocks, 8, mesh=mesh, axis=axis).block_ids


def decode_scan(args, n: int) -> dict:
    shape = dict(batch=args.scan_batch, n_heads=args.index_heads, dim=args.index_dim)
    keys = iter(jax.random.split(jax.random.key(0), 2 * (1 + args.steps) + 1))
    one = jax.jit(functools.partial(candidate_scan, blocks=args.scan_blocks))
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:n]), ("seq",))
    sharded = jax.jit(
        functools.partial(sharded_candidate_scan, blocks=args.scan_blocks, mesh=mesh, axis="seq")
    )
    spread = NamedSharding(mesh, P(None, "seq"))
    rows = NamedSharding(mesh, P())

    def one_call():
        data = jax.block_until_ready(random_inputs(next(keys), n_pos=args.scan_context, **shape))
        return lambda: one(*data)

    def sharded_data():
        k, q, w, lens = random_inputs(next(keys), n_pos=n * args.scan_context, **shape)
        return jax.device_put(k, spread), *jax.device_put((q, w, lens), rows)

    def sharded_call():
        data = jax.block_until_ready(sharded_data())
        return lambda: sharded(*data)

    result = {
        "one": dict(context=args.scan_context, **_timed(one_call, args.steps)),
        "sharded": dict(context=n * args.scan_context, **_timed(sharded_call, args.steps)),
    }
    # Correctness: the sharded pool equals the one-device pool of the same keys.
    data = sharded_data()
    want = one(*jax.device_put(data, jax.devices()[0]))
    got = sharded(*data)
    result["pool_equal"] = bool(np.array_equal(np.asarray(got), np.asarray(want)))
    result["ratio"] = result["sharded"]["median_s"] / result["one"]["median_s"]
    for side in ("one", "sharded"):
        entry = result[side]
        entry["gbps"] = (
            (args.scan_batch * entry["context"] * (args.index_dim // 2 + args.index_dim // 32))
            / entry["median_s"]
            / 1e9
        )
    return result


# --------------------------------------------------------------------------- report


def table(report: dict) -> str:
    """BENCHMARKS.md's table of a report."""
    lines = [
        f"Commit {report['commit']}, {report['date']}, jax {report['jax']}, "
        f"{report['devices']} × {report['device']}.",
        "",
        "| measurement | one device | N devices | ratio | target |",
        "|---|---|---|---|---|",
    ]
    if "dp" in report:
        d = report["dp"]
        lines.append(
            f"| data parallel, {d['one']['seq_len']:,} tokens × batch {d['one']['batch']} per "
            f"device | {d['one']['tokens_per_s']:,.0f} tok/s | "
            f"{d['sharded']['tokens_per_s']:,.0f} tok/s | {d['speedup']:.2f}× | ≥ 1.8× |"
        )
    if "cp" in report:
        c = report["cp"]
        if "error" in c:
            lines.append(f"| context parallel | {c['error']} | | | |")
        else:
            one, many = c["one"], c["sharded"]
            peaks = [p for p in many["peak_gib_per_device"] if p is not None]
            peak = f", peak {max(peaks):.1f} GiB/device" if peaks else ""
            lines.append(
                f"| context parallel, batch 1, query_chunk {one['query_chunk']} | longest "
                f"{one['seq_len']:,} tokens: {one['tokens_per_s']:,.0f} tok/s | "
                f"{many['seq_len']:,} tokens: {many['tokens_per_s']:,.0f} tok/s{peak} | "
                f"{many['seq_len'] // one['seq_len']}× context | "
                f"2× context |"
            )
    if "scan" in report:
        s = report["scan"]
        lines.append(
            f"| decode candidate scan, batch {report['config']['scan_batch']}, pool "
            f"{report['config']['scan_blocks']} blocks | {s['one']['context']:,} positions: "
            f"{s['one']['median_s'] * 1e3:.1f} ms | {s['sharded']['context']:,} positions: "
            f"{s['sharded']['median_s'] * 1e3:.1f} ms (pool equal: {s['pool_equal']}) | "
            f"{s['ratio']:.2f}× time | ≤ 1.2× |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    parser.add_argument("--devices", type=int, default=2, help="N (the first N devices)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, for CPU devices")
    parser.add_argument("--memory-gib", type=float, help="device memory (default: reported)")
    for name, value in DEFAULTS.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(value))
    parser.add_argument("--out", type=Path)
    parser.add_argument("--print", type=Path, metavar="FILE", help="print a report's table")
    args = parser.parse_args(argv)
    if args.print:
        print(table(json.loads(args.print.read_text())))
        return 0
    if args.out is None:
        parser.error("--out: required (where the JSON goes)")
    base = SMOKE if args.smoke else DEFAULTS
    for name, value in base.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    n = args.devices
    if n < 2 or n > jax.device_count():
        parser.error(f"--devices: expected 2..{jax.device_count()} (devices here), got {n}")
    report = {
        **_common.environment(),
        "date": time.strftime("%Y-%m-%d"),
        "devices": n,
        "config": {name: getattr(args, name) for name in base}
        | {"smoke": args.smoke, "model_changes": _model(args)["changes"]},
    }

    def save():
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))

    for part, measure in (("scan", decode_scan), ("dp", data_parallel), ("cp", context_parallel)):
        if part in args.parts:
            print(f"== {part}", flush=True)
            report[part] = measure(args, n)
            save()
    print(table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
