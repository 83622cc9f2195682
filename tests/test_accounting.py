"""The seed's byte and multiply-add tables, recomputed from the presets (DESIGN §5).

Every expected value is the number as the seed article states it, compared at the rounding the
article uses; the exact values come from `v41jax.accounting`.
"""

import dataclasses
import itertools
import json
from fractions import Fraction

import pytest

from v41jax import accounting
from v41jax.nn import config
from v41jax.nn.config import Role
from v41jax.ops import formats

MIB = 2**20


def sig(x, digits: int = 2) -> float:
    """`x` rounded to `digits` significant digits (2.8e10 for 27,917,287,424)."""
    return float(f"{float(x):.{digits - 1}e}")


@pytest.fixture(scope="module")
def v41():
    return accounting.kv_bytes_per_token(config.v41_flash())


@pytest.fixture(scope="module")
def v4():
    return accounting.kv_bytes_per_token(config.v4_flash())


@pytest.fixture(scope="module")
def cost():
    return accounting.indexer_cost(config.v41_flash(), MIB)


def test_row_bytes():
    v41_flash, v4_flash = config.v41_flash(), config.v4_flash()
    assert accounting.main_row_bytes(v41_flash) == 288
    assert accounting.index_row_bytes(v41_flash) == 68
    assert accounting.window_row_bytes(v41_flash) == 528
    assert accounting.main_row_bytes(v4_flash) == 584


def test_v41_flash_890(v41):
    assert v41.total == 890
    assert (v41.main_bytes, v41.index_bytes) == (720, 170)
    assert v41.entries_per_token == Fraction(5, 2)
    encoder = [s for s in v41.sources if s.compress_ratio == 2]
    decoder = [s for s in v41.sources if s.compress_ratio == 1]
    assert [s.layer for s in encoder] == [2, 8, 14]
    assert [s.layer for s in decoder] == [20] and decoder[0].is_candidate_source
    assert sum(s.main_bytes for s in encoder) == 432
    assert sum(s.index_bytes for s in encoder) == 102
    assert (decoder[0].main_bytes, decoder[0].index_bytes) == (288, 68)


def test_v4_flash_3514(v4):
    assert round(v4.total) == 3514
    assert round(v4.main_bytes) == 3157
    assert v4.main_bytes == Fraction(12629, 4)  # 3157.25, kept exact
    assert v4.index_bytes == 357
    assert round(float(v4.entries_per_token), 2) == 5.41
    csa = [s for s in v4.sources if s.role is Role.FULL]
    hca = [s for s in v4.sources if s.role is Role.DENSE]
    assert (len(csa), len(hca)) == (21, 20)
    assert {(s.compress_ratio, s.main_row_bytes, s.index_row_bytes) for s in csa} == {(4, 584, 68)}
    assert {(s.compress_ratio, s.main_row_bytes, s.index_row_bytes) for s in hca} == {(128, 584, 0)}
    assert sum(s.main_bytes for s in csa) == 3066
    assert round(sum(s.main_bytes for s in hca)) == 91
    assert round(float(sum(s.entries_per_token for s in hca)), 2) == 0.16


def test_storage_steps():
    v4, layout, v41 = accounting.storage_steps()
    assert [s.name for s in (v4, layout, v41)] == [
        "V4-Flash",
        "V4.1 layout, V4 storage",
        "V4.1-Flash",
    ]
    assert layout.kv.total == 1630
    assert layout.kv.entries_per_token == Fraction(5, 2)
    assert v4.factor is None
    assert round(float(layout.factor), 2) == 2.16
    assert round(float(v41.factor), 2) == 1.83
    assert round(float(v4.kv.total / v41.kv.total), 1) == 3.9


def test_one_million_tokens(v41, v4):
    assert round(float(v4.bytes_at(MIB) / accounting.GIB), 1) == 3.4
    assert round(float(v41.bytes_at(MIB) / accounting.GIB), 2) == 0.87


