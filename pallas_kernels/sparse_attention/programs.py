"""The attention kernel's lowered programs, one SHA-1 each: what a change meant to leave the
kernel as it was (a review, a refactor) is checked against on any host, before a GPU is at
hand.

    python3 -m pallas_kernels.sparse_attention.programs --out after.json
    # the commit before, from a worktree of it that has this module:
    PYTHONPATH=<worktree> python3 -m pallas_kernels.sparse_attention.programs --out before.json
    python3 -m pallas_kernels.sparse_attention.programs --compare before.json after.json

Each program is the Mosaic GPU module of one call (`lowering.mosaic_gpu_modules`), lowered for
the H200 on any host (`lowering.lower_for_gpu`) at the benchmark's shape (64 heads, D = 512,
top-512 of 4,096 rows, a window of 128) with its splits given: on a CPU the call resolves one
split at any batch (the device has no SM count), so "unchanged at batch 64" without them
compares one-split programs (the twenty-sixth session found its own and the session before's
checks so). The default at 1, 2 and 4 splits (its merge in the kernel at 2, in XLA at 4 and
at 4 in the kernel when told), and each benchmark variant (`bench.MGPU_VARIANTS`) at 1 and 2.
`experiments/results/attention_programs_40cf04b.json` holds them at 40cf04b (jax 0.11.2): a
later change compares against it without checking that commit out.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import json
from pathlib import Path

import jax

from pallas_kernels import lowering
from pallas_kernels.sparse_attention import api, bench, kernel_mgpu

SHAPE = dict(heads=64, dim=512, n_kv=4096, topk=512, window=128)
"""The benchmark's shape of one query (`bench.run`'s defaults): V4.1's 64 heads, 512-dim rows,
top-512 of 4,096 rows, a window of 128."""


def programs(labels: list[str] | None = None) -> dict[str, tuple[dict, int]]:
    """(configuration as `TuningConfig` fields, batch) by name `<label>@<splits>`: the default
    ('default') and the benchmark's variants, or only `labels` of them.

    Raises:
      ValueError: a label that is neither 'default' nor a benchmark variant."""
    known = {"default": kernel_mgpu.TuningConfig(), **bench.MGPU_VARIANTS}
    if unknown := sorted(set(labels or ()) - set(known)):
        raise ValueError(f"labels: expected 'default' or a bench variant, got {unknown}")
    out = {}
    for label, config in known.items():
        if labels and label not in labels:
            continue
        fields = dataclasses.asdict(config)
        for splits in (1, 2, 4) if label == "default" else (1, 2):
            out[f"{label}@{splits}"] = ({**fields, "splits": splits}, 128 // splits)
        if label == "default":
            out["default_merge_kernel@4"] = ({**fields, "splits": 4, "merge": "kernel"}, 32)
    return out


def digest(fields: dict, batch: int) -> str:
    """The SHA-1 of the Mosaic GPU program(s) of a call with `TuningConfig(**fields)` at
    `batch` queries of `SHAPE`, or 'error: <first line>' where the configuration is refused
    or does not lower."""
    # The benchmark's inputs, abstract: their shapes and dtypes, nothing computed.
    inputs = functools.partial(bench.random_inputs, batch=batch, **SHAPE)
    args = jax.eval_shape(inputs, jax.random.key(0))
    try:
        config = api.Config(mgpu=kernel_mgpu.TuningConfig(**fields))
        attend = functools.partial(api.fp4_sparse_attention, implementation="pallas", config=config)
        texts = lowering.mosaic_gpu_modules(lowering.lower_for_gpu(attend, *args))
    except Exception as error:
        return f"error: {str(error).splitlines()[0] if str(error) else type(error).__name__}"
    return hashlib.sha1("\n".join(texts).encode()).hexdigest()


def compare(before: dict[str, str], after: dict[str, str]) -> list[str]:
    """One line per program whose digest differs, or that only one side has."""
    return [
        f"{name}: {before.get(name, 'absent')} -> {after.get(name, 'absent')}"
        for name in sorted(set(before) | set(after))
        if before.get(name) != after.get(name)
    ]


def main(argv: list[str] | None = None) -> dict[str, str] | list[str]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--labels", nargs="+", help="'default' and bench variants; default all")
    parser.add_argument("--out", type=Path, help="the digests as JSON")
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("BEFORE", "AFTER"))
    args = parser.parse_args(argv)
    if args.compare:
        before, after = (json.loads(p.read_text()) for p in args.compare)
        changed = compare(before, after)
        print("\n".join(changed) if changed else f"all {len(after)} programs the same")
        return changed
    try:
        todo = programs(args.labels)
    except ValueError as error:
        parser.error(f"--labels: {error}")
    digests = {name: digest(fields, batch) for name, (fields, batch) in todo.items()}
    for name, value in digests.items():
        print(f"{name}: {value}")
    if args.out:
        args.out.write_text(json.dumps(digests, indent=1))
    return digests


if __name__ == "__main__":
    main()
