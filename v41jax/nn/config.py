"""Model configuration and the layer roles derived from it (DESIGN §3).

One frozen `ModelConfig` describes the real V4.1-Flash (for accounting only; never allocated),
V4-Flash (what the byte accounting needs) and the toy presets. Layer roles are *derived* from
the config by `layer_plan`, never stored: a researcher changes `kv_source_layers` or
`compress_ratios` and every role, source and pool consumer follows.

Roles (`v41_architecture.md` §1):
  - WINDOW:  compress ratio 0; sliding-window attention only.
  - FULL:    a KV source that is an index source; owns a Compressor and an Indexer with its own
             keys. The last KV source is the candidate source and publishes the candidate pool.
  - REINDEX: an index source that is not a KV source; own indexer query and head weights, scores
             the latest Full layer's index keys (inside the pool when after the candidate source).
  - REUSE:   everything else with a ratio > 0; takes the latest published top-k.
  - DENSE:   a KV source with no indexer that attends to every visible compressed entry
             (DeepSeek-V4's HCA layers; needed only to describe `v4_flash()`).

Numerics (issue 13, DESIGN §3's last paragraph). An independent comparison with the official
V4.1-Flash inference code on the same inputs found the quantizers bit-exact and the rest equal
within bf16 rounding, except for the points below. Where the project's default differs, a field
switches it; `ModelConfig.with_reference_numerics()` (and `v41_flash_reference()`) sets every
switch the way the official code behaves. The defaults stay the project's rules: the studies
run with them, and the switches exist for fidelity studies (`experiments/README.md`).

1. Index-score precision: `index_score_dtype='bfloat16'`. The reference's indexer tensors are
   bf16 (the MXFP4-quantized q and index keys, the head weights), so its einsum rounds each
   head's q·k to bf16 (float32 accumulation inside the GEMM), its product with the head weight
   rounds to bf16, and the sum over heads (float32 accumulation) rounds to bf16. The switch rounds
   at exactly those places (`ops.scoring.index_scores`), so near-equal scores collide into ties
   as in the reference. What remains different: the reference rounds weights_proj's output and
   again its product with 1/sqrt(index_head_dim·index_n_heads), the project rounds the scaled
   weights once (the same when that factor is a power of two: 1/64 in V4.1); float32
   accumulation orders differ, so a score on a bf16 rounding boundary can land one ulp apart.
   The pooled-scoring kernel computes float32 scores and refuses 'bfloat16' (its `supports`).
2. −inf picks: `neginf_picks='keep'`. The reference invalidates only picks at or beyond
   compress_lens, so a Reindex layer whose candidate pool holds fewer than index_topk visible
   positions also attends to visible positions outside the pool (`v41_architecture.md` §3 step
   11). 'keep' does the same and never picks an invisible position (that would be a causality
   bug). The reference's decode has no invisible positions to rank; its prefill ranks them among
   the −inf picks and then drops them, so how many out-of-pool picks its prefill keeps depends on
   its tie order. Here both modes follow the decode rule (the k best visible positions,
   out-of-pool ones after all in-pool ones), so prefill and decode agree. The pool's blocks are
   chosen among reachable blocks only, in the reference as here.
3. Tie order: not set by the helper. The reference selects with `torch.topk` (unsorted for the
   positions), whose order among equal scores is implementation-defined: CPU and CUDA choose
   differently (`v41_architecture.md` §3 step 11, the tt-metal README), and no deterministic rule
   reproduces it. The project's default is 'oldest' (the lowest ids win: a stable top-k);
   'newest' (the highest ids win) is the other natural rule. ReLU makes exact-zero scores common,
   so a study sensitive to ties runs both and reports the spread.
4. Known differences that stay (no switch): non-finite inputs. The reference's NVFP4 fake-quant
   maps ±inf to ±2688 (the E4M3 scale saturates at 448, the value clamps at ±6) and its MXFP4
   fake-quant turns a group holding NaN into zeros; the project makes such a group NaN
   (`ops.formats`: a non-finite input must not silently become a number). An attention row with
   no valid key and a −inf sink gives NaN in the reference and zeros here (DESIGN §3 step 4).
   YaRN belongs to the model's description (its own fields, set by `v41_flash()`), and the
   released model's FP8 projections on bf16 activations are not modelled (float32 here).
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Sequence

import numpy as np

from v41jax.nn.rope import Yarn
from v41jax.ops import formats
from v41jax.ops.pool import BLOCK_REDUCERS
from v41jax.ops.scoring import NEGINF_PICKS, SCORE_DTYPES, TIE_ORDERS


class Role(enum.StrEnum):
    WINDOW = "window"
    FULL = "full"
    REINDEX = "reindex"
    REUSE = "reuse"
    DENSE = "dense"


@dataclasses.dataclass(frozen=True)
class LayerPlan:
    """What one layer owns and reads, derived from a `ModelConfig` by `layer_plan`.

    Attributes:
      layer: layer index.
      role: the layer's `Role`.
      compress_ratio: tokens per compressed entry (0 for WINDOW layers).
      kv_source: the layer whose compressed KV this layer attends to (itself for FULL and DENSE;
        None for WINDOW).
      index_key_source: the FULL layer whose index keys this layer's indexer scores (itself for
        FULL; the latest FULL layer for REINDEX; None otherwise).
      topk_source: the layer whose published top-k this layer uses (itself for FULL and REINDEX;
        the latest index source for REUSE; None for WINDOW and DENSE, and for a REUSE layer whose
        KV source is DENSE, which attends to every visible entry).
      is_candidate_source: this layer publishes the candidate pool.
      uses_candidates: this layer's top-k is restricted to the candidate pool (REINDEX layers
        after the candidate source).
    """

    layer: int
    role: Role
    compress_ratio: int
    kv_source: int | None
    index_key_source: int | None
    topk_source: int | None
    is_candidate_source: bool
    uses_candidates: bool


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A V4.1-style attention stack (DESIGN §3). Validated on construction.

    Args:
      n_layers: number of transformer blocks.
      dim: residual width.
      n_heads: query heads of the core attention.
      head_dim: width of the single shared KV latent (K = V, MQA over one latent).
      rope_head_dim: the trailing dims of every rotated vector that carry RoPE (interleaved pairs).
      q_lora_rank: width of the shared low-rank query latent (main attention and indexer).
      o_groups: groups of heads in the grouped low-rank output projection.
      o_lora_rank: per-group width of that projection.
      window_size: sliding-window keys per query, the current token included.
      index_n_heads: indexer heads.
      index_head_dim: indexer query/key width.
      index_topk: compressed entries each index source selects.
      compress_ratios: tokens per compressed entry, one per layer; 0 = window only.
      kv_source_layers: layers that own a Compressor (compressed KV).
      index_source_layers: layers that own an indexer (query side at least).
      candidate_source_layer: the layer that publishes the candidate pool (the last KV source),
        or None for no hierarchical pool.
      candidate_block_size: positions per candidate block.
      candidate_topk_blocks: blocks kept in each query's candidate pool.
      block_score: block reducer of the candidate pool, a name in `ops.pool.BLOCK_REDUCERS`
        ('max', V4.1's; 'mean'; 'top2', the mean of a block's two best scores).
      kv_format: storage format of the main (compressed) KV (`ops.formats.formats_for('kv')`).
      index_format: storage format of the index keys (and fake-quant of indexer queries;
        `formats_for('index')`).
      window_format: storage format of the sliding-window KV (`formats_for('window')`).
      dense_kv_layers: KV sources with no indexer that attend densely (V4's HCA); () for V4.1.
      vocab_size: embedding rows.
      ffn_dim: hidden width of the dense SwiGLU FFN (the real model's MoE is out of scope).
      rope_theta: RoPE base of window-only layers.
      compress_rope_theta: RoPE base of layers with compressed KV.
      yarn_original_len: YaRN's original context L (`nn.rope`), or 0 for plain RoPE. When set,
        every layer with compressed KV (its queries, window KV, compressed KV and indexer) turns
        at YaRN's rescaled frequencies at every position, as V4.1 does (L = 65,536); window-only
        layers keep plain RoPE with `rope_theta`. For a toy, choose L near the training length
        so that the ramp falls inside its few pairs (e.g. tiny(): rope_head_dim 16, L = 64,
        factor 4 rescales pairs 1..7).
      yarn_factor: YaRN's `rope_factor` (>= 1): slow pairs turn this many times slower.
      yarn_beta_fast, yarn_beta_slow: YaRN's correction range in turns over L (32 and 1).
      norm_eps: RMSNorm epsilon.
      query_chunk: queries per chunk of a layer's prefill and training pass, or 0 for the whole
        sequence at once. With chunks, each layer with compressed KV scores, selects and attends
        chunk by chunk under rematerialization (`nn.attention.Attention.__call__`): the sparse
        layers gather their selected keys (O(T·(k + w)) memory), the index scans and dense
        attention hold O(chunk·S) at a time, and the published state keeps top-k and pool block
        ids only (no [T, S] pool mask). Values and gradients are those of the whole-sequence
        path; `debug` and `diagnostics` runs use the whole-sequence path.
      index_score_dtype: 'float32' (default) or 'bfloat16': the index scores with the official
        reference's bf16 roundings (`ops.scoring` module docstring), everywhere scores are made
        (prefill, the chunked pass, decode, the pooled scoring).
      tie_order: 'oldest' (default: among equal scores the lowest position or block id wins) or
        'newest' (the highest), in every selection: the candidate pool's blocks and every top-k.
      neginf_picks: 'drop' (default: a top-k pick scoring −inf becomes −1) or 'keep' (the
        reference: a Reindex layer whose pool holds fewer than index_topk visible positions keeps
        visible out-of-pool picks; invisible positions are never picked; `ops.scoring.topk`).
    """

    n_layers: int
    dim: int
    n_heads: int
    head_dim: int
    rope_head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    window_size: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    compress_ratios: tuple[int, ...]
    kv_source_layers: tuple[int, ...]
    index_source_layers: tuple[int, ...]
    candidate_source_layer: int | None
    candidate_block_size: int = 8
    candidate_topk_blocks: int = 2048
    block_score: str = "max"
    kv_format: str = "nvfp4"
    index_format: str = "mxfp4"
    window_format: str = "fp8"
    dense_kv_layers: tuple[int, ...] = ()
    vocab_size: int = 256
    ffn_dim: int = 256
    rope_theta: float = 10_000.0
    compress_rope_theta: float = 160_000.0
    yarn_original_len: int = 0
    yarn_factor: float = 1.0
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    norm_eps: float = 1e-6
    query_chunk: int = 0
    # Numerics switches (issue 13); defaults are the project's rules, `with_reference_numerics`
    # sets the official code's.
    index_score_dtype: str = "float32"
    tie_order: str = "oldest"
    neginf_picks: str = "drop"

    def __post_init__(self):
        for name in (
            "compress_ratios",
            "kv_source_layers",
            "index_source_layers",
            "dense_kv_layers",
        ):
            value = getattr(self, name)
            if not isinstance(value, Sequence) or isinstance(value, str):
                raise ValueError(f"ModelConfig.{name}: expected a sequence of ints, got {value!r}")
            if not all(isinstance(v, int | np.integer) and not isinstance(v, bool) for v in value):
                raise ValueError(f"ModelConfig.{name}: expected a sequence of ints, got {value!r}")
            object.__setattr__(self, name, tuple(int(v) for v in value))
        _validate(self)

    def replace(self, **changes) -> ModelConfig:
        """A copy with `changes` applied (validated again)."""
        return dataclasses.replace(self, **changes)

    def with_reference_numerics(self) -> ModelConfig:
        """This config with the official inference code's selection numerics: bf16 index scores
        and kept −inf picks; the tie order is left as it is (the reference's is unspecified).
        Point by point, with the differences that remain: the module docstring, "Numerics"."""
        return self.replace(index_score_dtype="bfloat16", neginf_picks="keep")

    @property
    def layers(self) -> tuple[LayerPlan, ...]:
        """The layer plan (`layer_plan(self)`)."""
        return layer_plan(self)

    @property
    def candidate_pool_size(self) -> int:
        """Positions in a full candidate pool: `candidate_topk_blocks * candidate_block_size`."""
        return self.candidate_topk_blocks * self.candidate_block_size

    def rope(self, compress_ratio: int) -> tuple[float, Yarn | None]:
        """(theta, YaRN or None) of a layer with this compress ratio: layers with compressed KV
        (ratio > 0) use `compress_rope_theta` and YaRN when `yarn_original_len` is set, window-only
        layers `rope_theta` and plain RoPE (`nn.rope`)."""
        if not compress_ratio:
            return self.rope_theta, None
        yarn = None
        if self.yarn_original_len:
            yarn = Yarn(
                self.yarn_factor, self.yarn_original_len, self.yarn_beta_fast, self.yarn_beta_slow
            )
        return self.compress_rope_theta, yarn


