"""Where a measurement comes from, recorded in every report the project writes (benchmarks of
the kernel layer and the experiments alike): jax's version, the device, the commit."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import jax


def environment() -> dict:
    """Jax version, device kind and git commit (with '-dirty'), or the commit `V41JAX_COMMIT`
    names (a device copy's git metadata can lag the tree it runs); 'unknown' outside a
    checkout."""
    commit = os.environ.get("V41JAX_COMMIT")
    if not commit:
        try:
            commit = subprocess.run(
                ["git", "describe", "--always", "--dirty"],
                cwd=Path(__file__).resolve().parent,
                capture_output=True,
                text=True,
                check=True,
            ).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            commit = "unknown"
    return {"jax": jax.__version__, "device": jax.devices()[0].device_kind, "commit": commit}
