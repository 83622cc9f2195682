"""The pre-norm residual block: CSA2 attention, then a dense SwiGLU FFN (DESIGN §3 step 5).

A block owns its wiring: `__call__` (prefill and training) and `decode` share one residual stack
(`_residual`), so the model only loops over blocks.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
from flax import nnx
from jaxtyping import Array, Float, Int

from v41jax.nn.attention import Attention
from v41jax.nn.cache import LayerCache
from v41jax.nn.config import ModelConfig
from v41jax.nn.selection import SharedState


class SwiGLU(nnx.Module):
    """Dense SwiGLU FFN (the real model's MoE and hyper-connections are out of scope)."""

    def __init__(self, dim: int, hidden: int, *, rngs: nnx.Rngs):
        self.w1 = nnx.Linear(dim, hidden, use_bias=False, rngs=rngs)
        self.w3 = nnx.Linear(dim, hidden, use_bias=False, rngs=rngs)
        self.w2 = nnx.Linear(hidden, dim, use_bias=False, rngs=rngs)

    def __call__(self, x):
        return self.w2(jax.nn.silu(self.w1(x)) * self.w3(x))


class LayerTrace(NamedTuple):
    """One block of a prefill: its normalized attention input, the shared state after it, and
    the attention's aux (`Attention.__call__`)."""

    x: Float[Array, "b t dim"]
    shared: SharedState
    aux: dict[str, Array]


class Block(nnx.Module):
    """Pre-norm residual block: h + attention(norm(h)), then h + FFN(norm(h))."""

    def __init__(self, config: ModelConfig, layer: int, *, rngs: nnx.Rngs):
        self.attn_norm = nnx.RMSNorm(config.dim, epsilon=config.norm_eps, rngs=rngs)
        self.attn = Attention(config, config.layers[layer], rngs=rngs)
        self.ffn_norm = nnx.RMSNorm(config.dim, epsilon=config.norm_eps, rngs=rngs)
        self.ffn = SwiGLU(config.dim, config.ffn_dim, rngs=rngs)

    def _residual(self, h, attention_out):
        h = h + attention_out
        return h + self.ffn(self.ffn_norm(h))

    def __call__(
        self, h: Float[Array, "b t dim"], shared: SharedState, **options
    ) -> tuple[Float[Array, "b t dim"], SharedState, LayerTrace]:
        """Prefill over [B, T]; `options` are `Attention.__call__`'s keywords. Returns the new
        residual stream, the shared state and this block's `LayerTrace`."""
        x = self.attn_norm(h)
        out, shared, aux = self.attn(x, shared, **options)
        return self._residual(h, out), shared, LayerTrace(x, shared, aux)

    def decode(
        self,
        h: Float[Array, "b dim"],
        shared: SharedState,
        cache: LayerCache,
        positions: Int[Array, " b"],
        **options,
    ) -> tuple[Float[Array, "b dim"], SharedState, LayerCache]:
        """One token per sequence; `options` are `Attention.decode`'s keywords."""
        out, shared, cache = self.attn.decode(
            self.attn_norm(h), shared, cache, positions, **options
        )
        return self._residual(h, out), shared, cache

    def prefill_cache(self, trace: LayerTrace, lengths, max_len: int) -> LayerCache:
        """This block's packed cache after the prefill that produced `trace`."""
        return self.attn.prefill_cache(trace.x, trace.shared, lengths, max_len)
