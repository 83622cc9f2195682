"""One kernel, called a few times on fresh random data: the program a hardware profiler wraps.

    ncu --kernel-name regex:mosaic --launch-skip 1 --launch-count 1 --set full -o attention \
        python -m pallas_kernels.profile attention --batch 128

`scripts/ncu.sh` runs every target under Nsight Compute and prints its reports as text. Each
target calls its kernel `calls` times (the first is the warm-up that compiles it; profile a
later launch), at the shapes of the project's benchmarks:

- `attention`: FP4 sparse attention (`sparse_attention.bench`'s shape: 64 heads × 512, 512
  selected + 128 window keys), under the default `TuningConfig` or a variant of
  `sparse_attention.bench.MGPU_VARIANTS`;
- `pooled`: pooled scoring's scores over a pool of 2,048 blocks (`pooled_scoring.api.POOL_CONFIG`);
- `scan`: the candidate source's block maxima over every block (`source_scan.api.SCAN_CONFIG`).

Nothing is timed here: a profiler's replay changes the time, and timing is `timing.measure`'s.
"""

from __future__ import annotations

import argparse
import functools

import jax

from pallas_kernels.pooled_scoring import api as pooled_api
from pallas_kernels.pooled_scoring import bench as pooled_bench
from pallas_kernels.pooled_scoring import kernel_mgpu as pooled_kernel
from pallas_kernels.source_scan import api as scan_api
from pallas_kernels.sparse_attention import bench as attention_bench
from pallas_kernels.sparse_attention import kernel_mgpu as attention_kernel

TARGETS = ("attention", "pooled", "scan")
ATTENTION_VARIANTS = ("default", *attention_bench.MGPU_VARIANTS)
"""`attention`'s variants: the default `TuningConfig` and the benchmark's labels."""


def attention(batch: int, variant: str, calls: int, n_kv: int = 4096) -> None:
    """Calls the FP4 sparse-attention Mosaic GPU kernel `calls` times, each on fresh inputs."""
    if variant not in ATTENTION_VARIANTS:
        raise ValueError(f"variant: expected one of {ATTENTION_VARIANTS}, got {variant!r}")
    config = attention_bench.MGPU_VARIANTS.get(variant, attention_kernel.TuningConfig())
    fn = jax.jit(functools.partial(attention_kernel.fp4_sparse_attention_mgpu, config=config))
    for i in range(calls):
        args = attention_bench.random_inputs(
            jax.random.key(i), batch, heads=64, dim=512, n_kv=n_kv, topk=512, window=128
        )
        jax.block_until_ready(fn(*args))


def pooled(batch: int, calls: int, n_pos: int = 65536, n_blocks: int = 2048) -> None:
    """Calls the pooled-scoring kernel (scores of a pool of `n_blocks`) `calls` times."""
    fn = jax.jit(functools.partial(pooled_kernel.pooled_scores_mgpu, config=pooled_api.POOL_CONFIG))
    for i in range(calls):
        k_packed, q, weights, ids, lengths = pooled_bench.random_pool_inputs(
            jax.random.key(i), batch=batch, n_pos=n_pos, n_heads=32, dim=128, n_blocks=n_blocks
        )
        jax.block_until_ready(fn(k_packed, q, weights, ids, lengths))


def scan(batch: int, calls: int, n_pos: int = 262144) -> None:
    """Calls the block-maxima kernel over every block of an `n_pos`-key cache `calls` times."""
    fn = jax.jit(
        functools.partial(
            pooled_kernel.pooled_block_max_mgpu, block_ids=None, config=scan_api.SCAN_CONFIG
        )
    )
    for i in range(calls):
        k_packed, q, weights, lengths = pooled_bench.random_inputs(
            jax.random.key(i), batch=batch, n_pos=n_pos, n_heads=32, dim=128
        )
        jax.block_until_ready(fn(k_packed, q, weights, lengths=lengths))


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, checked (`scripts/ncu.sh`'s profiles are command lines of this)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("target", choices=TARGETS)
    parser.add_argument("--batch", type=int, default=None, help="default: 128 attention, 64 else")
    parser.add_argument("--variant", default="default", help="attention: a MGPU_VARIANTS label")
    parser.add_argument("--calls", type=int, default=3, help="calls, the first one the warm-up")
    args = parser.parse_args(argv)
    if args.calls < 1:
        parser.error(f"--calls: expected >= 1, got {args.calls}")
    if args.batch is not None and args.batch < 1:
        parser.error(f"--batch: expected >= 1, got {args.batch}")
    if args.target == "attention" and args.variant not in ATTENTION_VARIANTS:
        parser.error(f"--variant: expected one of {ATTENTION_VARIANTS}, got {args.variant!r}")
    if args.target != "attention" and args.variant != "default":
        parser.error(f"--variant: only for 'attention', got {args.variant!r} for {args.target!r}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    if args.target == "attention":
        attention(args.batch or 128, args.variant, args.calls)
    elif args.target == "pooled":
        pooled(args.batch or 64, args.calls)
    else:
        scan(args.batch or 64, args.calls)


if __name__ == "__main__":
    main()
