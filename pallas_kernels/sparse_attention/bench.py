"""Device-side timing of FP4 sparse attention against the XLA baselines (DESIGN §6).

    python -m pallas_kernels.sparse_attention.bench     # on a GPU; prints the JSON

`run()` times, per batch size, on fresh random data (never zeros), with CUPTI
(`jax.experimental.mosaic.gpu.profiler.measure`: per-call GPU time summed over every kernel the
call launches, the small XLA ops around a Pallas kernel included) after a warm-up, median of
`iterations` calls:

- each Pallas kernel (`implementation=` of `api.fp4_sparse_attention`),
- (a) 'xla_bf16_cache': XLA over a BF16 cache (gather + bf16 einsums + fp32 softmax),
- (b) 'xla_packed': XLA over the packed FP4/FP8 cache dequantized by jnp (the reference).

Reported per entry: time, TFLOP/s (2·H·keys·2·D per query: QK^T and PV), the bytes that must move
(each selected key row once in its stored format, q read and the output written once, indices and
window flags) and that over the time, and the error against the float32 reference.
"""

from __future__ import annotations

import functools
import json
import statistics
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.sparse_attention import api, sparse_attention_mgpu
from pallas_kernels.sparse_attention.reference import (
    bf16_cache_attention,
    fp4_sparse_attention_reference,
)
from v41jax import quant


def _inputs(key, batch, heads, dim, n_kv, topk, window):
    """Fresh random inputs: normal q and caches packed on device, distinct random indices with
    a few −1 holes, ~90% valid window slots, normal sinks."""
    kq, kkv, kw, ki, kv_, ks = jax.random.split(key, 6)
    q = jax.random.normal(kq, (batch, heads, dim), jnp.bfloat16)
    pack = jax.jit(quant.pack, static_argnums=1)
    kv_packed = pack(jax.random.normal(kkv, (batch, n_kv, dim), jnp.float32), "nvfp4")
    window_packed = pack(jax.random.normal(kw, (batch, window, dim), jnp.float32), "fp8")
    order = jax.vmap(lambda k: jax.random.permutation(k, n_kv)[:topk])(jax.random.split(ki, batch))
    holes = jax.random.bernoulli(kv_, 0.02, (batch, topk))
    indices = jnp.where(holes, -1, order).astype(jnp.int32)
    window_valid = jax.random.bernoulli(ks, 0.9, (batch, window))
    sink = jax.random.normal(ks, (heads,), jnp.float32)
    return q, kv_packed, indices, window_packed, window_valid, sink


def _time(f, args, iterations):
    """(median ms, all ms, median ms of the longest kernel, output) of f(*args), CUPTI-timed."""
    from jax.experimental.mosaic.gpu import profiler

    f = jax.jit(f)
    jax.block_until_ready(f(*args))  # compile and warm up
    out, per_kernel = profiler.measure(f, iterations=iterations, aggregate=False)(*args)
    if iterations == 1:  # measure() drops the per-iteration level for a single call
        per_kernel = [per_kernel]
    totals = [sum(t for _, t in it) for it in per_kernel]
    longest = [max(t for _, t in it) for it in per_kernel]
    return statistics.median(totals), totals, statistics.median(longest), out