def _fail(field: str, expected: str, got) -> None:
    raise ValueError(f"ModelConfig.{field}: expected {expected}, got {got!r}")


def _validate(c: ModelConfig) -> None:
    for name in (
        "n_layers",
        "dim",
        "n_heads",
        "head_dim",
        "q_lora_rank",
        "o_groups",
        "o_lora_rank",
        "window_size",
        "index_n_heads",
        "index_head_dim",
        "index_topk",
        "candidate_block_size",
        "candidate_topk_blocks",
        "vocab_size",
        "ffn_dim",
    ):
        value = getattr(c, name)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            _fail(name, "a positive int", value)
    if isinstance(c.query_chunk, bool) or not isinstance(c.query_chunk, int) or c.query_chunk < 0:
        _fail("query_chunk", "an int >= 0 (0: the whole sequence at once)", c.query_chunk)
    for name, allowed in (
        ("index_score_dtype", SCORE_DTYPES),
        ("tie_order", TIE_ORDERS),
        ("neginf_picks", NEGINF_PICKS),
    ):
        if not isinstance(getattr(c, name), str) or getattr(c, name) not in allowed:
            _fail(name, f"one of {allowed}", getattr(c, name))
    for name in ("rope_theta", "compress_rope_theta", "norm_eps"):
        value = getattr(c, name)
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        if not ok or not math.isfinite(value) or value <= 0:
            _fail(name, "a finite number > 0", value)
    if (
        isinstance(c.yarn_original_len, bool)
        or not isinstance(c.yarn_original_len, int)
        or c.yarn_original_len < 0
    ):
        _fail("yarn_original_len", "an int >= 0 (0: no YaRN)", c.yarn_original_len)
    for name, low in (("yarn_factor", 1.0), ("yarn_beta_slow", 0.0), ("yarn_beta_fast", 0.0)):
        value = getattr(c, name)
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        if not ok or not math.isfinite(value) or value < low or (low == 0 and value == 0):
            _fail(name, f"a finite number {'>= 1' if low else '> 0'}", value)
    if c.yarn_beta_fast <= c.yarn_beta_slow:
        _fail("yarn_beta_fast", f"> yarn_beta_slow ({c.yarn_beta_slow})", c.yarn_beta_fast)
    if c.rope_head_dim < 0 or c.rope_head_dim % 2:
        _fail("rope_head_dim", "a non-negative even int (RoPE rotates pairs)", c.rope_head_dim)
    if c.rope_head_dim > min(c.head_dim, c.index_head_dim):
        _fail(
            "rope_head_dim",
            f"<= head_dim ({c.head_dim}) and index_head_dim ({c.index_head_dim})",
            c.rope_head_dim,
        )
    if c.n_heads % c.o_groups:
        _fail("o_groups", f"a divisor of n_heads={c.n_heads}", c.o_groups)
    for name, allowed in (
        ("kv_format", formats.formats_for("kv")),
        ("index_format", formats.formats_for("index")),
        ("window_format", formats.formats_for("window")),
        ("block_score", tuple(BLOCK_REDUCERS)),
    ):
        if getattr(c, name) not in allowed:
            _fail(name, f"one of {allowed}", getattr(c, name))
    # The row layouts of `ops.formats` know their own group sizes and constraints.
    for name, fmt, width, rope in (
        ("head_dim", c.kv_format, c.head_dim, c.rope_head_dim),
        ("head_dim", c.window_format, c.head_dim, 0),
        ("index_head_dim", c.index_format, c.index_head_dim, 0),
    ):
        try:
            formats.packed_row_bytes(fmt, width, rope_dim=rope)
        except ValueError as e:
            _fail(name, f"a width that the {fmt} layout can store ({e})", width)

    if len(c.compress_ratios) != c.n_layers:
        _fail(
            "compress_ratios",
            f"{c.n_layers} entries (one per layer)",
            f"{len(c.compress_ratios)} entries",
        )
    for layer, r in enumerate(c.compress_ratios):
        if r < 0:
            _fail("compress_ratios", "ratios >= 0", f"{r} at layer {layer}")
    for name in ("kv_source_layers", "index_source_layers", "dense_kv_layers"):
        layers = getattr(c, name)
        if list(layers) != sorted(set(layers)) or any(not 0 <= x < c.n_layers for x in layers):
            _fail(name, f"strictly increasing layer ids in [0, {c.n_layers})", layers)

    kv, index, dense = set(c.kv_source_layers), set(c.index_source_layers), set(c.dense_kv_layers)
    for layer in range(c.n_layers):
        r = c.compress_ratios[layer]
        if r == 0 and (layer in kv or layer in index):
            _fail(
                "compress_ratios",
                f"a ratio > 0 at layer {layer} (a KV or index source); ratio-0 "
                "layers are window only",
                0,
            )
    for layer in sorted(kv):
        if layer not in index and layer not in dense:
            _fail(
                "index_source_layers",
                f"to contain KV source layer {layer} (every KV source is an "
                "index source, unless listed in dense_kv_layers)",
                c.index_source_layers,
            )
    for layer in sorted(dense):
        if layer not in kv or layer in index:
            _fail(
                "dense_kv_layers",
                f"KV sources that are not index sources; layer {layer} is "
                f"{'an index source' if layer in index else 'not a KV source'}",
                c.dense_kv_layers,
            )
    if c.candidate_source_layer is not None:
        if not c.kv_source_layers or c.candidate_source_layer != c.kv_source_layers[-1]:
            _fail(
                "candidate_source_layer",
                f"the last KV source ({c.kv_source_layers[-1] if c.kv_source_layers else None})",
                c.candidate_source_layer,
            )
        if c.candidate_source_layer in dense:
            _fail(
                "candidate_source_layer",
                "an index source (not a dense KV layer)",
                c.candidate_source_layer,
            )

    latest_kv = None
    for layer in range(c.n_layers):
        r = c.compress_ratios[layer]
        if layer in kv:
            latest_kv = layer
        if r == 0:
            continue
        if latest_kv is None:
            _fail(
                "kv_source_layers",
                f"a KV source at or before layer {layer} (ratio {r} needs compressed KV)",
                c.kv_source_layers,
            )
        if r != c.compress_ratios[latest_kv]:
            _fail(
                "compress_ratios",
                f"layer {layer} to share the ratio {c.compress_ratios[latest_kv]} "
                f"of its KV source {latest_kv}",
                r,
            )
        if layer in index and latest_kv in dense:
            _fail(
                "index_source_layers",
                f"layer {layer} to read a KV source with index keys; its KV "
                f"source {latest_kv} is dense",
                c.index_source_layers,
            )


