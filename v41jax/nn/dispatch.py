"""Where the model meets the kernels: the ops a layer runs through `implementation=` (DESIGN §6).

The switch itself ('xla' | 'pallas' | 'pallas_interpret') is defined once, in
`pallas_kernels.dispatch`; each kernel op takes it and runs its `v41jax.ops` definition for 'xla'.
This module passes the layer's config to those ops and asks the kernels' own `supports` whether
they take a config (`check_kernel_config`): the model never copies a kernel's limits.

Decode is the only mode with kernels (they take one query per sequence): prefill and training
accept `PREFILL_IMPLEMENTATIONS` only.
"""

from __future__ import annotations

from jaxtyping import Array, Bool, Float, Int, UInt8

from pallas_kernels import dispatch
from pallas_kernels import pooled_scoring as pooled_kernel
from pallas_kernels import source_scan as source_kernel
from pallas_kernels import sparse_attention as attention_kernel
from pallas_kernels.dispatch import IMPLEMENTATIONS, KERNEL_IMPLEMENTATIONS
from v41jax.nn.config import LayerPlan, ModelConfig, Role
from v41jax.ops.pool import SourceSelection
from v41jax.ops.scoring import TopK

__all__ = [
    "IMPLEMENTATIONS",
    "KERNEL_IMPLEMENTATIONS",
    "PREFILL_IMPLEMENTATIONS",
    "attend_packed",
    "candidate_source",
    "check_implementation",
    "check_kernel_config",
    "pooled_topk",
    "scans_on_kernels",
]

PREFILL_IMPLEMENTATIONS = ("xla",)
"""Values of `implementation=` accepted by prefill and training (the kernels serve decode)."""

# The kernel arguments each config field becomes (for messages that name the field).
_ATTENTION_FIELDS = {"kv_fmt": "kv_format", "window_fmt": "window_format", "dim": "head_dim"}
_SCORING_FIELDS = {
    "fmt": "index_format",
    "dim": "index_head_dim",
    "block_size": "candidate_block_size",
    "n_heads": "index_n_heads",
    "score_dtype": "index_score_dtype",
}


def check_implementation(implementation: str, *, decode: bool = False) -> None:
    """Raise ValueError unless `implementation` is accepted by decode (`decode=True`) or by
    prefill and training (`decode=False`)."""
    if decode:
        dispatch.check_implementation(implementation, IMPLEMENTATIONS, where="decode")
    else:
        dispatch.check_implementation(
            implementation,
            PREFILL_IMPLEMENTATIONS,
            where="prefill and training (the kernels serve decode only)",
        )


def _scoring(config: ModelConfig) -> dict:
    """The scoring kernels' `supports` arguments of a config."""
    return dict(
        fmt=config.index_format,
        dim=config.index_head_dim,
        block_size=config.candidate_block_size,
        n_heads=config.index_n_heads,
        score_dtype=config.index_score_dtype,
    )


def scans_on_kernels(config: ModelConfig, plan: LayerPlan, implementation: str) -> bool:
    """Whether a Full layer scans its packed index keys on the kernel route
    (`source_scan.candidate_source`) at decode. The candidate source does under every kernel
    implementation (`check_kernel_config` has checked that the scan takes the config). Another
    Full layer (its own top-k only, no pool) does when the scan's `supports` takes the config,
    and scans in XLA otherwise: its picks are the same up to float ties either way, and a
    config without a pool keeps running the attention kernel whatever its index format."""
    if plan.role is not Role.FULL or implementation not in KERNEL_IMPLEMENTATIONS:
        return False
    if plan.is_candidate_source:
        return True
    return bool(source_kernel.supports(implementation, **_scoring(config)))