def test_window_kv():
    window = accounting.window_bytes_per_sequence(config.v41_flash())
    assert window == 40 * 128 * 528 == 2_703_360
    assert round(float(window / 1e6), 1) == 2.7


def test_without_sharing(v41):
    unshared = accounting.kv_bytes_per_token(accounting.without_sharing(config.v41_flash()))
    assert len(unshared.sources) == 38
    assert unshared.entries_per_token == 29
    assert unshared.total == 10_324
    assert round(unshared.total / 1000) == 10  # "每 token 约 10 KB"
    assert round(float(unshared.total / v41.total), 1) == 11.6
    assert round(float(unshared.entries_per_token / v41.entries_per_token), 1) == 11.6


def test_v4_flash_is_already_unshared(v4):
    unshared = accounting.kv_bytes_per_token(accounting.without_sharing(config.v4_flash()))
    assert unshared == v4


def test_indexer_without_pool(cost):
    assert cost.macs_per_entry == 32 * 128 == 4096
    encoder = [x for x in cost.layers if x.compress_ratio == 2]
    layer20, *reindex = [x for x in cost.layers if x.compress_ratio == 1]
    assert [x.layer for x in encoder] == [2, 8, 14]
    assert layer20.layer == 20 and layer20.is_candidate_source
    assert [x.layer for x in reindex] == [24, 28, 32, 36]
    assert round(encoder[0].visible_entries, -4) == 520_000  # "各 52 万"
    assert round(layer20.visible_entries, -4) == 1_050_000  # "105 万"
    assert sig(encoder[0].macs_without_pool) == 2.1e9
    assert sig(layer20.macs_without_pool) == 4.3e9
    assert sig(cost.total_without_pool) == 2.8e10
    assert sig(cost.reindex_without_pool) == 1.7e10
    assert round(float(cost.reindex_share_without_pool), 1) == 0.6  # "占了六成"


def test_indexer_with_pool(cost):
    assert cost.candidate_pool_size == 16_384
    reindex = [x for x in cost.layers if x.role is Role.REINDEX]
    assert all(x.uses_candidates for x in reindex)
    assert {x.scored_with_pool for x in reindex} == {16_384}
    assert sig(reindex[0].macs_with_pool) == 6.7e7
    assert cost.pool_layer_fraction == Fraction(1, 64)
    assert sig(cost.reindex_with_pool) == 2.7e8
    assert sig(cost.total_with_pool) == 1.1e10
    assert round(float(cost.with_pool_fraction), 1) == 0.4  # "是没有候选池时的四成"
    full = [x for x in cost.layers if x.role is Role.FULL]
    assert all(x.scored_with_pool == x.scored_without_pool for x in full)


def test_core_attention(cost):
    assert cost.core_attention_macs_per_layer == 2 * 64 * 640 * 512
    assert sig(cost.core_attention_macs_per_layer) == 4.2e7


def test_pool_covers_short_contexts():
    cfg = config.v41_flash()
    short = accounting.indexer_cost(cfg, cfg.candidate_pool_size)
    assert short.total_with_pool == short.total_without_pool
    longer = accounting.indexer_cost(cfg, 2 * cfg.candidate_pool_size)
    assert longer.pool_layer_fraction == Fraction(1, 2)


def test_kv_format_changes_main_bytes_only(v41):
    cfg = config.v41_flash().replace(kv_format="bf16")
    kv = accounting.kv_bytes_per_token(cfg)
    assert accounting.main_row_bytes(cfg) == formats.packed_row_bytes("bf16", 512) == 1024
    assert kv.main_bytes == Fraction(5, 2) * 1024 == v41.main_bytes * 1024 / 288
    assert kv.index_bytes == v41.index_bytes