def layer_plan(config: ModelConfig) -> tuple[LayerPlan, ...]:
    """Derives every layer's role and sources from `config` (the only place roles are computed)."""
    kv, index = set(config.kv_source_layers), set(config.index_source_layers)
    dense = set(config.dense_kv_layers)
    cand = config.candidate_source_layer
    plans = []
    latest_kv = latest_index = None
    for layer, r in enumerate(config.compress_ratios):
        if layer in kv:
            latest_kv = layer
        if layer in index:
            latest_index = layer
        if r == 0:
            role, kv_src, key_src, topk_src = Role.WINDOW, None, None, None
        elif layer in dense:
            role, kv_src, key_src, topk_src = Role.DENSE, layer, None, None
        elif layer in kv:
            role, kv_src, key_src, topk_src = Role.FULL, layer, layer, layer
        elif layer in index:
            role, kv_src, key_src, topk_src = Role.REINDEX, latest_kv, latest_kv, layer
        else:
            role, kv_src, key_src = Role.REUSE, latest_kv, None
            topk_src = None if latest_kv in dense else latest_index
        plans.append(
            LayerPlan(
                layer=layer,
                role=role,
                compress_ratio=r,
                kv_source=kv_src,
                index_key_source=key_src,
                topk_source=topk_src,
                is_candidate_source=layer == cand,
                uses_candidates=role is Role.REINDEX and cand is not None and cand < layer,
            )
        )
    return tuple(plans)


