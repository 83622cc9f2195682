"""The top-k after a kernel's scores: one entry point over the project's `implementation=` switch
(`pallas_kernels.dispatch`).

    picks = topk(scores, 512, implementation="pallas")   # TopK: positions ascending, −1 padded

- 'xla': `v41jax.ops.scoring.topk`, the definition: XLA's sort-based `lax.top_k`, then the picks
  sorted by position.
- 'pallas' / 'pallas_interpret': the same picks bit for bit (ties, −inf, NaN and ±0 included)
  by one of three methods. The first two are made of XLA ops, not Pallas kernels (they run the
  same on the GPU and the CPU), and stand in the kernel routes where their scores are selected
  (pooled scoring with `topk`, the source scan's selections):
  - 'blocks': `blocks.topk`, the sort of the definition run over the best blocks of 8 by max
    only (recursively), a fraction of the scores;
  - 'radix': `radix.threshold_topk`, radix select and compaction, no sort. Measured on the H200
    (BENCHMARKS.md, 2026-12-02): as fast as the sort at 16,384 scores (a chain of small
    kernels), 1.5× faster at 131,072.
  - 'kernel': `kernel_triton.select`, the radix select and its compaction in one Pallas
    program per row (interpreted under 'pallas_interpret'; a pool's row of 16,384 scores is
    split over two programs, then their picks selected by a third:
    `kernel_triton.default_segments`), on the whole row where it has at most
    `kernel_triton.MAX_N` scores, else as the leaves of the selection through the best
    blocks. Compiled on the H200 (2026-12-04, BENCHMARKS.md): equal to the definition at 1-
    and 2-bit passes, and with 2-bit passes 1.6× 'blocks' at 16,384 scores, 2.3× at 131,072.
  What they take: `supports` (not `neginf_picks='keep'` with a mask; 'kernel': rows or k·8 of
  at most `kernel_triton.MAX_N`). The default (`default_method`): 'kernel' with 1-bit passes
  under 'pallas' wherever it takes the call, else 'blocks'; 'blocks' under 'pallas_interpret'
  (the Triton interpreter runs the kernel op by op: minutes on a CPU at a pool's size; the
  tests run it interpreted on small rows). Every method makes the same picks.
"""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from pallas_kernels import dispatch
from pallas_kernels.topk import blocks, kernel_triton, radix
from v41jax.ops import scoring
from v41jax.ops.scoring import TopK

METHODS = ("blocks", "radix", "kernel")
"""The kernel implementations' selections (module docstring)."""

KERNEL_DIGIT_BITS = 1
"""The kernel's bits per counting pass by default: the fastest measured on the H200
(results/bench_topk_h200_2026-12-04_bits12.json: 1-bit passes 0.036 ms against 2-bit 0.043 ms
at 16,384 scores, 0.108 against 0.141 ms at 131,072, × 64 rows; 4-bit passes compile slowly).
A 2-bit pass makes 3 block-wide counts where a 1-bit pass makes 1: twice the passes cost less."""


def default_method(
    implementation: str,
    *,
    masked: bool = False,
    neginf_picks: str = "drop",
    n_pos: int = 1,
    k: int = 1,
) -> tuple[str, int]:
    """The `(method, digit_bits)` a call of `topk` without them runs (module docstring): the
    kernel where `implementation` is 'pallas' and the kernel `supports` the call, else 'blocks'
    (whose digit_bits are unused)."""
    dispatch.check_implementation(implementation)
    kernel = ("kernel", KERNEL_DIGIT_BITS)
    if implementation == "pallas" and supports(
        implementation,
        masked=masked,
        neginf_picks=neginf_picks,
        n_pos=n_pos,
        k=k,
        method=kernel[0],
        digit_bits=kernel[1],
    ):
        return kernel
    return "blocks", 4


