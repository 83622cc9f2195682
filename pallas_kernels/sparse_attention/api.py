"""`fp4_sparse_attention`: one entry point, `implementation=` dispatch, a reference backward.

DESIGN §6: each kernel has an `implementation=` switch and a `custom_vjp` whose backward uses the
reference, so a training step can call the kernel forward. Gradients flow to `q` and `sink` (the
packed caches are uint8 and the indices integers: they get none); the backward is `jax.vjp` of
`fp4_sparse_attention_reference`, recomputed in XLA from the saved inputs.

| implementation    | what runs                                                   | output  |
|-------------------|-------------------------------------------------------------|---------|
| 'xla'             | `fp4_sparse_attention_reference` (gather, jnp unpack, fp32) | fp32    |
| 'pallas'          | the Mosaic GPU kernel (`sparse_attention_mgpu`)             | bf16    |
| 'pallas_mgpu'     | the same, by its backend's name                             | bf16    |
| 'pallas_triton'   | the Triton-backend stepping stone (`sparse_attention_triton`)| bf16   |

The result is cast to q.dtype, so with bf16 queries (the real model) no implementation adds a
pass; with float32 queries the kernels' bf16 output is widened.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, UInt8

from pallas_kernels.sparse_attention import sparse_attention_mgpu, sparse_attention_triton
from pallas_kernels.sparse_attention.reference import fp4_sparse_attention_reference
from v41jax import quant

IMPLEMENTATIONS = ("xla", "pallas", "pallas_mgpu", "pallas_triton")


@dataclasses.dataclass(frozen=True)
class Config:
    """Tuning of every backend; each reads its own field.

    Args:
      mgpu: `sparse_attention_mgpu.TuningConfig` ('pallas', 'pallas_mgpu').
      triton: `sparse_attention_triton.TuningConfig` ('pallas_triton').
    """

    mgpu: sparse_attention_mgpu.TuningConfig = dataclasses.field(
        default_factory=sparse_attention_mgpu.TuningConfig
    )
    triton: sparse_attention_triton.TuningConfig = dataclasses.field(
        default_factory=sparse_attention_triton.TuningConfig
    )


@dataclasses.dataclass(frozen=True)
class _Static:
    implementation: str
    kv_fmt: str
    window_fmt: str
    scale: float | None
    config: Config
    interpret: bool


def _forward(static: _Static, q, kv_packed, indices, window_packed, window_valid, sink):
    args = (q, kv_packed, indices, window_packed, window_valid, sink)
    formats = dict(kv_fmt=static.kv_fmt, window_fmt=static.window_fmt, scale=static.scale)
    if static.implementation == "xla":
        out = fp4_sparse_attention_reference(*args, **formats)
    elif static.implementation == "pallas_triton":
        out = sparse_attention_triton.fp4_sparse_attention_triton(
            *args, **formats, config=static.config.triton, interpret=static.interpret
        )
    else:
        out = sparse_attention_mgpu.fp4_sparse_attention_mgpu(
            *args, **formats, config=static.config.mgpu, interpret=static.interpret
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

    def reference(q, sink):
        out = fp4_sparse_attention_reference(
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

    _, vjp = jax.vjp(reference, q, sink)
    dq, dsink = vjp(g)
    return dq, None, None, None, None, dsink


_attention.defvjp(_attention_fwd, _attention_bwd)


def _check(name: str, x: jax.Array, ndim: int, layout: str, kind) -> None:
    if x.ndim != ndim or not jnp.issubdtype(x.dtype, kind):
        raise ValueError(f"{name}: expected {layout} {kind.__name__}, got {x.dtype}{x.shape}")


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
    interpret: bool = False,
) -> Float[Array, "batch head dim"]:
    """Sparse attention of B single queries over packed FP4/FP8 caches (DESIGN §3 step 4, §6).

    Semantics: `fp4_sparse_attention_reference` (one softmax over valid window keys, selected
    compressed keys and a per-head sink; K = V; −1 slots skipped; an empty row gives zeros).
    Differentiable in q and sink through the reference's VJP.

    Args:
      q: [B, H, D] queries, float32 or bfloat16.
      kv_packed: [B, S, packed_row_bytes(kv_fmt, D)] uint8 compressed cache of each query.
      indices: [B, K] integer rows of kv_packed (−1 or out of range: skipped).
      window_packed: [B, W, packed_row_bytes(window_fmt, D)] uint8 window rows of each query.
      window_valid: [B, W] bool (a validity mask, not a count: ring slots fill out of order).
      sink: [H] float sink logits.
      kv_fmt, window_fmt: packed formats; the kernels decode only ('nvfp4', 'fp8').
      scale: logit scale, a Python number; default D^-0.5.
      implementation: one of IMPLEMENTATIONS (see the module docstring).
      config: `Config` of the kernels.
      interpret: run a Pallas kernel on CPU in interpret mode (tests; small sizes).

    Returns:
      [B, H, D] in q.dtype.
    """
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"implementation: expected one of {IMPLEMENTATIONS}, got {implementation!r}"
        )
    q, kv_packed, indices = jnp.asarray(q), jnp.asarray(kv_packed), jnp.asarray(indices)
    window_packed, window_valid = jnp.asarray(window_packed), jnp.asarray(window_valid)
    sink = jnp.asarray(sink)
    _check("q", q, 3, "[B, H, D]", jnp.floating)
    _check("kv_packed", kv_packed, 3, "[B, S, row_bytes]", jnp.unsignedinteger)
    _check("indices", indices, 2, "[B, K]", jnp.integer)
    _check("window_packed", window_packed, 3, "[B, W, row_bytes]", jnp.unsignedinteger)
    _check("window_valid", window_valid, 2, "[B, W]", jnp.bool_)
    _check("sink", sink, 1, "[H]", jnp.floating)
    batch, n_heads, dim = q.shape
    for name, x, fmt in (
        ("kv_packed", kv_packed, kv_fmt),
        ("window_packed", window_packed, window_fmt),
    ):
        want = (batch, x.shape[1], quant.packed_row_bytes(fmt, dim))
        if x.shape != want or x.dtype != jnp.uint8:
            raise ValueError(
                f"{name}: expected uint8{want} ({fmt} rows of D = {dim}), got {x.dtype}{x.shape}"
            )
    if indices.shape[0] != batch:
        raise ValueError(f"indices: expected [{batch}, K] (q's B), got {indices.shape}")
    if window_valid.shape != window_packed.shape[:2]:
        raise ValueError(
            f"window_valid: expected {window_packed.shape[:2]} (window_packed's [B, W]), "
            f"got {window_valid.shape}"
        )
    if sink.shape != (n_heads,):
        raise ValueError(f"sink: expected shape ({n_heads},) (q's H), got {sink.shape}")
    if scale is not None:
        scale = float(scale)
    static = _Static(implementation, kv_fmt, window_fmt, scale, config, interpret)
    indices = indices.astype(jnp.int32)
    return _attention(static, q, kv_packed, indices, window_packed, window_valid, sink)
