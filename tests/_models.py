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
