"""Device-side timing of FP4 sparse attention against the XLA baselines (DESIGN §6).

    python -m pallas_kernels.sparse_attention.bench     # on a GPU; prints the JSON
    python -m pallas_kernels.sparse_attention.bench --backends mgpu --variants specialized splits1 \
        --out results.json                               # the Mosaic GPU kernel and variants

`run()` times, per batch size, on fresh random data (never zeros), with the project's device
timer (`pallas_kernels.timing.measure`: CUPTI, per-call GPU time summed over every kernel the
call launches, the small XLA ops around a Pallas kernel included, after a warm-up), median of
`iterations` calls:

- each kernel backend (`api.BACKENDS`, run as `fp4_sparse_attention(implementation='pallas')`),
  labelled 'pallas_<backend>',
- (a) 'xla_bf16_cache': XLA over a BF16 cache (gather + bf16 einsums + fp32 softmax:
  `bf16_cache_attention`, what the official code runs),
- (b) 'xla_packed': XLA over the packed FP4/FP8 cache dequantized by jnp (the op's definition).

Reported per entry: time, TFLOP/s (2·H·keys·2·D per query: QK^T and PV), the bytes that must move
(each selected key row once in its stored format, q read and the output written once, indices and
window flags) and that over the time, the error against the float32 reference, and each kernel
of the last call by name (`kernels_us`: the Pallas kernel and the XLA ops around it).
"""

from __future__ import annotations

import argparse
import functools
import json
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from pallas_kernels import timing
from pallas_kernels.sparse_attention import api, kernel_mgpu
from v41jax import provenance
from v41jax.ops import formats
from v41jax.ops.attention import packed_sparse_attention, softmax_with_sink

MGPU_VARIANTS = {
    "specialized": kernel_mgpu.TuningConfig(kernel="specialized"),
    "specialized_splits1": kernel_mgpu.TuningConfig(kernel="specialized", splits=1),
    "specialized_async": kernel_mgpu.TuningConfig(kernel="specialized", gather="async"),
    "specialized_async_keys": kernel_mgpu.TuningConfig(
        kernel="specialized", gather="async", qk="keys"
    ),
    "specialized_two_producers": kernel_mgpu.TuningConfig(
        kernel="specialized", gather="async", qk="keys", producers=2
    ),
    "specialized_two_producers_slots": kernel_mgpu.TuningConfig(
        kernel="specialized", gather="async", qk="keys", producers=2, slots="kernel"
    ),
    "specialized_two_producers_merge": kernel_mgpu.TuningConfig(
        kernel="specialized",
        gather="async",
        qk="keys",
        producers=2,
        slots="kernel",
        merge="kernel",
    ),
    "specialized_two_producers_r176": kernel_mgpu.TuningConfig(
        kernel="specialized", gather="async", qk="keys", producers=2, registers=(176, 80)
    ),
    "specialized_async_keys_r200": kernel_mgpu.TuningConfig(
        kernel="specialized", gather="async", qk="keys", registers=(200, 104)
    ),
    "specialized_async_keys_r192": kernel_mgpu.TuningConfig(
        kernel="specialized", gather="async", qk="keys", registers=(192, 120)
    ),
    "splits1": kernel_mgpu.TuningConfig(splits=1),
    "registers": kernel_mgpu.TuningConfig(kernel="exchange", gather="registers"),
    "async_gather": kernel_mgpu.TuningConfig(kernel="exchange", gather="async"),
    "q_overlap": kernel_mgpu.TuningConfig(kernel="exchange", q_overlap=True),
    "behind_pv": kernel_mgpu.TuningConfig(kernel="exchange", gather="behind_pv"),
    "behind_pv_q_overlap": kernel_mgpu.TuningConfig(
        kernel="exchange", gather="behind_pv", q_overlap=True
    ),
    "exchange": kernel_mgpu.TuningConfig(kernel="exchange"),
    "pipelined": kernel_mgpu.TuningConfig(kernel="pipelined", gather="registers"),
    "pipelined_splits1": kernel_mgpu.TuningConfig(kernel="pipelined", gather="registers", splits=1),
    "pipelined_async": kernel_mgpu.TuningConfig(kernel="pipelined", gather="async"),
    "xla_merge": kernel_mgpu.TuningConfig(merge="xla"),
    "kernel_merge": kernel_mgpu.TuningConfig(merge="kernel"),
    "xla_slots": kernel_mgpu.TuningConfig(slots="xla"),
    "heads": kernel_mgpu.TuningConfig(qk="heads"),
    "split_keys": kernel_mgpu.TuningConfig(qk="keys"),
    "split_keys_registers": kernel_mgpu.TuningConfig(qk="keys", gather="registers"),
    "merge_loop": kernel_mgpu.TuningConfig(merge_columns=64),
    "merge_unrolled": kernel_mgpu.TuningConfig(merge_columns=None),
    "no_topk_rows": kernel_mgpu.TuningConfig(kernel="exchange", ablation="no_topk_rows"),
    "no_topk_gather": kernel_mgpu.TuningConfig(kernel="exchange", ablation="no_topk_gather"),
    "no_topk_decode": kernel_mgpu.TuningConfig(kernel="exchange", ablation="no_topk_decode"),
}
"""Mosaic GPU configurations the command line can add by label (`--variants`); the default
(`pallas_mgpu`) is the two-tile kernel with its words staged by `cp.async` since 2026-12-06 (the
eleventh session). The warp-specialized kernel (its first form, at one split, with staged words,
with split keys, with two producers, and with the split keys at two register splits that keep the
producer's decode out of spills: `TuningConfig.registers`); split-KV off; the exchange kernel
(the default before) as it runs by default, with each chunk's loads at its start (its default
before the tenth session at every batch), with the staged gather (`cp.async`), with q awaited at
the first product, with the next chunk's loads behind PV (alone and with q awaited late); the
two-tile kernel with its words loaded into registers (with its splits and at one split) and
staged; the default with its splits merged in XLA (as before the twelfth session, which merged
them in the kernel; since the fourteenth, the default does so at two splits only) and merged in
the kernel at any number of splits; with its slots made by an XLA op before the kernel (as before
the thirteenth session, which made the kernel build them); with its merge in the kernel looping
over 64 columns a pass (`merge_columns`; the nineteenth session's, the default since the
twentieth) and unrolled (the default before); and the exchange kernel without the top-k rows'
gather and decode, without the gather alone, or without the decode alone (leave-one-out timings:
their outputs are wrong, their `rel_err` large)."""


