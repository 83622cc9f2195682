"""What a layer attends to: the shared cross-layer state and the selection of index sources
(DESIGN §3 steps 2–3, `v41_architecture.md` §3–§4).

Cross-layer state — the latest compressed KV and index keys, the latest published top-k, the
candidate pool — is an explicit pytree, `SharedState`, that each layer takes and returns; the
official code keeps it in a global runtime object instead.

- `select`: an index source (Full or Reindex layer) scores, the candidate source builds the pool,
  and the layer publishes its top-k (inside the pool for a Reindex layer after the candidate
  source). Reuse, Dense and window-only layers publish nothing new.
- `select_chunk`: `select` for a chunk of a long sequence's queries, in compact form: a Reindex
  layer scores only its pool's positions (gathered rows), the candidate source publishes block
  ids (no [T, S] pool mask).
- `attended_indices`: the compressed entries a layer attends to: the latest published top-k, or
  every visible entry (dense attention, or after a dense KV source).

The config's numerics switches (`index_score_dtype`, `tie_order`, `neginf_picks`) reach every
score and selection made here, in each path alike (whole sequence, chunks, decode, kernels).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import struct
from jaxtyping import Array, Float, Int

from v41jax.nn import dispatch
from v41jax.nn.config import LayerPlan, ModelConfig, Role
from v41jax.nn.indexer import Indexer
from v41jax.nn.sharding import CONTEXT, data_axis, rowwise, split_sequence
from v41jax.ops.invariants import check_scores, check_selection
from v41jax.ops.pool import (
    CandidatePool,
    pool_mask_from_block_ids,
    pool_positions,
    pool_topk_from_scores,
    select_candidate_blocks,
    sharded_candidate_blocks,
    sharded_pooled_topk,
    sharded_topk,
)
from v41jax.ops.scoring import gather_rows, index_scores, index_scores_at, topk_indices


@struct.dataclass
class SharedState:
    """What layers publish to later layers, in layer order (one slot each, overwritten).

    Attributes:
      kv: [B, S, head_dim] float compressed main KV of the latest KV source (prefill), or None.
      kv_packed: [B, S, row_bytes] uint8 packed main KV of the latest KV source (decode), or None.
      index_k: [B, S, index_head_dim] float index keys of the latest Full layer, or None.
      index_k_packed: [B, S, index_row_bytes] uint8 packed index keys of the latest Full layer
        (decode), or None.
      topk: [B, T, index_topk] int32 latest published selection (positions into the compressed
        KV, ascending, −1 padded), or None.
      pool: the candidate pool published by the candidate source (`CandidatePool` with mask
        [B, T, S] and block_ids [B, T, topk_blocks]; mask None after a chunked pass,
        `ModelConfig.query_chunk`), or None.
    """

    kv: Float[Array, "b s d"] | None = None
    kv_packed: Array | None = None
    index_k: Float[Array, "b s di"] | None = None
    index_k_packed: Array | None = None
    topk: Int[Array, "b t k"] | None = None
    pool: CandidatePool | None = None


def select(
    config: ModelConfig,
    plan: LayerPlan,
    indexer: Indexer | None,
    qr: Float[Array, "b t q_lora"],
    x: Float[Array, "b t dim"],
    positions: Int[Array, "*t"],
    compress_lens: Int[Array, "b t"],
    shared: SharedState,
    *,
    debug: bool = False,
    implementation: str = "xla",
    sequence_mesh: jax.sharding.Mesh | None = None,
) -> tuple[SharedState, Float[Array, "b t s"] | None]:
    """Scores, candidate pool and top-k of an index source; other roles return `shared` as is.

    The indexer reads its inputs through `stop_gradient`: its only training signal is the KL
    loss (`indexer.indexer_kl`), and that loss must not reach the rest of the model (DESIGN §7).

    With a kernel implementation (decode only: one query per sequence, T = 1), a Reindex layer
    inside the pool reads only the packed index keys of its pool's blocks
    (`dispatch.pooled_topk`), and the candidate source (and any other Full layer whose keys the
    scan takes: `dispatch.scans_on_kernels`) scores its packed index keys with the same kernel
    (`dispatch.candidate_source`), all keeping `topk_indices`' and
    `select_candidate_blocks`' rules (the config's reducer, tie order and −inf picks, positions
    ≥ compress_lens invisible).

    At decode on a cache sharded by position over `sequence_mesh`'s 'context' axis (T = 1,
    implementation 'xla'), the pool, the candidate source's own top-k and a Reindex layer's
    top-k inside the pool are the sequence-sharded ops (`ops.pool.sharded_candidate_blocks`,
    `sharded_topk`, `sharded_pooled_topk`): each device selects among the positions it holds
    and the devices merge (score, id) pairs; the same picks, bit for bit.

    Returns:
      (the state with this layer's top-k and pool published, the index scores [B, T, S]); the
      scores are None for layers that do not score and for layers that score with a kernel.
    """
    if plan.role not in (Role.FULL, Role.REINDEX):
        return shared, None
    q, weights = indexer.queries(jax.lax.stop_gradient(qr), jax.lax.stop_gradient(x), positions)
    pool = shared.pool
    if sequence_mesh is not None:
        topk, pool, scores = _select_sequence_sharded(
            config, plan, q, weights, compress_lens, shared, sequence_mesh
        )
    elif plan.uses_candidates and implementation in dispatch.KERNEL_IMPLEMENTATIONS:
        picks = dispatch.pooled_topk(
            config,
            shared.index_k_packed,
            q[:, 0],
            weights[:, 0],
            pool.block_ids[:, 0],
            compress_lens[:, 0],
            implementation,
        )
        topk, scores = picks.indices[:, None], None
    elif dispatch.scans_on_kernels(config, plan, implementation):
        lens = compress_lens[:, 0]
        source = plan.is_candidate_source
        found = dispatch.candidate_source(
            config,
            shared.index_k_packed,
            q[:, 0],
            weights[:, 0],
            lens,
            implementation,
            pool=source,
        )
        if source:
            n_pos = shared.index_k_packed.shape[1]
            block_size = config.candidate_block_size
            mask = pool_mask_from_block_ids(found.block_ids, n_pos, block_size, lens)
            pool = CandidatePool(mask[:, None], found.block_ids[:, None])
        topk, scores = found.topk.indices[:, None], None
    else:
        # Rows are queries: split like the sequence under context parallelism (`sharding`).
        scores = split_sequence(
            index_scores(
                q, weights, shared.index_k, compress_lens, score_dtype=config.index_score_dtype
            )
        )
        if plan.is_candidate_source:
            pool = rowwise(lambda s, n: candidate_pool(config, s, n), scores, compress_lens)
        topk = rowwise(
            lambda s, m: topk_indices(
                s,
                config.index_topk,
                m,
                tie_order=config.tie_order,
                neginf_picks=config.neginf_picks,
            ),
            scores,
            pool.mask if plan.uses_candidates else None,
        )
    if debug:
        if scores is not None:
            check_scores(plan.layer, scores)
        check_selection(
            plan.layer,
            topk,
            compress_lens,
            pool,
            block_size=config.candidate_block_size,
            restricted=plan.uses_candidates,
            neginf_picks=config.neginf_picks,
            publishes_pool=plan.is_candidate_source,
        )
    return shared.replace(topk=topk, pool=pool), scores


def _select_sequence_sharded(config, plan, q, weights, compress_lens, shared, mesh):
    """`select`'s picks at decode (T = 1) on a cache sharded by position over the mesh's
    'context' axis: (top-k [B, 1, k], pool, scores [B, 1, S] or None)."""
    lens, rows = compress_lens[:, 0], data_axis(mesh)
    where = dict(mesh=mesh, axis=CONTEXT, batch_axis=rows, tie_order=config.tie_order)
    if plan.uses_candidates:
        picks = sharded_pooled_topk(
            shared.index_k_packed,
            q[:, 0],
            weights[:, 0],
            shared.pool.block_ids[:, 0],
            lens,
            config.index_topk,
            block_size=config.candidate_block_size,
            fmt=config.index_format,
            score_dtype=config.index_score_dtype,
            neginf_picks=config.neginf_picks,
            **where,
        )
        return picks.indices[:, None], shared.pool, None
    scores = index_scores(
        q, weights, shared.index_k, compress_lens, score_dtype=config.index_score_dtype
    )
    pool = shared.pool
    if plan.is_candidate_source:
        found = sharded_candidate_blocks(
            scores[:, 0],
            lens,
            config.candidate_topk_blocks,
            config.candidate_block_size,
            reduce=config.block_score,
            **where,
        )
        pool = CandidatePool(found.mask[:, None], found.block_ids[:, None])
    # Unrestricted (no mask): −inf picks are dropped under either `neginf_picks` rule.
    topk = sharded_topk(scores[:, 0], config.index_topk, **where).indices[:, None]
    return topk, pool, scores


class ChunkSelection(NamedTuple):
    """`select_chunk`'s result for a chunk of C queries.

    Attributes:
      topk: [B, C, index_topk] int32 the layer's picks (ascending, −1 padded).
      block_ids: [B, C, candidate_topk_blocks] int32 the candidate pool's blocks when the layer
        is the candidate source, else None.
    """

    topk: Int[Array, "b c k"]
    block_ids: Int[Array, "b c nb"] | None


def select_chunk(
    config: ModelConfig,
    plan: LayerPlan,
    q: Float[Array, "b c heads index_dim"],
    weights: Float[Array, "b c heads"],
    compress_lens: Int[Array, "b c"],
    index_k: Float[Array, "b s index_dim"],
    pool_block_ids: Int[Array, "b c nb"] | None,
) -> ChunkSelection:
    """`select` of an index source for a chunk of queries, given its indexer queries and weights.

    The same picks as `select` (`topk_indices`' rules with the config's switches) in the compact
    form of long sequences: a Reindex layer inside the pool scores only
    the pool's positions (`index_scores_at` on gathered rows, `pool_topk_from_scores`), and the
    candidate source returns its pool's block ids, not a [C, S] mask.
    """
    if plan.uses_candidates:
        block_size = config.candidate_block_size
        positions = pool_positions(pool_block_ids, block_size)
        rows = gather_rows(index_k, positions)
        scores = index_scores_at(
            q, weights, rows, positions, compress_lens, score_dtype=config.index_score_dtype
        )
        picks = pool_topk_from_scores(
            scores,
            pool_block_ids,
            config.index_topk,
            block_size=block_size,
            lengths=compress_lens,
            tie_order=config.tie_order,
            neginf_picks=config.neginf_picks,
            ascending_ids=True,  # a CandidatePool's block ids
        )
        return ChunkSelection(picks.indices, None)
    scores = index_scores(q, weights, index_k, compress_lens, score_dtype=config.index_score_dtype)
    block_ids = None
    if plan.is_candidate_source:
        block_ids = candidate_pool(config, scores, compress_lens).block_ids
    topk = topk_indices(scores, config.index_topk, tie_order=config.tie_order)
    return ChunkSelection(topk, block_ids)


def candidate_pool(
    config: ModelConfig, scores: Float[Array, "*rows s"], compress_lens: Int[Array, "*rows"]
) -> CandidatePool:
    """The candidate pool of the candidate source's `scores` under `config` (block size, blocks
    kept, block reducer, tie order): `ops.pool.select_candidate_blocks`."""
    return select_candidate_blocks(
        scores,
        compress_lens,
        config.candidate_topk_blocks,
        config.candidate_block_size,
        reduce=config.block_score,
        tie_order=config.tie_order,
    )


def attended_indices(
    plan: LayerPlan,
    shared: SharedState,
    compress_lens: Int[Array, "b t"],
    n_entries: int,
    *,
    dense: bool = False,
) -> Int[Array, "b t k"] | None:
    """The compressed entries a layer attends to: the latest published top-k, or every visible
    entry (after a dense KV source, or when `dense`), −1 padded; None for window-only layers."""
    if plan.role is Role.WINDOW:
        return None
    if dense or plan.topk_source is None:
        entries = jnp.arange(n_entries)
        return jnp.where(entries < compress_lens[..., None], entries, -1)
    return shared.topk