def test_tiny():
    cfg = config.tiny()
    main, index = accounting.main_row_bytes(cfg), accounting.index_row_bytes(cfg)
    kv = accounting.kv_bytes_per_token(cfg)
    assert [s.layer for s in kv.sources] == [1, 3]
    assert kv.entries_per_token == Fraction(3, 2)
    assert kv.total == Fraction(3, 2) * (main + index)
    assert accounting.window_bytes_per_sequence(cfg) == 8 * 32 * accounting.window_row_bytes(cfg)
    cost = accounting.indexer_cost(cfg, 256)
    assert [(x.layer, x.scored_without_pool, x.scored_with_pool) for x in cost.layers] == [
        (1, 128, 128),
        (3, 256, 256),
        (4, 256, 32),  # the pool: 4 blocks of 8
        (6, 256, 32),
    ]
    assert cost.macs_per_entry == 2 * 32  # index heads x index head dim
    assert accounting.config_summary(cfg, 256)["indexer"]["total_with_pool"] == 64 * (
        128 + 256 + 32 + 32
    )


def test_v4_flash_has_no_pool():
    cost = accounting.indexer_cost(config.v4_flash(), MIB)
    assert len(cost.layers) == 21
    assert cost.pool_layer_fraction is None
    assert cost.reindex_without_pool == 0
    assert cost.total_with_pool == cost.total_without_pool


@pytest.mark.parametrize(
    ("text", "tokens"),
    [("1M", MIB), ("1m", MIB), ("65536", 65_536), ("64K", 65_536), (" 2k ", 2048), ("1G", 2**30)],
)
def test_parse_context(text, tokens):
    assert accounting.parse_context(text) == tokens


@pytest.mark.parametrize("text", ["", "0", "-5", "1.5M", "1T", "M", "lots"])
def test_parse_context_rejects(text):
    with pytest.raises(ValueError, match=r"context: expected a positive number of tokens"):
        accounting.parse_context(text)


def test_indexer_cost_rejects_bad_context():
    with pytest.raises(ValueError, match=r"context: expected a positive int, got 0"):
        accounting.indexer_cost(config.tiny(), 0)


@pytest.mark.parametrize("preset", ["v41_flash", "small", "tiny"])
def test_sequence_sharded_traffic(preset):
    c = config.preset(preset)
    plan = config.layer_plan(c)
    context = 2**20
    assert accounting.sharded_traffic(c, context, 1).decode_total == 0
    assert accounting.sharded_traffic(c, context, 1).train_total == 0
    selecting = [p for p in plan if p.topk_source == p.layer]
    pairs = {(p.kv_source, p.topk_source) for p in plan if p.kv_source is not None}
    main = accounting.main_row_bytes(c)
    for n in (2, 8, 512):
        t = accounting.sharded_traffic(c, context, n)
        remote = Fraction(n - 1, n)
        # The all-gather moves every stored global-KV byte but the device's own slice: the
        # seed's bytes per token (890 B for V4.1-Flash) times the context.
        gather = sum(x.train_gather for x in t.layers)
        assert gather == accounting.kv_bytes_per_token(c).total * context * remote
        # Every selecting layer merges n - 1 lists of index_topk pairs; the candidate source
        # also n - 1 lists of its blocks.
        merge = sum(x.decode_topk for x in t.layers)
        lists = len(selecting) * c.index_topk + c.candidate_topk_blocks
        assert merge == (n - 1) * lists * accounting.PAIR_BYTES
        # Remote rows: once per distinct (KV source, top-k source), n - 1 of n of the picks.
        rows = sum(x.decode_rows for x in t.layers)
        assert rows == len(pairs) * remote * c.index_topk * main
        assert t.decode_total == merge + rows
        reuse = [x for x in t.layers if x.role is Role.REUSE]
        assert all(x.train_gather == x.train_scatter == 0 for x in reuse)
    with pytest.raises(ValueError, match="n_devices: expected a positive int"):
        accounting.sharded_traffic(c, context, 0)


# --------------------------------------------------------------------------- mesh plan


@pytest.fixture(scope="module")
def v41_params():
    from v41jax.nn.model import parameter_counts

    return parameter_counts(config.v41_flash())["total"]