def check_kernel_config(config: ModelConfig, implementation: str) -> None:
    """Raise ValueError, naming every offending config field with its expected and received
    value, when `implementation` runs kernels on a config they cannot take.

    Layers with compressed KV attend with `fp4_sparse_attention`; Reindex layers inside the pool
    select with `pooled_scores`, the candidate source with `source_scan.candidate_source`. Each
    kernel's `supports` decides; 'xla' takes any config. The numerics switches concern the
    selection only: `tie_order` and `neginf_picks` every implementation honours,
    `index_score_dtype` the pooled-scoring kernel's `supports` judges.
    """
    if implementation not in KERNEL_IMPLEMENTATIONS:
        return
    c, limits = config, []
    if any(plan.role is not Role.WINDOW for plan in c.layers):
        support = attention_kernel.supports(
            implementation, kv_fmt=c.kv_format, window_fmt=c.window_format, dim=c.head_dim
        )
        limits += [(_ATTENTION_FIELDS[limit.argument], limit) for limit in support.limits]
    scoring = _scoring(c)
    scoring_limits = []
    if any(plan.uses_candidates for plan in c.layers):
        scoring_limits += pooled_kernel.supports(implementation, **scoring).limits
    if any(plan.is_candidate_source for plan in c.layers):
        scoring_limits += source_kernel.supports(implementation, **scoring).limits
    # The same limit from both (the scan runs the pooled-scoring kernel): named once.
    limits += [(_SCORING_FIELDS[limit.argument], limit) for limit in dict.fromkeys(scoring_limits)]
    if limits:
        problems = [
            f"config.{field}: expected {lim.expected}, got {lim.got!r}" for field, lim in limits
        ]
        raise ValueError(
            f"implementation={implementation!r} runs the Pallas kernels, which need "
            + "; ".join(problems)
            + " (config.small_kernels() is a toy they take)"
        )


def attend_packed(
    config: ModelConfig,
    q: Float[Array, "b head dim"],
    kv_packed: UInt8[Array, "b n_kv row"],
    selected: Int[Array, "b k"],
    window_packed: UInt8[Array, "b window wrow"],
    window_valid: Bool[Array, "b window"],
    sink: Float[Array, " head"],
    implementation: str,
) -> Float[Array, "b head dim"]:
    """Core attention of B single queries over the packed caches (decode): the main-KV rows at
    `selected` (−1 skips) and the window ring where `window_valid`.

    'xla' is `ops.attention.packed_sparse_attention` (float32); the kernels' output is bf16 with
    float32 accumulation, widened to float32 (~2e-3 relative error against 'xla').
    """
    return attention_kernel.fp4_sparse_attention(
        q,
        kv_packed,
        selected,
        window_packed,
        window_valid,
        sink,
        kv_fmt=config.kv_format,
        window_fmt=config.window_format,
        implementation=implementation,
    )


def pooled_topk(
    config: ModelConfig,
    index_k_packed: UInt8[Array, "b s row"],
    q: Float[Array, "b heads dim"],
    weights: Float[Array, "b heads"],
    block_ids: Int[Array, "b n_blocks"],
    compress_lens: Int[Array, " b"],
    implementation: str,
) -> TopK:
    """A Reindex layer's top-k inside the candidate pool at decode, reading only the pool's packed
    index keys (`ops.pool.pooled_topk` for 'xla'); the selection rules of `ops.scoring.topk`
    with the config's score dtype, tie order and −inf picks (positions ≥ compress_lens
    invisible). `block_ids` are a `CandidatePool`'s: ascending, then −1."""
    return pooled_kernel.pooled_scores(
        index_k_packed,
        q,
        weights,
        block_ids,
        compress_lens,
        block_size=config.candidate_block_size,
        fmt=config.index_format,
        implementation=implementation,
        topk=config.index_topk,
        score_dtype=config.index_score_dtype,
        tie_order=config.tie_order,
        neginf_picks=config.neginf_picks,
        ascending_ids=True,  # a CandidatePool's block ids
    )


def candidate_source(
    config: ModelConfig,
    index_k_packed: UInt8[Array, "b s row"],
    q: Float[Array, "b heads dim"],
    weights: Float[Array, "b heads"],
    compress_lens: Int[Array, " b"],
    implementation: str,
    *,
    pool: bool = True,
) -> SourceSelection:
    """The candidate source's pool and own top-k at decode from its packed index keys
    (`ops.pool.candidate_source_scan` for 'xla'): the config's pool size, block size, block
    reducer, top-k, score dtype and tie order (positions ≥ compress_lens invisible; the source's
    own top-k is unrestricted, so −inf picks are dropped under either `neginf_picks`). With
    `pool=False` (a Full layer that is not the source) the pool is empty: the own top-k only."""
    return source_kernel.candidate_source(
        index_k_packed,
        q,
        weights,
        compress_lens,
        topk_blocks=config.candidate_topk_blocks if pool else 0,
        index_topk=config.index_topk,
        block_size=config.candidate_block_size,
        fmt=config.index_format,
        reduce=config.block_score,
        implementation=implementation,
        score_dtype=config.index_score_dtype,
        tie_order=config.tie_order,
    )
