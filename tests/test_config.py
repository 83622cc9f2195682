"""ModelConfig: presets, derived layer roles (v41_architecture.md §1) and validation messages."""

import dataclasses
from collections import Counter

import pytest

from v41jax.nn import config
from v41jax.nn.config import PRESETS, ModelConfig, Role, layer_plan

V41_FULL = (2, 8, 14, 20)
V41_REINDEX = (24, 28, 32, 36)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_construct(name):
    cfg = config.preset(name)
    assert isinstance(cfg, ModelConfig)
    assert len(cfg.layers) == cfg.n_layers


def test_unknown_preset_names_the_choices():
    with pytest.raises(ValueError, match=r"preset: expected one of .*'tiny'.*got 'huge'"):
        config.preset("huge")


def test_v41_flash_roles():
    plan = config.v41_flash().layers
    assert [p.layer for p in plan] == list(range(40))
    for p in plan:
        if p.layer in (0, 1):
            expected = Role.WINDOW
        elif p.layer in V41_FULL:
            expected = Role.FULL
        elif p.layer in V41_REINDEX:
            expected = Role.REINDEX
        else:
            expected = Role.REUSE
        assert p.role is expected, p
        assert p.is_candidate_source == (p.layer == 20), p
        assert p.uses_candidates == (p.layer in V41_REINDEX), p
    assert Counter(p.role for p in plan) == {
        Role.WINDOW: 2,
        Role.FULL: 4,
        Role.REINDEX: 4,
        Role.REUSE: 30,
    }
    assert [p.compress_ratio for p in plan] == [0, 0] + [2] * 18 + [1] * 20


@pytest.mark.parametrize(
    ("layer", "kv_source", "index_key_source", "topk_source"),
    [
        (0, None, None, None),
        (2, 2, 2, 2),
        (3, 2, None, 2),
        (7, 2, None, 2),
        (13, 8, None, 8),
        (19, 14, None, 14),
        (20, 20, 20, 20),
        (21, 20, None, 20),
        (24, 20, 20, 24),
        (25, 20, None, 24),
        (36, 20, 20, 36),
        (39, 20, None, 36),
    ],
)
def test_v41_flash_sources(layer, kv_source, index_key_source, topk_source):
    p = config.v41_flash().layers[layer]
    assert (p.kv_source, p.index_key_source, p.topk_source) == (
        kv_source,
        index_key_source,
        topk_source,
    )


def test_v41_flash_pool_size():
    assert config.v41_flash().candidate_pool_size == 16384


def test_tiny_roles():
    plan = config.tiny().layers
    assert [p.role for p in plan] == [
        Role.WINDOW,
        Role.FULL,
        Role.REUSE,
        Role.FULL,
        Role.REINDEX,
        Role.REUSE,
        Role.REINDEX,
        Role.REUSE,
    ]
    assert [p.layer for p in plan if p.is_candidate_source] == [3]
    assert [p.layer for p in plan if p.uses_candidates] == [4, 6]
    assert [p.kv_source for p in plan] == [None, 1, 1, 3, 3, 3, 3, 3]
    assert [p.topk_source for p in plan] == [None, 1, 1, 3, 4, 4, 6, 6]


def test_v4_flash_counts():
    cfg = config.v4_flash()
    plan = cfg.layers
    assert cfg.n_layers == 43
    by_role = Counter((p.role, p.compress_ratio) for p in plan)
    assert by_role == {(Role.WINDOW, 0): 2, (Role.FULL, 4): 21, (Role.DENSE, 128): 20}
    assert all(p.kv_source == p.layer for p in plan if p.role is Role.DENSE)
    assert all(p.topk_source is None for p in plan if p.role is Role.DENSE)
    assert not any(p.is_candidate_source or p.uses_candidates for p in plan)
    assert cfg.kv_format == "v4_fp8"


def test_frozen():
    cfg = config.tiny()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.n_layers = 3