def bf16_cache_attention(
    q: Float[Array, "batch head dim"],
    kv: Float[Array, "batch n_kv dim"],
    indices: Int[Array, "batch topk"],
    window: Float[Array, "batch window dim"],
    window_valid: Bool[Array, "batch window"],
    sink: Float[Array, " head"],
    *,
    scale: float | None = None,
) -> Float[Array, "batch head dim"]:
    """Baseline (a): the op as XLA runs it over a BF16 cache, the official code's precision.

    Gather the selected bf16 rows, bf16 einsums with float32 accumulation, the float32 softmax
    with the sink (`ops.attention.softmax_with_sink`), probabilities cast to bf16 before PV: the
    fast XLA path a BF16 cache allows, not the float32 definition.

    Args:
      q: [B, H, D]; kv: [B, S, D] bf16; indices: [B, K] (−1 skips); window: [B, W, D] bf16;
      window_valid: [B, W] bool; sink: [H] float32; scale: default D^-0.5.

    Returns:
      [B, H, D] float32.
    """
    dim = q.shape[-1]
    scale = dim**-0.5 if scale is None else scale
    valid = (indices >= 0) & (indices < kv.shape[1])
    selected = jnp.take_along_axis(kv, jnp.where(valid, indices, 0)[..., None], axis=1)
    keys = jnp.concatenate([window.astype(jnp.bfloat16), selected.astype(jnp.bfloat16)], axis=1)
    valid = jnp.concatenate([window_valid, valid], axis=1)
    keys = jnp.where(valid[..., None], keys, jnp.zeros((), jnp.bfloat16))
    logits = jnp.einsum(
        "bhd,bjd->bhj", q.astype(jnp.bfloat16), keys, preferred_element_type=jnp.float32
    )
    probs, _ = softmax_with_sink(logits * scale, valid[:, None, :], sink)
    return jnp.einsum(
        "bhj,bjd->bhd", probs.astype(jnp.bfloat16), keys, preferred_element_type=jnp.float32
    )


def unpacked_caches(
    kv_packed, window_packed, dim: int, *, kv_fmt: str = "nvfp4", window_fmt: str = "fp8"
):
    """The packed caches as bf16 arrays: the inputs of `bf16_cache_attention` holding the same
    (exactly representable) values, for comparing the two on one cache."""
    unpack = jax.jit(formats.unpack, static_argnums=(1, 2), static_argnames="dtype")
    return (
        unpack(kv_packed, kv_fmt, dim, dtype=jnp.bfloat16),
        unpack(window_packed, window_fmt, dim, dtype=jnp.bfloat16),
    )


