"""The lightning indexer of Full and Reindex layers (DESIGN §3 step 2, `v41_architecture.md` §3).

Queries come from the shared low-rank query latent `qr` (the one the main attention uses), keys
from the pre-RoPE compressed latent: k = RMSNorm(wk(latent)). Both get RoPE on their tail at
their own positions (tokens for queries, j·ratio for keys) and the index format's fake-quant
(MXFP4 by default). Head weights are w = weights_proj(x) / sqrt(index_head_dim · index_n_heads).
The scores themselves are `v41jax.ops.scoring.index_scores`, a pure function.

A Full layer's indexer owns keys (`wk`, `k_norm`); a Reindex layer's has the query side only and
scores the latest Full layer's keys. The indexer's training signal, `indexer_kl`, is here too.
"""

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Bool, Float, Int

from v41jax.nn.config import ModelConfig
from v41jax.nn.rope import apply_rope
from v41jax.ops import formats


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
        # Indexers live in layers with compressed KV only: their base and YaRN.
        theta, yarn = c.rope(compress_ratio=1)
        x = apply_rope(x, positions, c.rope_head_dim, theta, yarn=yarn)
        return formats.fake_quant(x, c.index_format)

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


def indexer_kl(
    scores: Float[Array, "*rows s"],
    probs: Float[Array, "*rows heads s"],
    key_mask: Bool[Array, "*rows s"],
) -> tuple[Float[Array, ""], Float[Array, ""]]:
    """The indexer's KL loss over the keys a layer attended to (DESIGN §7, DSA / Megatron CSA2).

    Target: the main attention's probabilities of those keys (each head normalized over window,
    selected keys and sink, as the layer computed them), summed over heads and renormalized over
    the keys, detached. Student: log-softmax of the index scores over the same keys. Returns
    (Σ over query rows of KL(target ‖ student), the number of rows that have a key); rows without
    a key contribute nothing.

    Args:
      scores: [..., S] index scores (finite at every position `key_mask` holds).
      probs: [..., H, S] main-attention probabilities of the compressed positions.
      key_mask: [..., S] the keys the layer attended to.
    """
    target = jax.lax.stop_gradient(jnp.sum(probs, axis=-2))
    target = jnp.where(key_mask, target, 0.0)
    total = jnp.sum(target, axis=-1, keepdims=True)
    has_key = total[..., 0] > 0
    target = target / jnp.where(has_key[..., None], total, 1.0)
    student = jnp.where(key_mask & has_key[..., None], scores, -jnp.inf)
    log_student = jax.nn.log_softmax(jnp.where(has_key[..., None], student, 0.0), axis=-1)
    positive = target > 0
    log_target = jnp.log(jnp.where(positive, target, 1.0))
    terms = jnp.where(positive, target * (log_target - log_student), 0.0)
    kl = jnp.where(has_key, jnp.sum(terms, axis=-1), 0.0)
    return jnp.sum(kl), jnp.sum(has_key).astype(jnp.float32)