def test_replace_revalidates():
    cfg = config.tiny()
    assert cfg.replace(block_score="mean").block_score == "mean"
    assert cfg.block_score == "max"
    with pytest.raises(ValueError, match=r"ModelConfig\.block_score"):
        cfg.replace(block_score="median")


def test_sequences_become_tuples():
    cfg = config.tiny().replace(kv_source_layers=[1, 3], compress_ratios=list((0, 2, 2) + (1,) * 5))
    assert cfg.kv_source_layers == (1, 3)
    assert isinstance(cfg.compress_ratios, tuple)
    assert layer_plan(cfg) == config.tiny().layers


# Each invalid change to `tiny()` and the field its message must name.
INVALID_TINY = {
    "kv source not an index source": (
        {"index_source_layers": (3, 4, 6)},
        "index_source_layers",
    ),
    "candidate source not the last kv source": (
        {"candidate_source_layer": 1},
        "candidate_source_layer",
    ),
    "reuse layer ratio differs from its kv source": (
        {"compress_ratios": (0, 2, 4, 1, 1, 1, 1, 1)},
        "compress_ratios",
    ),
    "ratio-0 layer as kv source": (
        {"compress_ratios": (0, 0, 2, 1, 1, 1, 1, 1)},
        "compress_ratios",
    ),
    "compressed layer before any kv source": (
        {"compress_ratios": (2, 2, 2, 1, 1, 1, 1, 1)},
        "kv_source_layers",
    ),
    "group size does not divide head_dim": ({"head_dim": 40}, "head_dim"),
    "group size does not divide index_head_dim": ({"index_head_dim": 48}, "index_head_dim"),
    "zero topk": ({"index_topk": 0}, "index_topk"),
    "negative topk": ({"index_topk": -1}, "index_topk"),
    "wrong compress_ratios length": ({"compress_ratios": (0, 2, 2, 1)}, "compress_ratios"),
    "negative ratio": ({"compress_ratios": (0, 2, 2, 1, 1, 1, 1, -1)}, "compress_ratios"),
    "unknown kv format": ({"kv_format": "int4"}, "kv_format"),
    "unknown index format": ({"index_format": "nvfp4"}, "index_format"),
    "unknown window format": ({"window_format": "mxfp4"}, "window_format"),
    "unknown block score": ({"block_score": "median"}, "block_score"),
    "odd rope_head_dim": ({"rope_head_dim": 15}, "rope_head_dim"),
    "rope wider than the index head": ({"rope_head_dim": 48}, "rope_head_dim"),
    "o_groups not dividing n_heads": ({"o_groups": 3}, "o_groups"),
    "unsorted kv sources": ({"kv_source_layers": (3, 1)}, "kv_source_layers"),
    "layer id out of range": ({"index_source_layers": (1, 3, 4, 6, 8)}, "index_source_layers"),
    "kv sources not a sequence": ({"kv_source_layers": 3}, "kv_source_layers"),
    "dense layer that is an index source": ({"dense_kv_layers": (1,)}, "dense_kv_layers"),
    "zero candidate block size": ({"candidate_block_size": 0}, "candidate_block_size"),
    "dense candidate source": (
        {"index_source_layers": (1,), "dense_kv_layers": (3,)},
        "candidate_source_layer",
    ),
}


@pytest.mark.parametrize("case", sorted(INVALID_TINY))
def test_validation_names_the_field(case):
    changes, field = INVALID_TINY[case]
    with pytest.raises(ValueError, match=rf"ModelConfig\.{field}: expected .*, got "):
        config.tiny().replace(**changes)


def test_row_layout_constraints_come_from_quant():
    # v4_fp8 groups the non-rope dims by 64: 512 - 32 = 480 is not a multiple of 64.
    with pytest.raises(ValueError, match=r"ModelConfig\.head_dim: .*v4_fp8"):
        config.v41_flash().replace(kv_format="v4_fp8", rope_head_dim=32)
    with pytest.raises(ValueError, match=r"ModelConfig\.index_head_dim: .*mxfp4"):
        config.tiny().replace(index_head_dim=48, rope_head_dim=16)
