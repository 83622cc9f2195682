"""The CSA2 attention layer; its role (window, Full, Reindex, Reuse, candidate source) comes from
the config (DESIGN §3, `v41_architecture.md` §1–§5).

`Attention.__call__` reads as the data flow of DESIGN §3: queries and the window row; (Full)
the compressor's entries published as the shared KV and index keys (step 1); (index sources)
scores, pool and top-k (steps 2–3, `selection.select`); one softmax over window, selected keys
and sink (step 4, `ops.attention.masked_attention`); inverse RoPE and the output projection.
The pieces live elsewhere: selection and the shared state in `selection`, the indexer and its
KL loss in `indexer`, cache building in `cache`, the kernel switch in `dispatch`.

Each layer runs in two modes that share every piece of math:
  - prefill (`__call__`): a whole batch of padded sequences [B, T]; causality alone keeps a valid
    row from seeing padding, since padding only ever sits in its future;
  - decode (`decode`): one token per sequence at its own position, reading and writing the packed
    cache (`cache.LayerCache`); with `implementation='pallas'` the kernels of `pallas_kernels`
    read the packed rows directly (DESIGN §6).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jaxtyping import Array, Float, Int

from v41jax.nn import cache as cache_lib
from v41jax.nn import dispatch
from v41jax.nn.cache import LayerCache
from v41jax.nn.compressor import Compressor
from v41jax.nn.config import LayerPlan, ModelConfig, Role
from v41jax.nn.indexer import Indexer, indexer_kl
from v41jax.nn.rope import apply_rope
from v41jax.nn.selection import SharedState, attended_indices, select, select_chunk
from v41jax.nn.sharding import (
    CONTEXT,
    check_decode_implementation,
    context_mesh,
    data_axis,
    rowwise,
    split_sequence,
    whole_sequence,
    window_rows,
)
from v41jax.ops import formats
from v41jax.ops.attention import (
    chunk_attention,
    masked_attention,
    sharded_packed_sparse_attention,
)
from v41jax.ops.pool import CandidatePool
from v41jax.ops.scoring import (
    gather_rows,
    index_scores,
    index_scores_at,
    indices_to_mask,
    topk_indices,
)


def check_buildable(config: ModelConfig) -> None:
    """Raises unless `config` can build a model: its main-KV format must be one that quantizes
    (`v4_flash()`'s 'v4_fp8' is registered for byte accounting only)."""
    if formats.FORMATS[config.kv_format].accounting_only:
        usable = formats.formats_for("kv", quantizable=True)
        raise ValueError(
            f"config.kv_format: expected one of {list(usable)} to build a model "
            f"({config.kv_format!r} is for byte accounting only), got {config.kv_format!r}"
        )


class Attention(nnx.Module):
    """One CSA2 attention layer: queries, window KV, and the role's compressed-KV machinery."""

    def __init__(self, config: ModelConfig, plan: LayerPlan, *, rngs: nnx.Rngs):
        check_buildable(config)
        c = self.config = config
        self.plan = plan
        self.theta, self.yarn = c.rope(plan.compress_ratio)
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

    def _rope(self, x, positions, *, inverse=False):
        """RoPE of this layer (`ModelConfig.rope`: its base, and YaRN where it applies)."""
        c = self.config
        return apply_rope(
            x, positions, c.rope_head_dim, self.theta, inverse=inverse, yarn=self.yarn
        )

    def _queries(self, x, positions):
        """The low-rank query latent (shared with the indexer) and the rotated queries
        [..., H, D]."""
        c = self.config
        qr = self.q_norm(self.wq_a(x))
        q = self.wq_b(qr).reshape(*x.shape[:-1], c.n_heads, c.head_dim)
        return qr, self._rope(q, positions[..., None])

    def _window_kv(self, x, positions):
        """This token's window KV row: rotated at its position, fake-quantized (FP8)."""
        c = self.config
        window = self._rope(self.kv_norm(self.wkv(x)), positions)
        return formats.fake_quant(window, c.window_format)

    def _main_kv(self, latent, entry_positions):
        """Compressed main KV: the latent rotated at its group's first token, then quantized."""
        c = self.config
        kv = self._rope(latent, entry_positions)
        return formats.fake_quant(kv, c.kv_format)

    def _output(self, o, positions):
        """Inverse RoPE on the output's tail, then the grouped low-rank output projection."""
        c = self.config
        o = self._rope(o, positions[..., None], inverse=True)
        o = o.reshape(*o.shape[:-2], c.o_groups, c.n_heads // c.o_groups * c.head_dim)
        o = jnp.einsum("...gi,gio->...go", o, self.wo_a[...])
        return self.wo_b(o.reshape(*o.shape[:-2], c.o_groups * c.o_lora_rank))

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
          implementation: 'xla' (`dispatch.PREFILL_IMPLEMENTATIONS`; the kernels serve decode).
          debug: stage the selection invariants (`v41jax.ops.invariants`).
          dense: attend to every visible compressed entry instead of the selection (the dense
            baseline and the indexer warm-up); index sources still score, select and publish.
          indexer_loss: compute this index source's KL loss (`indexer.indexer_kl`).
          diagnostics: also return the index scores, the attention probabilities and indices.

        Returns:
          (output [B, T, dim], the updated shared state, aux). aux holds, for index sources,
          'indexer_kl' (summed over query rows) and 'indexer_kl_rows' (rows with a key) when
          `indexer_loss`; with `diagnostics`, for layers with compressed KV: 'key_mask'
          [B, T, S] (the compressed keys the layer attended to), 'probs' [B, T, H, S] (their
          attention probabilities, normalized with the window and the sink), 'dense_probs'
          [B, T, S] (the layer's attention over every visible compressed position, summed over
          heads and renormalized), for index sources 'scores' [B, T, S], and for Reindex layers
          after the candidate source 'unrestricted_topk' [B, T, index_topk] (its picks without
          the pool).
        """
        dispatch.check_implementation(implementation)
        c, plan = self.config, self.plan
        batch, seq, _ = x.shape
        if c.query_chunk and seq and plan.role is not Role.WINDOW and not (debug or diagnostics):
            return self._call_chunked(x, shared, dense=dense, indexer_loss=indexer_loss)
        positions = jnp.arange(seq)
        qr, q = self._queries(x, positions)
        window = self._window_kv(x, positions)
        shared = self._publish_compressed(x, shared)

        if plan.role is Role.WINDOW:
            kv = jnp.zeros((batch, 0, c.head_dim), x.dtype)
            key_mask, scores, compress_lens = jnp.zeros((batch, seq, 0), bool), None, None
        else:
            compress_lens = split_sequence(
                jnp.broadcast_to((positions + 1) // plan.compress_ratio, (batch, seq))
            )
            shared, scores = select(
                c, plan, self.indexer, qr, x, positions, compress_lens, shared, debug=debug
            )
            kv = shared.kv
            indices = attended_indices(plan, shared, compress_lens, kv.shape[1], dense=dense)
            key_mask = rowwise(lambda i: indices_to_mask(i, kv.shape[1]), indices)
        result = masked_attention(
            q, window, kv, key_mask, self.sink[...], window_size=c.window_size
        )

        aux = {}
        probs = result.probs
        if indexer_loss and self.indexer is not None:
            aux["indexer_kl"], aux["indexer_kl_rows"] = indexer_kl(scores, probs, key_mask)
        if diagnostics and plan.role is not Role.WINDOW:
            dense_probs = self._dense_probs(q, window, kv, compress_lens)
            aux.update(key_mask=key_mask, probs=probs, dense_probs=dense_probs)
            if scores is not None:
                aux["scores"] = scores
            if plan.uses_candidates:
                aux["unrestricted_topk"] = topk_indices(scores, c.index_topk, tie_order=c.tie_order)
        return self._output(result.out, positions), shared, aux

    def _call_chunked(
        self, x, shared: SharedState, *, dense: bool, indexer_loss: bool
    ) -> tuple[Float[Array, "b t dim"], SharedState, dict[str, Array]]:
        """`__call__` with `config.query_chunk` queries at a time (long sequences).

        The per-sequence pieces (queries, window rows, the compressed KV and index keys) are
        computed once; then, chunk by chunk under `jax.checkpoint` (the backward pass recomputes
        a chunk instead of storing it; only the selection's integer ids are kept), an index
        source scores and selects (`selection.select_chunk`), the layer attends to its window
        and its selected keys gathered (`chunk_attention`; every visible key under a mask when
        dense), and the KL loss reads the selected keys' scores (`index_scores_at`; every
        visible key's when dense). Live memory is O(chunk·S) for a full scan or dense
        attention, O(chunk·(W + k)) otherwise; the published state holds top-k and pool block
        ids [B, T, ·] (the pool's mask is None). A last partial chunk is padded with queries
        past the end whose results are dropped (and kept out of the KL loss).

        Under context parallelism (`sharding`: the sequence split into N contiguous slices)
        each device loops over its own slice: step i takes the i-th chunk of every slice, N
        chunks side by side on the 'context' axis (each slice padded on its own), the
        selection runs per device (`rowwise`), and each device gathers its window rows from its
        slice and the W − 1 rows before it (`window_rows`: a halo from its neighbour). With
        N = 1 this is the chunking above.
        """
        c, plan = self.config, self.plan
        batch, seq, _ = x.shape
        mesh = context_mesh()
        n_split = 1 if mesh is None else mesh.shape[CONTEXT]
        if seq % n_split:
            raise ValueError(
                f"x: expected a sequence length divisible by the mesh's context={n_split}, "
                f"got {seq}"
            )
        local = seq // n_split  # each device's slice
        chunk = min(c.query_chunk, local)
        n_chunks = -(-local // chunk)
        padded = n_chunks * chunk
        step_rows = n_split * chunk  # the queries of one step, over all devices
        positions = jnp.arange(seq)
        qr, q = self._queries(x, positions)
        window = self._window_kv(x, positions)
        shared = self._publish_compressed(x, shared)
        kv, index_k, sink = shared.kv, shared.index_k, self.sink[...]
        n_kv, ratio = kv.shape[1], plan.compress_ratio
        scans = self.indexer is not None
        score_dtype = c.index_score_dtype
        attends_all = dense or plan.topk_source is None

        def chunked(a, fill):  # [B, T, ...] -> [n_chunks, B, n_split · chunk, ...]
            tail = a.shape[2:]
            a = a.reshape(batch, n_split, local, *tail)
            a = jnp.pad(
                a, ((0, 0), (0, 0), (0, padded - local)) + ((0, 0),) * len(tail),
                constant_values=fill,
            )  # fmt: skip
            a = jnp.moveaxis(a.reshape(batch, n_split, n_chunks, chunk, *tail), 2, 0)
            return a.reshape(n_chunks, batch, step_rows, *tail)

        def whole(a):  # [n_chunks, B, n_split · chunk, ...] -> [B, T, ...]
            tail = a.shape[3:]
            a = jnp.moveaxis(a.reshape(n_chunks, batch, n_split, chunk, *tail), 0, 2)
            a = a.reshape(batch, n_split, padded, *tail)[:, :, :local]
            return split_sequence(a.reshape(batch, seq, *tail))

        # Step i's queries: offset i·chunk + r of every slice (r < chunk), real where inside it.
        offsets = jnp.arange(n_chunks)[:, None, None] * chunk + jnp.arange(chunk)
        starts = jnp.arange(n_split)[:, None] * local
        xs = {
            "q": chunked(q, 0.0),
            "positions": (starts + offsets).reshape(n_chunks, step_rows),
            "real": jnp.broadcast_to(offsets < local, (n_chunks, n_split, chunk)).reshape(
                n_chunks, step_rows
            ),
        }
        if scans:
            index_q, index_w = self.indexer.queries(
                jax.lax.stop_gradient(qr), jax.lax.stop_gradient(x), positions
            )
            xs.update(index_q=chunked(index_q, 0.0), index_w=chunked(index_w, 0.0))
            if plan.uses_candidates:
                xs["pool"] = chunked(shared.pool.block_ids, -1)
        elif not attends_all:
            xs["topk"] = chunked(shared.topk, -1)

        def one_chunk(xs):
            pos = xs["positions"]
            lens = split_sequence(
                jnp.broadcast_to(jnp.minimum((pos + 1) // ratio, n_kv), (batch, step_rows))
            )
            real = jnp.broadcast_to(xs["real"], (batch, step_rows))
            outs = {}
            if scans:
                picks = rowwise(
                    lambda q, w, n, pool, keys: select_chunk(c, plan, q, w, n, keys, pool),
                    xs["index_q"], xs["index_w"], lens, xs.get("pool"),
                    whole=(index_k,),
                )  # fmt: skip
                outs["topk"] = topk = checkpoint_name(picks.topk, "selection")
                if picks.block_ids is not None:
                    outs["pool"] = checkpoint_name(picks.block_ids, "selection")
            else:
                topk = xs.get("topk")
            rows, rows_valid = window_rows(window, c.window_size, pos)
            visible = jnp.arange(n_kv) < lens[..., None]
            if attends_all:
                result = chunk_attention(xs["q"], rows, rows_valid, kv, sink, key_mask=visible)
            else:
                result = chunk_attention(xs["q"], rows, rows_valid, kv, sink, indices=topk)
            outs["out"] = result.out
            if indexer_loss and scans:
                if dense:
                    scores = index_scores(
                        xs["index_q"], xs["index_w"], index_k, lens, score_dtype=score_dtype
                    )
                    keys = visible & real[..., None]
                else:
                    rows_k = gather_rows(index_k, topk)
                    scores = index_scores_at(
                        xs["index_q"], xs["index_w"], rows_k, topk, lens, score_dtype=score_dtype
                    )
                    keys = (topk >= 0) & real[..., None]
                outs["kl"], outs["kl_rows"] = indexer_kl(scores, result.probs, keys)
            return outs

        policy = jax.checkpoint_policies.save_only_these_names("selection")
        outs = jax.lax.map(jax.checkpoint(one_chunk, prevent_cse=False, policy=policy), xs)
        aux = {}
        if scans:
            pool = shared.pool
            if "pool" in outs:
                pool = CandidatePool(mask=None, block_ids=whole(outs["pool"]))
            shared = shared.replace(topk=whole(outs["topk"]), pool=pool)
            if indexer_loss:
                aux["indexer_kl"] = jnp.sum(outs["kl"])
                aux["indexer_kl_rows"] = jnp.sum(outs["kl_rows"])
        return self._output(whole(outs["out"]), positions), shared, aux

    def _publish_compressed(self, x, shared: SharedState) -> SharedState:
        """Step 1 (KV sources): the compressor's entries become the shared main KV, and a Full
        layer's index keys the shared index keys (through `stop_gradient`: only the KL loss
        trains the indexer)."""
        if self.compressor is None:
            return shared
        latent = self.compressor(x)
        entry_positions = jnp.arange(latent.shape[1]) * self.plan.compress_ratio
        # Whole on every device under context parallelism (`sharding`): local queries read all.
        shared = shared.replace(kv=whole_sequence(self._main_kv(latent, entry_positions)))
        if self.indexer is not None:
            keys = self.indexer.keys(jax.lax.stop_gradient(latent), entry_positions)
            shared = shared.replace(index_k=whole_sequence(keys))
        return shared

    def _dense_probs(self, q, window, kv, compress_lens):
        """The layer's dense attention (all visible entries, its own queries) over compressed
        positions, summed over heads and renormalized: what a selection should cover."""
        visible = jnp.arange(kv.shape[1]) < compress_lens[..., None]
        dense = masked_attention(
            q, window, kv, visible, self.sink[...], window_size=self.config.window_size
        )
        dense_probs = jnp.sum(dense.probs, axis=-2)
        total = jnp.sum(dense_probs, axis=-1, keepdims=True)
        return dense_probs / jnp.where(total > 0, total, 1.0)

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
        c, r = self.config, self.plan.compress_ratio
        window = self._window_kv(x, jnp.arange(x.shape[1]))
        cache = LayerCache(
            window=cache_lib.ring_from_prefill(window, lengths, c.window_size, c.window_format)
        )
        if self.compressor is None:
            return cache
        cache = cache.replace(
            main_kv=cache_lib.table_from_prefill(shared.kv, lengths, r, max_len, c.kv_format)
        )
        if self.indexer is not None:
            index_k = cache_lib.table_from_prefill(
                shared.index_k, lengths, r, max_len, c.index_format
            )
            cache = cache.replace(index_k=index_k)
        if r > 1:
            kv_state, score_state = cache_lib.buffer_from_prefill(
                *self.compressor.project(x), lengths, r
            )
            cache = cache.replace(kv_state=kv_state, score_state=score_state)
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
          implementation: 'xla' | 'pallas' | 'pallas_interpret' (`dispatch.IMPLEMENTATIONS`).
            With a kernel, a layer with compressed KV attends with `fp4_sparse_attention` on
            the packed caches (the shared main-KV rows, its selection, the FP8 window ring)
            instead of gathering and unpacking in XLA, a Reindex layer inside the pool selects
            with `pooled_scores`, and the candidate source (and another Full layer whose keys
            the scan takes: `dispatch.scans_on_kernels`) scans its packed index keys with the
            same kernel (`source_scan`); window-only layers stay XLA. The kernel's attention
            output is bf16 (float32 accumulation), widened to float32: ~2e-3 relative error
            against 'xla' (tests/test_decode_kernels.py bounds it by 1e-2).
          debug: stage the selection invariants (`v41jax.ops.invariants`).

        Returns:
          (output [B, dim] float32, the updated shared state, the updated layer cache).
        """
        dispatch.check_implementation(implementation, decode=True)
        dispatch.check_kernel_config(self.config, implementation)
        c, plan = self.config, self.plan
        # A cache sharded by position (`sharding.shard_cache`, under a mesh with 'context' > 1).
        mesh = check_decode_implementation(implementation)
        qr, q = self._queries(x, positions)
        window_row = formats.pack(self._window_kv(x, positions), c.window_format)
        cache = cache.replace(window=cache_lib.write_ring(cache.window, positions, window_row))
        window_valid = cache_lib.window_slot_valid(positions, c.window_size)
        cache = self._compress_step(x, positions, cache)
        if self.compressor is not None:
            shared = shared.replace(kv_packed=cache.main_kv)
            if self.indexer is not None:
                # Full layers scan every position (XLA, or the scan kernel route:
                # `dispatch.scans_on_kernels`); Reindex kernels read the packed rows of their
                # pool.
                index_k = formats.unpack(cache.index_k, c.index_format, c.index_head_dim)
                shared = shared.replace(index_k=index_k, index_k_packed=cache.index_k)

        if plan.role is Role.WINDOW:
            kv_row = formats.packed_row_bytes(c.kv_format, c.head_dim, rope_dim=c.rope_head_dim)
            kv_packed = jnp.zeros((x.shape[0], 0, kv_row), jnp.uint8)
            selected = jnp.zeros((x.shape[0], 0), jnp.int32)
            implementation = "xla"  # no compressed KV to read: the window ring alone, in XLA
        else:
            compress_lens = (positions + 1) // plan.compress_ratio
            shared, _ = select(
                c,
                plan,
                self.indexer,
                qr[:, None],
                x[:, None],
                positions[:, None],
                compress_lens[:, None],
                shared,
                debug=debug,
                implementation=implementation,
                sequence_mesh=mesh,
            )
            kv_packed = shared.kv_packed
            selected = attended_indices(plan, shared, compress_lens[:, None], kv_packed.shape[1])
            selected = selected[:, 0]
        if mesh is not None and plan.role is not Role.WINDOW:
            o = sharded_packed_sparse_attention(
                q,
                kv_packed,
                selected,
                cache.window,
                window_valid,
                self.sink[...],
                mesh=mesh,
                axis=CONTEXT,
                batch_axis=data_axis(mesh),
                kv_fmt=c.kv_format,
                window_fmt=c.window_format,
            )
        else:
            o = dispatch.attend_packed(
                c, q, kv_packed, selected, cache.window, window_valid, self.sink[...],
                implementation,
            )  # fmt: skip
        return self._output(o, positions), shared, cache

    def _compress_step(self, x, positions, cache: LayerCache) -> LayerCache:
        """Step 1 at decode (KV sources): buffers this token in the compressor; a sequence whose
        group is now complete writes packed main-KV (and index-key) row j = position // ratio."""
        if self.compressor is None:
            return cache
        c, r = self.config, self.plan.compress_ratio
        latent, complete, kv_state, score_state = self.compressor.decode(
            x, positions, cache.kv_state, cache.score_state
        )
        entry = positions // r
        main = formats.pack(self._main_kv(latent, entry * r), c.kv_format)
        cache = cache.replace(
            main_kv=cache_lib.write_entry(cache.main_kv, entry, main, complete),
            kv_state=kv_state,
            score_state=score_state,
        )
        if self.indexer is not None:
            keys = formats.pack(self.indexer.keys(latent, entry * r), c.index_format)
            cache = cache.replace(
                index_k=cache_lib.write_entry(cache.index_k, entry, keys, complete)
            )
        return cache