def v41_flash() -> ModelConfig:
    """The real DeepSeek-V4.1-Flash attention stack (`v41_architecture.md` §1; MTP layers omitted).

    Used for accounting and abstract (`nnx.eval_shape`) parameter counts; never allocated.
    `ffn_dim` is a placeholder: the real FFN is a mixture of experts, which is out of scope.
    """
    return ModelConfig(
        n_layers=40,
        dim=5120,
        n_heads=64,
        head_dim=512,
        rope_head_dim=64,
        q_lora_rank=1280,
        o_groups=8,
        o_lora_rank=1024,
        window_size=128,
        index_n_heads=32,
        index_head_dim=128,
        index_topk=512,
        compress_ratios=(0, 0) + (2,) * 18 + (1,) * 20,
        kv_source_layers=(2, 8, 14, 20),
        index_source_layers=(2, 8, 14, 20, 24, 28, 32, 36),
        candidate_source_layer=20,
        candidate_block_size=8,
        candidate_topk_blocks=2048,
        block_score="max",
        kv_format="nvfp4",
        index_format="mxfp4",
        window_format="fp8",
        vocab_size=129_280,
        ffn_dim=2048,
        rope_theta=10_000.0,
        compress_rope_theta=160_000.0,
        yarn_original_len=65_536,
        yarn_factor=16.0,
        yarn_beta_fast=32.0,
        yarn_beta_slow=1.0,
        norm_eps=1e-20,
    )


