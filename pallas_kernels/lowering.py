"""Lower a function for an NVIDIA GPU on any host, the CPU included: the check that a kernel's
Pallas program is one its GPU backend can express, before a GPU is at hand.

Pallas turns a kernel into Triton IR or the Mosaic GPU dialect in Python, at lowering time,
with the target's compute capability taken from the device, or from an abstract device when
one is set (`jax.sharding.AbstractDevice`). So `lower_for_gpu` on a CPU-only machine runs the
same lowering rules a GPU run would, and a kernel that uses an op or a type combination its
backend cannot lower fails here, in CI, with the error the GPU would give (the radix-select
kernel's first H200 run, 2026-12-03, failed in exactly this step: an int32 add of a boolean).

What it cannot check: the Triton and ptxas compiles that follow on a GPU (register and
shared-memory limits, unsupported PTX), and the results. Those stay the GPU tests' (`-m gpu`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

DEVICE_KIND = "NVIDIA H200"
"""The project's GPU (DESIGN: Hopper, sm_90a), as its devices name their kind."""

CUSTOM_CALLS = {"triton": "__gpu$xla.gpu.triton", "mosaic_gpu": "mosaic_gpu"}
"""The custom-call target (a prefix: Mosaic GPU's carries a version, `mosaic_gpu_v2`) that a
lowered module holds for a Pallas kernel of each GPU backend."""


def lower_for_gpu(
    fn: Callable[..., Any], *args: Any, device_kind: str = DEVICE_KIND, **kwargs: Any
) -> jax.stages.Lowered:
    """`jax.jit(fn).trace(*args, **kwargs).lower(...)` for CUDA, with `device_kind` as the
    abstract device that the Pallas GPU backends read their target from. `args` may be arrays
    or `jax.ShapeDtypeStruct`s; nothing is compiled or run. Raises what the lowering raises."""
    device = jax.sharding.AbstractDevice(device_kind=device_kind, num_cores=None, platform="gpu")
    mesh = jax.sharding.AbstractMesh((1,), ("lowering",), abstract_device=device)
    with jax.sharding.use_abstract_mesh(mesh):
        return jax.jit(fn).trace(*args, **kwargs).lower(lowering_platforms=("cuda",))


def custom_calls(lowered: jax.stages.Lowered) -> dict[str, int]:
    """How many calls of each Pallas GPU backend (`CUSTOM_CALLS`) `lowered` holds."""
    text = lowered.as_text()
    return {name: text.count(f"custom_call @{target}") for name, target in CUSTOM_CALLS.items()}
