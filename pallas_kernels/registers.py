"""What ptxas makes of the warp-specialized attention kernel at each register split: its PTX
(Mosaic GPU's dump, `h200.sh attention_ptxas`) with every `setmaxnreg.inc` set to the
consumers' count and every `setmaxnreg.dec` to the producers', assembled for sm_90a with
`ptxas -v`, and its report read back: registers at entry, stack frame, spilled bytes, the
notes ptxas adds (C75xx: a `setmaxnreg` it ignored, wgmmas it serialized) or its fatal error.

    # anywhere ptxas is on PATH, from a dump brought back from the GPU (.ptx files or a .tgz
    # of them, each named by its folder): one table row per PTX file and split
    python3 -m pallas_kernels.registers \\
        experiments/results/ptx_specialized_h100_2026-12-07e.tgz \\
        --programs ptx_specialized ptx_specialized_async_keys \\
        --splits 224/56 216/80 208/96 200/112 192/128 --out registers.json

The PTX is the same program at every split (only the two counts change), so the differences
are ptxas's alone; ptxas is the assembler on PATH, which need not be the one Mosaic GPU ran.
`--wgmma-columns N` first splits every wider wgmma into ones of N columns
(`with_wgmma_columns`): the registers of a kernel changed that way, before it is.
"""

from __future__ import annotations

import argparse
import json
import re
import tarfile
from pathlib import Path

from pallas_kernels import ptxas

_INC = re.compile(r"setmaxnreg\.inc\.sync\.aligned\.u32 \d+;")
_DEC = re.compile(r"setmaxnreg\.dec\.sync\.aligned\.u32 \d+;")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers")
_NOTE = re.compile(r"\((C75\d\d)\) (.*)")
_FATAL = re.compile(r"ptxas fatal\s*: (.*)")


def with_split(ptx: str, consumers: int, producers: int) -> str:
    """`ptx` with every `setmaxnreg.inc` asking for `consumers` registers and every
    `setmaxnreg.dec` for `producers`.

    Raises:
      ValueError: `ptx` has no `setmaxnreg.inc` or no `setmaxnreg.dec` (not a
        warp-specialized kernel's)."""
    if not _INC.search(ptx) or not _DEC.search(ptx):
        raise ValueError("ptx: expected a setmaxnreg.inc and a setmaxnreg.dec, found not both")
    ptx = _INC.sub(f"setmaxnreg.inc.sync.aligned.u32 {consumers};", ptx)
    return _DEC.sub(f"setmaxnreg.dec.sync.aligned.u32 {producers};", ptx)


_WGMMA = re.compile(
    r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k16\.f32\.bf16\.bf16 \{([^}]*)\}, ([^;]*);"
)


def with_wgmma_columns(ptx: str, columns: int) -> str:
    """`ptx` with every float32-accumulating bf16 wgmma of more than `columns` output columns
    issued as several of `columns` each, over consecutive parts of its accumulator registers:
    what ptxas makes of a kernel whose wide wgmma is split, asked of the PTX before the kernel
    is. The operands after the accumulator (descriptors, scales) are kept as they are, so the
    program computes something else; its registers are the split kernel's, its results not.

    Raises:
      ValueError: `columns` is not a multiple of 8 in [8, 256], or it does not divide the
        columns of a wgmma it splits."""
    if columns % 8 or not 8 <= columns <= 256:
        raise ValueError(f"columns: expected a multiple of 8 in [8, 256], got {columns}")

    def split(match: re.Match) -> str:
        width, accumulator, rest = int(match[1]), match[2].split(","), match[3]
        if width <= columns:
            return match[0]
        if width % columns:
            raise ValueError(f"columns: expected a divisor of the wgmma's {width}, got {columns}")
        per = len(accumulator) * columns // width
        return " ".join(
            f"wgmma.mma_async.sync.aligned.m64n{columns}k16.f32.bf16.bf16 "
            f"{{{','.join(accumulator[i : i + per])}}}, {rest};"
            for i in range(0, len(accumulator), per)
        )

    return _WGMMA.sub(split, ptx)