def v41_flash_reference() -> ModelConfig:
    """`v41_flash()` with the official inference code's selection numerics
    (`ModelConfig.with_reference_numerics`; the module docstring, "Numerics")."""
    return v41_flash().with_reference_numerics()


def v4_flash() -> ModelConfig:
    """DeepSeek-V4-Flash as far as the KV byte accounting needs it (DESIGN §5).

    21 CSA layers (ratio 4, each its own KV and index source, 584-byte legacy FP8 main-KV rows and
    68-byte MXFP4 index keys) alternate with 20 HCA layers (ratio 128, dense over their compressed
    entries, main KV only), after two window-only layers. Widths other than the KV row layout are
    those of V4.1 and are not claimed to be V4-Flash's.
    """
    ratios = (0, 0, *(4 if i % 2 == 0 else 128 for i in range(41)))
    compressed = tuple(layer for layer, r in enumerate(ratios) if r)
    csa = tuple(layer for layer in compressed if ratios[layer] == 4)
    return v41_flash().replace(
        n_layers=43,
        compress_ratios=ratios,
        kv_source_layers=compressed,
        index_source_layers=csa,
        dense_kv_layers=tuple(layer for layer in compressed if ratios[layer] == 128),
        candidate_source_layer=None,
        kv_format="v4_fp8",
    )


