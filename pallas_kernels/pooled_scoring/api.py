"""Pooled indexer scoring: one entry point, several implementations (DESIGN §6.1).

    scores = pooled_scores(k_packed, q, weights, block_ids, lengths)                 # [B, NB·8]
    picks = pooled_scores(..., implementation="pallas", topk=512)  # TopK(positions, scores)

Implementations:
- 'xla': `reference.pooled_scores_reference`, the op's definition (gather the pool's rows,
  dequantize, einsum); any format, block size and head dim.
- 'pallas': the Mosaic GPU kernel (`kernel_mgpu`), for MXFP4 keys of dim 128 in blocks of 8 on a
  Hopper GPU; `interpret=True` runs the same kernel in the Mosaic GPU interpreter on the CPU.

The gradient (w.r.t. q and weights) is always the reference's (`jax.vjp`), so training can call
the kernel's forward. With `topk`, the pool's best positions are selected from the scores
(`reference.pool_topk_from_scores`, `scoring.topk`'s tie rule) and their scores carry the
gradient.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal

import jax
from jaxtyping import Array, Float, Int, UInt8

from pallas_kernels.pooled_scoring import kernel_mgpu, reference
from v41jax import scoring

Implementation = Literal["xla", "pallas"]
IMPLEMENTATIONS: tuple[Implementation, ...] = ("xla", "pallas")


@dataclasses.dataclass(frozen=True)
class _Options:
    implementation: Implementation
    block_size: int
    fmt: str
    config: kernel_mgpu.TuningConfig
    interpret: bool


def _forward(k_packed, q, weights, block_ids, lengths, options: _Options):
    if options.implementation == "xla":
        return reference.pooled_scores_reference(
            k_packed,
            q,
            weights,
            block_ids,
            lengths,
            block_size=options.block_size,
            fmt=options.fmt,
        )
    reference._check(k_packed, q, weights, block_ids, lengths, options.block_size, options.fmt)
    if (options.fmt, options.block_size, q.shape[-1]) != ("mxfp4", kernel_mgpu.BLOCK_SIZE, 128):
        raise ValueError(
            "implementation='pallas' supports fmt='mxfp4', block_size=8 and dim 128 only, got "
            f"fmt={options.fmt!r}, block_size={options.block_size}, dim={q.shape[-1]}"
        )
    return kernel_mgpu.pooled_scores_mgpu(
        k_packed,
        q,
        weights,
        block_ids,
        lengths,
        config=options.config,
        interpret=options.interpret,
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _pooled_scores(k_packed, q, weights, block_ids, lengths, options):
    return _forward(k_packed, q, weights, block_ids, lengths, options)


def _pooled_scores_fwd(k_packed, q, weights, block_ids, lengths, options):
    scores = _forward(k_packed, q, weights, block_ids, lengths, options)
    return scores, (k_packed, q, weights, block_ids, lengths)


def _pooled_scores_bwd(options, residuals, cotangent):
    k_packed, q, weights, block_ids, lengths = residuals

    def ref(q, weights):
        return reference.pooled_scores_reference(
            k_packed,
            q,
            weights,
            block_ids,
            lengths,
            block_size=options.block_size,
            fmt=options.fmt,
        )

    _, vjp = jax.vjp(ref, q, weights)
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
    implementation: Implementation = "xla",
    topk: int | None = None,
    config: kernel_mgpu.TuningConfig | None = None,
    interpret: bool = False,
) -> Float[Array, "batch n_pool"] | scoring.TopK:
    """Scores of a query's candidate pool, optionally reduced to its top-k positions.

    Args:
      k_packed: [B, S, row_bytes] uint8 packed index keys per sequence (`quant.pack`).
      q: [B, H, D] indexer queries (already fake-quantized), float32 or bfloat16.
      weights: [B, H] float head weights.
      block_ids: [B, NB] int candidate blocks, ascending, −1 padded (`CandidatePool.block_ids`).
      lengths: [B] int visible positions per query.
      block_size: positions per block.
      fmt: packed format of `k_packed`.
      implementation: 'xla' (the reference) or 'pallas' (Mosaic GPU kernel).
      topk: None for the scores; an int k for the k best positions.
      config: tuning of the 'pallas' kernel (default `kernel_mgpu.TuningConfig()`).
      interpret: run the 'pallas' kernel in the Mosaic GPU interpreter (CPU tests).

    Returns:
      Without `topk`: [B, NB·block_size] float32 scores in block order (slot i·block_size + j is
      position block_ids[b, i]·block_size + j), −inf for −1 blocks and positions ≥ lengths[b]
      or ≥ S. With `topk`: `TopK(indices [B, k] positions ascending then −1, scores [B, k])`.
    """
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"implementation: expected one of {IMPLEMENTATIONS}, got {implementation!r}"
        )
    options = _Options(
        implementation, block_size, fmt, config or kernel_mgpu.TuningConfig(), interpret
    )
    scores = _pooled_scores(k_packed, q, weights, block_ids, lengths, options)
    if topk is None:
        return scores
    return reference.pool_topk_from_scores(scores, block_ids, topk, block_size=block_size)