def supports(
    implementation: str,
    *,
    masked: bool = False,
    neginf_picks: str = "drop",
    method: str = "blocks",
    digit_bits: int = 4,
    n_pos: int = 1,
    k: int = 1,
) -> dispatch.Support:
    """Whether `implementation` takes a top-k of `k` from `n_pos` scores per row with
    (`masked`) or without a mask, under `neginf_picks`, by `method`, deciding `digit_bits` bits
    per counting pass of 'radix' and 'kernel' ('xla' takes every call)."""
    dispatch.check_implementation(implementation)
    if implementation == "xla":
        return dispatch.Support("xla")
    neginf = (
        not (masked and neginf_picks == "keep"),
        "neginf_picks",
        "'drop' with a mask (out-of-mask picks are the definition's: implementation='xla')",
        neginf_picks,
    )
    if method == "kernel":
        longest = kernel_triton.MAX_N
        return dispatch.support(
            "the top-k by 'kernel' (pallas_kernels.topk)",
            neginf,
            (
                n_pos <= longest or 8 * k <= longest,
                "n_pos, k",
                f"rows of at most {longest} scores, or k of at most {longest // 8}",
                (n_pos, k),
            ),
            (
                digit_bits in kernel_triton.DIGIT_BITS,
                "digit_bits",
                f"one of {kernel_triton.DIGIT_BITS}",
                digit_bits,
            ),
        )
    return dispatch.support(
        f"the top-k by {method!r} (pallas_kernels.topk)",
        (method in METHODS, "method", f"one of {METHODS}", method),
        neginf,
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
    method: str | None = None,
    digit_bits: int | None = None,
) -> TopK:
    """`ops.scoring.topk(scores, k, mask, tie_order=..., neginf_picks=...)` by `implementation`.

    Args:
      scores, k, mask, tie_order, neginf_picks: as `ops.scoring.topk` (its checks and errors).
      implementation: 'xla' | 'pallas' | 'pallas_interpret' (module docstring).
      method: the kernel implementations' selection, 'blocks' | 'radix' | 'kernel', or None:
        `default_method`'s (module docstring).
      digit_bits: key bits each counting pass of the radix select decides (`radix.DIGIT_BITS`,
        `kernel_triton.DIGIT_BITS` for 'kernel'; fewer bits: more passes, fewer counts each);
        None: 4, or `default_method`'s with the default method.

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
    if method is None:
        method, default_bits = default_method(
            implementation,
            masked=mask is not None,
            neginf_picks=neginf_picks,
            n_pos=scores.shape[-1],
            k=k,
        )
        digit_bits = default_bits if digit_bits is None else digit_bits
    elif digit_bits is None:
        digit_bits = 4
    supported = supports(
        implementation,
        masked=mask is not None,
        neginf_picks=neginf_picks,
        method=method,
        digit_bits=digit_bits,
        n_pos=scores.shape[-1],
        k=k,
    )
    if not supported:
        raise supported.error()
    if mask is not None:
        scores = jnp.where(mask, scores, -jnp.inf)
    n_pos = scores.shape[-1]
    n_picks = min(k, n_pos)
    if method == "radix":
        picks = radix.threshold_topk(scores, n_picks, tie_order=tie_order, digit_bits=digit_bits)
    elif method == "kernel":
        picks = _kernel_topk(
            scores,
            n_picks,
            tie_order=tie_order,
            digit_bits=digit_bits,
            interpret=dispatch.interpret(implementation),
        )
    else:
        picks = blocks.topk(scores, n_picks, tie_order=tie_order, leaf=scoring.topk)
    pad = [(0, 0)] * (scores.ndim - 1) + [(0, k - n_picks)]
    return TopK(
        jnp.pad(picks.indices, pad, constant_values=-1),
        jnp.pad(picks.scores, pad, constant_values=-jnp.inf),
    )


def _kernel_topk(scores, k: int, *, tie_order: str, digit_bits: int, interpret: bool) -> TopK:
    """'kernel': `kernel_triton.select` on the whole row, or on the leaves of the selection
    through the best blocks where the row is longer than the kernel holds."""

    def leaf(scores, k, *, tie_order):
        if k == 0:
            return scoring.topk(scores, 0, tie_order=tie_order)  # nothing to select
        return kernel_triton.select(
            scores, k, tie_order=tie_order, digit_bits=digit_bits, interpret=interpret
        )

    if scores.shape[-1] <= kernel_triton.MAX_N:
        return leaf(scores, k, tie_order=tie_order)
    return blocks.topk(scores, k, tie_order=tie_order, leaf=leaf)
