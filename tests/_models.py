"""Small model configs that several test files share."""

from v41jax.nn import config as config_lib


def four_layer_f32(**changes) -> config_lib.ModelConfig:
    """Every selecting role in four layers of tiny(): Full at ratio 2; Full at ratio 1 and
    candidate source (blocks of 4; 2 blocks unless `changes` say otherwise); Reindex; Reuse.
    Index top-k 6, a window of 8. Float32 storage formats: nothing rounds unless a test asks, so
    two paths that sum in another order cannot land on opposite sides of a rounding boundary."""
    return config_lib.tiny().replace(
        **{
            "n_layers": 4,
            "compress_ratios": (2, 1, 1, 1),
            "kv_source_layers": (0, 1),
            "index_source_layers": (0, 1, 2),
            "candidate_source_layer": 1,
            "kv_format": "f32",
            "index_format": "f32",
            "window_format": "f32",
            "candidate_block_size": 4,
            "candidate_topk_blocks": 2,
            "index_topk": 6,
            "window_size": 8,
            **changes,
        }
    )


# The four-layer training model of the trainer's group and multi-device tests (window; Full and
# candidate source; Reindex; Reuse), `TrainConfig.model_overrides` of tiny(): a pool of 2 blocks
# of 8 that bites at 64 tokens of MQAR (`TRAIN_TASK`).
FOUR_LAYER_TRAIN = {
    "n_layers": 4,
    "compress_ratios": (0, 1, 1, 1),
    "kv_source_layers": (1,),
    "index_source_layers": (1, 2),
    "candidate_source_layer": 1,
    "candidate_topk_blocks": 2,
    "index_topk": 8,
}
TRAIN_TASK = {"seq_len": 64, "n_pairs": 4, "n_queries": 2}
