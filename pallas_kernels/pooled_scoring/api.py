"""Pooled indexer scoring: one entry point over the project's `implementation=` switch
(DESIGN §6.1).

    scores = pooled_scores(k_packed, q, weights, block_ids, lengths)                 # [B, NB·8]
    picks = pooled_scores(..., implementation="pallas", topk=512)  # TopK(positions, scores)

- 'xla': `v41jax.ops.pool.pooled_scores`, the op's definition (gather the pool's rows, unpack,
  `index_scores`); any format, block size and head dim.
- 'pallas': the Mosaic GPU kernel (`kernel_mgpu`) on a Hopper GPU; 'pallas_interpret' runs the
  same kernel in the Mosaic GPU interpreter on the CPU. What it takes: `supports`.

The gradient (w.r.t. q and weights) is always the definition's (`jax.vjp`), so training can call
the kernel's forward. With `topk`, the pool's best positions are selected from the scores
(`ops.pool.pool_topk_from_scores`, `ops.scoring.topk`'s rules; the kernel implementations select
with `pallas_kernels.topk`, the same picks from a sort of the best blocks only) and their scores
carry the gradient.

The numerics switches (`ops.scoring`): `tie_order` and `neginf_picks` act in the top-k after the
scores, so every implementation honours them; `score_dtype='bfloat16'` rounds inside the score
(between the head products and the head sum): 'xla' honours it, the kernel refuses it
(`supports`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, UInt8

from pallas_kernels import dispatch
from pallas_kernels.pooled_scoring import kernel_mgpu
from pallas_kernels.topk import api as topk_api
from v41jax.ops import pool
from v41jax.ops.scoring import TopK

# The kernel's tuning for a pool by default. At 1 M keys × batch 64 and a pool of 2,048 blocks
# on the H200, 16 tiles × 2 stages per CTA took 53.4 µs against 55.5 for the kernel's own
# default (32 × 4); 8 × 2 tied (53.3), 24 × 4 and 12 × 4 were slower
# (`bench --sweep`, results/bench_pooled_scoring_h200_2026-12-04_sweep.json).
POOL_CONFIG = kernel_mgpu.TuningConfig(tiles_per_cta=16, num_stages=2)


def supports(
    implementation: str,
    *,
    fmt: str,
    dim: int,
    block_size: int,
    n_heads: int,
    score_dtype: str = "float32",
) -> dispatch.Support:
    """Whether `implementation` takes pooled scoring of `n_heads` heads of `dim` over packed
    `fmt` keys in blocks of `block_size`, scores in `score_dtype` ('xla' takes everything; the
    kernel: `kernel_mgpu`). Tie order and −inf picks are honoured by every implementation."""
    dispatch.check_implementation(implementation)
    if implementation == "xla":
        return dispatch.Support("xla")
    return kernel_mgpu.supports(
        fmt=fmt, dim=dim, block_size=block_size, n_heads=n_heads, score_dtype=score_dtype
    )


@dataclasses.dataclass(frozen=True)
class _Options:
    implementation: str
    block_size: int
    fmt: str
    score_dtype: str
    config: kernel_mgpu.TuningConfig


def _forward(k_packed, q, weights, block_ids, lengths, options: _Options):
    # An empty batch or pool has nothing to launch a kernel for: the definition's empty result.
    if options.implementation == "xla" or q.shape[0] == 0 or block_ids.shape[1] == 0:
        return pool.pooled_scores(
            k_packed,
            q,
            weights,
            block_ids,
            lengths,
            block_size=options.block_size,
            fmt=options.fmt,
            score_dtype=options.score_dtype,
        )
    pool.check_pooled_scores_args(
        k_packed, q, weights, block_ids, lengths, options.block_size, options.fmt
    )
    supported = supports(
        options.implementation,
        fmt=options.fmt,
        dim=q.shape[-1],
        block_size=options.block_size,
        n_heads=q.shape[1],
        score_dtype=options.score_dtype,
    )
    if not supported:
        raise supported.error()
    return kernel_mgpu.pooled_scores_mgpu(
        k_packed,
        q,
        weights,
        block_ids,
        lengths,
        config=options.config,
        interpret=dispatch.interpret(options.implementation),
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _pooled_scores(k_packed, q, weights, block_ids, lengths, options):
    return _forward(k_packed, q, weights, block_ids, lengths, options)


def _pooled_scores_fwd(k_packed, q, weights, block_ids, lengths, options):
    scores = _forward(k_packed, q, weights, block_ids, lengths, options)
    return scores, (k_packed, q, weights, block_ids, lengths)


def _pooled_scores_bwd(options, residuals, cotangent):
    k_packed, q, weights, block_ids, lengths = residuals

    def definition(q, weights):
        return pool.pooled_scores(
            k_packed,
            q,
            weights,
            block_ids,
            lengths,
            block_size=options.block_size,
            fmt=options.fmt,
            score_dtype=options.score_dtype,
        )

    _, vjp = jax.vjp(definition, q, weights)
    dq, dweights = vjp(cotangent)
    # Packed keys, block ids and lengths are integers: no cotangent.
    return None, dq, dweights, None, None


_pooled_scores.defvjp(_pooled_scores_fwd, _pooled_scores_bwd)


def pooled_scores(
    k_packed: UInt8[Array, "batch seq row_bytes"],
    q: Float[Array, "batch heads dim"],
    weights: Float[Array, "batch heads"],
    block_ids: Int[Array, "batch n_blocks"],
    lengths: Int[Array, " batch"],
    *,
    block_size: int = 8,
    fmt: str = "mxfp4",
    implementation: str = "xla",
    topk: int | None = None,
    config: kernel_mgpu.TuningConfig | None = None,
    score_dtype: str = "float32",
    tie_order: str = "oldest",
    neginf_picks: str = "drop",
    ascending_ids: bool = False,
) -> Float[Array, "batch n_pool"] | TopK:
    """Scores of a query's candidate pool, optionally reduced to its top-k positions.

    Args:
      k_packed: [B, S, row_bytes] uint8 packed index keys per sequence (`ops.formats.pack`).
      q: [B, H, D] indexer queries (already fake-quantized), float32 or bfloat16.
      weights: [B, H] float head weights.
      block_ids: [B, NB] int candidate blocks, ascending, −1 padded (`CandidatePool.block_ids`).
      lengths: [B] int visible positions per query.
      block_size: positions per block.
      fmt: packed format of `k_packed`.
      implementation: 'xla' | 'pallas' | 'pallas_interpret' (`pallas_kernels.dispatch`).
      topk: None for the scores; an int k for the k best positions.
      config: tuning of the kernel (default `POOL_CONFIG`).
      score_dtype: 'float32' | 'bfloat16' (`ops.scoring.index_scores`; the kernel: float32).
      tie_order: 'oldest' | 'newest': which of equal scores the top-k keeps.
      neginf_picks: 'drop' | 'keep': with 'keep' the top-k is completed with visible positions
        outside the pool when the pool holds fewer than `topk` (`ops.pool.pool_topk_from_scores`).
      ascending_ids: with `topk`, the caller's promise that each row's valid block ids ascend
        (a `CandidatePool`'s do): the picks' sort by position is skipped
        (`ops.pool.pool_topk_from_scores`).

    Returns:
      Without `topk`: [B, NB·block_size] float32 scores in block order (slot i·block_size + j is
      position block_ids[b, i]·block_size + j), −inf for −1 blocks and positions ≥ lengths[b]
      or ≥ S. With `topk`: `TopK(indices [B, k] positions ascending then −1, scores [B, k])`.
    """
    dispatch.check_implementation(implementation)
    k_packed, q, weights = jnp.asarray(k_packed), jnp.asarray(q), jnp.asarray(weights)
    block_ids, lengths = jnp.asarray(block_ids), jnp.asarray(lengths)
    options = _Options(implementation, block_size, fmt, score_dtype, config or POOL_CONFIG)
    scores = _pooled_scores(k_packed, q, weights, block_ids, lengths, options)
    if topk is None:
        return scores
    return pool.pool_topk_from_scores(
        scores,
        block_ids,
        topk,
        block_size=block_size,
        lengths=jnp.minimum(lengths, k_packed.shape[1]),
        tie_order=tie_order,
        neginf_picks=neginf_picks,
        select=functools.partial(topk_api.topk, implementation=implementation),
        ascending_ids=ascending_ids,
    )
