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