def context_part(m: accounting.MeshCost) -> Fraction:
    """A mesh's training bytes minus the gradient sum: what the context axis sends."""
    return (
        m.train_intra
        + m.train_inter
        - sum(accounting.gradient_sync_bytes(m.param_bytes // accounting.PARAM_BYTES, m.n_devices))
    )


@pytest.mark.parametrize(("tokens", "ratio", "cap"), [(37, 1, None), (37, 2, None), (64, 3, 5)])
def test_visible_sum_is_the_sum_over_positions(tokens, ratio, cap):
    brute = sum(min(cap or tokens, (p + 1) // ratio) for p in range(tokens))
    assert accounting._visible_sum(tokens, ratio, cap) == brute


def test_training_flops_tie_to_the_per_token_costs():
    c = config.tiny()
    tokens = 300  # past the window, the top-k and the candidate pool
    flops = accounting.training_flops(c, 1000, tokens)
    # The index scores: the decode-time cost of every position, summed.
    per_position = sum(accounting.indexer_cost(c, p + 1).total_with_pool for p in range(tokens))
    assert flops.indexer == 2 * per_position
    compressed = sum(1 for r in c.compress_ratios if r)
    window_only = c.n_layers - compressed
    core = accounting.core_attention_macs_per_layer(c)
    window = 2 * c.n_heads * c.window_size * c.head_dim
    assert flops.attention == 6 * tokens * (compressed * core + window_only * window)
    assert flops.matmul == 6 * (1000 - c.vocab_size * c.dim) * tokens
    assert flops.total == flops.matmul + flops.attention + flops.indexer


def test_mesh_memory_ties_to_independent_counts(v41_params):
    c, tokens = config.v41_flash(), MIB
    kv = accounting.kv_bytes_per_token(c).total * tokens
    for n in (8, 64):
        plan = accounting.plan_mesh(c, v41_params, n, tokens)
        assert [m.context for m in plan.candidates] == [2**i for i in range(n.bit_length())]
        for m in plan.candidates:
            assert m.data * m.context == n
            assert m.param_bytes == m.grad_bytes == v41_params * 2
            assert m.optimizer_bytes * n == v41_params * 12
            assert m.kv_bytes == kv / m.context
            assert m.kv_bytes + m.kv_gathered_bytes == kv
            assert m.activation_bytes * m.context == c.n_layers * c.dim * 2 * tokens
            window = c.n_layers * c.window_size * accounting.window_row_bytes(c)
            assert m.decode_memory == m.param_bytes + m.kv_bytes + window
            traffic = accounting.sharded_traffic(c, tokens, m.context)
            assert context_part(m) == traffic.train_total
            assert m.decode_intra + m.decode_inter == traffic.decode_total
            flops = accounting.training_flops(c, v41_params, tokens).total
            assert m.train_flops * m.context == flops
            assert m.decode_read * m.context == accounting.decode_read_bytes(c, tokens)


def test_gradient_sync_in_one_node_and_across_nodes():
    p = 1000
    intra, inter = accounting.gradient_sync_bytes(p, 8)
    assert (intra, inter) == (2 * Fraction(7, 8) * 2 * p, 0)
    intra, inter = accounting.gradient_sync_bytes(p, 64)
    assert intra == 2 * Fraction(7, 8) * 2 * p
    assert inter == 2 * Fraction(7, 8) * 2 * p / 8  # 8 nodes, each GPU its 1/8 slice
    assert accounting.gradient_sync_bytes(p, 1) == (0, 0)


def test_context_traffic_stays_in_the_node_up_to_eight(v41_params):
    c = config.v41_flash()
    for m in accounting.plan_mesh(c, v41_params, 512).candidates:
        grad_inter = accounting.gradient_sync_bytes(v41_params, 512)[1]
        if m.context <= 8:
            assert m.train_inter == grad_inter and m.decode_inter == 0
        else:
            assert m.train_inter > grad_inter and m.decode_inter > 0


def test_more_context_shards_less_memory_more_traffic(v41_params):
    c = config.v41_flash()
    meshes = accounting.plan_mesh(c, v41_params, 512).candidates
    for small, large in itertools.pairwise(meshes):
        assert large.kv_bytes < small.kv_bytes
        assert large.train_memory < small.train_memory
        assert large.decode_memory < small.decode_memory
        assert large.train_compute_s < small.train_compute_s
        assert context_part(large) > context_part(small)
        assert large.decode_intra + large.decode_inter > small.decode_intra + small.decode_inter


@pytest.mark.parametrize("n", [8, 64, 512])
def test_the_chosen_mesh_is_the_smallest_context_that_fits(v41_params, n):
    plan = accounting.plan_mesh(config.v41_flash(), v41_params, n)
    for chosen, fits in ((plan.train, "train_fits"), (plan.decode, "decode_fits")):
        assert chosen is not None and getattr(chosen, fits)
        assert not any(getattr(m, fits) for m in plan.candidates if m.context < chosen.context)
    assert plan.train.train_memory <= accounting.H200.usable_bytes
    assert f"context={plan.train.context}" in plan.train_reason
    assert f"data={plan.decode.data} replicas" in plan.decode_reason


def test_a_mesh_that_does_not_fit_is_never_chosen(v41_params):
    c = config.v41_flash()
    meshes = accounting.plan_mesh(c, v41_params, 64).candidates
    # HBM between the needs of context 8 and 16: only 16 and more fit.
    usable = (meshes[3].train_memory + meshes[4].train_memory) / 2
    cluster = dataclasses.replace(accounting.H200, hbm_bytes=usable, hbm_reserve=Fraction(0))
    plan = accounting.plan_mesh(c, v41_params, 64, cluster=cluster)
    assert plan.train.context == 16 and plan.train.train_fits
    assert not meshes[3].train_memory <= cluster.usable_bytes
    tiny_hbm = dataclasses.replace(accounting.H200, hbm_bytes=10**9)
    none = accounting.plan_mesh(c, v41_params, 8, cluster=tiny_hbm)
    assert none.train is None and none.decode is None
    assert none.train_reason.startswith("no mesh fits")


@pytest.mark.parametrize(
    ("data", "context", "match"),
    [(3, 4, r"data × context: expected at most 8 GPUs or whole nodes"), (0, 8, "data:")],
)
def test_mesh_cost_rejects_bad_meshes(v41_params, data, context, match):
    with pytest.raises(ValueError, match=match):
        accounting.mesh_cost(config.v41_flash(), v41_params, data, context)


def test_cli_mesh_prints_the_plan(capsys, v41_params):
    from v41jax import cli

    assert cli.main(["mesh"]) == 0
    out = capsys.readouterr().out
    for n in (8, 64, 512):
        plan = accounting.plan_mesh(config.v41_flash(), v41_params, n)
        assert f"{n} GPUs (* chosen for training" in out
        assert f"{plan.train.data} × {plan.train.context} *" in out
        assert f"train: data={plan.train.data} × context={plan.train.context}:" in out
        assert f"decode: data={plan.decode.data} × context={plan.decode.context}:" in out
    assert cli.main(["mesh", "--devices", "16", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    plan = accounting.plan_mesh(config.v41_flash(), v41_params, 16)
    assert data["n_params"] == v41_params
    assert data["plans"] == accounting.mesh_summary([plan])


@pytest.mark.parametrize("value", ["12", "0", "8,x", "", "8,,64"])
def test_cli_mesh_refuses_bad_device_counts(capsys, value):
    from v41jax import cli

    with pytest.raises(SystemExit) as exit_info:
        cli.main(["mesh", "--devices", value])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "argument --devices: expected comma-separated GPU counts" in err
    assert repr(value) in err


def test_cli_mesh_refuses_a_preset_it_cannot_count(capsys):
    from v41jax import cli

    assert cli.main(["mesh", "--preset", "v4_flash", "--devices", "8"]) == 2
    assert "v41jax mesh: error: --preset v4_flash: config.kv_format" in capsys.readouterr().err
