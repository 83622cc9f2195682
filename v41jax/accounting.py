"""KV bytes per token and indexer multiply-adds, computed from a `ModelConfig` (DESIGN §5).

Reproduces the seed article's numbers (`seed/000_bd507f5a48fb42e1.txt`, "890 字节的分项" and
"Reindex 层每个 token 要给 100 万条打分") from the presets and the packed row layouts of
`v41jax.ops.formats`; no number here is typed in. Per-token byte values are kept exact as
`Fraction`s (V4-Flash's HCA layers store 20/128 of an entry per token); `v41jax.tables` renders
them as the text tables of `v41jax bytes`, `config_summary` / `seed_summary` as JSON.

    bytes per token = Σ over KV source layers of (row bytes) × (entries per token = 1/ratio)

Example::

    from v41jax import accounting, tables
    from v41jax.nn import config
    accounting.kv_bytes_per_token(config.v41_flash()).total      # Fraction(890, 1)
    accounting.indexer_cost(config.v41_flash(), 2**20).total_with_pool
    print(tables.render_seed_report(2**20))                      # what `v41jax bytes` prints
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from fractions import Fraction

from v41jax.nn.config import LayerPlan, ModelConfig, Role, layer_plan, v4_flash, v41_flash
from v41jax.ops import formats

GIB = 2**30
DEFAULT_CONTEXT = 2**20


# --------------------------------------------------------------------------- global KV bytes


@dataclasses.dataclass(frozen=True)
class SourceBytes:
    """One KV source layer's share of the global KV cache, per token of context.

    Attributes:
      layer: the KV source layer.
      role: FULL (main KV + index keys) or DENSE (main KV only).
      compress_ratio: tokens per compressed entry.
      is_candidate_source: the layer publishes the candidate pool.
      main_row_bytes: packed bytes of one main-KV entry (`kv_format`, head_dim, rope_head_dim).
      index_row_bytes: packed bytes of one index-key entry (`index_format`, index_head_dim);
        0 for a layer without index keys.
    """

    layer: int
    role: Role
    compress_ratio: int
    is_candidate_source: bool
    main_row_bytes: int
    index_row_bytes: int

    @property
    def entries_per_token(self) -> Fraction:
        return Fraction(1, self.compress_ratio)

    @property
    def main_bytes(self) -> Fraction:
        return self.main_row_bytes * self.entries_per_token

    @property
    def index_bytes(self) -> Fraction:
        return self.index_row_bytes * self.entries_per_token

    @property
    def total(self) -> Fraction:
        return self.main_bytes + self.index_bytes


@dataclasses.dataclass(frozen=True)
class KVBytes:
    """Global (compressed) KV bytes per token of one config: main KV plus indexer K.

    Sliding-window KV is not included: it does not grow with the context (see
    `window_bytes_per_sequence`).
    """

    sources: tuple[SourceBytes, ...]

    @property
    def entries_per_token(self) -> Fraction:
        return sum((s.entries_per_token for s in self.sources), Fraction(0))

    @property
    def main_bytes(self) -> Fraction:
        return sum((s.main_bytes for s in self.sources), Fraction(0))

    @property
    def index_bytes(self) -> Fraction:
        return sum((s.index_bytes for s in self.sources), Fraction(0))

    @property
    def total(self) -> Fraction:
        return self.main_bytes + self.index_bytes

    def bytes_at(self, context: int) -> Fraction:
        """Bytes per sequence at `context` tokens (bytes per token × context, as the seed does)."""
        return self.total * context


def main_row_bytes(config: ModelConfig) -> int:
    """Packed bytes of one main-KV entry."""
    return formats.packed_row_bytes(
        config.kv_format, config.head_dim, rope_dim=config.rope_head_dim
    )


def index_row_bytes(config: ModelConfig) -> int:
    """Packed bytes of one index-key entry."""
    return formats.packed_row_bytes(config.index_format, config.index_head_dim)


def window_row_bytes(config: ModelConfig) -> int:
    """Packed bytes of one sliding-window KV entry."""
    return formats.packed_row_bytes(config.window_format, config.head_dim)


def kv_bytes_per_token(config: ModelConfig) -> KVBytes:
    """Global KV bytes per token: each KV source stores one main-KV row per `compress_ratio`
    tokens, and a FULL source also one index-key row (a DENSE source has no index keys)."""
    main, index = main_row_bytes(config), index_row_bytes(config)
    return KVBytes(
        tuple(
            SourceBytes(
                layer=p.layer,
                role=p.role,
                compress_ratio=p.compress_ratio,
                is_candidate_source=p.is_candidate_source,
                main_row_bytes=main,
                index_row_bytes=index if p.index_key_source == p.layer else 0,
            )
            for p in layer_plan(config)
            if p.kv_source == p.layer
        )
    )


def without_sharing(config: ModelConfig) -> ModelConfig:
    """`config` with no cross-layer sharing: every layer with a ratio > 0 owns its compressed KV
    and (unless it is a dense KV layer) its index keys, and there is no candidate pool.

    For V4.1-Flash this is the seed's "38 layers each store their own": 29 entries per token,
    29 × (288 + 68) = 10,324 B.
    """
    compressed = tuple(layer for layer, r in enumerate(config.compress_ratios) if r)
    return config.replace(
        kv_source_layers=compressed,
        index_source_layers=tuple(x for x in compressed if x not in config.dense_kv_layers),
        candidate_source_layer=None,
    )


def window_bytes_per_sequence(config: ModelConfig) -> int:
    """Sliding-window KV of one sequence: every layer keeps `window_size` packed window rows."""
    return config.n_layers * config.window_size * window_row_bytes(config)


def with_storage_of(layout: ModelConfig, storage: ModelConfig) -> ModelConfig:
    """`layout`'s layers and ratios with `storage`'s KV and index-key formats (the seed's
    hypothetical "V4.1 layout with V4 storage" is `with_storage_of(v41_flash(), v4_flash())`)."""
    return layout.replace(kv_format=storage.kv_format, index_format=storage.index_format)


@dataclasses.dataclass(frozen=True)
class StorageStep:
    """One row of the seed's "3514 → 890 in two steps" table.

    Attributes:
      name: what the row is.
      kv: its global KV bytes per token.
      factor: bytes per token of the previous row / this row's (None for the first row).
    """

    name: str
    kv: KVBytes
    factor: Fraction | None


def storage_steps(
    before: ModelConfig | None = None,
    after: ModelConfig | None = None,
    names: Sequence[str] = ("V4-Flash", "V4.1 layout, V4 storage", "V4.1-Flash"),
) -> tuple[StorageStep, ...]:
    """`before` → `after`'s layout with `before`'s storage → `after`, separating what the layer
    layout (cross-layer sharing, ratios) and what the storage format each contribute.

    Defaults to the seed's V4-Flash → "V4.1 layout, V4 storage" → V4.1-Flash (÷ 2.16, ÷ 1.83).
    """
    before = v4_flash() if before is None else before
    after = v41_flash() if after is None else after
    configs = (before, with_storage_of(after, before), after)
    steps, previous = [], None
    for name, cfg in zip(names, configs, strict=True):
        kv = kv_bytes_per_token(cfg)
        steps.append(StorageStep(name, kv, None if previous is None else previous / kv.total))
        previous = kv.total
    return tuple(steps)


# --------------------------------------------------------------------------- indexer cost


@dataclasses.dataclass(frozen=True)
class LayerIndexerCost:
    """Indexer work of one index-source layer for one decoded token.

    Attributes:
      layer, role, compress_ratio, is_candidate_source, uses_candidates: from the layer plan.
      visible_entries: compressed entries the query can see (context // compress_ratio).
      scored_without_pool: entries scored when every index source scans all visible entries.
      scored_with_pool: entries scored when Reindex layers after the candidate source score
        only inside the candidate pool (at most `candidate_pool_size`).
      macs_per_entry: index_n_heads × index_head_dim.
    """

    layer: int
    role: Role
    compress_ratio: int
    is_candidate_source: bool
    uses_candidates: bool
    visible_entries: int
    scored_without_pool: int
    scored_with_pool: int
    macs_per_entry: int

    @property
    def macs_without_pool(self) -> int:
        return self.scored_without_pool * self.macs_per_entry

    @property
    def macs_with_pool(self) -> int:
        return self.scored_with_pool * self.macs_per_entry


@dataclasses.dataclass(frozen=True)
class IndexerCost:
    """Indexer multiply-adds per decoded token at `context` tokens, without and with the
    candidate pool, and the context-independent core attention for comparison.

    Attributes:
      context: tokens of context of the decoded token.
      macs_per_entry: index_n_heads × index_head_dim multiply-adds to score one entry.
      candidate_pool_size: candidate_topk_blocks × candidate_block_size positions.
      layers: one row per index-source layer, in layer order.
      core_attention_macs_per_layer: 2 · n_heads · (index_topk + window_size) · head_dim, the
        scores and the weighted sum of one layer's core attention over its full key set.
    """

    context: int
    macs_per_entry: int
    candidate_pool_size: int
    layers: tuple[LayerIndexerCost, ...]
    core_attention_macs_per_layer: int

    @property
    def total_without_pool(self) -> int:
        return sum(x.macs_without_pool for x in self.layers)

    @property
    def total_with_pool(self) -> int:
        return sum(x.macs_with_pool for x in self.layers)

    @property
    def reindex_without_pool(self) -> int:
        return sum(x.macs_without_pool for x in self.layers if x.role is Role.REINDEX)

    @property
    def reindex_with_pool(self) -> int:
        return sum(x.macs_with_pool for x in self.layers if x.role is Role.REINDEX)

    @property
    def reindex_share_without_pool(self) -> Fraction:
        """Fraction of the unpooled total spent in Reindex layers (the seed's "六成")."""
        return Fraction(self.reindex_without_pool, self.total_without_pool)

    @property
    def with_pool_fraction(self) -> Fraction:
        """Total with the pool / total without it (the seed's "四成")."""
        return Fraction(self.total_with_pool, self.total_without_pool)

    @property
    def pool_layer_fraction(self) -> Fraction | None:
        """Scored entries of one pooled Reindex layer with / without the pool (1/64 at 1M);
        None without pooled layers. Uses the first pooled layer; they all see the same entries."""
        pooled = [x for x in self.layers if x.uses_candidates]
        if not pooled:
            return None
        return Fraction(pooled[0].scored_with_pool, pooled[0].scored_without_pool)


def core_attention_macs_per_layer(config: ModelConfig) -> int:
    """Multiply-adds of one layer's core attention per decoded token over its full key set
    (`index_topk` compressed + `window_size` window keys): scores and weighted sum, every head."""
    return 2 * config.n_heads * (config.index_topk + config.window_size) * config.head_dim


def indexer_cost(config: ModelConfig, context: int = DEFAULT_CONTEXT) -> IndexerCost:
    """Indexer multiply-adds for the token decoded at `context` tokens of context.

    Every index source scores its visible entries (context // ratio). With the candidate pool,
    a Reindex layer that `uses_candidates` scores only min(candidate_pool_size, visible) of them;
    Full layers (the candidate source included) still scan everything.
    """
    if not isinstance(context, int) or context <= 0:
        raise ValueError(f"indexer_cost: context: expected a positive int, got {context!r}")
    per_entry = config.index_n_heads * config.index_head_dim
    pool = config.candidate_pool_size

    def row(p: LayerPlan) -> LayerIndexerCost:
        visible = context // p.compress_ratio
        return LayerIndexerCost(
            layer=p.layer,
            role=p.role,
            compress_ratio=p.compress_ratio,
            is_candidate_source=p.is_candidate_source,
            uses_candidates=p.uses_candidates,
            visible_entries=visible,
            scored_without_pool=visible,
            scored_with_pool=min(pool, visible) if p.uses_candidates else visible,
            macs_per_entry=per_entry,
        )

    return IndexerCost(
        context=context,
        macs_per_entry=per_entry,
        candidate_pool_size=pool,
        layers=tuple(row(p) for p in layer_plan(config) if p.topk_source == p.layer),
        core_attention_macs_per_layer=core_attention_macs_per_layer(config),
    )


# --------------------------------------------------------------------------- sharded traffic

PAIR_BYTES = 8  # one (score float32, position or block id int32) pair of a local top-k
GRAD_BYTES = 2  # a bf16 gradient element


@dataclasses.dataclass(frozen=True)
class LayerTraffic:
    """What one layer moves between devices when every sequence is sharded by position over
    `n_devices` devices (contiguous slices; issue 15), in bytes received by one device.

    Decode (per decoded token of one sequence, the query's device):
      decode_topk: the merge of the devices' local top-k lists, (n − 1) lists of PAIR_BYTES
        pairs: the `index_topk` positions of a layer that selects (FULL, REINDEX) and, at the
        candidate source, its `candidate_topk_blocks` blocks too. The merge is exact
        (`ops.pool.sharded_candidate_blocks`).
      decode_rows: the selected main-KV rows that live on other devices, read packed:
        (n − 1)/n of `index_topk` rows in expectation, once per distinct (KV source, top-k
        source) pair: a REUSE layer attends to the rows its sources' layer already fetched.
    Training (per step, per sequence of `context` tokens, every device alike):
      train_gather: the all-gather of the compressed KV (packed rows, as stored) and of the
        index keys a source publishes: (n − 1)/n of its context / ratio rows;
      train_scatter: the reduce-scatter of their gradients in bf16, the same rows;
      train_halo: the window's halo, `window_size` bf16 KV rows from the previous device, and
        their gradient back (every layer with a window: all of them).
    """

    layer: int
    role: Role
    compress_ratio: int
    is_candidate_source: bool
    uses_candidates: bool
    decode_topk: Fraction
    decode_rows: Fraction
    train_gather: Fraction
    train_scatter: Fraction
    train_halo: Fraction

    @property
    def decode_total(self) -> Fraction:
        return self.decode_topk + self.decode_rows

    @property
    def train_total(self) -> Fraction:
        return self.train_gather + self.train_scatter + self.train_halo


@dataclasses.dataclass(frozen=True)
class ShardedTraffic:
    """`sharded_traffic`'s result: one `LayerTraffic` per layer and the totals."""

    context: int
    n_devices: int
    layers: tuple[LayerTraffic, ...]

    @property
    def decode_total(self) -> Fraction:
        return sum((x.decode_total for x in self.layers), Fraction(0))

    @property
    def train_total(self) -> Fraction:
        return sum((x.train_total for x in self.layers), Fraction(0))


def sharded_traffic(
    config: ModelConfig, context: int = DEFAULT_CONTEXT, n_devices: int = 8
) -> ShardedTraffic:
    """Bytes each layer sends between devices when sequences are sharded by position over
    `n_devices` (see `LayerTraffic` for what each field counts and why). The decode figures
    are per decoded token and sequence; the training ones per step and sequence of `context`
    tokens. Computed from the config's layer plan and packed row sizes; nothing typed in."""
    if not isinstance(context, int) or context <= 0:
        raise ValueError(f"sharded_traffic: context: expected a positive int, got {context!r}")
    if isinstance(n_devices, bool) or not isinstance(n_devices, int) or n_devices < 1:
        raise ValueError(f"sharded_traffic: n_devices: expected a positive int, got {n_devices!r}")
    n = n_devices
    remote = Fraction(n - 1, n)
    main, index = main_row_bytes(config), index_row_bytes(config)
    rows_fetched: set[tuple[int | None, int | None]] = set()
    out = []
    for p in layer_plan(config):
        topk = Fraction(0)
        if p.topk_source == p.layer:  # FULL and REINDEX layers select their own top-k
            pairs = config.index_topk + (
                config.candidate_topk_blocks if p.is_candidate_source else 0
            )
            topk = Fraction((n - 1) * pairs * PAIR_BYTES)
        rows = Fraction(0)
        if p.kv_source is not None and (p.kv_source, p.topk_source) not in rows_fetched:
            rows_fetched.add((p.kv_source, p.topk_source))
            selected = (
                config.index_topk if p.topk_source is not None else context // p.compress_ratio
            )
            rows = remote * selected * main
        gather = scatter = Fraction(0)
        if p.kv_source == p.layer:
            entries = Fraction(context, p.compress_ratio)
            gather += remote * entries * main
            scatter += remote * entries * config.head_dim * GRAD_BYTES
            if p.index_key_source == p.layer:
                gather += remote * entries * index
                scatter += remote * entries * config.index_head_dim * GRAD_BYTES
        halo = Fraction(0)
        if n > 1 and config.window_size:
            halo = Fraction(2 * config.window_size * config.head_dim * GRAD_BYTES)
        out.append(
            LayerTraffic(
                layer=p.layer,
                role=p.role,
                compress_ratio=p.compress_ratio,
                is_candidate_source=p.is_candidate_source,
                uses_candidates=p.uses_candidates,
                decode_topk=topk,
                decode_rows=rows,
                train_gather=gather,
                train_scatter=scatter,
                train_halo=halo,
            )
        )
    return ShardedTraffic(context=context, n_devices=n, layers=tuple(out))


# --------------------------------------------------------------------------- mesh plan


@dataclasses.dataclass(frozen=True)
class Cluster:
    """The machine a mesh plan is made for: per-GPU figures and how GPUs are grouped in nodes.

    Attributes:
      hbm_bytes: device memory per GPU.
      hbm_reserve: the fraction of `hbm_bytes` kept free for what the plan does not count (the
        working set of the layer being recomputed, XLA temporaries, fragmentation); an
        assumption, not a measurement.
      hbm_bandwidth: bytes/s of device memory.
      peak_flops: dense bf16 FLOP/s.
      nvlink_bandwidth: bytes/s one GPU sends to the GPUs of its node (one direction).
      ib_bandwidth: bytes/s one GPU sends to other nodes (one direction; a NIC per GPU).
      gpus_per_node: GPUs joined by NVLink.
    """

    hbm_bytes: int
    hbm_reserve: Fraction
    hbm_bandwidth: int
    peak_flops: int
    nvlink_bandwidth: int
    ib_bandwidth: int
    gpus_per_node: int

    @property
    def usable_bytes(self) -> Fraction:
        return self.hbm_bytes * (1 - self.hbm_reserve)


# H200 SXM nodes of 8. HBM 141 GB and NVLink 900 GB/s per GPU: NVIDIA's H200 datasheet (not in
# `shared/reference`); 900 GB/s is both directions together, so a GPU sends 450 GB/s. HBM
# 4.8 TB/s and bf16 dense 989 TFLOP/s: `shared/reference/kernel_anchors.md` §5. InfiniBand NDR
# 400 Gb/s per GPU = 50 GB/s per direction (one ConnectX-7 per GPU, the usual HGX H200 node).
H200 = Cluster(
    hbm_bytes=141 * 10**9,
    hbm_reserve=Fraction(1, 10),
    hbm_bandwidth=4_800 * 10**9,
    peak_flops=989 * 10**12,
    nvlink_bandwidth=450 * 10**9,
    ib_bandwidth=50 * 10**9,
    gpus_per_node=8,
)

PARAM_BYTES = 2  # bf16 weights, as the forward and backward read them
OPTIMIZER_BYTES = 12  # AdamW: float32 master weights and two float32 moments per parameter


def _visible_sum(tokens: int, ratio: int, cap: int | None = None) -> int:
    """Σ over positions p < `tokens` of min(cap, (p + 1) // ratio): the entries the queries of
    a `tokens`-long sequence see (each capped at `cap`, e.g. the candidate pool)."""

    def floor_sum(n: int) -> int:  # Σ_{q=1..n} q // ratio
        whole, rest = divmod(n, ratio)
        return ratio * whole * (whole - 1) // 2 + whole * (rest + 1)

    if cap is None or cap * ratio > tokens:
        return floor_sum(tokens)
    return floor_sum(cap * ratio - 1) + cap * (tokens - cap * ratio + 1)


@dataclasses.dataclass(frozen=True)
class StepFlops:
    """FLOPs of one training step over one sequence of `tokens` tokens (all devices together).

    Attributes:
      matmul: 6 · (parameters − the embedding table's vocab_size · dim) · tokens: forward and
        backward of every weight matrix (the norms' few weights included).
      attention: 3 × the forward's 2 FLOPs per multiply-add of the core attention over each
        layer's key set (`window_size` keys, plus `index_topk` compressed keys in a layer with a
        top-k; every visible entry in a DENSE layer), every query at full key set.
      indexer: the forward's index scores, 2 FLOPs per multiply-add over the entries each
        query sees (inside the candidate pool for the Reindex layers that use it); the indexer
        loss's backward is not counted.
    """

    tokens: int
    matmul: int
    attention: int
    indexer: int

    @property
    def total(self) -> int:
        return self.matmul + self.attention + self.indexer


def training_flops(config: ModelConfig, n_params: int, tokens: int) -> StepFlops:
    """`StepFlops` of one sequence of `tokens` tokens; `n_params` is the model's parameter count
    (`v41jax.nn.model.parameter_counts(config)['total']`, counted on the model itself)."""
    per_key = 2 * config.n_heads * config.head_dim  # scores and weighted sum, every head
    attention_macs = 0
    indexer_macs = 0
    per_entry = config.index_n_heads * config.index_head_dim
    for p in layer_plan(config):
        attention_macs += per_key * min(config.window_size, tokens) * tokens
        if p.kv_source is not None and p.topk_source is not None:
            attention_macs += per_key * config.index_topk * tokens
        elif p.kv_source is not None:
            attention_macs += per_key * _visible_sum(tokens, p.compress_ratio)
        if p.topk_source == p.layer:
            cap = config.candidate_pool_size if p.uses_candidates else None
            indexer_macs += per_entry * _visible_sum(tokens, p.compress_ratio, cap)
    return StepFlops(
        tokens=tokens,
        matmul=6 * (n_params - config.vocab_size * config.dim) * tokens,
        attention=3 * 2 * attention_macs,
        indexer=2 * indexer_macs,
    )


def decode_read_bytes(config: ModelConfig, context: int = DEFAULT_CONTEXT) -> int:
    """Cache bytes read from device memory to decode one token at `context` tokens: the packed
    index keys every index source scores (`indexer_cost`, with the pool), the `index_topk`
    packed main-KV rows of each distinct (KV source, top-k source) pair, and every layer's
    window rows. The weights are read once per step for the whole batch and are not counted."""
    scored = sum(x.scored_with_pool for x in indexer_cost(config, context).layers)
    plan = layer_plan(config)
    pairs = {(p.kv_source, p.topk_source) for p in plan if p.kv_source is not None}
    rows = sum(
        config.index_topk if topk is not None else context // config.compress_ratios[kv]
        for kv, topk in pairs
    )
    return (
        scored * index_row_bytes(config)
        + rows * main_row_bytes(config)
        + window_bytes_per_sequence(config)
    )


def _split_by_node(
    spread: Fraction, neighbour: Fraction, context: int, cluster: Cluster
) -> tuple[Fraction, Fraction]:
    """(NVLink, InfiniBand) shares of a device's context-axis bytes: `spread` comes evenly from
    the other context - 1 devices of its group, `neighbour` from the previous device. The context
    axis is the mesh's inner axis, so a group of <= gpus_per_node devices lies in one node; a
    larger one spans nodes, and the neighbour may be in another node (counted there)."""
    if context <= cluster.gpus_per_node:
        return spread + neighbour, Fraction(0)
    inter = Fraction(context - cluster.gpus_per_node, context - 1)
    return spread * (1 - inter), spread * inter + neighbour


def gradient_sync_bytes(
    n_params: int, n_devices: int, cluster: Cluster = H200
) -> tuple[Fraction, Fraction]:
    """(NVLink, InfiniBand) bytes one device sends per step to sum the bf16 gradients over all
    `n_devices` devices (the weights are replicated over data and context): a reduce-scatter in
    the node, one over the nodes on its 1/g slice, then the all-gathers of the updated bf16
    weights (the optimizer state is sharded; the same bytes as an all-reduce)."""
    g = min(n_devices, cluster.gpus_per_node)
    nodes = n_devices // g
    grads = Fraction(n_params * GRAD_BYTES)
    return 2 * Fraction(g - 1, g) * grads, 2 * Fraction(nodes - 1, nodes) * grads / g


@dataclasses.dataclass(frozen=True)
class MeshCost:
    """One data × context mesh at `tokens` tokens per sequence, per device: memory, the bytes it
    sends and the time bounds, for a training step and for a decoded token.

    The mesh: `data` replicas, each a group of `context` devices over which every sequence is
    sharded by position (contiguous slices), the context axis inner (in one node while it has
    <= gpus_per_node devices). One training step: each replica trains on one sequence. Weights
    are replicated; gradients bf16, replicated; AdamW's state (`OPTIMIZER_BYTES` per parameter)
    sharded over all devices (ZeRO-1). Activations: the bf16 residual at every layer's input,
    each layer recomputed in the backward.

    Attributes:
      data, context: the mesh.
      tokens: tokens per sequence.
      param_bytes: bf16 weights.
      grad_bytes: bf16 gradients (training).
      optimizer_bytes: this device's shard of the AdamW state (training).
      activation_bytes: n_layers · dim · 2 B per token of the device's slice (training).
      kv_bytes: the device's slice of the packed global KV, kv_bytes_per_token × tokens / context.
      kv_gathered_bytes: the other devices' packed KV, all-gathered for the step (training).
      window_bytes: one sequence's window KV (decode, on the device of the newest token).
      train_intra, train_inter: bytes sent per step over NVLink and InfiniBand: the context
        axis's `sharded_traffic` and the gradient sum (`gradient_sync_bytes`).
      train_flops: this device's 1/context of the sequence's `training_flops`.
      decode_intra, decode_inter: bytes per decoded token and sequence (`sharded_traffic`).
      decode_read: this device's 1/context of `decode_read_bytes`.
    """

    data: int
    context: int
    tokens: int
    cluster: Cluster
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: Fraction
    activation_bytes: Fraction
    kv_bytes: Fraction
    kv_gathered_bytes: Fraction
    window_bytes: int
    train_intra: Fraction
    train_inter: Fraction
    train_flops: Fraction
    decode_intra: Fraction
    decode_inter: Fraction
    decode_read: Fraction

    @property
    def n_devices(self) -> int:
        return self.data * self.context

    @property
    def train_memory(self) -> Fraction:
        return (
            self.param_bytes
            + self.grad_bytes
            + self.optimizer_bytes
            + self.activation_bytes
            + self.kv_bytes
            + self.kv_gathered_bytes
        )

    @property
    def decode_memory(self) -> Fraction:
        return self.param_bytes + self.kv_bytes + self.window_bytes

    @property
    def train_fits(self) -> bool:
        return self.train_memory <= self.cluster.usable_bytes

    @property
    def decode_fits(self) -> bool:
        return self.decode_memory <= self.cluster.usable_bytes

    @property
    def train_compute_s(self) -> Fraction:
        return self.train_flops / self.cluster.peak_flops

    @property
    def train_nvlink_s(self) -> Fraction:
        return self.train_intra / self.cluster.nvlink_bandwidth

    @property
    def train_ib_s(self) -> Fraction:
        return self.train_inter / self.cluster.ib_bandwidth

    @property
    def train_bound_s(self) -> Fraction:
        """The step's time lower bound: compute, NVLink and InfiniBand perfectly overlapped."""
        return max(self.train_compute_s, self.train_nvlink_s, self.train_ib_s)

    @property
    def decode_hbm_s(self) -> Fraction:
        return self.decode_read / self.cluster.hbm_bandwidth

    @property
    def decode_link_s(self) -> Fraction:
        return max(
            self.decode_intra / self.cluster.nvlink_bandwidth,
            self.decode_inter / self.cluster.ib_bandwidth,
        )

    @property
    def decode_bound_s(self) -> Fraction:
        """A decoded token's time lower bound (bandwidth only; no latency per message)."""
        return max(self.decode_hbm_s, self.decode_link_s)


def mesh_cost(
    config: ModelConfig,
    n_params: int,
    data: int,
    context: int,
    tokens: int = DEFAULT_CONTEXT,
    cluster: Cluster = H200,
) -> MeshCost:
    """`MeshCost` of a data × context mesh (see there for what is counted and assumed)."""
    for name, value in (("n_params", n_params), ("data", data), ("context", context)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"mesh_cost: {name}: expected a positive int, got {value!r}")
    n = data * context
    if n > cluster.gpus_per_node and n % cluster.gpus_per_node:
        raise ValueError(
            f"mesh_cost: data × context: expected at most {cluster.gpus_per_node} GPUs or whole "
            f"nodes of {cluster.gpus_per_node}, got {data} × {context} = {n}"
        )
    traffic = sharded_traffic(config, tokens, context)
    spread = sum((x.train_gather + x.train_scatter for x in traffic.layers), Fraction(0))
    halo = sum((x.train_halo for x in traffic.layers), Fraction(0))
    ctx_intra, ctx_inter = _split_by_node(spread, halo, context, cluster)
    grad_intra, grad_inter = gradient_sync_bytes(n_params, n, cluster)
    dec_intra, dec_inter = _split_by_node(traffic.decode_total, Fraction(0), context, cluster)
    kv = kv_bytes_per_token(config).total * tokens
    return MeshCost(
        data=data,
        context=context,
        tokens=tokens,
        cluster=cluster,
        param_bytes=n_params * PARAM_BYTES,
        grad_bytes=n_params * GRAD_BYTES,
        optimizer_bytes=Fraction(n_params * OPTIMIZER_BYTES, n),
        activation_bytes=Fraction(config.n_layers * config.dim * GRAD_BYTES * tokens, context),
        kv_bytes=kv / context,
        kv_gathered_bytes=kv * Fraction(context - 1, context),
        window_bytes=window_bytes_per_sequence(config),
        train_intra=ctx_intra + grad_intra,
        train_inter=ctx_inter + grad_inter,
        train_flops=Fraction(training_flops(config, n_params, tokens).total, context),
        decode_intra=dec_intra,
        decode_inter=dec_inter,
        decode_read=Fraction(decode_read_bytes(config, tokens), context),
    )


@dataclasses.dataclass(frozen=True)
class MeshPlan:
    """`plan_mesh`'s result for one number of GPUs: every candidate mesh and the choices.

    Attributes:
      n_devices: GPUs.
      candidates: one `MeshCost` per context degree (powers of two dividing n_devices), in
        increasing order.
      train: the chosen mesh for training (None when none fits), and `train_reason`.
      decode: the chosen mesh for decode (None when none fits), and `decode_reason`.
    """

    n_devices: int
    candidates: tuple[MeshCost, ...]
    train: MeshCost | None
    train_reason: str
    decode: MeshCost | None
    decode_reason: str


def _gb(x) -> str:
    """Decimal units, three significant digits: 86.9 GB, 1.38 MB, 0 B."""
    for unit, size in (("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if x >= size:
            return f"{float(x) / size:.3g} {unit}"
    return f"{float(x):.3g} B"


def _seconds(x) -> str:
    x = float(x)
    if x >= 1:
        return f"{x:.3g} s"
    if x >= 1e-3:
        return f"{x * 1e3:.3g} ms"
    return f"{x * 1e6:.3g} µs"


def _where(mesh: MeshCost) -> str:
    node = mesh.cluster.gpus_per_node
    if mesh.context <= node:
        inside = "inside a node, its all-gathers on NVLink"
    else:
        inside = f"across {mesh.context // node} nodes, part of its all-gathers on InfiniBand"
    across = "across nodes" if mesh.n_devices > node else "in the node"
    return f"context={mesh.context} {inside}; data={mesh.data} {across}"


def _train_reason(candidates: Sequence[MeshCost], chosen: MeshCost | None) -> str:
    usable = candidates[0].cluster.usable_bytes
    if chosen is None:
        last = candidates[-1]
        return (
            f"no mesh fits: even context={last.context} needs {_gb(last.train_memory)} per "
            f"device, more than the {_gb(usable)} usable"
        )
    smaller = [m for m in candidates if m.context < chosen.context]
    misses = (
        f" (context={smaller[-1].context} needs {_gb(smaller[-1].train_memory)})" if smaller else ""
    )
    return (
        f"the smallest context degree that fits: {_gb(chosen.train_memory)} of "
        f"{_gb(usable)} usable per device{misses}; {_where(chosen)}: per step "
        f"{_gb(chosen.train_intra)} over NVLink ({_seconds(chosen.train_nvlink_s)}) and "
        f"{_gb(chosen.train_inter)} over InfiniBand ({_seconds(chosen.train_ib_s)}) against "
        f"{_seconds(chosen.train_compute_s)} of compute"
    )


def _decode_reason(candidates: Sequence[MeshCost], chosen: MeshCost | None) -> str:
    if chosen is None:
        return "no mesh fits one sequence's weights and KV"
    text = (
        f"the smallest context degree that fits: {_gb(chosen.decode_memory)} per device "
        f"(weights {_gb(chosen.param_bytes)}, one sequence's KV {_gb(chosen.kv_bytes)}); "
        f"data={chosen.data} replicas"
    )
    if chosen.context == 1:
        text += ", no bytes between devices"
    wider = [m for m in candidates if 1 < m.context <= chosen.cluster.gpus_per_node]
    if wider and wider[-1].context > chosen.context:
        w = wider[-1]
        text += (
            f"; context={w.context} would cut the cache-read bound per token from "
            f"{_seconds(chosen.decode_hbm_s)} to {_seconds(w.decode_hbm_s)} for "
            f"{_gb(w.decode_intra)} over NVLink per token ({_seconds(w.decode_link_s)}), "
            f"latency not counted"
        )
    return text


def plan_mesh(
    config: ModelConfig,
    n_params: int,
    n_devices: int,
    tokens: int = DEFAULT_CONTEXT,
    cluster: Cluster = H200,
) -> MeshPlan:
    """Every data × context mesh of `n_devices` GPUs (context a power of two dividing it) and
    the one chosen for training and for decode at `tokens` tokens per sequence.

    The rule, for training and for decode alike: **the mesh with the smallest context degree
    whose memory per device fits** (`MeshCost.train_fits`, `decode_fits`: at most the usable
    HBM); None if none fits. Why: the weights are replicated, so every mesh does the same
    compute per token and sends the same gradient bytes per step, while a larger context degree
    adds context-axis traffic (the all-gathers grow with (context − 1)/context, and leave the
    node past gpus_per_node) and gives each step fewer tokens per device to hide that traffic
    and the gradient sum behind. The reason is written from the chosen mesh's numbers.
    """
    if isinstance(n_devices, bool) or not isinstance(n_devices, int) or n_devices < 1:
        raise ValueError(f"plan_mesh: n_devices: expected a positive int, got {n_devices!r}")
    degrees = [c for c in (2**i for i in range(n_devices.bit_length())) if n_devices % c == 0]
    candidates = tuple(
        mesh_cost(config, n_params, n_devices // c, c, tokens, cluster) for c in degrees
    )
    train = next((m for m in candidates if m.train_fits), None)
    decode = next((m for m in candidates if m.decode_fits), None)
    return MeshPlan(
        n_devices=n_devices,
        candidates=candidates,
        train=train,
        train_reason=_train_reason(candidates, train),
        decode=decode,
        decode_reason=_decode_reason(candidates, decode),
    )


def mesh_summary(plans: Sequence[MeshPlan]) -> list[dict]:
    """`plan_mesh` results as JSON-ready values (bytes, FLOPs and seconds as floats)."""

    def mesh(m: MeshCost) -> dict:
        return {
            "data": m.data,
            "context": m.context,
            "train": {
                "memory_bytes": float(m.train_memory),
                "param_bytes": m.param_bytes,
                "grad_bytes": m.grad_bytes,
                "optimizer_bytes": float(m.optimizer_bytes),
                "activation_bytes": float(m.activation_bytes),
                "kv_bytes": float(m.kv_bytes),
                "kv_gathered_bytes": float(m.kv_gathered_bytes),
                "fits": m.train_fits,
                "nvlink_bytes": float(m.train_intra),
                "ib_bytes": float(m.train_inter),
                "flops": float(m.train_flops),
                "compute_s": float(m.train_compute_s),
                "nvlink_s": float(m.train_nvlink_s),
                "ib_s": float(m.train_ib_s),
                "bound_s": float(m.train_bound_s),
            },
            "decode": {
                "memory_bytes": float(m.decode_memory),
                "fits": m.decode_fits,
                "nvlink_bytes": float(m.decode_intra),
                "ib_bytes": float(m.decode_inter),
                "read_bytes": float(m.decode_read),
                "hbm_s": float(m.decode_hbm_s),
                "link_s": float(m.decode_link_s),
                "bound_s": float(m.decode_bound_s),
            },
        }

    def choice(m: MeshCost | None) -> dict | None:
        return None if m is None else {"data": m.data, "context": m.context}

    return [
        {
            "n_devices": p.n_devices,
            "tokens": p.candidates[0].tokens,
            "usable_hbm_bytes": float(p.candidates[0].cluster.usable_bytes),
            "candidates": [mesh(m) for m in p.candidates],
            "train_choice": choice(p.train),
            "train_reason": p.train_reason,
            "decode_choice": choice(p.decode),
            "decode_reason": p.decode_reason,
        }
        for p in plans
    ]


# --------------------------------------------------------------------------- context lengths

_SUFFIX = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}


def parse_context(text: str) -> int:
    """A context length: '65536', '64K', '1M', '1m' (binary suffixes: K = 1024)."""
    match = re.fullmatch(r"\s*(\d+)\s*([KMG]?)\s*", str(text), flags=re.IGNORECASE)
    if match is None or int(match[1]) == 0:
        raise ValueError(
            f"context: expected a positive number of tokens such as 65536, 64K or 1M "
            f"(K = 1024), got {text!r}"
        )
    return int(match[1]) * _SUFFIX[match[2].upper()]


def format_context(context: int) -> str:
    """'1,048,576 (1M)' for a whole number of K/M/G, else '1,000'."""
    for suffix in ("G", "M", "K"):
        if context % _SUFFIX[suffix] == 0:
            return f"{context:,} ({context // _SUFFIX[suffix]}{suffix})"
    return f"{context:,}"


# --------------------------------------------------------------------------- structured output


def config_summary(config: ModelConfig, context: int = DEFAULT_CONTEXT) -> dict:
    """Every number of one config's report as plain JSON-ready values (floats are exact here
    whenever the ratios are powers of two)."""
    kv, unshared = kv_bytes_per_token(config), kv_bytes_per_token(without_sharing(config))
    cost = indexer_cost(config, context)

    def kv_dict(k: KVBytes) -> dict:
        return {
            "entries_per_token": float(k.entries_per_token),
            "main_bytes": float(k.main_bytes),
            "index_bytes": float(k.index_bytes),
            "total_bytes": float(k.total),
        }

    pool_fraction = cost.pool_layer_fraction
    return {
        "formats": {
            "kv": config.kv_format,
            "index": config.index_format,
            "window": config.window_format,
        },
        "row_bytes": {
            "main": main_row_bytes(config),
            "index": index_row_bytes(config),
            "window": window_row_bytes(config),
        },
        "kv_bytes_per_token": kv_dict(kv)
        | {
            "sources": [
                {
                    "layer": s.layer,
                    "role": str(s.role),
                    "compress_ratio": s.compress_ratio,
                    "is_candidate_source": s.is_candidate_source,
                    "entries_per_token": float(s.entries_per_token),
                    "main_row_bytes": s.main_row_bytes,
                    "index_row_bytes": s.index_row_bytes,
                    "main_bytes": float(s.main_bytes),
                    "index_bytes": float(s.index_bytes),
                }
                for s in kv.sources
            ]
        },
        "without_sharing": kv_dict(unshared) | {"factor": float(unshared.total / kv.total)},
        "context": context,
        "kv_bytes_at_context": float(kv.bytes_at(context)),
        "kv_gib_at_context": float(kv.bytes_at(context) / GIB),
        "window_bytes_per_sequence": window_bytes_per_sequence(config),
        "indexer": {
            "macs_per_entry": cost.macs_per_entry,
            "candidate_pool_size": cost.candidate_pool_size,
            "total_without_pool": cost.total_without_pool,
            "total_with_pool": cost.total_with_pool,
            "reindex_without_pool": cost.reindex_without_pool,
            "reindex_with_pool": cost.reindex_with_pool,
            "reindex_share_without_pool": float(cost.reindex_share_without_pool),
            "with_pool_fraction": float(cost.with_pool_fraction),
            "pool_layer_fraction": None if pool_fraction is None else float(pool_fraction),
            "core_attention_macs_per_layer": cost.core_attention_macs_per_layer,
            "layers": [
                {
                    "layer": x.layer,
                    "role": str(x.role),
                    "compress_ratio": x.compress_ratio,
                    "is_candidate_source": x.is_candidate_source,
                    "uses_candidates": x.uses_candidates,
                    "visible_entries": x.visible_entries,
                    "scored_without_pool": x.scored_without_pool,
                    "scored_with_pool": x.scored_with_pool,
                    "macs_without_pool": x.macs_without_pool,
                    "macs_with_pool": x.macs_with_pool,
                }
                for x in cost.layers
            ],
        },
    }


def steps_summary(steps: Sequence[StorageStep], context: int = DEFAULT_CONTEXT) -> list[dict]:
    """`storage_steps` as JSON-ready rows."""
    return [
        {
            "name": s.name,
            "entries_per_token": float(s.kv.entries_per_token),
            "main_bytes": float(s.kv.main_bytes),
            "index_bytes": float(s.kv.index_bytes),
            "total_bytes": float(s.kv.total),
            "factor": None if s.factor is None else float(s.factor),
            "gib_at_context": float(s.kv.bytes_at(context) / GIB),
        }
        for s in steps
    ]


def seed_summary(context: int = DEFAULT_CONTEXT) -> dict:
    """`render_seed_report`'s numbers as JSON-ready values."""
    return {
        "context": context,
        "presets": {
            "v41_flash": config_summary(v41_flash(), context),
            "v4_flash": config_summary(v4_flash(), context),
        },
        "storage_steps": steps_summary(storage_steps(), context),
    }