def assemble(ptx: str, arch: str = "sm_90a") -> dict:
    """ptxas -O3 -v's report of `ptx`: registers at entry, stack frame and spill bytes, the
    C75xx notes, or `fatal` (its first fatal line) when it refused the program.

    Raises:
      RuntimeError: ptxas is not on PATH."""
    proc = ptxas.run(ptx, "-O3", "-v", arch=arch)
    text = proc.stdout + proc.stderr
    report: dict = {"notes": [f"{m[1]} {m[2].strip()}" for m in _NOTE.finditer(text)]}
    if fatal := _FATAL.search(text):
        return report | {"fatal": fatal[1].strip()}
    frame, used = _FRAME.search(text), _USED.search(text)
    if frame is None or used is None:
        raise RuntimeError(f"ptxas -v: no register report in its output:\n{text}")
    stack, stores, loads = map(int, frame.groups())
    return report | {
        "registers": int(used[1]),
        "stack_bytes": stack,
        "spill_store_bytes": stores,
        "spill_load_bytes": loads,
    }


def read_ptx(paths: list[Path]) -> dict[str, str]:
    """PTX programs by name: a .ptx file by its parent folder's name, each .ptx member of a
    .tgz by its folder inside the archive."""
    programs = {}
    for path in paths:
        if path.suffix == ".ptx":
            programs[path.parent.name] = path.read_text()
            continue
        with tarfile.open(path) as archive:
            for member in archive.getmembers():
                if member.name.endswith(".ptx"):
                    name = Path(member.name).parent.name
                    programs[name] = archive.extractfile(member).read().decode()
    if not programs:
        raise ValueError(f"paths: expected .ptx files or archives holding some, got {paths}")
    return programs


def over_pool(row: dict) -> int | None:
    """The CTA's `setmaxnreg` pool where `row`'s split asks for more (None where it fits or
    ptxas refused the program): the pool is what the CTA's warpgroups started with, ptxas's
    registers at entry times their number (65,536 a CTA shared out: three warpgroups at 168,
    four at 128), and two of them are consumers. A split past it assembles, but its
    consumers' `setmaxnreg.inc` waits forever at run time."""
    if "registers" not in row:
        return None
    warpgroups = 65_536 // (128 * row["registers"])
    pool = warpgroups * row["registers"]
    asked = 2 * row["consumers"] + (warpgroups - 2) * row["producers"]
    return pool if asked > pool else None


def table(rows: list[dict]) -> str:
    """One line per program and split: registers at entry, stack, spills, or the error; a
    split past the CTA's register pool (`over_pool`) says so among the notes."""
    lines = [
        "| program | consumers / producers | registers at entry | stack | spill stores | "
        "spill loads | ptxas notes |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        split = f"{r['consumers']} / {r['producers']}"
        notes = r["notes"]
        if pool := over_pool(r):
            notes = [f"over the CTA's pool of {pool}: would hang in setmaxnreg.inc", *notes]
        notes = "; ".join(notes)
        program = r["program"]
        if "wgmma_columns" in r:
            program += f", wgmmas split to {r['wgmma_columns']} columns"
        if "fatal" in r:
            lines.append(f"| {program} | {split} | refused: {r['fatal']} |  |  |  | {notes} |")
            continue
        lines.append(
            f"| {program} | {split} | {r['registers']} | {r['stack_bytes']} B | "
            f"{r['spill_store_bytes']} B | {r['spill_load_bytes']} B | {notes} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", type=Path, nargs="+", help=".ptx files or .tgz archives")
    parser.add_argument(
        "--splits", nargs="+", default=["224/56", "208/96"], help="consumers/producers"
    )
    parser.add_argument("--programs", nargs="+", help="only these (folder names); default all")
    parser.add_argument(
        "--wgmma-columns",
        type=int,
        help="first split every wider wgmma into ones of this many columns (registers only)",
    )
    parser.add_argument("--out", type=Path, help="the rows as JSON")
    args = parser.parse_args(argv)
    programs = read_ptx(args.paths)
    if args.programs:
        if missing := sorted(set(args.programs) - set(programs)):
            parser.error(f"--programs: {missing} not among {sorted(programs)}")
        programs = {name: programs[name] for name in args.programs}
    splits = []
    for split in args.splits:
        try:
            consumers, producers = (int(n) for n in split.split("/"))
        except ValueError:
            parser.error(f"--splits: expected CONSUMERS/PRODUCERS such as 208/96, got {split!r}")
        splits.append((consumers, producers))
    if args.wgmma_columns:
        try:
            columns = args.wgmma_columns
            programs = {name: with_wgmma_columns(ptx, columns) for name, ptx in programs.items()}
        except ValueError as error:
            parser.error(f"--wgmma-columns: {error}")
    rows = [
        {"program": name, "consumers": c, "producers": p}
        | ({"wgmma_columns": args.wgmma_columns} if args.wgmma_columns else {})
        | assemble(with_split(ptx, c, p))
        for name, ptx in programs.items()
        for c, p in splits
    ]
    print(table(rows))
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
