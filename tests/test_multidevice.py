"""The multi-device tests (`tests/multidevice/`), in a process of their own with 8 simulated CPU
devices (`JAX_NUM_CPU_DEVICES=8`): jax fixes its device count when it starts, so they cannot
share this process; and a data-parallel run across two processes (`jax.distributed` on
localhost)."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from flax import nnx

from tests.multidevice._shared import ADAM_ATOL
from tests.multidevice._shared import DATA_PARALLEL as CFG
from v41jax import train

ROOT = Path(__file__).resolve().parent.parent


# tests/multidevice in two processes that xdist can run side by side.
MULTIDEVICE = {
    "data-parallel": ["tests/multidevice/test_data_parallel.py"],
    "the-rest": ["tests/multidevice", "--ignore=tests/multidevice/test_data_parallel.py"],
}


@pytest.mark.parametrize("group", sorted(MULTIDEVICE))
def test_the_multidevice_tests_pass_on_8_simulated_cpu_devices(group):
    env = dict(os.environ) | {
        "JAX_NUM_CPU_DEVICES": "8",
        "JAX_PLATFORMS": "cpu",
        "V41JAX_MULTIDEVICE": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *MULTIDEVICE[group]]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    output = done.stdout[-6000:] + done.stderr[-2000:]
    assert done.returncode == 0, output
    last = done.stdout.strip().splitlines()[-1]
    assert " passed" in last and "skipped" not in last and "failed" not in last, output


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def test_a_data_parallel_run_across_two_processes_equals_one_device(tmp_path):
    out = tmp_path / "params.npz"
    port = str(_free_port())
    env = os.environ | {
        "JAX_NUM_CPU_DEVICES": "2",
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    worker = str(ROOT / "tests" / "multidevice" / "_two_process_worker.py")
    procs = [
        subprocess.Popen(
            [sys.executable, worker, str(pid), port, str(out)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for pid in (0, 1)
    ]
    logs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(log[-3000:] for log in logs)
    got = np.load(out)
    model, optimizer = train.build(CFG)
    train.train_steps(model, optimizer, CFG, CFG.make_task(), 0, CFG.steps)
    want = {
        "/".join(map(str, p)): np.asarray(v.get_value())
        for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))
    }
    assert sorted(got.files) == sorted(want)
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-4, atol=ADAM_ATOL, err_msg=name)
