"""The CSA2 attention layer; its role (window, Full, Reindex, Reuse, candidate source) comes from
the config (DESIGN §3, `v41_architecture.md` §1–§5).

Cross-layer state — the latest compressed KV and index keys, the latest published top-k, the
candidate pool — is an explicit pytree, `SharedState`, that each layer takes and returns; the
official code keeps it in a global runtime object instead.

Each layer runs in two modes that share every piece of math:
  - prefill (`__call__`): a whole batch of padded sequences [B, T]; causality alone keeps a valid
    row from seeing padding, since padding only ever sits in its future;
  - decode (`decode`): one token per sequence at its own position, reading and writing the packed
    cache (`v41jax.cache.LayerCache`); compressed rows are gathered packed, then unpacked, or, with
    `implementation='pallas'`, read packed by the kernels of `pallas_kernels` (DESIGN §6).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx, struct
from jaxtyping import Array, Bool, Float, Int

from v41jax import quant
from v41jax.cache import LayerCache
from v41jax.compressor import Compressor
from v41jax.config import LayerPlan, ModelConfig, Role
from v41jax.indexer import Indexer
from v41jax.invariants import check_selection
from v41jax.pool import CandidatePool, select_candidate_blocks
from v41jax.rope import apply_rope
from v41jax.scoring import index_scores, indices_to_mask, topk_indices
from v41jax.sparse_attention import masked_attention, sparse_attention

IMPLEMENTATIONS = ("xla", "pallas", "pallas_interpret")
"""Values of `implementation=` accepted by decode (`Attention.decode`, `model.decode_step`).

- 'xla': gather the selected packed rows, unpack them, float32 math (the definition).
- 'pallas': the Mosaic GPU kernels of `pallas_kernels` read the packed caches directly (Hopper):
  `fp4_sparse_attention` for the core attention of every layer with compressed KV, and
  `pooled_scores(..., topk=)` for the scoring of Reindex layers inside the candidate pool. The
  candidate source's full scan, Full layers' scans and window-only layers stay XLA. Needs a
  kernel-shaped config (`check_kernel_config`, `config.small_kernels()`).
- 'pallas_interpret': the same kernels in the Mosaic GPU interpreter on the CPU (tests; about a
  second per kernel call). Run it outside `jit`, as `model.decode_step` does: inside a larger
  jitted program the interpreter's kernels can deadlock under XLA:CPU's async dispatch.

Prefill and training (`Attention.__call__`, `Model.run`, `model.prefill`) accept only
`PREFILL_IMPLEMENTATIONS`: the kernels take one query per sequence.
"""

PREFILL_IMPLEMENTATIONS = ("xla",)
"""Values of `implementation=` accepted by prefill and training."""

KERNEL_IMPLEMENTATIONS = ("pallas", "pallas_interpret")
"""The entries of `IMPLEMENTATIONS` that run the Pallas kernels."""

# The kernels' shape limits (pallas_kernels/sparse_attention/sparse_attention_mgpu.py,
# pallas_kernels/pooled_scoring/kernel_mgpu.py).
_ATTENTION_KERNEL_HEAD_DIMS = (256, 512)
_SCORING_KERNEL_MAX_HEADS = 256


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
        [B, T, S] and block_ids [B, T, topk_blocks]), or None.
    """

    kv: Float[Array, "b s d"] | None = None
    kv_packed: Array | None = None
    index_k: Float[Array, "b s di"] | None = None
    index_k_packed: Array | None = None
    topk: Int[Array, "b t k"] | None = None
    pool: CandidatePool | None = None


def check_implementation(implementation: str, *, decode: bool = False) -> None:
    """Raise ValueError unless `implementation` is accepted by decode (`decode=True`) or by
    prefill and training (`decode=False`)."""
    allowed = IMPLEMENTATIONS if decode else PREFILL_IMPLEMENTATIONS
    if implementation not in allowed:
        where = "decode" if decode else "prefill and training (the kernels serve decode only)"
        raise ValueError(
            f"implementation: expected one of {allowed} for {where}, got {implementation!r}"
        )


