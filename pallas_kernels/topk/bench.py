"""The top-k of the decode step on the GPU (issue 16 item 2; DESIGN §6 "How to measure").

    PYTHONPATH=. python3 -m pallas_kernels.topk.bench --out topk.json   # also prints it

`run(...)` times `pallas_kernels.topk.topk` with the definition's sort ('xla': `lax.top_k`, then
the picks sorted by position), with the sort through the best blocks ('pallas', `blocks`), with
the radix select ('pallas', one entry per pass width) and with the radix-select kernel
('pallas', `kernel`, one entry per pass width it takes: `kernel_triton.DIGIT_BITS`),
with the project's device timer (`pallas_kernels.timing.measure`: CUPTI, warm-up, medians) on
several fresh random data sets, at the three selections of a V4.1 decode step at 1 M tokens,
batch 64:

- `pool_slots`: a Reindex layer's top-512 of its pool's 2,048 blocks × 8 slots (after the
  pooled-scoring kernel: issue 16 measured this top-k at 2.5× the kernel);
- `source_blocks`: the candidate source's pool, the top 2,048 of 131,072 block scores;
- `source_block_leaves`: each of the two selections that one makes through the best blocks
  (2,048 of 16,384: the groups of 8 blocks, then the blocks of the best groups);
- `source_positions`: the candidate source's own top-512 of 1,048,576 position scores (the
  definition's selection; the route selects it as below);
- `source_own_slots`: the route's own top-512, from the 512 best blocks' 4,096 slots.

The scores are ReLU-like by default (a third of them exactly 0, a tenth −inf), so ties are as
common as in the model; `--scores distinct` draws them as a full pool's weighted sums are
(distinct, all visible). Every entry also records whether its picks equal the sort's on the
data it was timed on. Returns a plain JSON-able dict; errors are recorded, not raised.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import timing
from pallas_kernels.topk import api, kernel_triton
from v41jax import provenance

SHAPES = {
    "pool_slots": (16_384, 512),
    "source_blocks": (131_072, 2_048),
    "source_block_leaves": (16_384, 2_048),
    "source_positions": (1_048_576, 512),
    "source_own_slots": (4_096, 512),
}
"""name: (scores per query, k) at 1 M tokens, pool 2,048 blocks of 8, index_topk 512."""


SCORES = ("relu", "distinct")
"""The kinds of random scores (`random_scores`)."""


def random_scores(key, batch: int, n: int, kind: str = "relu"):
    """'relu': ReLU-like scores: normal, a third exactly 0 (ties), a tenth −inf (invisible).
    'distinct': normal only, as the pooled-scoring kernel's weighted sums over a full pool are
    (no ties, nothing invisible: the radix select's longest digit searches)."""
    if kind not in SCORES:
        raise ValueError(f"kind: expected one of {SCORES}, got {kind!r}")
    k_x, k_zero, k_inf = jax.random.split(key, 3)
    x = jax.random.normal(k_x, (batch, n), jnp.float32)
    if kind == "distinct":
        return (x,)
    x = jnp.where(jax.random.uniform(k_zero, (batch, n)) < 1 / 3, 0.0, x)
    return (jnp.where(jax.random.uniform(k_inf, (batch, n)) < 0.1, -jnp.inf, x),)


def run(
    shapes: dict[str, tuple[int, int]] = SHAPES,
    batch: int = 64,
    digit_bits: tuple[int, ...] = (2, 4, 8),
    iterations: int = 10,
    n_datasets: int = 2,
    progress: Callable[[dict], None] | None = None,
    implementation: str = "pallas",
    kernel_warps: tuple[int, ...] = (),
    kernel_segments: tuple[int, ...] = (),
    scores: str = "relu",
    kernel_row_output: bool = False,
) -> dict:
    """Times the sort, the selection through the best blocks, the radix select and the
    radix-select kernel (each of `digit_bits` they take) at each of `shapes`.

    Args:
      shapes: name → (scores per query, k).
      batch: queries (rows).
      digit_bits: the radix select's pass widths to time.
      iterations: timed runs per data set (after one warm-up).
      n_datasets: fresh random data sets per shape.
      progress: called with the partial result after every timing (e.g. to save it).
      implementation: the methods' implementation ('pallas_interpret' runs the kernel in the
        Pallas interpreter: a CPU check of this script, not a timing).
      kernel_warps: also time the kernel alone (`kernel_triton.select`) with each of these
        warps per program, at the shapes whose rows it holds whole (entries
        `kernel_{bits}bit_{warps}w`): a tuning of `kernel_triton.default_warps`.
      kernel_segments: also time the kernel alone with each row split over this many programs
        (`kernel_triton.select(segments=...)`, entries `kernel_{bits}bit_{segments}seg`).
      scores: the kind of random scores (`random_scores`).
      kernel_row_output: each `kernel_segments` entry twice, its programs writing only the
        first k slots (`select(row_output=False)`) and every slot of their partitions
        (`row_output=True`, entries `..._rows`); without it, the entries take
        `kernel_triton.default_row_output`.
    """
    out = {
        **provenance.environment(),
        "date": time.strftime("%Y-%m-%d"),
        "batch": batch,
        "scores": scores,
        "shapes": {},
    }
    for name, (n, k) in shapes.items():
        entry = {"n": n, "k": k}
        out["shapes"][name] = entry
        try:
            datasets = [
                random_scores(jax.random.key(31 * n + i), batch, n, scores)
                for i in range(n_datasets)
            ]
            jax.block_until_ready(datasets)
        except Exception as e:  # recorded in the JSON
            entry["error"] = repr(e)
            continue
        sort = jax.jit(functools.partial(api.topk, k=k, implementation="xla"))
        timing.record(entry, "xla_sort", sort, datasets, iterations)
        if progress:
            progress(out)
        want = sort(*datasets[-1])
        methods = [("blocks", {"method": "blocks"})] + [
            (f"radix_{bits}bit", {"method": "radix", "digit_bits": bits}) for bits in digit_bits
        ]
        methods += [
            (f"kernel_{bits}bit", {"method": "kernel", "digit_bits": bits})
            for bits in digit_bits
            if bits in kernel_triton.DIGIT_BITS
        ]
        interpret = implementation == "pallas_interpret"
        methods += [
            (
                f"kernel_{bits}bit_{warps}w",
                {"digit_bits": bits, "num_warps": warps, "segments": 1},  # one program per row
            )
            for bits in digit_bits
            for warps in kernel_warps
            if kernel_triton.supports(n, k, digit_bits=bits, num_warps=warps)
        ]
        methods += [
            (
                f"kernel_{bits}bit_{segments}seg" + "_rows" * rows,
                {"digit_bits": bits, "segments": segments}
                | ({"row_output": rows} if kernel_row_output else {}),
            )
            for bits in digit_bits
            for segments in kernel_segments
            for rows in (False, True)[: 1 + kernel_row_output]
            if kernel_triton.supports(n, k, digit_bits=bits, segments=segments)
        ]
        for label, method in methods:
            if "num_warps" in method or "segments" in method:
                fn = functools.partial(kernel_triton.select, interpret=interpret)
            else:
                fn = functools.partial(api.topk, implementation=implementation)
            select = jax.jit(functools.partial(fn, k=k, **method))
            timing.record(entry, label, select, datasets, iterations)
            if "median_ms" in entry[label]:
                got = select(*datasets[-1])
                entry[label]["equal_to_sort"] = bool(
                    np.array_equal(got.indices, want.indices)
                    and np.array_equal(got.scores, want.scores)
                )
                entry[label]["speedup_vs_sort"] = (
                    entry["xla_sort"].get("median_ms", float("nan")) / entry[label]["median_ms"]
                )
            if progress:
                progress(out)
        del datasets
    return out


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the JSON here (and print it)")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--digit-bits", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--datasets", type=int, default=2)
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    parser.add_argument(
        "--kernel-warps",
        type=int,
        nargs="+",
        default=[],
        choices=kernel_triton.WARPS,
        help="also time the kernel alone at these warps per program (rows it holds whole)",
    )
    parser.add_argument(
        "--kernel-segments",
        type=int,
        nargs="+",
        default=[],
        help="also time the kernel alone with each row split over this many programs",
    )
    parser.add_argument("--scores", choices=SCORES, default="relu", help="random_scores' kind")
    parser.add_argument(
        "--kernel-row-output",
        action="store_true",
        help="beside each --kernel-segments entry, the kernel writing every slot (_rows)",
    )
    args = parser.parse_args()

    save = timing.json_writer(args.out)

    result = run(
        shapes={name: SHAPES[name] for name in args.shapes},
        batch=args.batch,
        digit_bits=tuple(args.digit_bits),
        iterations=args.iterations,
        n_datasets=args.datasets,
        progress=save,
        kernel_warps=tuple(args.kernel_warps),
        kernel_segments=tuple(args.kernel_segments),
        scores=args.scores,
        kernel_row_output=args.kernel_row_output,
    )
    save(result)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
