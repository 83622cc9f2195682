"""The multi-device tests (`tests/multidevice/`), in a process of their own with 8 simulated CPU
devices (`JAX_NUM_CPU_DEVICES=8`): jax fixes its device count when it starts, so they cannot
share this process."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_multidevice_tests_pass_on_8_simulated_cpu_devices():
    env = os.environ | {
        "JAX_NUM_CPU_DEVICES": "8",
        "JAX_PLATFORMS": "cpu",
        "V41JAX_MULTIDEVICE": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/multidevice"]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    output = done.stdout[-6000:] + done.stderr[-2000:]
    assert done.returncode == 0, output
    last = done.stdout.strip().splitlines()[-1]
    assert " passed" in last and "skipped" not in last and "failed" not in last, output