def check_kernel_config(config: ModelConfig, implementation: str) -> None:
    """Raise ValueError, naming every offending config field with its expected and received
    value, when `implementation` runs the Pallas kernels on a config they cannot take.

    `fp4_sparse_attention` (layers with compressed KV) decodes NVFP4 main-KV rows and FP8 window
    rows of D in {256, 512}; `pooled_scores` (Reindex layers inside the pool) scores MXFP4 index
    keys of dim 128 in candidate blocks of 8, at most 256 heads. 'xla' takes any config.
    """
    if implementation not in KERNEL_IMPLEMENTATIONS:
        return
    from pallas_kernels.pooled_scoring import kernel_mgpu  # lazy: it imports v41jax

    c, problems = config, []

    def need(name: str, ok: bool, expected: str) -> None:
        if not ok:
            problems.append(f"config.{name}: expected {expected}, got {getattr(c, name)!r}")

    if any(plan.role is not Role.WINDOW for plan in c.layers):
        need("kv_format", c.kv_format == "nvfp4", "'nvfp4'")
        need("window_format", c.window_format == "fp8", "'fp8'")
        dims = _ATTENTION_KERNEL_HEAD_DIMS
        need("head_dim", c.head_dim in dims, " or ".join(map(str, dims)))
    if any(plan.uses_candidates for plan in c.layers):
        need("index_format", c.index_format == "mxfp4", "'mxfp4'")
        need("index_head_dim", c.index_head_dim == kernel_mgpu.DIM, str(kernel_mgpu.DIM))
        need(
            "candidate_block_size",
            c.candidate_block_size == kernel_mgpu.BLOCK_SIZE,
            str(kernel_mgpu.BLOCK_SIZE),
        )
        need(
            "index_n_heads",
            c.index_n_heads <= _SCORING_KERNEL_MAX_HEADS,
            f"<= {_SCORING_KERNEL_MAX_HEADS}",
        )
    if problems:
        raise ValueError(
            f"implementation={implementation!r} runs the Pallas kernels, which need "
            + "; ".join(problems)
            + " (config.small_kernels() is a toy they take)"
        )


def window_slot_valid(position: Int[Array, " b"], window: int) -> Bool[Array, "b window"]:
    """Which ring-buffer slots hold a token for a query at `position` (the token itself included).

    Slot s holds the latest position p <= `position` with p ≡ s (mod window); it is valid iff
    p >= 0, i.e. the ring buffer has been written there for this sequence.
    """
    slots = jnp.arange(window)
    latest = position[:, None] - (position[:, None] - slots) % window
    return latest >= 0


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


