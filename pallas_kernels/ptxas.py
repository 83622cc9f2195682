"""CUDA's PTX assembler, where it is on PATH: the one place the CPU-side checks of the kernels'
PTX find and run it (`lowering.assemble_inline_ptx` on the inline programs a kernel writes,
`registers` on a whole kernel's PTX brought back from the GPU).

It imports no jax, so a table printer that reads the register report (`bench_tables.py`) starts
as fast as one that reads JSON.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

PTXAS = shutil.which("ptxas")
"""The assembler `run` calls, or None where `ptxas` is not on PATH."""


def run(ptx: str, *flags: str, arch: str = "sm_90a") -> subprocess.CompletedProcess:
    """`ptxas -arch=arch *flags` on the PTX text `ptx`, its output discarded; returns the
    finished process (return code, stdout and stderr as text) for the caller to read.

    Raises:
      RuntimeError: ptxas is not on PATH."""
    if PTXAS is None:
        raise RuntimeError("ptxas: not on PATH (CUDA's assembler; the GPU machine has it)")
    with tempfile.TemporaryDirectory() as folder:
        source = Path(folder, "program.ptx")
        source.write_text(ptx)
        command = [PTXAS, f"-arch={arch}", *flags, str(source), "-o", "/dev/null"]
        return subprocess.run(command, capture_output=True, text=True)
