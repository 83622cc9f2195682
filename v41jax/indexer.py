"""The lightning indexer of Full and Reindex layers (DESIGN §3 step 2, `v41_architecture.md` §3).

Queries come from the shared low-rank query latent `qr` (the one the main attention uses), keys
from the pre-RoPE compressed latent: k = RMSNorm(wk(latent)). Both get RoPE on their tail at
their own positions (tokens for queries, j·ratio for keys) and the index format's fake-quant
(MXFP4 by default). Head weights are w = weights_proj(x) / sqrt(index_head_dim · index_n_heads).
The scores themselves are `v41jax.scoring.index_scores`, a pure function.

A Full layer's indexer owns keys (`wk`, `k_norm`); a Reindex layer's has the query side only and
scores the latest Full layer's keys.
"""

import math

import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from v41jax import quant
from v41jax.config import ModelConfig
from v41jax.rope import apply_rope


class Indexer(nnx.Module):
    """Indexer queries and head weights, and (when `owns_keys`) index keys."""

    def __init__(self, config: ModelConfig, *, owns_keys: bool, rngs: nnx.Rngs):
        self.config = config
        heads, width = config.index_n_heads, config.index_head_dim
        self.wq_b = nnx.Linear(config.q_lora_rank, heads * width, use_bias=False, rngs=rngs)
        self.weights_proj = nnx.Linear(config.dim, heads, use_bias=False, rngs=rngs)
        self.weight_scale = 1.0 / math.sqrt(width * heads)
        if owns_keys:
            self.wk = nnx.Linear(config.head_dim, width, use_bias=False, rngs=rngs)
            self.k_norm = nnx.RMSNorm(width, epsilon=config.norm_eps, rngs=rngs)
        else:
            self.wk = self.k_norm = None

    def _rotate_and_quantize(self, x, positions):
        c = self.config
        x = apply_rope(x, positions, c.rope_head_dim, c.compress_rope_theta)
        return quant.fake_quant(x, c.index_format)

    def queries(
        self,
        qr: Float[Array, "*batch q_lora"],
        x: Float[Array, "*batch dim"],
        positions: Int[Array, "*batch"],
    ) -> tuple[Float[Array, "*batch heads index_dim"], Float[Array, "*batch heads"]]:
        """Quantized queries [..., H, D] and head weights [..., H] of tokens at `positions`."""
        c = self.config
        q = self.wq_b(qr).reshape(*qr.shape[:-1], c.index_n_heads, c.index_head_dim)
        q = self._rotate_and_quantize(q, positions[..., None])
        weights = self.weights_proj(x).astype(jnp.float32) * self.weight_scale
        return q, weights

    def keys(
        self, latent: Float[Array, "*batch head_dim"], entry_positions: Int[Array, "*batch"]
    ) -> Float[Array, "*batch index_dim"]:
        """Quantized index keys of compressed entries; `entry_positions` = j · ratio."""
        if self.wk is None:
            raise ValueError(
                "Indexer.keys: this indexer belongs to a Reindex layer and owns no keys"
            )
        return self._rotate_and_quantize(self.k_norm(self.wk(latent)), entry_positions)