class Attention(nnx.Module):
    """One CSA2 attention layer: queries, window KV, and the role's compressed-KV machinery."""

    def __init__(self, config: ModelConfig, plan: LayerPlan, *, rngs: nnx.Rngs):
        if quant.FORMATS[config.kv_format].accounting_only:
            usable = [n for n, f in quant.FORMATS.items() if not f.accounting_only]
            raise ValueError(
                f"config.kv_format: expected one of {usable} to build a model "
                f"({config.kv_format!r} is for byte accounting only), got {config.kv_format!r}"
            )
        c = self.config = config
        self.plan = plan
        self.theta = c.compress_rope_theta if plan.compress_ratio else c.rope_theta
        self.wq_a = nnx.Linear(c.dim, c.q_lora_rank, use_bias=False, rngs=rngs)
        self.q_norm = nnx.RMSNorm(c.q_lora_rank, epsilon=c.norm_eps, rngs=rngs)
        self.wq_b = nnx.Linear(c.q_lora_rank, c.n_heads * c.head_dim, use_bias=False, rngs=rngs)
        self.wkv = nnx.Linear(c.dim, c.head_dim, use_bias=False, rngs=rngs)
        self.kv_norm = nnx.RMSNorm(c.head_dim, epsilon=c.norm_eps, rngs=rngs)
        self.sink = nnx.Param(jnp.zeros((c.n_heads,), jnp.float32))
        group_in = c.n_heads // c.o_groups * c.head_dim
        init = nnx.initializers.lecun_normal(in_axis=1, out_axis=2, batch_axis=0)
        self.wo_a = nnx.Param(init(rngs.params(), (c.o_groups, group_in, c.o_lora_rank)))
        self.wo_b = nnx.Linear(c.o_groups * c.o_lora_rank, c.dim, use_bias=False, rngs=rngs)
        owns = plan.role in (Role.FULL, Role.DENSE)
        self.compressor = Compressor(c, plan.compress_ratio, rngs=rngs) if owns else None
        self.indexer = (
            Indexer(c, owns_keys=plan.role is Role.FULL, rngs=rngs)
            if plan.role in (Role.FULL, Role.REINDEX)
            else None
        )

    # --- pieces shared by prefill and decode ---

    def _queries_and_window(self, x, positions):
        """Low-rank query latent, rotated queries [..., H, D] and this token's window KV row."""
        c = self.config
        qr = self.q_norm(self.wq_a(x))
        q = self.wq_b(qr).reshape(*x.shape[:-1], c.n_heads, c.head_dim)
        q = apply_rope(q, positions[..., None], c.rope_head_dim, self.theta)
        window = apply_rope(self.kv_norm(self.wkv(x)), positions, c.rope_head_dim, self.theta)
        return qr, q, quant.fake_quant(window, c.window_format)

    def _main_kv(self, latent, entry_positions):
        """Compressed main KV: the latent rotated at its group's first token, then quantized."""
        c = self.config
        kv = apply_rope(latent, entry_positions, c.rope_head_dim, self.theta)
        return quant.fake_quant(kv, c.kv_format)

    def _select(
        self,
        qr,
        x,
        positions,
        compress_lens,
        shared: SharedState,
        debug: bool,
        implementation: str = "xla",
    ):
        """Scores, candidate pool and top-k of an index source; Reuse and Dense layers publish
        nothing new (a Dense layer's consumers attend to every visible entry).

        Returns the new shared state and the index scores (None for non-index sources, and for
        Reindex layers that score with the pooled-scoring kernel). The indexer reads its inputs
        through `stop_gradient`: its only training signal is the KL loss, and that loss must not
        reach the rest of the model (DESIGN §7).

        With a kernel implementation (decode only: one query per sequence, T = 1), a Reindex
        layer inside the pool reads the packed index keys of its pool's blocks with
        `pooled_scores(..., topk=)`, which keeps `topk_indices`' rules (ties to the lowest
        position, −inf picks dropped to −1, positions ≥ compress_lens invisible).
        """
        c, plan = self.config, self.plan
        if plan.role not in (Role.FULL, Role.REINDEX):
            return shared, None
        q, weights = self.indexer.queries(
            jax.lax.stop_gradient(qr), jax.lax.stop_gradient(x), positions
        )
        pool = shared.pool
        if plan.uses_candidates and implementation in KERNEL_IMPLEMENTATIONS:
            from pallas_kernels.pooled_scoring.api import pooled_scores  # lazy: imports v41jax

            picks = pooled_scores(
                shared.index_k_packed,
                q[:, 0],
                weights[:, 0],
                pool.block_ids[:, 0],
                compress_lens[:, 0],
                block_size=c.candidate_block_size,
                fmt=c.index_format,
                implementation="pallas",
                topk=c.index_topk,
                interpret=implementation == "pallas_interpret",
            )
            topk, scores = picks.indices[:, None], None
        else:
            scores = index_scores(q, weights, shared.index_k, compress_lens)
            if plan.is_candidate_source:
                pool = select_candidate_blocks(
                    scores,
                    compress_lens,
                    c.candidate_topk_blocks,
                    c.candidate_block_size,
                    reduce=c.block_score,
                )
            mask = pool.mask if plan.uses_candidates else None
            topk = topk_indices(scores, c.index_topk, mask)
        if debug:
            check_selection(
                plan.layer,
                topk,
                compress_lens,
                pool,
                block_size=c.candidate_block_size,
                restricted=plan.uses_candidates,
                publishes_pool=plan.is_candidate_source,
            )
        return shared.replace(topk=topk, pool=pool), scores

    def _selection(self, shared: SharedState, compress_lens, n_entries, dense: bool = False):
        """The indices this layer attends to: the latest top-k, or all visible entries (after a
        dense KV source, or when `dense`); None for window-only layers."""
        if self.plan.role is Role.WINDOW:
            return None
        if dense or self.plan.topk_source is None:
            entries = jnp.arange(n_entries)
            return jnp.where(entries < compress_lens[..., None], entries, -1)
        return shared.topk

    def _output(self, o, positions):
        """Inverse RoPE on the output's tail, then the grouped low-rank output projection."""
        c = self.config
        o = apply_rope(o, positions[..., None], c.rope_head_dim, self.theta, inverse=True)
        o = o.reshape(*o.shape[:-2], c.o_groups, -1)
        o = jnp.einsum("...gi,gio->...go", o, self.wo_a[...])
        return self.wo_b(o.reshape(*o.shape[:-2], -1))

    # --- prefill ---

    def __call__(
        self,
        x: Float[Array, "b t dim"],
        shared: SharedState,
        *,
        implementation: str = "xla",
        debug: bool = False,
        dense: bool = False,
        indexer_loss: bool = False,
        diagnostics: bool = False,
    ) -> tuple[Float[Array, "b t dim"], SharedState, dict[str, Array]]:
        """Prefill over [B, T] tokens at positions 0..T−1 (padding rows compute garbage that no
        valid row reads).

        Args:
          x: [B, T, dim] normalized layer input.
          shared: the state published by earlier layers.
          implementation: 'xla' (`PREFILL_IMPLEMENTATIONS`; the kernels serve decode only).
          debug: stage the selection invariants (`v41jax.invariants`).
          dense: attend to every visible compressed entry instead of the selection (the dense
            baseline and the indexer warm-up); index sources still score, select and publish.
          indexer_loss: compute this index source's KL loss (`indexer_kl`).
          diagnostics: also return the index scores, the attention probabilities and indices.

        Returns:
          (output [B, T, dim], the updated shared state, aux). aux holds, for index sources,
          'indexer_kl' (summed over query rows) and 'indexer_kl_rows' (rows with a key) when
          `indexer_loss`; with `diagnostics`, for layers with compressed KV: 'key_mask'
          [B, T, S] (the compressed keys the layer attended to), 'probs' [B, T, H, S] (their
          attention probabilities, normalized with the window and the sink), 'dense_probs'
          [B, T, S] (the layer's attention over every visible compressed position, summed over
          heads and renormalized), for index sources
          'scores' [B, T, S], and for Reindex layers after the candidate source
          'unrestricted_topk' [B, T, index_topk] (its picks without the pool).
        """
        check_implementation(implementation)
        c, plan = self.config, self.plan
        batch, seq, _ = x.shape
        positions = jnp.arange(seq)
        qr, q, window = self._queries_and_window(x, positions)

        if self.compressor is not None:
            latent = self.compressor(x)
            entry_positions = jnp.arange(latent.shape[1]) * plan.compress_ratio
            shared = shared.replace(kv=self._main_kv(latent, entry_positions))
            if self.indexer is not None:
                keys = self.indexer.keys(jax.lax.stop_gradient(latent), entry_positions)
                shared = shared.replace(index_k=keys)

        # Query p sees window positions p−W+1..p and compressed entries j < (p+1)//r.
        offsets = jnp.arange(c.window_size) - (c.window_size - 1)
        window_pos = positions[:, None] + offsets
        window_rows = window[:, jnp.maximum(window_pos, 0)]
        window_valid = jnp.broadcast_to(window_pos >= 0, (batch, seq, c.window_size))

        if plan.role is Role.WINDOW:
            kv, indices, scores = jnp.zeros((batch, 0, c.head_dim), x.dtype), None, None
        else:
            compress_lens = jnp.broadcast_to((positions + 1) // plan.compress_ratio, (batch, seq))
            shared, scores = self._select(qr, x, positions, compress_lens, shared, debug)
            kv = shared.kv
            indices = self._selection(shared, compress_lens, kv.shape[1], dense)
        key_mask = (
            jnp.zeros((batch, seq, kv.shape[1]), bool)
            if indices is None
            else indices_to_mask(indices, kv.shape[1])
        )
        result = masked_attention(q, window_rows, window_valid, kv, key_mask, self.sink[...])
        o = result.out
        aux = {}
        probs = result.probs[..., c.window_size :]
        if indexer_loss and self.indexer is not None:
            aux["indexer_kl"], aux["indexer_kl_rows"] = indexer_kl(scores, probs, key_mask)
        if diagnostics and plan.role is not Role.WINDOW:
            # The layer's dense attention (all visible entries, its own queries), summed over
            # heads and renormalized over compressed positions: what a selection should cover.
            visible = jnp.arange(kv.shape[1]) < compress_lens[..., None]
            dense = masked_attention(q, window_rows, window_valid, kv, visible, self.sink[...])
            dense_probs = jnp.sum(dense.probs[..., c.window_size :], axis=-2)
            total = jnp.sum(dense_probs, axis=-1, keepdims=True)
            dense_probs = dense_probs / jnp.where(total > 0, total, 1.0)
            aux.update(key_mask=key_mask, probs=probs, dense_probs=dense_probs)
            if scores is not None:
                aux["scores"] = scores
            if plan.uses_candidates:
                aux["unrestricted_topk"] = topk_indices(scores, c.index_topk)
        return self._output(o, positions), shared, aux

    def prefill_cache(
        self,
        x: Float[Array, "b t dim"],
        shared: SharedState,
        lengths: Int[Array, " b"],
        max_len: int,
    ) -> LayerCache:
        """This layer's packed cache after a prefill of sequences of `lengths` tokens.

        `shared` is the state this layer returned from the same prefill. Rows beyond a sequence's
        length are zero; the compressor buffer holds the sequence's trailing incomplete group.
        """
        c, plan = self.config, self.plan
        batch, seq, _ = x.shape
        rows = jnp.arange(batch)[:, None]
        _, _, window = self._queries_and_window(x, jnp.arange(seq))
        # Ring slot s holds the latest position p < length with p ≡ s (mod window_size).
        last = lengths[:, None] - 1
        slot_pos = last - (last - jnp.arange(c.window_size)) % c.window_size
        ring = quant.pack(window[rows, jnp.maximum(slot_pos, 0)], c.window_format)
        cache = LayerCache(window=jnp.where((slot_pos >= 0)[..., None], ring, 0))
        if self.compressor is None:
            return cache

        r = plan.compress_ratio
        entries = -(-max_len // r)
        complete = lengths[:, None] // r

        def table(values, fmt):
            packed = quant.pack(values, fmt)
            packed = jnp.where((jnp.arange(packed.shape[1]) < complete)[..., None], packed, 0)
            return jnp.pad(packed, ((0, 0), (0, entries - packed.shape[1]), (0, 0)))

        cache = cache.replace(main_kv=table(shared.kv, c.kv_format))
        if self.indexer is not None:
            cache = cache.replace(index_k=table(shared.index_k, c.index_format))
        if r > 1:
            kv, score = self.compressor.project(x)
            tail = complete * r + jnp.arange(r)
            buffered = tail < lengths[:, None]
            tail = jnp.minimum(tail, seq - 1)
            cache = cache.replace(
                kv_state=jnp.where(buffered[..., None], kv[rows, tail], 0.0),
                score_state=jnp.where(buffered[..., None], score[rows, tail], -jnp.inf),
            )
        return cache

    # --- decode ---

    def decode(
        self,
        x: Float[Array, "b dim"],
        shared: SharedState,
        cache: LayerCache,
        positions: Int[Array, " b"],
        *,
        implementation: str = "xla",
        debug: bool = False,
    ) -> tuple[Float[Array, "b dim"], SharedState, LayerCache]:
        """One token per sequence at `positions` [B]; reads and writes this layer's packed cache.

        Args:
          x: [B, dim] normalized layer input.
          shared: the state published by earlier layers in this step.
          cache: this layer's packed cache (rows of `positions` are written here).
          positions: [B] int position of each sequence's token.
          implementation: one of `IMPLEMENTATIONS`. With 'pallas' (or 'pallas_interpret'),
            a layer with compressed KV attends with `fp4_sparse_attention` on the packed caches
            (the shared main-KV rows, its selection, the FP8 window ring) instead of gathering
            and unpacking in XLA, and a Reindex layer inside the pool selects with
            `pooled_scores`; window-only layers and full scans stay XLA. The kernel's attention
            output is bf16 (float32 accumulation), widened to float32: ~2e-3 relative error
            against 'xla' (tests/test_decode_kernels.py bounds it by 1e-2).
          debug: stage the selection invariants (`v41jax.invariants`).

        Returns:
          (output [B, dim] float32, the updated shared state, the updated layer cache).
        """
        check_implementation(implementation, decode=True)
        check_kernel_config(self.config, implementation)
        c, plan = self.config, self.plan
        batch = x.shape[0]
        rows = jnp.arange(batch)
        qr, q, window = self._queries_and_window(x, positions)
        slot = positions % c.window_size
        cache = cache.replace(
            window=cache.window.at[rows, slot].set(quant.pack(window, c.window_format))
        )
        window_valid = window_slot_valid(positions, c.window_size)

        if self.compressor is not None:
            cache = self._compress_step(x, positions, cache)
            shared = shared.replace(kv_packed=cache.main_kv)
            if self.indexer is not None:
                # Full layers scan every position (XLA); Reindex kernels read the packed rows.
                index_k = quant.unpack(cache.index_k, c.index_format, c.index_head_dim)
                shared = shared.replace(index_k=index_k, index_k_packed=cache.index_k)

        if plan.role is Role.WINDOW:
            kv_row = quant.packed_row_bytes(c.kv_format, c.head_dim, rope_dim=c.rope_head_dim)
            kv_packed = jnp.zeros((batch, 0, kv_row), jnp.uint8)
            selected = jnp.zeros((batch, 0), jnp.int32)
            # No compressed KV to read: the window ring alone is attended in XLA.
            implementation = "xla"
        else:
            compress_lens = (positions + 1) // plan.compress_ratio
            shared, _ = self._select(
                qr[:, None],
                x[:, None],
                positions[:, None],
                compress_lens[:, None],
                shared,
                debug,
                implementation,
            )
            kv_packed = shared.kv_packed
            selected = self._selection(shared, compress_lens[:, None], kv_packed.shape[1])[:, 0]
        o = self._attend_packed(q, kv_packed, selected, cache.window, window_valid, implementation)
        return self._output(o, positions), shared, cache

    def _attend_packed(self, q, kv_packed, selected, window_packed, window_valid, implementation):
        """Core attention of B single queries [B, H, D] over packed rows: main KV [B, S, row]
        at `selected` [B, K] (−1 skips) and the window ring [B, W, row] where `window_valid`.

        'xla' gathers the selected rows, unpacks them and runs `sparse_attention` (float32); the
        kernel implementations hand the packed caches to `fp4_sparse_attention` (bf16 output).
        """
        c = self.config
        if implementation in KERNEL_IMPLEMENTATIONS:
            from pallas_kernels.sparse_attention.api import fp4_sparse_attention  # lazy

            return fp4_sparse_attention(
                q,
                kv_packed,
                selected,
                window_packed,
                window_valid,
                self.sink[...],
                kv_fmt=c.kv_format,
                window_fmt=c.window_format,
                implementation="pallas",
                interpret=implementation == "pallas_interpret",
            )
        # Gather the selected packed rows, then unpack only those.
        packed = jnp.take_along_axis(kv_packed, jnp.maximum(selected, 0)[..., None], axis=1)
        kv_rows = quant.unpack(packed, c.kv_format, c.head_dim)
        local = jnp.where(selected >= 0, jnp.arange(selected.shape[-1]), -1)
        window_rows = quant.unpack(window_packed, c.window_format, c.head_dim)
        return jax.vmap(
            lambda q_b, rows_b, valid_b, kv_b, idx_b: sparse_attention(
                q_b, rows_b, valid_b, kv_b, idx_b, self.sink[...]
            )
        )(q, window_rows, window_valid, kv_rows, local)

    def _compress_step(self, x, positions, cache: LayerCache) -> LayerCache:
        """Buffers this token in the compressor state; a sequence whose group is now complete
        pools it and writes packed main-KV (and index-key) row j = position // ratio."""
        c, r = self.config, self.plan.compress_ratio
        rows = jnp.arange(x.shape[0])
        kv, score = self.compressor.project(x)
        if r == 1:
            latent, complete = (
                self.compressor.finish(kv[:, None], None),
                jnp.ones_like(positions, bool),
            )
        else:
            slot = positions % r
            kv_state = cache.kv_state.at[rows, slot].set(kv)
            score_state = cache.score_state.at[rows, slot].set(score)
            cache = cache.replace(kv_state=kv_state, score_state=score_state)
            latent = self.compressor.finish(kv_state, score_state)
            complete = (positions + 1) % r == 0
        entry = positions // r
        entry_positions = entry * r

        def write(table, row):
            old = table[rows, entry]
            return table.at[rows, entry].set(jnp.where(complete[:, None], row, old))

        main = quant.pack(self._main_kv(latent, entry_positions), c.kv_format)
        cache = cache.replace(main_kv=write(cache.main_kv, main))
        if self.indexer is not None:
            keys = quant.pack(self.indexer.keys(latent, entry_positions), c.index_format)
            cache = cache.replace(index_k=write(cache.index_k, keys))
        return cache
