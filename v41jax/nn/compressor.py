"""The Compressor of a KV source layer (DESIGN §3 step 1, `v41_architecture.md` §2).

Non-overlapping groups of `ratio` consecutive tokens, aligned at position 0, are pooled into one
entry: for ratio > 1 a per-channel softmax over the group's tokens of a learned gate score weights
the group's projected KV (in float32); ratio 1 is a plain projection. RMSNorm follows. The output
is the *pre-RoPE* latent: the indexer builds its keys from it, and the main KV is the latent
rotated at the group's first token (j·ratio) and then quantized, both done by the caller.

Entry j covers tokens [j·r, j·r + r − 1] and is visible to a query at position p iff
j < (p + 1) // r. In decode, tokens fill a per-sequence buffer of r slots and the entry is pooled
when its last token arrives (`Compressor.decode`); `pool_group` is shared by both paths so they
agree bit for bit.
"""

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Bool, Float, Int

from v41jax.nn.config import ModelConfig


def pool_group(
    kv: Float[Array, "*batch ratio dim"], score: Float[Array, "*batch ratio dim"] | None
) -> Float[Array, "*batch dim"]:
    """Softmax-gated pooling over the group axis (-2); `score=None` means ratio 1 (no gate)."""
    if score is None:
        return kv[..., 0, :]
    weights = jax.nn.softmax(score.astype(jnp.float32), axis=-2)
    return jnp.sum(weights * kv.astype(jnp.float32), axis=-2)


class Compressor(nnx.Module):
    """Projects, pools and normalizes groups of `ratio` tokens into compressed entries."""

    def __init__(self, config: ModelConfig, ratio: int, *, rngs: nnx.Rngs):
        if ratio < 1:
            raise ValueError(f"ratio: expected >= 1 for a Compressor, got {ratio}")
        self.ratio = ratio
        self.wkv = nnx.Linear(config.dim, config.head_dim, use_bias=False, rngs=rngs)
        # The gate exists only where there is a group to pool over (V4.1: ratio 1 has no wgate).
        self.wgate = (
            nnx.Linear(config.dim, config.head_dim, use_bias=False, rngs=rngs)
            if ratio > 1
            else None
        )
        self.norm = nnx.RMSNorm(config.head_dim, epsilon=config.norm_eps, rngs=rngs)

    def project(
        self, x: Float[Array, "*batch dim"]
    ) -> tuple[Float[Array, "*batch head_dim"], Float[Array, "*batch head_dim"] | None]:
        """Per-token KV and gate score (None for ratio 1), float32: what a decode step buffers."""
        kv = self.wkv(x).astype(jnp.float32)
        score = None if self.wgate is None else self.wgate(x).astype(jnp.float32)
        return kv, score

    def finish(self, kv: Float[Array, "*b ratio d"], score) -> Float[Array, "*b d"]:
        """Pools one group of projected tokens and normalizes it into a pre-RoPE latent."""
        return self.norm(pool_group(kv, score))

    def __call__(self, x: Float[Array, "batch seq dim"]) -> Float[Array, "batch entries head_dim"]:
        """Compresses a whole prefix: [B, T, dim] → [B, T // ratio, head_dim] pre-RoPE latents.

        The trailing T % ratio tokens form no entry yet (see `project` for the decode buffer).
        """
        batch, seq, _ = x.shape
        n = seq // self.ratio
        kv, score = self.project(x[:, : n * self.ratio])
        group = lambda a: None if a is None else a.reshape(batch, n, self.ratio, a.shape[-1])
        return self.finish(group(kv), group(score))

    def decode(
        self,
        x: Float[Array, "batch dim"],
        positions: Int[Array, " batch"],
        kv_state: Float[Array, "batch ratio head_dim"] | None,
        score_state: Float[Array, "batch ratio head_dim"] | None,
    ) -> tuple[
        Float[Array, "batch head_dim"],
        Bool[Array, " batch"],
        Float[Array, "batch ratio head_dim"] | None,
        Float[Array, "batch ratio head_dim"] | None,
    ]:
        """One token per sequence at `positions`: buffers it in slot position % ratio and pools
        the buffer.

        Returns:
          (the pooled pre-RoPE latent of each sequence's current group, whether that group is
          complete with this token (only then is the latent an entry), the updated buffer).
          For ratio 1 every token completes its entry and there is no buffer (None).
        """
        kv, score = self.project(x)
        if self.ratio == 1:
            return self.finish(kv[:, None], None), jnp.ones_like(positions, bool), None, None
        rows, slot = jnp.arange(x.shape[0]), positions % self.ratio
        kv_state = kv_state.at[rows, slot].set(kv)
        score_state = score_state.at[rows, slot].set(score)
        complete = (positions + 1) % self.ratio == 0
        return self.finish(kv_state, score_state), complete, kv_state, score_state
