"""What the pooled-scoring kernel's instructions are: its PTX (Mosaic GPU's dump), assembled
for sm_90a and counted by opcode, for the full kernel and a leave-one-out variant (NOTES.md).

    # on the GPU machine (ptxas and cuobjdump on PATH): dump, assemble, count
    PYTHONPATH=. python3 -m pallas_kernels.pooled_scoring.sass --out $OUT/sass_mix.json
    # anywhere: count SASS listings already dumped (`cuobjdump -sass` output), one per variant
    python3 -m pallas_kernels.pooled_scoring.sass --listing none=full.sass \\
        no_decode=nodec.sass --out sass_mix.json

The kernel is the source scan's block-max kernel (`pooled_block_max_mgpu` over every block,
default tuning) at a small size: the code does not depend on the cache length. Each variant
compiles in a process of its own with `MOSAIC_GPU_DUMP_PTX` and `MOSAIC_GPU_DUMP_TO` set, and
the PTX is assembled with
`ptxas -arch=sm_90a -O3`, which need not be byte for byte what Mosaic GPU's own compile produced.
The counts are static (instructions in the listing, not executed ones); the tile loop is not
unrolled, so a tile's code appears once and the difference between two variants is what the
left-out part adds to each tile, per thread.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp

from pallas_kernels.pooled_scoring import kernel_mgpu
from pallas_kernels.pooled_scoring.bench import random_inputs

VARIANTS = ("none", "no_decode", "listed_ids")
"""'none': the kernel as the source scan runs it (every block, no ids read); 'no_decode': its
leave-one-out without the FP4 decode; 'listed_ids': the same blocks listed as ids in memory
(`source_scan.every_block`), as any pool hands them (none − listed_ids < 0: what reading and
selecting the ids adds per tile)."""
# A SASS line: "/*01a0*/  @!P0 OPCODE.MODIFIERS operands ;"
_INSTRUCTION = re.compile(r"^\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[0-9T]\s+)?([A-Z][A-Z0-9_]*)")


def opcode_counts(listing: str) -> dict[str, int]:
    """Instructions per opcode (modifiers dropped: IMAD.SHL.U32 counts as IMAD) in a
    `cuobjdump -sass` listing, most frequent first."""
    counts = collections.Counter(
        m.group(1) for line in listing.splitlines() if (m := _INSTRUCTION.match(line))
    )
    return dict(counts.most_common())


def mix(listings: dict[str, str]) -> dict:
    """Each variant's total and opcode counts, and each variant's difference from 'none' (the
    full kernel) per opcode: what the left-out part costs in instructions."""
    out = {"variants": {}}
    for name, listing in listings.items():
        counts = opcode_counts(listing)
        if not counts:
            raise ValueError(f"listing {name!r}: no SASS instructions found")
        out["variants"][name] = {"total": sum(counts.values()), "opcodes": counts}
    full = out["variants"].get("none")
    if full is not None:
        for name, v in out["variants"].items():
            if name == "none":
                continue
            ops = set(full["opcodes"]) | set(v["opcodes"])
            delta = {
                op: full["opcodes"].get(op, 0) - v["opcodes"].get(op, 0)
                for op in sorted(ops)
                if full["opcodes"].get(op, 0) != v["opcodes"].get(op, 0)
            }
            out[f"none_minus_{name}"] = {"total": full["total"] - v["total"], "opcodes": delta}
    return out


def _dump_variant(variant: str) -> None:
    """Compiles and runs the block-max kernel once in this process (the parent set the dump
    variables)."""
    n_pos, batch = 65536, 4
    k, q, w, lengths = random_inputs(
        jax.random.key(0), batch=batch, n_pos=n_pos, n_heads=32, dim=128
    )
    ids = None  # every block
    if variant == "listed_ids":
        every_block = jnp.arange(n_pos // kernel_mgpu.BLOCK_SIZE, dtype=jnp.int32)
        ids = jnp.broadcast_to(every_block, (batch, every_block.size))
    ablation = None if variant in ("none", "listed_ids") else variant
    fn = functools.partial(kernel_mgpu.pooled_block_max_mgpu, _ablation=ablation)
    jax.block_until_ready(jax.jit(fn)(k, q, w, ids, lengths))


def dump_and_assemble(variants=VARIANTS) -> dict[str, str]:
    """The SASS listing of each variant: a child process compiles the kernel with the PTX dump
    on, then ptxas and cuobjdump turn the PTX into a listing."""
    listings = {}
    with tempfile.TemporaryDirectory() as tmp:
        for variant in variants:
            directory = Path(tmp) / variant
            directory.mkdir()
            env = {**os.environ, "MOSAIC_GPU_DUMP_PTX": "1", "MOSAIC_GPU_DUMP_TO": str(directory)}
            subprocess.run(
                [sys.executable, "-m", __spec__.name, "--child", variant],
                env=env,
                check=True,
                stdout=subprocess.DEVNULL,
            )
            ptx = sorted(directory.glob("*.ptx"))
            if len(ptx) != 1:
                raise RuntimeError(f"variant {variant!r}: expected one PTX dump, found {ptx}")
            cubin = directory / "kernel.cubin"
            subprocess.run(
                ["ptxas", "-arch=sm_90a", "-O3", str(ptx[0]), "-o", str(cubin)],
                check=True,
                capture_output=True,
            )
            listings[variant] = subprocess.run(
                ["cuobjdump", "-sass", str(cubin)], check=True, capture_output=True, text=True
            ).stdout
    return listings


def main(argv: list[str] | None = None) -> dict | None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument(
        "--listing",
        nargs="+",
        metavar="VARIANT=FILE",
        help="count these `cuobjdump -sass` listings instead of compiling (variant 'none' is "
        "the full kernel)",
    )
    parser.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        _dump_variant(args.child)
        return None
    if args.listing:
        listings = {}
        for item in args.listing:
            name, sep, path = item.partition("=")
            if not sep or not name or not path:
                parser.error(f"--listing: expected VARIANT=FILE, got {item!r}")
            listings[name] = Path(path).read_text()
    else:
        listings = dump_and_assemble()
    report = mix(listings)
    text = json.dumps(report, indent=1)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    print(json.dumps({k: v for k, v in report.items() if k != "variants"}, indent=1))
    return report


if __name__ == "__main__":
    main()
