"""The candidate source's scan on the GPU (issue 16 item 1; DESIGN §6 "How to measure").

    PYTHONPATH=. python3 -m pallas_kernels.source_scan.bench --out scan.json   # also prints it

`run(...)` times, with the project's device timer (`pallas_kernels.timing.measure`: CUPTI,
warm-up, medians), on several fresh random data sets (never zeros), for a decode batch whose
every query sees its whole cache:

- `xla_scan`: the definition, `ops.pool.candidate_source_scan` (unpack and score all S rows,
  the pool's blocks, the source's own top-k): what the model's decode does today, and the
  official code's approach;
- `pallas_route`: `source_scan.candidate_source(implementation='pallas')` with V4.1's 'max'
  block score: the kernel writes only block maxima, then the selections (the own top-k rescored
  inside its best blocks);
- `pallas_route_mean`: the same with the 'mean' block score: the kernel writes every position's
  score and the selections read them (the route of every reducer but 'max');
- `pallas_block_max`: the 'max' route's kernel alone (block maxima over every block);
- `pallas_scores`: the 'mean' route's kernel alone (every position's score written);
- `selections_xla`: the definition's selections alone (`ops.pool.source_selection` on given
  scores): block scores, the top-`topk_blocks` of S/8 block scores and the top-`index_topk` of
  S scores, both by sort;
- `selections_pallas`: the route's (`api.selections(implementation='pallas')`): the same picks
  by `pallas_kernels.topk` (sorts through the best blocks by max, not of every score).

Bytes that must move: the cache's rows (S·68 B per query), q, the head weights and the
selections' output; the 'mean' route also writes and re-reads one f32 score per position
(counted in `bytes_route`). Achieved bandwidth = bytes / time, against the copy ceiling
measured in the same run. Returns a plain JSON-able dict; errors are recorded, not raised.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import timing
from pallas_kernels.pooled_scoring import kernel_mgpu
from pallas_kernels.pooled_scoring.bench import random_inputs
from pallas_kernels.source_scan import api
from v41jax import provenance
from v41jax.ops import formats, pool

BLOCK_SIZE = kernel_mgpu.BLOCK_SIZE


def run(
    contexts: tuple[int, ...] = (65536, 262144, 1048576),
    batch: int = 64,
    topk_blocks: int = 2048,
    index_topk: int = 512,
    n_heads: int = 32,
    dim: int = 128,
    iterations: int = 10,
    n_datasets: int = 2,
    copy_gbps: float | None = None,
    progress: Callable[[dict], None] | None = None,
) -> dict:
    """Times the scan's XLA definition, the kernel route, and the route's two parts.

    Args:
      contexts: cache lengths S (index keys per sequence).
      batch: decode queries (one sequence each).
      topk_blocks: the pool's blocks (V4.1: 2,048); index_topk: the source's own picks (512).
      n_heads, dim: indexer heads and head dim.
      iterations: timed runs per data set (after one warm-up).
      n_datasets: fresh random data sets per context (each holds a whole cache: 4.5 GB at
        1 M x 64).
      copy_gbps: the copy ceiling in GB/s; measured here when None.
      progress: called with the partial result after every timing (e.g. to save it).
    """
    copy = {"GBps": copy_gbps} if copy_gbps else timing.copy_ceiling()
    out = {
        **provenance.environment(),
        "date": time.strftime("%Y-%m-%d"),
        "sizes": {
            "batch": batch,
            "topk_blocks": topk_blocks,
            "index_topk": index_topk,
            "block_size": BLOCK_SIZE,
        },
        "heads": n_heads,
        "dim": dim,
        "copy": copy,
        "contexts": {},
    }
    select = dict(topk_blocks=topk_blocks, index_topk=index_topk)
    for n_pos in contexts:
        rows = batch * n_pos * formats.packed_row_bytes("mxfp4", dim)
        small = batch * (n_heads * dim * 4 + n_heads * 4 + 4)  # q, weights, lengths
        picks = batch * (topk_blocks * 4 + index_topk * 8)
        entry = {
            "n_pos": n_pos,
            "bytes": rows + small + picks,
            "bytes_route": rows + small + picks + 2 * batch * n_pos * 4,
        }
        out["contexts"][str(n_pos)] = entry
        try:
            datasets = [
                random_inputs(
                    jax.random.key(7000 * n_pos + i),
                    batch=batch,
                    n_pos=n_pos,
                    n_heads=n_heads,
                    dim=dim,
                )
                for i in range(n_datasets)
            ]
            jax.block_until_ready(datasets)
        except Exception as e:  # recorded in the JSON
            entry["error"] = repr(e)
            continue

        def timed(name, fn, data, n_bytes=None, entry=entry):
            timing.record(
                entry, name, fn, data, iterations, n_bytes=n_bytes, copy_gbps=copy["GBps"]
            )
            if progress:
                progress(out)

        def kernel_only(k_packed, q, weights, lengths, n_pos=n_pos, *, fn, listed=False):
            # The route's mode (no ids: every block), or `every_block`'s ids read from memory.
            ids = api.every_block(lengths, n_pos, BLOCK_SIZE) if listed else None
            return fn(k_packed, q, weights, ids, lengths, n_pos=n_pos, config=api.SCAN_CONFIG)

        # The definition first: its number survives a kernel failure.
        scan = functools.partial(pool.candidate_source_scan, **select)
        timed("xla_scan", jax.jit(scan), datasets, entry["bytes"])
        for name, reduce in (("pallas_route", "max"), ("pallas_route_mean", "mean")):
            route = functools.partial(
                api.candidate_source, implementation="pallas", reduce=reduce, **select
            )
            timed(name, jax.jit(route), datasets, entry["bytes"])
        route_max = functools.partial(
            api.candidate_source, implementation="pallas", reduce="max", **select
        )
        block_max_of_every_block = functools.partial(
            kernel_only, fn=kernel_mgpu.pooled_block_max_mgpu
        )
        block_max_listed = functools.partial(block_max_of_every_block, listed=True)
        for name, fn, n_out, listed in (
            ("pallas_scores", kernel_mgpu.pooled_scores_mgpu, n_pos, False),
            ("pallas_block_max", kernel_mgpu.pooled_block_max_mgpu, n_pos // BLOCK_SIZE, False),
            (
                "pallas_block_max_listed_ids",
                kernel_mgpu.pooled_block_max_mgpu,
                n_pos // BLOCK_SIZE,
                True,
            ),
        ):
            kernel = functools.partial(kernel_only, fn=fn, listed=listed)
            timed(name, jax.jit(kernel), datasets, rows + small + batch * n_out * 4)
        # A ragged batch: lengths spread evenly over (0, S] (half the cache visible on average),
        # where the kernel over every block skips the tiles past each row and the listed ids
        # (`every_block`'s) do not.
        spread = jnp.asarray((np.arange(1, batch + 1) * n_pos) // batch, jnp.int32)
        ragged = [(k, q, w, spread) for k, q, w, _ in datasets]
        for name, fn in (
            ("pallas_route_ragged", jax.jit(route_max)),
            ("pallas_block_max_ragged", jax.jit(block_max_of_every_block)),
            ("pallas_block_max_ragged_listed_ids", jax.jit(block_max_listed)),
        ):
            timed(name, fn, ragged)
        del datasets, ragged  # room for the scores: 0.27 GB per data set at 1 M x 64
        scores = [
            (
                jax.random.normal(jax.random.key(9000 * n_pos + i), (batch, n_pos)),
                jnp.full((batch,), n_pos, jnp.int32),
            )
            for i in range(n_datasets)
        ]
        for implementation in ("xla", "pallas"):
            chosen = functools.partial(api.selections, implementation=implementation, **select)
            timed(f"selections_{implementation}", jax.jit(chosen), scores)
        route_ms = entry.get("pallas_route", {}).get("median_ms")
        if route_ms and "median_ms" in entry.get("xla_scan", {}):
            entry["speedup_route_vs_xla_scan"] = entry["xla_scan"]["median_ms"] / route_ms
        del scores
    return out


TUNE_CONFIGS = tuple(
    kernel_mgpu.TuningConfig(tiles_per_cta=tiles, num_stages=stages)
    for tiles in (8, 16, 32, 64)
    for stages in (2, 3, 4, 6)
)
ABLATIONS = ("no_fetch", "no_decode")


def tune(
    n_pos: int = 1048576,
    batch: int = 64,
    n_heads: int = 32,
    dim: int = 128,
    configs: tuple[kernel_mgpu.TuningConfig, ...] = TUNE_CONFIGS,
    iterations: int = 10,
    copy_gbps: float | None = None,
    progress: Callable[[dict], None] | None = None,
    ablations: tuple[str, ...] = ABLATIONS,
) -> dict:
    """The 'max' route's kernel (`pooled_block_max_mgpu` over every block) under each tuning in
    `configs`, then, under the route's tuning (`api.SCAN_CONFIG`), the plain kernel and its
    leave-one-out variants (`ablations`, none for (): without the refills after the prologue,
    without the FP4 decode; wrong results, timing only), which say what limits it. One data
    set of `n_pos` keys × `batch` queries (4.5 GB at 1 M × 64)."""
    copy = {"GBps": copy_gbps} if copy_gbps else timing.copy_ceiling()
    rows = batch * n_pos * formats.packed_row_bytes("mxfp4", dim)
    n_bytes = rows + batch * (n_heads * dim * 4 + n_heads * 4 + 4 + n_pos // BLOCK_SIZE * 4)
    out = {
        **provenance.environment(),
        "date": time.strftime("%Y-%m-%d"),
        "n_pos": n_pos,
        "batch": batch,
        "heads": n_heads,
        "dim": dim,
        "bytes": n_bytes,
        "copy": copy,
        "default": dataclasses.asdict(api.SCAN_CONFIG),
        "configs": {},
        "ablations": {},
    }
    data = [random_inputs(jax.random.key(11), batch=batch, n_pos=n_pos, n_heads=n_heads, dim=dim)]
    jax.block_until_ready(data)

    def block_max(k_packed, q, weights, lengths, *, config, ablation=None):
        return kernel_mgpu.pooled_block_max_mgpu(
            k_packed, q, weights, None, lengths, config=config, _ablation=ablation
        )

    runs = [("configs", f"{c.tiles_per_cta}x{c.num_stages}", c, None) for c in configs]
    if ablations:
        runs += [("ablations", a, api.SCAN_CONFIG, a) for a in (None, *ablations)]
    for group, name, config, ablation in runs:
        fn = jax.jit(functools.partial(block_max, config=config, ablation=ablation))
        timing.record(
            out[group], name or "none", fn, data, iterations, n_bytes=n_bytes,
            copy_gbps=copy["GBps"],
        )  # fmt: skip
        if progress:
            progress(out)
    return out


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the JSON here (and print it)")
    parser.add_argument("--contexts", type=int, nargs="+", default=[65536, 262144, 1048576])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--datasets", type=int, default=2)
    parser.add_argument(
        "--tune-configs",
        nargs="+",
        metavar="TILESxSTAGES",
        help="with --tune: these tunings (e.g. 32x4 16x2) instead of the whole grid",
    )
    parser.add_argument(
        "--skip-ablations",
        action="store_true",
        help="with --tune: the tunings only, not the leave-one-out variants",
    )
    parser.add_argument(
        "--tune",
        action="store_true",
        help="time the 'max' route's kernel under each tuning and its leave-one-out variants "
        "at the first context (`tune`) instead",
    )
    args = parser.parse_args()

    save = timing.json_writer(args.out)
    if args.tune:
        configs = TUNE_CONFIGS
        if args.tune_configs:
            configs = tuple(
                kernel_mgpu.TuningConfig(*map(int, text.split("x"))) for text in args.tune_configs
            )
        result = tune(
            n_pos=args.contexts[0],
            batch=args.batch,
            configs=configs,
            iterations=args.iterations,
            progress=save,
            ablations=() if args.skip_ablations else ABLATIONS,
        )
        save(result)
        print(json.dumps(result, indent=1))
        return

    result = run(
        contexts=tuple(args.contexts),
        batch=args.batch,
        iterations=args.iterations,
        n_datasets=args.datasets,
        progress=save,
    )
    save(result)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