def tiny() -> ModelConfig:
    """A toy with V4.1's role pattern that learns `v41jax train`'s default task on 2 CPU cores
    within the 5-minute budget (about 0.4 s a step at batch 32 x 128 tokens).

    Layers: 0 window only; 1 encoder Full (ratio 2); 2 Reuse; 3 decoder Full (ratio 1) and
    candidate source; 4 Reindex; 5 Reuse; 6 Reindex; 7 Reuse. The pool (4 blocks of 8) bites from
    32 compressed positions on; a window of 32 tokens. Width 64 with 2 heads keeps a step cheap.
    """
    return ModelConfig(
        n_layers=8,
        dim=64,
        n_heads=2,
        head_dim=32,
        rope_head_dim=16,
        q_lora_rank=32,
        o_groups=2,
        o_lora_rank=32,
        window_size=32,
        index_n_heads=2,
        index_head_dim=32,
        index_topk=16,
        compress_ratios=(0, 2, 2, 1, 1, 1, 1, 1),
        kv_source_layers=(1, 3),
        index_source_layers=(1, 3, 4, 6),
        candidate_source_layer=3,
        candidate_block_size=8,
        candidate_topk_blocks=4,
        vocab_size=256,
        ffn_dim=128,
    )


def small() -> ModelConfig:
    """A GPU-sized toy with the same role pattern: 12 layers, dim 512, pool of 32 blocks of 8."""
    return ModelConfig(
        n_layers=12,
        dim=512,
        n_heads=8,
        head_dim=128,
        rope_head_dim=32,
        q_lora_rank=256,
        o_groups=4,
        o_lora_rank=256,
        window_size=64,
        index_n_heads=8,
        index_head_dim=64,
        index_topk=128,
        compress_ratios=(0, 2, 2, 2, 1, 1, 1, 1, 1, 1, 1, 1),
        kv_source_layers=(1, 4),
        index_source_layers=(1, 4, 6, 9),
        candidate_source_layer=4,
        candidate_block_size=8,
        candidate_topk_blocks=32,
        vocab_size=512,
        ffn_dim=1024,
    )


def small_kernels() -> ModelConfig:
    """small() shaped for the Pallas kernels: head_dim 512 and index_head_dim 128, NVFP4 main KV,
    FP8 window, MXFP4 index keys and candidate blocks of 8, as the kernels decode them (their
    `supports` say so; `nn.dispatch.check_kernel_config` asks them). The toy that
    `model.decode_step(..., implementation='pallas')` runs on a Hopper GPU.
    """
    return small().replace(
        head_dim=512,
        index_head_dim=128,
        kv_format="nvfp4",
        window_format="fp8",
        index_format="mxfp4",
        candidate_block_size=8,
    )


PRESETS = {
    "tiny": tiny,
    "small": small,
    "small_kernels": small_kernels,
    "v41_flash": v41_flash,
    "v4_flash": v4_flash,
}


def preset(name: str) -> ModelConfig:
    """A preset by name (`PRESETS`)."""
    if name not in PRESETS:
        raise ValueError(f"preset: expected one of {sorted(PRESETS)}, got {name!r}")
    return PRESETS[name]()
