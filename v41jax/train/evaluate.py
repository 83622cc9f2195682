"""Evaluation: task accuracy and the indexer's selection quality, per Reindex layer (DESIGN §7).

For every Reindex layer restricted to the candidate pool, with U its unrestricted top-k (the
indexer's own picks over all visible positions), S its actual selection inside the pool P, and A
the layer's dense attention over the compressed positions (summed over heads, renormalized):
  - pool recall |U ∩ P| / |U|, over queries that see more positions than the pool holds, for
    the trained pool and three baselines: random blocks, the most recent blocks, and oracle
    blocks (the pool rule applied to A itself: the best any block pool can do for this layer);
  - within-pool recall |S ∩ U_A| / |U_A| with U_A the top-k of A (same queries): how much of
    what the layer's dense attention would pick the selection keeps;
  - attention mass covered by S and by P (Σ A over them);
  - pool recall by distance bucket (t − s);
  - the evidence (the one position a scored answer needs, `tasks.Batch.evidence`) in the
    candidate pool (`evidence_in_pool`), in the layer's selection (`evidence_selected`) and in
    its unrestricted top-k (`evidence_topk`), at scored queries beyond the pool's size.
Task accuracy is split by evidence distance (`tasks.Batch.evidence`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Int

from v41jax.nn.config import ModelConfig
from v41jax.nn.model import Model, indexer_kls
from v41jax.nn.selection import candidate_pool
from v41jax.ops.pool import block_scores
from v41jax.ops.scoring import topk_indices
from v41jax.train import diagnostics

BASELINES = ("random", "recent", "oracle")


def distance_edges(config: ModelConfig) -> tuple[int, ...]:
    """Bucket edges for distances: inside the window, inside one pool's span, beyond (the
    window and pool sizes, ascending; one edge when they are equal)."""
    return tuple(sorted({config.window_size, config.candidate_pool_size}))


def _pool(config: ModelConfig, scores, lens) -> jax.Array:
    return candidate_pool(config, scores, lens).mask


@nnx.jit(static_argnames=("dense",), graph_updates=False)  # no parameter copied out (model.py)
def _eval_batch(model: Model, tokens, targets, loss_mask, evidence, key, *, dense: bool):
    c = model.config
    logits, trace = model.run(tokens, dense=dense, diagnostics=True, indexer_loss=True)
    mask = loss_mask.astype(jnp.float32)
    ce = -jnp.take_along_axis(jax.nn.log_softmax(logits, -1), targets[..., None], -1)[..., 0]
    correct = (jnp.argmax(logits, -1) == targets).astype(jnp.float32)
    seq = tokens.shape[1]
    distance = jnp.arange(seq) - evidence
    bucket = jnp.searchsorted(jnp.asarray(distance_edges(c)), distance, side="right")
    n_buckets = len(distance_edges(c)) + 1
    in_bucket = (bucket[..., None] == jnp.arange(n_buckets)) & loss_mask[..., None]
    out = {
        "task_loss": (jnp.sum(ce * mask), jnp.sum(mask)),
        "accuracy": (jnp.sum(correct * mask), jnp.sum(mask)),
        "accuracy_by_distance": (
            jnp.sum(correct[..., None] * in_bucket, axis=(0, 1)),
            jnp.sum(in_bucket, axis=(0, 1)).astype(jnp.float32),
        ),
    }
    kls = indexer_kls(trace)
    if kls:
        out["indexer_kl"] = (jnp.sum(jnp.stack(kls)), jnp.asarray(float(len(kls))))
    if dense or c.candidate_source_layer is None:
        return out

    pool = trace[c.candidate_source_layer].shared.pool.mask
    source_ratio = c.layers[c.candidate_source_layer].compress_ratio
    # The evidence (the one token a scored answer needs) at the candidate source's positions:
    # in the pool or not, at scored queries that see more positions than the pool holds.
    t_lens = (jnp.arange(seq) + 1) // source_ratio
    ev = jnp.where(evidence >= 0, evidence // source_ratio, -1)
    scored = loss_mask & (ev >= 0) & (ev < t_lens) & (t_lens > c.candidate_pool_size)
    ev_in_pool = jnp.take_along_axis(pool, jnp.clip(ev, 0, pool.shape[-1] - 1)[..., None], -1)
    n_scored = jnp.sum(scored).astype(jnp.float32)
    out["evidence_in_pool"] = (jnp.sum(ev_in_pool[..., 0] & scored).astype(jnp.float32), n_scored)
    for plan, step in zip(c.layers, trace, strict=True):
        if not plan.uses_candidates:
            continue
        lens = jnp.broadcast_to((jnp.arange(seq) + 1) // plan.compress_ratio, tokens.shape)
        n_pos = pool.shape[-1]
        # The layer's dense attention over its compressed positions, with its own queries.
        dense_probs = step.aux["dense_probs"]
        unrestricted = step.aux["unrestricted_topk"]
        selected = step.shared.topk
        beyond = lens > c.candidate_pool_size
        key, sub = jax.random.split(key)
        visible = jnp.arange(n_pos) < lens[..., None]
        pools = {
            "": pool,
            "_random": _pool(
                c, jnp.where(visible, jax.random.uniform(sub, pool.shape), -jnp.inf), lens
            ),
            "_recent": _pool(
                c, jnp.where(visible, jnp.arange(n_pos, dtype=jnp.float32), -jnp.inf), lens
            ),
            "_oracle": _pool(c, jnp.where(visible, dense_probs, -jnp.inf), lens),
        }
        name = f"layer{plan.layer}"
        # The evidence in the layer's selection (inside the pool) and in its unrestricted top-k.
        ev_here = jnp.where(evidence >= 0, evidence // plan.compress_ratio, -1)[..., None]
        for metric, picks in (("evidence_selected", selected), ("evidence_topk", unrestricted)):
            hit = jnp.any((picks == ev_here) & (picks >= 0), -1) & scored
            out[f"{name}/{metric}"] = (jnp.sum(hit).astype(jnp.float32), n_scored)
        for suffix, p in pools.items():
            recall = diagnostics.candidate_pool_recall(unrestricted, p, lens, c.candidate_pool_size)
            out[f"{name}/pool_recall{suffix}"] = (recall.value * recall.count, recall.count)
        # Within-pool recall against the layer's own dense attention: the top-k of A that the
        # selection keeps. (Against its unrestricted top-k it would equal the pool recall: a
        # top-k inside the pool keeps exactly the unrestricted picks that lie in the pool.)
        oracle_topk = topk_indices(
            jnp.where(visible, dense_probs, -jnp.inf), c.index_topk, tie_order=c.tie_order
        )
        within = diagnostics.within_pool_recall(selected, oracle_topk, beyond)
        out[f"{name}/within_pool_recall"] = (within.value * within.count, within.count)
        covered = diagnostics.attention_mass_covered(dense_probs, selected)
        pool_mass = jnp.sum(jnp.where(pool, dense_probs, 0.0), -1)
        n_beyond = jnp.sum(beyond).astype(jnp.float32)
        out[f"{name}/mass_selected"] = (jnp.sum(jnp.where(beyond, covered, 0.0)), n_beyond)
        out[f"{name}/mass_pool"] = (jnp.sum(jnp.where(beyond, pool_mass, 0.0)), n_beyond)
        hit = diagnostics.in_mask(unrestricted, pool)
        by_distance = diagnostics.recall_by_distance(
            hit, unrestricted, lens - 1, distance_edges(c), beyond
        )
        out[f"{name}/pool_recall_by_distance"] = (
            by_distance.value * by_distance.count,
            by_distance.count,
        )
    return out


def evaluate(model: Model, task, *, seed: int, batches: int, batch_size: int, dense: bool) -> dict:
    """Mean metrics over `batches` batches of `task` drawn from `seed` (use a seed that training
    never uses). Values are floats, or lists for per-bucket metrics (buckets of
    `distance_edges`); None where nothing was counted."""
    totals: dict[str, list] = {}
    key = jax.random.key(seed)
    for i in range(batches):
        b = task.batch_at(seed, i, batch_size)
        key, sub = jax.random.split(key)
        out = _eval_batch(
            model,
            jnp.asarray(b.tokens),
            jnp.asarray(b.targets),
            jnp.asarray(b.loss_mask),
            jnp.asarray(b.evidence),
            sub,
            dense=dense,
        )
        for name, (total, count) in jax.device_get(out).items():
            acc = totals.setdefault(name, [0.0, 0.0])
            acc[0] = acc[0] + np.asarray(total, np.float64)
            acc[1] = acc[1] + np.asarray(count, np.float64)
    result = {}
    for name, (total, count) in totals.items():
        # None (JSON null) where nothing was counted, e.g. an empty distance bucket.
        value = np.where(count > 0, total / np.maximum(count, 1), np.nan).tolist()
        nan_to_none = lambda v: None if v != v else v
        result[name] = [nan_to_none(v) for v in value] if np.ndim(count) else nan_to_none(value)
    return result


def _finite_or_none(values) -> list[float | None]:
    """Floats to 6 significant digits, None where not finite (JSON has no infinities)."""
    return [float(f"{v:.6g}") if np.isfinite(v) else None for v in np.asarray(values, np.float64)]


@nnx.jit(graph_updates=False)
def _snapshot_arrays(model: Model, tokens: Int[Array, "1 t"], lens: Int[Array, " t"]):
    """`pool_snapshot`'s arrays of one example (`lens`: each query's visible source
    positions), in one program: the source's block scores, its pool's block ids, and each
    Reindex layer's picks, per query. Op by op, a fresh process compiled some 450 small
    programs for them (16.8 s against 3.2 s jitted on 2 cores, 2026-12-07, one run each; a
    process that had compiled them already ran it in 0.9 s)."""
    c = model.config
    _, trace = model.run(tokens, dense=False, diagnostics=True)
    source = trace[c.candidate_source_layer]
    scores = block_scores(source.aux["scores"][0], lens, c.candidate_block_size, c.block_score)
    picks = [s.shared.topk[0] for p, s in zip(c.layers, trace, strict=True) if p.uses_candidates]
    return scores, source.shared.pool.block_ids[0], picks


def pool_snapshot(model: Model, task, *, seed: int, scores_for: int = 4) -> dict:
    """One held-out example seen from the inside, small enough to keep beside a study's results
    (a trained model's pools can be looked at without the model).

    The example is the first of `task.batch_at(seed, 0, 1)`, run with the pool and the top-k
    (`Model.run(..., diagnostics=True)`). Per scored query, in the candidate source's
    compressed positions and blocks of `candidate_block_size`: the query `t` and its visible
    positions, the evidence's position and block, the pool's blocks, the rank of the
    evidence's block among the source's block scores (0: the best; the pinned newest block
    counts), and for each Reindex layer the blocks its selection falls in and whether it
    selected the evidence. The source's block scores (`ops.block_scores`, None where −inf or
    the +inf pin) are kept for the first `scores_for` queries.
    """
    c = model.config
    if c.candidate_source_layer is None:
        raise ValueError("model: expected a config with a candidate source, got none")
    batch = task.batch_at(seed, 0, 1)
    ratio, size = c.layers[c.candidate_source_layer].compress_ratio, c.candidate_block_size
    lens = (np.arange(batch.tokens.shape[1]) + 1) // ratio
    arrays = _snapshot_arrays(model, jnp.asarray(batch.tokens), jnp.asarray(lens))
    scores, pool_ids, picks = jax.device_get(arrays)
    reindex = [p.layer for p in c.layers if p.uses_candidates]
    queries = []
    for t in np.flatnonzero(batch.loss_mask[0]):
        evidence = int(batch.evidence[0, t]) // ratio
        block = evidence // size
        query = {
            "t": int(t),
            "visible": int(lens[t]),
            "evidence": evidence,
            "evidence_block": block,
            "pool_blocks": [int(i) for i in pool_ids[t] if i >= 0],
            "evidence_block_rank": int(np.sum(scores[t] > scores[t, block])),
        }
        for layer, layer_picks in zip(reindex, picks, strict=True):
            kept = layer_picks[t][layer_picks[t] >= 0]
            query[f"layer{layer}/selected_blocks"] = sorted({int(p) // size for p in kept})
            query[f"layer{layer}/evidence_selected"] = bool(np.any(kept == evidence))
        if len(queries) < scores_for:
            query["block_scores"] = _finite_or_none(scores[t])
        queries.append(query)
    return {
        "seed": seed,
        "block_size": size,
        "block_score": c.block_score,
        "pool_blocks": c.candidate_topk_blocks,
        "source_layer": c.candidate_source_layer,
        "reindex_layers": [f"layer{layer}" for layer in reindex],
        "queries": queries,
    }
