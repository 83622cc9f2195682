"""The model layer: the config and the NNX modules of the V4.1 attention stack (DESIGN §2–§3).

Imports the ops (`v41jax.ops`) and the kernels (`pallas_kernels`), never the training layer.

| module        | what it holds                                                                   |
|---------------|---------------------------------------------------------------------------------|
| `config`      | `ModelConfig`, the presets, the layer roles derived from a config (`layer_plan`) |
| `rope`        | rotary embedding on the tail dims, interleaved pairs                             |
| `compressor`  | the Compressor of a KV source (prefill and its decode buffer)                    |
| `indexer`     | the lightning indexer (queries, keys, head weights) and its KL loss             |
| `selection`   | the shared cross-layer state; scores → candidate pool → top-k of index sources  |
| `dispatch`    | where the model meets the kernels: `implementation=`, `check_kernel_config`     |
| `attention`   | the CSA2 attention layer (`__call__` for prefill, `decode`)                     |
| `blocks`      | the residual block (attention + SwiGLU) with `__call__` and `decode`            |
| `cache`       | the packed decode cache and its builders                                        |
| `model`       | `Model`, `prefill`, `decode_step`, `parameter_counts`, `with_fields`            |
"""

from v41jax.nn.attention import Attention
from v41jax.nn.blocks import Block, LayerTrace
from v41jax.nn.cache import Cache, LayerCache, init_cache
from v41jax.nn.config import (
    PRESETS,
    LayerPlan,
    ModelConfig,
    Role,
    layer_plan,
    preset,
    small,
    small_kernels,
    tiny,
    v4_flash,
    v41_flash,
)
from v41jax.nn.model import (
    Model,
    Selections,
    decode_step,
    parameter_counts,
    prefill,
    with_fields,
)
from v41jax.nn.selection import SharedState

__all__ = [
    "PRESETS",
    "Attention",
    "Block",
    "Cache",
    "LayerCache",
    "LayerPlan",
    "LayerTrace",
    "Model",
    "ModelConfig",
    "Role",
    "Selections",
    "SharedState",
    "decode_step",
    "init_cache",
    "layer_plan",
    "parameter_counts",
    "prefill",
    "preset",
    "small",
    "small_kernels",
    "tiny",
    "v4_flash",
    "v41_flash",
    "with_fields",
]
