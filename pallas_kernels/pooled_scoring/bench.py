"""Pooled-scoring benchmark on the GPU (DESIGN §6 "How to measure").

    PYTHONPATH=. python3 -m pallas_kernels.pooled_scoring.bench   # prints the JSON

`run(...)` times, with the project's device timer (`pallas_kernels.timing.measure`: CUPTI,
warm-up, medians), on several fresh random data sets (never zeros):

- the Mosaic GPU kernel: scores only, and scores + XLA top-k (the `pooled_scores` API);
- (a) `ops.pool.full_scan_topk`: the official approach (dequantize and score all S keys, mask,
  top-k over all S);
- (b) `ops.pool.pooled_topk`: XLA gather of the pool + einsum + top-k over the pool (and its
  scores alone, `ops.pool.pooled_scores`).

Bytes that must move per query: the pool's rows (NB·8·68 B), q (as given, f32), the head
weights, the block ids and the output (the pool's f32 scores, or the top-k positions and scores).
Achieved bandwidth = those bytes / time; the fraction is against a device copy measured in the
same run (bytes read + written). Returns plain JSON-able dicts.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import timing
from pallas_kernels.pooled_scoring import api, kernel_mgpu
from v41jax import provenance
from v41jax.ops import formats, pool

BLOCK_SIZE = kernel_mgpu.BLOCK_SIZE


def random_inputs(key, *, batch: int, n_pos: int, n_heads: int, dim: int):
    """Random packed keys (random E2M1 bytes, E8M0 scales 2^-8..2^7), fake-quantized q, head
    weights and full lengths.

    The nibble bytes are drawn as 32-bit words and viewed as bytes: drawn as uint8, jax's
    (partitionable) threefry makes a 32-bit draw and its counters per byte, and the draw of a
    1 M × 64 cache took 64 GiB of temporaries, more than an 80 GB H100 holds (2026-12-06);
    as words, about 3 times the cache's 4.3 GB (`test_random_keys_are_drawn_in_words`)."""
    k_bytes, k_scales, k_q, k_w = jax.random.split(key, 4)
    words = jax.random.bits(k_bytes, (batch, n_pos, dim // 8), jnp.uint32)
    nibbles = lax.bitcast_convert_type(words, jnp.uint8).reshape(batch, n_pos, dim // 2)
    scales = jax.random.randint(k_scales, (batch, n_pos, dim // 32), 119, 135).astype(jnp.uint8)
    k_packed = jnp.concatenate([nibbles, scales], axis=-1)
    q = formats.mxfp4_fake_quant(jax.random.normal(k_q, (batch, n_heads, dim), jnp.float32))
    weights = jax.random.normal(k_w, (batch, n_heads), jnp.float32) * (dim * n_heads) ** -0.5
    return k_packed, q, weights, jnp.full((batch,), n_pos, jnp.int32)


def random_pool_inputs(key, *, batch, n_pos, n_heads, dim, n_blocks):
    """`random_inputs` and ascending distinct block ids (a random subset of the cache's
    blocks): (k_packed, q, weights, block ids, lengths)."""
    k_packed, q, weights, lengths = random_inputs(
        key, batch=batch, n_pos=n_pos, n_heads=n_heads, dim=dim
    )
    cache_blocks = n_pos // BLOCK_SIZE
    draw = jax.random.uniform(jax.random.fold_in(key, 1), (batch, cache_blocks))
    ids = jnp.sort(jnp.argsort(draw, axis=-1)[:, :n_blocks], axis=-1).astype(jnp.int32)
    return k_packed, q, weights, ids, lengths


def run(
    contexts: tuple[int, ...] = (65536, 262144, 1048576),
    batch: int = 64,
    n_blocks: int = 2048,
    topk: int = 512,
    n_heads: int = 32,
    dim: int = 128,
    iterations: int = 10,
    n_datasets: int = 3,
    configs: tuple[kernel_mgpu.TuningConfig, ...] = (api.POOL_CONFIG,),
    full_scan_max_context: int = 1048576,
    copy_gbps: float | None = None,
    progress: Callable[[dict], None] | None = None,
) -> dict:
    """Times the kernel against (a) the full scan and (b) the XLA pooled reference.

    Args:
      contexts: cache lengths S (index keys per sequence) to run.
      batch: decode queries (one sequence each).
      n_blocks: candidate blocks per query (of 8 positions).
      topk: positions selected per query.
      n_heads, dim: indexer heads and head dim.
      iterations: timed runs per data set (after one warm-up).
      n_datasets: fresh random data sets per context.
      configs: kernel tunings to time: the first everywhere (the headline), the others (scores
        only) at the largest context.
      full_scan_max_context: skip (a) above this S.
      copy_gbps: the copy ceiling in GB/s; measured here when None.
      progress: called with the partial result after every timing (e.g. to save it).

    Returns:
      A JSON-able dict: device, the copy ceiling, and per context the timings, bytes, bandwidth
      and speed-ups (errors are recorded, not raised).
    """
    copy = {"GBps": copy_gbps} if copy_gbps else timing.copy_ceiling()
    out = {
        **provenance.environment(),
        "date": time.strftime("%Y-%m-%d"),
        "sizes": {"batch": batch, "n_blocks": n_blocks, "block_size": BLOCK_SIZE, "topk": topk},
        "heads": n_heads,
        "dim": dim,
        "copy": copy,
        "configs": [dataclasses.asdict(c) for c in configs],
        "contexts": {},
    }
    pool_size = n_blocks * BLOCK_SIZE
    common = batch * (n_heads * dim * 4 + n_heads * 4 + n_blocks * 4)  # q, weights, block ids
    rows = batch * pool_size * formats.packed_row_bytes("mxfp4", dim)
    bytes_scores = rows + common + batch * pool_size * 4
    bytes_topk = rows + common + batch * topk * 8
    for n_pos in contexts:
        entry = {"n_pos": n_pos, "bytes_scores": bytes_scores, "bytes_topk": bytes_topk}
        out["contexts"][str(n_pos)] = entry
        try:
            datasets = [
                random_pool_inputs(
                    jax.random.key(1000 * n_pos + i),
                    batch=batch,
                    n_pos=n_pos,
                    n_heads=n_heads,
                    dim=dim,
                    n_blocks=n_blocks,
                )
                for i in range(n_datasets)
            ]
            jax.block_until_ready(datasets)
        except Exception as e:  # recorded in the JSON
            entry["error"] = repr(e)
            continue

        def timed(name, fn, args_of=lambda d: d, n_bytes=None, entry=entry, datasets=datasets):
            data = [args_of(d) for d in datasets]
            timing.record(
                entry, name, fn, data, iterations, n_bytes=n_bytes, copy_gbps=copy["GBps"]
            )
            if progress:
                progress(out)

        # The references first: their numbers survive a kernel failure.
        timed("xla_pool_scores", jax.jit(pool.pooled_scores), n_bytes=bytes_scores)
        timed(
            "xla_pool_topk",
            jax.jit(functools.partial(pool.pooled_topk, k=topk)),
            n_bytes=bytes_topk,
        )
        if n_pos <= full_scan_max_context:
            timed(
                "full_scan_topk",
                jax.jit(functools.partial(pool.full_scan_topk, k=topk)),
                n_bytes=bytes_topk,
            )
        config = configs[0]
        words_fn = functools.partial(kernel_mgpu.pooled_scores_mgpu, n_pos=n_pos, config=config)
        scores = jax.jit(
            functools.partial(api.pooled_scores, implementation="pallas", config=config)
        )
        timed("pallas_scores", scores, n_bytes=bytes_scores)
        # The same kernel fed the cache as 32-bit words (no uint8 → uint32 view in the call).
        timed(
            "pallas_scores_words",
            jax.jit(words_fn),
            args_of=lambda d: (kernel_mgpu.packed_words(d[0]), *d[1:]),
            n_bytes=bytes_scores,
        )
        if n_pos == max(contexts):
            # Leave-one-part-out timings (wrong results, timing only): which part limits?
            for ablation in ("no_fetch", "no_decode"):
                timed(
                    f"pallas_scores_{ablation}",
                    jax.jit(functools.partial(words_fn, _ablation=ablation)),
                    args_of=lambda d: (kernel_mgpu.packed_words(d[0]), *d[1:]),
                )
            for other in configs[1:]:
                timed(
                    f"pallas_scores[{other.tiles_per_cta},{other.num_stages}]",
                    jax.jit(
                        functools.partial(api.pooled_scores, implementation="pallas", config=other)
                    ),
                    n_bytes=bytes_scores,
                )
        picks = jax.jit(
            functools.partial(
                api.pooled_scores,
                implementation="pallas",
                topk=topk,
                config=configs[0],
                ascending_ids=True,  # the ids are sorted, as a CandidatePool's (the model's call)
            )
        )
        timed("pallas_topk", picks, n_bytes=bytes_topk)
        kernel_ms = entry.get("pallas_topk", {}).get("median_ms")
        for name in ("full_scan_topk", "xla_pool_topk"):
            if kernel_ms and "median_ms" in entry.get(name, {}):
                entry[f"speedup_vs_{name}"] = entry[name]["median_ms"] / kernel_ms
        scores_ms = entry.get("pallas_scores", {}).get("median_ms")
        if scores_ms and "median_ms" in entry.get("xla_pool_scores", {}):
            entry["speedup_scores_vs_xla_pool_scores"] = (
                entry["xla_pool_scores"]["median_ms"] / scores_ms
            )
        del datasets
    return out


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the JSON here (default: print it)")
    parser.add_argument("--contexts", type=int, nargs="+", default=[65536, 262144, 1048576])
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--datasets", type=int, default=3)
    parser.add_argument(
        "--sweep",
        nargs="*",
        default=[],
        help="extra tunings TILES,STAGES timed at the largest context",
    )
    args = parser.parse_args()
    sweep = [kernel_mgpu.TuningConfig(*map(int, c.split(","))) for c in args.sweep]
    configs = (api.POOL_CONFIG, *sweep)

    save = timing.json_writer(args.out)

    result = run(
        contexts=tuple(args.contexts),
        iterations=args.iterations,
        n_datasets=args.datasets,
        configs=configs,
        progress=save,
    )
    save(result)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
