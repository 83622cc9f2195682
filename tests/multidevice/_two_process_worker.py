"""One of the two processes of `tests/test_multidevice.py`'s multi-process test:
`python _two_process_worker.py PROCESS_ID PORT OUT.npz`, with JAX_NUM_CPU_DEVICES=2. The two
processes form one jax runtime over localhost (`jax.distributed`, gloo collectives on the CPU),
train `_shared.DATA_PARALLEL` data-parallel over all 4 devices, and process 0 writes the
parameters."""

import sys

import jax

jax.config.update("jax_cpu_collectives_implementation", "gloo")
process_id, port, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
jax.distributed.initialize(f"localhost:{port}", num_processes=2, process_id=process_id)

import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from tests.multidevice._shared import DATA_PARALLEL as CFG  # noqa: E402
from v41jax import train  # noqa: E402

assert jax.process_count() == 2 and jax.device_count() == 4, (jax.process_count(), jax.devices())
mesh = train.make_mesh({"data": jax.device_count()})
model, optimizer = train.build(CFG)
train.train_steps(model, optimizer, CFG, CFG.make_task(), 0, CFG.steps, mesh=mesh)
params = nnx.to_flat_state(nnx.state(model, nnx.Param))
if process_id == 0:
    local = {
        "/".join(map(str, p)): np.asarray(v.get_value().addressable_data(0)) for p, v in params
    }
    np.savez(out, **local)
jax.distributed.shutdown()
