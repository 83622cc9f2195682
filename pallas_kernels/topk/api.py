"""The top-k after a kernel's scores: one entry point over the project's `implementation=` switch
(`pallas_kernels.dispatch`).

    picks = topk(scores, 512, implementation="pallas")   # TopK: positions ascending, −1 padded

- 'xla': `v41jax.ops.scoring.topk`, the definition: XLA's sort-based `lax.top_k`, then the picks
  sorted by position.
- 'pallas' / 'pallas_interpret': the same picks bit for bit (ties, −inf, NaN and ±0 included)
  by one of two methods, both made of XLA ops, not Pallas kernels (they run the same on the GPU
  and the CPU), standing in the kernel routes where their scores are selected (pooled scoring
  with `topk`, the source scan's selections):
  - 'blocks' (default): `blocks.topk`, the sort of the definition run over the best blocks of 8
    by max only (recursively), a fraction of the scores;
  - 'radix': `radix.threshold_topk`, radix select and compaction, no sort. Measured on the H200
    (BENCHMARKS.md, 2026-12-02): as fast as the sort at 16,384 scores (a chain of small
    kernels), 1.5× faster at 131,072.
  What they take: `supports` (not `neginf_picks='keep'` with a mask).
"""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from pallas_kernels import dispatch
from pallas_kernels.topk import blocks, radix
from v41jax.ops import scoring
from v41jax.ops.scoring import TopK

METHODS = ("blocks", "radix")
"""The kernel implementations' selections (module docstring)."""


def supports(
    implementation: str,
    *,
    masked: bool = False,
    neginf_picks: str = "drop",
    method: str = "blocks",
    digit_bits: int = 4,
) -> dispatch.Support:
    """Whether `implementation` takes a top-k with (`masked`) or without a mask, under
    `neginf_picks`, by `method`, deciding `digit_bits` bits per counting pass of 'radix' ('xla'
    takes every call)."""
    dispatch.check_implementation(implementation)
    if implementation == "xla":
        return dispatch.Support("xla")
    return dispatch.support(
        f"the top-k by {method!r} (pallas_kernels.topk)",
        (method in METHODS, "method", f"one of {METHODS}", method),
        (
            not (masked and neginf_picks == "keep"),
            "neginf_picks",
            "'drop' with a mask (out-of-mask picks are the definition's: implementation='xla')",
            neginf_picks,
        ),
        (digit_bits in radix.DIGIT_BITS, "digit_bits", f"one of {radix.DIGIT_BITS}", digit_bits),
    )


def topk(
    scores: Float[Array, "*batch n_pos"],
    k: int,
    mask: Bool[Array, "*batch n_pos"] | None = None,
    *,
    tie_order: str = "oldest",
    neginf_picks: str = "drop",
    implementation: str = "xla",
    method: str = "blocks",
    digit_bits: int = 4,
) -> TopK:
    """`ops.scoring.topk(scores, k, mask, tie_order=..., neginf_picks=...)` by `implementation`.

    Args:
      scores, k, mask, tie_order, neginf_picks: as `ops.scoring.topk` (its checks and errors).
      implementation: 'xla' | 'pallas' | 'pallas_interpret' (module docstring).
      method: the kernel implementations' selection, 'blocks' | 'radix' (module docstring).
      digit_bits: key bits each counting pass of the radix select decides (`radix.DIGIT_BITS`;
        fewer bits: more passes, fewer counts per pass).

    Returns:
      `TopK(indices [..., k] int32 ascending then −1, scores [..., k] float32)`, equal to the
      definition's.
    """
    dispatch.check_implementation(implementation)
    if implementation == "xla":
        return scoring.topk(scores, k, mask, tie_order=tie_order, neginf_picks=neginf_picks)
    scores, k, mask, tie_order, neginf_picks = scoring.check_topk_args(
        scores, k, mask, tie_order, neginf_picks
    )
    supported = supports(
        implementation,
        masked=mask is not None,
        neginf_picks=neginf_picks,
        method=method,
        digit_bits=digit_bits,
    )
    if not supported:
        raise supported.error()
    if mask is not None:
        scores = jnp.where(mask, scores, -jnp.inf)
    n_pos = scores.shape[-1]
    n_picks = min(k, n_pos)
    if method == "radix":
        picks = radix.threshold_topk(scores, n_picks, tie_order=tie_order, digit_bits=digit_bits)
    else:
        picks = blocks.topk(scores, n_picks, tie_order=tie_order, leaf=scoring.topk)
    pad = [(0, 0)] * (scores.ndim - 1) + [(0, k - n_picks)]
    return TopK(
        jnp.pad(picks.indices, pad, constant_values=-1),
        jnp.pad(picks.scores, pad, constant_values=-jnp.inf),
    )
