"""`pallas_kernels.ncu_report`: Nsight Compute's text outputs read back, on small listings made
here and on the committed profiles (whose summary NOTES.md quotes)."""

import csv
import gzip
import json
from pathlib import Path

import pytest

from pallas_kernels import ncu_report

PROFILES = Path(__file__).resolve().parent.parent / "experiments" / "results"

DETAILS = """\
  anonymous_mosaic_gpu_kernel (1, 1, 128)x(256, 1, 1), Context 1, Stream 14, Device 0, CC 9.0
    Section: GPU Speed Of Light Throughput
    ----------------------- ----------- ------------
    Metric Name             Metric Unit Metric Value
    ----------------------- ----------- ------------
    Elapsed Cycles                cycle       94,625
    Duration                         us        52.45
    Section: Launch Statistics
    Grid Size                                                    128
    Registers Per Thread             register/thread             255
    Section: Another
    Duration                         us        99.99
    OPT   Est. Speedup: 18.55%
"""


def _listing(path: Path, rows: list[tuple[str, int, int, dict[str, int]]]) -> None:
    """A SASS listing in ncu's CSV form: (sass, samples, executed, {stall reason: samples})."""
    reasons = ["stall_barrier", "stall_long_sb", "stall_math"]
    header = [
        "Address",
        "Source",
        "Warp Stall Sampling (All Samples)",
        "Warp Stall Sampling (Not-issued Samples)",
        "Instructions Executed",
        *reasons,
        *(f"{r} (Not Issued)" for r in reasons),
    ]
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "wt", newline="") as f:
        out = csv.writer(f)
        out.writerow(["Kernel Name", "anonymous_mosaic_gpu_kernel", ""])
        out.writerow(header)
        for i, (sass, samples, executed, stalls) in enumerate(rows):
            own = [stalls.get(r.removeprefix("stall_"), 0) for r in reasons]
            out.writerow([hex(16 * i), f"      {sass}", samples, samples, executed, *own, *own])


ROWS = [
    ("LDG.E.128 R4, desc[UR4][R2.64]", 1, 32, {"math": 1}),
    ("IADD3 R6, R6, 0x1, RZ", 0, 32, {}),
    ("SEL R8, R4, RZ, P0", 12, 32, {"long_sb": 12}),
    ("HGMMA.64x64x16.F32.BF16 R24, gdesc[UR8], RZ", 8, 64, {"barrier": 2}),  # 6 unlisted
    ("WARPGROUP.DEPBAR.LE gsb0, 0x0", 3, 64, {"barrier": 3}),
]


def test_details_and_stalls_read_what_ncu_writes(tmp_path):
    (tmp_path / "k_details.txt").write_text(DETAILS)
    _listing(tmp_path / "k_sass.csv.gz", ROWS)
    metrics = ncu_report.details(tmp_path / "k_details.txt")
    assert metrics["Elapsed Cycles"] == {"value": 94625.0, "unit": "cycle"}
    assert metrics["Duration"] == {"value": 52.45, "unit": "us"}  # the first section's
    assert metrics["Grid Size"] == {"value": 128.0, "unit": ""}
    assert metrics["Registers Per Thread"]["value"] == 255.0

    s = ncu_report.stalls(tmp_path / "k_sass.csv.gz", top=3, context=2)
    total = sum(r[1] for r in ROWS)
    assert (s["samples"], s["instructions"]) == (total, len(ROWS))
    assert s["reasons"] == pytest.approx(
        {"long_sb": 12 / total, "barrier": 5 / total, "unlisted": 6 / total, "math": 1 / total}
    )
    assert next(iter(s["reasons"])) == "long_sb"
    assert [t["index"] for t in s["top"]] == [2, 3, 4]  # the three largest, in program order
    sel, hgmma = s["top"][0], s["top"][1]
    assert sel["sass"] == ROWS[2][0] and sel["before"] == [ROWS[0][0], ROWS[1][0]]
    assert sel["reasons"] == {"long_sb": 1.0}
    assert hgmma["reasons"] == pytest.approx({"unlisted": 0.75, "barrier": 0.25})
    assert hgmma["executed"] == 64 and hgmma["share"] == pytest.approx(8 / total)
    executed = sum(r[2] for r in ROWS)
    assert s["executed"] == executed
    assert list(s["opcodes"])[:2] == ["HGMMA", "WARPGROUP"]  # ties keep program order
    assert s["opcodes"]["HGMMA"] == pytest.approx(64 / executed)
    assert len(s["opcodes"]) == 3  # `top`
    assert ncu_report.opcode("@!P2  LDG.E.128.CONSTANT R4, desc[UR4][R2.64]") == "LDG"
    assert ncu_report.opcode("      HMUL2 R59, R59, R24") == "HMUL2"


def test_summarize_pairs_each_profiles_files_and_prints_them(tmp_path):
    (tmp_path / "a_details.txt").write_text(DETAILS)
    _listing(tmp_path / "a_sass.csv", ROWS)
    _listing(tmp_path / "b_sass.csv.gz", ROWS[:3])
    summary = ncu_report.summarize(tmp_path, top=2)
    assert set(summary) == {"a", "b"}
    assert set(summary["a"]) == {"metrics", "stalls"} and set(summary["b"]) == {"stalls"}
    text = ncu_report.markdown(summary)
    assert "| Duration | 52.45 us |  |" in text
    assert "**b**: 13 samples; long_sb 92.3%, math 7.7%" in text
    assert "Instructions executed: 96; LDG 33.3%, IADD3 33.3%\n" in text  # top=2
    assert "| 2 | `SEL R8, R4, RZ, P0` | 12 | 92.3% | long_sb 100% |" in text


def test_bad_inputs_are_named(tmp_path):
    (tmp_path / "x_sass.csv").write_text("Kernel Name,k\nAddress,Source\n0x0,NOP\n")
    with pytest.raises(ValueError, match=r"path: .* has no .Warp Stall Sampling"):
        ncu_report.stalls(tmp_path / "x_sass.csv")
    _listing(tmp_path / "z_sass.csv", [("NOP", 0, 1, {})])
    with pytest.raises(ValueError, match="has no warp-state samples"):
        ncu_report.stalls(tmp_path / "z_sass.csv")
    with pytest.raises(ValueError, match="folder: no"):
        ncu_report.summarize(tmp_path / "absent")


@pytest.mark.parametrize(
    "folder", sorted(p for p in PROFILES.glob("ncu_*") if p.is_dir()), ids=lambda p: p.name
)
def test_committed_summaries_are_what_their_listings_give(folder):
    """The committed summary.json (NOTES.md quotes it) is `summarize` of the committed details
    and SASS listings beside it, and summary.md its `markdown`."""
    summary = ncu_report.summarize(folder)
    assert json.loads((folder / "summary.json").read_text()) == json.loads(json.dumps(summary))
    assert (folder / "summary.md").read_text().strip() == ncu_report.markdown(summary).strip()