def random_inputs(key, batch, heads, dim, n_kv, topk, window):
    """Fresh random inputs: normal q and caches packed on device, distinct random indices with
    a few −1 holes, ~90% valid window slots, normal sinks."""
    kq, kkv, kw, ki, kv_, ks = jax.random.split(key, 6)
    q = jax.random.normal(kq, (batch, heads, dim), jnp.bfloat16)
    pack = jax.jit(formats.pack, static_argnums=1)
    kv_packed = pack(jax.random.normal(kkv, (batch, n_kv, dim), jnp.float32), "nvfp4")
    window_packed = pack(jax.random.normal(kw, (batch, window, dim), jnp.float32), "fp8")
    order = jax.vmap(lambda k: jax.random.permutation(k, n_kv)[:topk])(jax.random.split(ki, batch))
    holes = jax.random.bernoulli(kv_, 0.02, (batch, topk))
    indices = jnp.where(holes, -1, order).astype(jnp.int32)
    window_valid = jax.random.bernoulli(ks, 0.9, (batch, window))
    sink = jax.random.normal(ks, (heads,), jnp.float32)
    return q, kv_packed, indices, window_packed, window_valid, sink


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
    backends: tuple[str, ...] = ("triton", "mgpu"),
    mgpu_variants: Mapping[str, kernel_mgpu.TuningConfig] | None = None,
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
      backends: kernel backends of `api.fp4_sparse_attention` to time (`api.BACKENDS`).
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
    packed_bytes = topk * formats.packed_row_bytes("nvfp4", dim) + window * (
        formats.packed_row_bytes("fp8", dim)
    )
    results = []
    for i, batch in enumerate(batches):
        args = random_inputs(jax.random.key(seed + i), batch, heads, dim, n_kv, topk, window)
        q, kv_packed, indices, window_packed, window_valid, sink = args
        reference = jax.jit(packed_sparse_attention)(*args)
        kv_bf16, window_bf16 = unpacked_caches(kv_packed, window_packed, dim)
        entries = [
            (
                "xla_bf16_cache",
                bf16_cache_attention,
                (q, kv_bf16, indices, window_bf16, window_valid, sink),
                topk * 2 * dim + window * 2 * dim,
            ),
            ("xla_packed", packed_sparse_attention, args, packed_bytes),
        ]
        entries += [
            (
                f"pallas_{backend}",
                functools.partial(
                    api.fp4_sparse_attention,
                    implementation="pallas",
                    config=api.Config(backend=backend),
                ),
                args,
                packed_bytes,
            )
            for backend in backends
        ]
        entries += [
            (
                f"pallas_mgpu[{label}]",
                functools.partial(
                    api.fp4_sparse_attention,
                    implementation="pallas",
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
                times, out = timing.measure(f, [f_args], iterations)
            except Exception as e:  # a failing backend is reported, the others still run
                entry["error"] = f"{type(e).__name__}: {str(e)[:2000]}"
            else:
                seconds = times["median_ms"] * 1e-3
                moved = batch * (kv_bytes + qo_bytes + index_bytes)
                entry.update(
                    time_us=times["median_ms"] * 1e3,
                    time_us_all=[t * 1e3 for t in times["times_ms"]],
                    longest_kernel_us=times["longest_kernel_ms"] * 1e3,
                    kernels_us=[(k["name"], k["ms"] * 1e3) for k in times["kernels"]],
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
    return {
        **provenance.environment(),
        "shape": dict(heads=heads, dim=dim, topk=topk, window=window, n_kv=n_kv),
        "flops_per_query": flops_per_query,
        "iterations": iterations,
        "results": results,
        "speedups": speedups,
    }


def main(argv: list[str] | None = None) -> dict:
    """The command line: `run` with the chosen batches, backends and `MGPU_VARIANTS`; prints
    the JSON and, with --out, writes it there."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--backends", nargs="+", default=list(api.BACKENDS))
    parser.add_argument("--variants", nargs="*", default=[], choices=list(MGPU_VARIANTS))
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--out", help="path of the JSON to write")
    args = parser.parse_args(argv)
    report = run(
        tuple(args.batches),
        backends=tuple(args.backends),
        mgpu_variants={label: MGPU_VARIANTS[label] for label in args.variants},
        iterations=args.iterations,
        on_result=lambda entry: print(json.dumps(entry), flush=True),
    )
    text = json.dumps(report, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(text)
    return report


if __name__ == "__main__":
    main()
