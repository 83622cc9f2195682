"""`fp4_sparse_attention`: one entry point over the project's `implementation=` switch, with the
definition's backward.

DESIGN §6: each kernel has an `implementation=` switch and a `custom_vjp` whose backward uses the
definition, so a training step can call the kernel forward. Gradients flow to `q` and `sink` (the
packed caches are uint8 and the indices integers: they get none); the backward is `jax.vjp` of
`v41jax.ops.attention.packed_sparse_attention`, recomputed in XLA from the saved inputs.

| implementation       | what runs                                                      | output |
|----------------------|----------------------------------------------------------------|--------|
| 'xla'                | `ops.attention.packed_sparse_attention` (gather, unpack, fp32) | fp32   |
| 'pallas'             | the kernel `Config.backend` names, compiled for the GPU        | bf16   |
| 'pallas_interpret'   | the same kernel in the Pallas interpreter on the CPU           | bf16   |

Backends: 'mgpu' (`kernel_mgpu`, Mosaic GPU: the one the model runs) and 'triton'
(`kernel_triton`, the Triton-backend stepping stone). What each takes: `supports`.

The result is cast to q.dtype, so with bf16 queries (the real model) no implementation adds a
pass; with float32 queries the kernels' bf16 output is widened.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, UInt8

from pallas_kernels import dispatch
from pallas_kernels.sparse_attention import kernel_mgpu, kernel_triton
from v41jax.ops import attention

BACKENDS = {"mgpu": kernel_mgpu, "triton": kernel_triton}
"""The kernels 'pallas' can run, by `Config.backend`."""


@dataclasses.dataclass(frozen=True)
class Config:
    """Which kernel runs under 'pallas' / 'pallas_interpret', and the tuning of each.

    Args:
      backend: 'mgpu' (Mosaic GPU, the default) or 'triton' (the stepping stone).
      mgpu: `kernel_mgpu.TuningConfig`.
      triton: `kernel_triton.TuningConfig`.
    """

    backend: str = "mgpu"
    mgpu: kernel_mgpu.TuningConfig = dataclasses.field(default_factory=kernel_mgpu.TuningConfig)
    triton: kernel_triton.TuningConfig = dataclasses.field(
        default_factory=kernel_triton.TuningConfig
    )

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"backend: expected one of {tuple(BACKENDS)}, got {self.backend!r}")


def supports(
    implementation: str, *, kv_fmt: str, window_fmt: str, dim: int, config: Config = Config()
) -> dispatch.Support:
    """Whether `implementation` (with `config.backend` for the kernels) takes attention over
    `kv_fmt` main-KV rows and `window_fmt` window rows of `dim` values. 'xla' takes everything."""
    dispatch.check_implementation(implementation)
    if implementation == "xla":
        return dispatch.Support("xla")
    return BACKENDS[config.backend].supports(kv_fmt=kv_fmt, window_fmt=window_fmt, dim=dim)


@dataclasses.dataclass(frozen=True)
class _Static:
    implementation: str
    kv_fmt: str
    window_fmt: str
    scale: float | None
    config: Config


def _forward(static: _Static, q, kv_packed, indices, window_packed, window_valid, sink):
    args = (q, kv_packed, indices, window_packed, window_valid, sink)
    formats = dict(kv_fmt=static.kv_fmt, window_fmt=static.window_fmt, scale=static.scale)
    # An empty batch has nothing to launch a kernel for: the definition's empty result.
    if static.implementation == "xla" or q.shape[0] == 0:
        out = attention.packed_sparse_attention(*args, **formats)
    elif static.config.backend == "triton":
        out = kernel_triton.fp4_sparse_attention_triton(
            *args,
            **formats,
            config=static.config.triton,
            interpret=dispatch.interpret(static.implementation),
        )
    else:
        out = kernel_mgpu.fp4_sparse_attention_mgpu(
            *args,
            **formats,
            config=static.config.mgpu,
            interpret=dispatch.interpret(static.implementation),
        )
    return out.astype(q.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(static, q, kv_packed, indices, window_packed, window_valid, sink):
    return _forward(static, q, kv_packed, indices, window_packed, window_valid, sink)


def _attention_fwd(static, q, kv_packed, indices, window_packed, window_valid, sink):
    out = _forward(static, q, kv_packed, indices, window_packed, window_valid, sink)
    return out, (q, kv_packed, indices, window_packed, window_valid, sink)


def _attention_bwd(static, residuals, g):
    q, kv_packed, indices, window_packed, window_valid, sink = residuals

    def definition(q, sink):
        out = attention.packed_sparse_attention(
            q,
            kv_packed,
            indices,
            window_packed,
            window_valid,
            sink,
            kv_fmt=static.kv_fmt,
            window_fmt=static.window_fmt,
            scale=static.scale,
        )
        return out.astype(q.dtype)

    _, vjp = jax.vjp(definition, q, sink)
    dq, dsink = vjp(g)
    return dq, None, None, None, None, dsink


_attention.defvjp(_attention_fwd, _attention_bwd)


def fp4_sparse_attention(
    q: Float[Array, "batch head dim"],
    kv_packed: UInt8[Array, "batch n_kv kv_row"],
    indices: Int[Array, "batch topk"],
    window_packed: UInt8[Array, "batch window window_row"],
    window_valid: Bool[Array, "batch window"],
    sink: Float[Array, " head"],
    *,
    kv_fmt: str = "nvfp4",
    window_fmt: str = "fp8",
    scale: float | None = None,
    implementation: str = "xla",
    config: Config = Config(),
) -> Float[Array, "batch head dim"]:
    """Sparse attention of B single queries over packed FP4/FP8 caches (DESIGN §3 step 4, §6).

    Semantics: `v41jax.ops.attention.packed_sparse_attention` (one softmax over valid window
    keys, selected compressed keys and a per-head sink; K = V; −1 slots skipped; an empty row
    gives zeros). Differentiable in q and sink through the definition's VJP.

    Args:
      q: [B, H, D] queries, float32 or bfloat16.
      kv_packed: [B, S, packed_row_bytes(kv_fmt, D)] uint8 compressed cache of each query.
      indices: [B, K] integer rows of kv_packed (−1 or out of range: skipped).
      window_packed: [B, W, packed_row_bytes(window_fmt, D)] uint8 window rows of each query.
      window_valid: [B, W] bool (a validity mask, not a count: ring slots fill out of order).
      sink: [H] float sink logits.
      kv_fmt, window_fmt: packed formats; what the kernels decode: `supports`.
      scale: logit scale, a Python number; default D^-0.5.
      implementation: 'xla' | 'pallas' | 'pallas_interpret' (`pallas_kernels.dispatch`).
      config: `Config`: the kernel backend and its tuning.

    Returns:
      [B, H, D] in q.dtype.
    """
    dispatch.check_implementation(implementation)
    q, kv_packed, indices = jnp.asarray(q), jnp.asarray(kv_packed), jnp.asarray(indices)
    window_packed, window_valid = jnp.asarray(window_packed), jnp.asarray(window_valid)
    sink = jnp.asarray(sink)
    attention.check_packed_attention_args(
        q, kv_packed, indices, window_packed, window_valid, sink, kv_fmt, window_fmt
    )
    supported = supports(
        implementation, kv_fmt=kv_fmt, window_fmt=window_fmt, dim=q.shape[-1], config=config
    )
    if not supported:
        raise supported.error()
    if scale is not None:
        scale = float(scale)
    static = _Static(implementation, kv_fmt, window_fmt, scale, config)
    indices = indices.astype(jnp.int32)
    return _attention(static, q, kv_packed, indices, window_packed, window_valid, sink)
