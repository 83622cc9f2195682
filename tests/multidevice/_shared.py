"""What the multi-device tests share (no device count needed to import it)."""

from tests._models import FOUR_LAYER_TRAIN, TRAIN_TASK
from v41jax import train

# Four layers (window; Full and candidate source; Reindex; Reuse), a pool that bites at 64
# tokens; one dense warm-up step, then sparse, so both stages run sharded.
CFG = train.TrainConfig(
    task="mqar",
    steps=3,
    batch_size=8,
    lr_warmup_steps=1,
    dense_warmup_steps=1,
    eval_every=3,
    eval_batches=1,
    checkpoint_every=3,
    task_overrides=TRAIN_TASK,
    model_overrides={**FOUR_LAYER_TRAIN, "kv_format": "f32"},
)


# Adam divides each gradient element by its own magnitude, so an element whose gradient is near 0
# turns a float-level difference of the sharded sum into a visible one (at most 2·lr a step);
# parameters after 3 steps agree to 1e-4 where the updates are ~1e-2. Gradients agree tighter.
ADAM_ATOL = 1e-4

# The window and the index keys unquantized. A quantizer turns float-level differences between a
# sharded and an unsharded run (each device compiles its own shapes, so a dot product may round
# differently at the last bit) into whole rounding steps where a value lies near a boundary (FP8
# window, MXFP4 keys), which says nothing about the layout: on 2026-12-02 the 8-way data-parallel
# gradient of this model was 110 times its tolerance away from one device's with the quantizers
# and 0.09 times without them (the same CPU, XLA's default code generation; 0.09 also with
# LLVM's optimizer off). The formats are tested on their own (tests/test_formats.py).
UNQUANTIZED = {"window_format": "f32", "index_format": "f32"}
# What the data-parallel comparisons train: CFG with UNQUANTIZED.
DATA_PARALLEL = CFG.replace(model_overrides={**dict(CFG.model_overrides), **UNQUANTIZED})