def _rel_err(out, ref) -> float:
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def run(
    batches: tuple[int, ...] = (64, 128),
    *,
    heads: int = 64,
    dim: int = 512,
    topk: int = 512,
    window: int = 128,
    n_kv: int = 4096,
    implementations: tuple[str, ...] = ("pallas_triton", "pallas_mgpu"),
    mgpu_variants: Mapping[str, sparse_attention_mgpu.TuningConfig] | None = None,
    iterations: int = 20,
    seed: int = 0,
    on_result: Callable[[dict], None] | None = None,
) -> dict:
    """Times the kernels and both baselines; returns a JSON-able dict (see the module docstring).

    Args:
      batches: numbers of queries (one CTA per query and 64 heads).
      heads, dim, topk, window: the V4.1 attention shape (64 × 512, 512 selected + 128 window).
      n_kv: compressed rows per query's cache; 4096 × 288 B × 128 queries ≈ 151 MB, several
        times the 50 MB L2, so the gathers come from HBM.
      implementations: Pallas backends of `api.fp4_sparse_attention` to time.
      mgpu_variants: extra Mosaic GPU configurations, timed as 'pallas_mgpu[label]'.
      iterations: timed calls per entry (after one warm-up call).
      seed: PRNG seed; each batch size draws its own data.
      on_result: called with each result entry as soon as it is measured (progress, or partial
        results when a later backend hangs).
    """
    keys = topk + window
    flops_per_query = 2 * heads * keys * 2 * dim
    qo_bytes = 2 * heads * dim * 2  # bf16 q in, bf16 output out
    index_bytes = 4 * topk + window
    packed_bytes = topk * quant.packed_row_bytes("nvfp4", dim) + window * quant.packed_row_bytes(
        "fp8", dim
    )
    results = []
    for i, batch in enumerate(batches):
        args = _inputs(jax.random.key(seed + i), batch, heads, dim, n_kv, topk, window)
        q, kv_packed, indices, window_packed, window_valid, sink = args
        reference = jax.jit(fp4_sparse_attention_reference)(*args)
        kv_bf16 = jax.jit(quant.unpack, static_argnums=(1, 2), static_argnames="dtype")(
            kv_packed, "nvfp4", dim, dtype=jnp.bfloat16
        )
        window_bf16 = jax.jit(quant.unpack, static_argnums=(1, 2), static_argnames="dtype")(
            window_packed, "fp8", dim, dtype=jnp.bfloat16
        )
        entries = [
            (
                "xla_bf16_cache",
                bf16_cache_attention,
                (q, kv_bf16, indices, window_bf16, window_valid, sink),
                topk * 2 * dim + window * 2 * dim,
            ),
            ("xla_packed", fp4_sparse_attention_reference, args, packed_bytes),
        ]
        entries += [
            (
                impl,
                functools.partial(api.fp4_sparse_attention, implementation=impl),
                args,
                packed_bytes,
            )
            for impl in implementations
        ]
        entries += [
            (
                f"pallas_mgpu[{label}]",
                functools.partial(
                    api.fp4_sparse_attention,
                    implementation="pallas_mgpu",
                    config=api.Config(mgpu=tuning),
                ),
                args,
                packed_bytes,
            )
            for label, tuning in (mgpu_variants or {}).items()
        ]
        for name, f, f_args, kv_bytes in entries:
            entry = {"batch": batch, "implementation": name}
            try:
                median_ms, all_ms, longest_ms, out = _time(f, f_args, iterations)
            except Exception as e:  # a failing backend is reported, the others still run
                entry["error"] = f"{type(e).__name__}: {str(e)[:2000]}"
            else:
                seconds = median_ms * 1e-3
                moved = batch * (kv_bytes + qo_bytes + index_bytes)
                entry.update(
                    time_us=median_ms * 1e3,
                    time_us_all=[t * 1e3 for t in all_ms],
                    longest_kernel_us=longest_ms * 1e3,
                    tflops=batch * flops_per_query / seconds / 1e12,
                    bytes=moved,
                    tb_per_s=moved / seconds / 1e12,
                    rel_err=_rel_err(out, reference),
                    finite=bool(np.isfinite(np.asarray(out, np.float32)).all()),
                )
            results.append(entry)
            if on_result is not None:
                on_result(entry)
    by = {(r["batch"], r["implementation"]): r for r in results if "time_us" in r}
    speedups = {
        f"{impl}@{batch}": {
            "vs_xla_bf16_cache": by[(batch, "xla_bf16_cache")]["time_us"] / r["time_us"],
            "vs_xla_packed": by[(batch, "xla_packed")]["time_us"] / r["time_us"],
        }
        for (batch, impl), r in by.items()
        if impl.startswith("pallas")
        and (batch, "xla_bf16_cache") in by
        and (batch, "xla_packed") in by
    }
    device = jax.devices()[0]
    return {
        "device": device.device_kind,
        "jax": jax.__version__,
        "shape": dict(heads=heads, dim=dim, topk=topk, window=window, n_kv=n_kv),
        "flops_per_query": flops_per_query,
        "iterations": iterations,
        "results": results,
        "speedups": speedups,
    }


if __name__ == "__main__":
    print(json.dumps(run(), indent=1))
