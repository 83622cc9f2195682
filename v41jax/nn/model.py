"""The toy V4.1 model: embedding, a stack of CSA2 attention + SwiGLU blocks, and a head.

`Model.__call__` runs a whole (padded) batch, as training does. `prefill` and `decode_step` serve
from the packed cache of `v41jax.nn.cache`; a prefill over T tokens and T decode steps give the same
logits (to float tolerance) and the same selections (DESIGN §3). `decode_step` also runs on the
Pallas kernels (`implementation='pallas'`, DESIGN §6), which read the packed cache directly.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import checkify
from jaxtyping import Array, Float, Int

from v41jax.nn.attention import check_buildable
from v41jax.nn.blocks import Block, LayerTrace
from v41jax.nn.cache import Cache
from v41jax.nn.config import ModelConfig, Role
from v41jax.nn.dispatch import check_implementation, check_kernel_config
from v41jax.nn.selection import SharedState
from v41jax.nn.sharding import check_decode_implementation, split_sequence
from v41jax.ops import check_finite


class Selections(NamedTuple):
    """What the index sources selected, for tests and diagnostics.

    Attributes:
      topk: {layer: [B, T, index_topk] int32} per Full/Reindex layer (ascending, −1 padded).
      pool_blocks: [B, T, candidate_topk_blocks] int32 block ids of the candidate pool, or None.
    """

    topk: dict[int, Int[Array, "b t k"]]
    pool_blocks: Int[Array, "b t nb"] | None


def _selections(config: ModelConfig, per_layer: list[SharedState]) -> Selections:
    topk, pool = {}, None
    for plan, shared in zip(config.layers, per_layer, strict=True):
        if plan.role in (Role.FULL, Role.REINDEX):
            topk[plan.layer] = shared.topk
        if plan.is_candidate_source:
            pool = shared.pool.block_ids
    return Selections(topk, pool)


def indexer_kls(trace: list[LayerTrace]) -> list[Float[Array, ""]]:
    """Each index source's indexer KL loss, averaged over its query rows that have a key (from a
    `Model.run(..., indexer_loss=True)` trace)."""
    return [
        t.aux["indexer_kl"] / jnp.maximum(t.aux["indexer_kl_rows"], 1.0)
        for t in trace
        if "indexer_kl" in t.aux
    ]


def _check_token_ids(tokens: Int[Array, "*shape"], vocab_size: int) -> None:
    """Stages a checkify check that every id is in [0, vocab_size) (debug mode, under jit)."""
    checkify.check(
        jnp.all((tokens >= 0) & (tokens < vocab_size)),
        f"tokens: expected ids in [0, vocab_size={vocab_size}), got {{}} out of range",
        jnp.sum((tokens < 0) | (tokens >= vocab_size)),
    )


class Model(nnx.Module):
    """Token embedding, `config.n_layers` blocks whose roles come from the config, head."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        # Before any parameter: a refused config must not leave the initializers of the layers
        # built so far running (asynchronously, on V4's real sizes: a minute of CPU in the
        # tests that followed such a refusal, 2026-12-04).
        check_buildable(config)
        self.config = config
        self.embed = nnx.Embed(config.vocab_size, config.dim, rngs=rngs)
        self.blocks = nnx.List([Block(config, i, rngs=rngs) for i in range(config.n_layers)])
        self.norm = nnx.RMSNorm(config.dim, epsilon=config.norm_eps, rngs=rngs)
        self.head = nnx.Linear(config.dim, config.vocab_size, use_bias=False, rngs=rngs)

    def _check_tokens(self, tokens, ndim):
        """Shape and dtype always; the ids themselves when they are concrete (an id outside the
        vocabulary embeds as NaN, a negative one wraps around: both refused). Under `jit` the
        ids cannot be read: `debug=True` checks them with checkify instead."""
        if tokens.ndim != ndim or not jnp.issubdtype(tokens.dtype, jnp.integer):
            layout = "[batch, seq]" if ndim == 2 else "[batch]"
            raise ValueError(
                f"tokens: expected integer array {layout}, got {tokens.dtype}{list(tokens.shape)}"
            )
        if isinstance(tokens, jax.core.Tracer) or not tokens.size:
            return
        values = np.asarray(tokens)
        bad = (values < 0) | (values >= self.config.vocab_size)
        if bad.any():
            first = tuple(int(i) for i in np.argwhere(bad)[0])
            raise ValueError(
                f"tokens: expected ids in [0, vocab_size={self.config.vocab_size}), got "
                f"{int(values[first])} at index {first} ({int(bad.sum())} out of range)"
            )

    def run(
        self,
        tokens: Int[Array, "b t"],
        *,
        implementation: str = "xla",
        debug: bool = False,
        dense: bool = False,
        indexer_loss: bool = False,
        diagnostics: bool = False,
    ) -> tuple[Float[Array, "b t vocab"], list[LayerTrace]]:
        """Logits of a padded batch, and per layer its input, published state and aux.

        `debug` stages the value invariants of `v41jax.ops.invariants` (run under checkify);
        `dense`, `indexer_loss` and `diagnostics` are as in `Attention.__call__`.
        """
        check_implementation(implementation)
        self._check_tokens(tokens, 2)
        if debug:
            _check_token_ids(tokens, self.config.vocab_size)
        h = split_sequence(self.embed(tokens))
        shared, trace = SharedState(), []
        for block in self.blocks:
            h, shared, layer = block(
                h,
                shared,
                implementation=implementation,
                debug=debug,
                dense=dense,
                indexer_loss=indexer_loss,
                diagnostics=diagnostics,
            )
            h = split_sequence(h)
            trace.append(layer)
        logits = self.head(self.norm(h))
        if debug:
            check_finite(logits, "logits")
        return logits, trace

    def __call__(self, tokens: Int[Array, "b t"], *, implementation: str = "xla"):
        """Logits [B, T, vocab] of a padded batch of token ids [B, T]."""
        return self.run(tokens, implementation=implementation)[0]


def _checked(fn, model: Model, *args, compile: bool = True, **static):
    """Runs `fn(model, *args, **static)` under checkify (jitted unless `compile` is False) and
    raises its first failed check (compiles on every call: a debugging tool, not a serving
    path)."""
    graphdef, state = nnx.split(model)

    def pure(state, *args):
        return fn(nnx.merge(graphdef, state), *args, **static)

    checked = checkify.checkify(pure)
    error, out = (jax.jit(checked) if compile else checked)(state, *args)
    error.throw()
    return out


def _prefill_impl(model: Model, tokens, lengths, *, max_len: int, implementation: str, debug):
    logits, trace = model.run(tokens, implementation=implementation, debug=debug)
    layers = tuple(
        block.prefill_cache(t, lengths, max_len)
        for block, t in zip(model.blocks, trace, strict=True)
    )
    cache = Cache(lengths=lengths.astype(jnp.int32), layers=layers, max_len=max_len)
    return logits, cache, _selections(model.config, [t.shared for t in trace])


# graph_updates=False: nnx.jit's default returns every Variable of the model from the program
# (graph updates), and XLA then copies each parameter into a new output buffer at every call:
# 176 copies in a decode step of small_kernels(), 0.39 ms of its 2.21 ms at 64 K tokens on an
# H100 (experiments/results/bench_decode_h100_2026-12-07_merge_loop.json's kernel list). A
# Variable the function assigns is still handed back; nothing here assigns one.
_prefill = nnx.jit(
    _prefill_impl, static_argnames=("max_len", "implementation", "debug"), graph_updates=False
)


def prefill(
    model: Model,
    tokens: Int[Array, "b t"],
    lengths: Int[Array, " b"],
    *,
    max_len: int,
    implementation: str = "xla",
    debug: bool = False,
) -> tuple[Float[Array, "b t vocab"], Cache, Selections]:
    """Runs a padded batch through the model and returns its logits, the packed cache for
    continuing each sequence after its own `lengths[b]` tokens, and the selections.

    Args:
      model: the model.
      tokens: [B, T] int token ids; row b is valid up to lengths[b] (the rest is padding).
      lengths: [B] int, 1 <= lengths[b] <= T.
      max_len: tokens the cache can hold per sequence (>= T).
      implementation: 'xla' (`dispatch.PREFILL_IMPLEMENTATIONS`; the kernels serve decode).
      debug: check the value invariants of `v41jax.ops.invariants` (selected indices visible, pool
        within the visible positions with its newest block pinned, Reindex picks inside the
        pool, finite logits) and raise `checkify.JaxRuntimeError` naming the first that fails.
    """
    tokens, lengths = jnp.asarray(tokens), jnp.asarray(lengths)
    model._check_tokens(tokens, 2)
    batch, seq = tokens.shape
    if seq == 0:
        raise ValueError(
            f"tokens: expected at least one token per sequence, got shape {tokens.shape}"
        )
    if lengths.shape != (batch,) or not jnp.issubdtype(lengths.dtype, jnp.integer):
        raise ValueError(
            f"lengths: expected int array [{batch}], got {lengths.dtype}{lengths.shape}"
        )
    if not isinstance(max_len, int) or max_len < seq:
        raise ValueError(f"max_len: expected an int >= tokens.shape[1] = {seq}, got {max_len!r}")
    if (
        not isinstance(lengths, jax.core.Tracer)
        and lengths.size
        and (int(lengths.min()) < 1 or int(lengths.max()) > seq)
    ):
        raise ValueError(f"lengths: expected values in [1, {seq}], got {lengths.tolist()}")
    check_implementation(implementation)
    static = dict(max_len=max_len, implementation=implementation, debug=debug)
    if debug:
        return _checked(_prefill_impl, model, tokens, lengths, **static)
    return _prefill(model, tokens, lengths, **static)


def _decode_step_impl(model: Model, tokens, cache: Cache, *, implementation: str, debug: bool):
    positions = cache.lengths
    if debug:
        _check_token_ids(tokens, model.config.vocab_size)
    h = model.embed(tokens)
    shared, layers, states = SharedState(), [], []
    for block, layer_cache in zip(model.blocks, cache.layers, strict=True):
        h, shared, layer_cache = block.decode(
            h, shared, layer_cache, positions, implementation=implementation, debug=debug
        )
        layers.append(layer_cache)
        states.append(shared)
    logits = model.head(model.norm(h))
    if debug:
        check_finite(logits, "logits")
    cache = cache.replace(lengths=positions + 1, layers=tuple(layers))
    return logits, cache, _selections(model.config, states)


_decode_step = nnx.jit(
    _decode_step_impl, static_argnames=("implementation", "debug"), graph_updates=False
)
# The same step with the cache's buffers donated: written in place instead of copied. No
# parameter leaves the program either (graph_updates=False, as `_prefill`).
_decode_step_donated = nnx.jit(
    _decode_step_impl,
    static_argnames=("implementation", "debug"),
    donate_argnames="cache",
    graph_updates=False,
)


def decode_step(
    model: Model,
    tokens: Int[Array, " b"],
    cache: Cache,
    *,
    implementation: str = "xla",
    debug: bool = False,
    donate_cache: bool = False,
) -> tuple[Float[Array, "b vocab"], Cache, Selections]:
    """Appends one token per sequence (at position `cache.lengths[b]`) and returns its logits,
    the updated cache and the selections ([B, 1, ...] per index source); `debug` as in
    `prefill`.

    `donate_cache=True` hands the cache's buffers to the step, which writes the new rows in
    place; the `cache` passed in is deleted (use the one returned). Without it every step
    copies the whole cache to write one row per table (`small_kernels()` holds 534 B per token
    and sequence, `cache.global_kv_bytes_per_token`: 18 GB at 1 M tokens × 32 sequences), more
    than the step's own reads at long context.
    A serving loop donates; a caller that decodes the same cache twice (a comparison) does not.
    `debug` and 'pallas_interpret' run without donation.

    `implementation` is one of `dispatch.IMPLEMENTATIONS`: 'xla' (gather, unpack, float32), or
    'pallas' on a Hopper GPU ('pallas_interpret': the same kernels interpreted on the CPU), where
    every layer with compressed KV attends with `fp4_sparse_attention` on the packed caches,
    every Reindex layer inside the candidate pool selects with `pooled_scores`, and the
    candidate source builds its pool and its own top-k with the same scoring kernel over every
    block of its cache (`pallas_kernels.source_scan`; another Full layer its own top-k, when
    the scan takes its keys: `dispatch.scans_on_kernels`). The kernels need
    a config they can take (`dispatch.check_kernel_config` raises naming the fields otherwise;
    `config.small_kernels()` is one). Their attention output is bf16 with float32 accumulation
    (~2e-3 relative error per layer), so at small_kernels() size logits differ from 'xla' by up
    to ~1e-2 of their RMS. That perturbation can also flip a later layer's near-tied top-k pick
    (an index query crossing an MXFP4 rounding boundary); from there on the sequence differs by
    more (up to ~0.3 of the logits' RMS measured on a random-initialized model).
    tests/test_decode_kernels.py derives and states the tolerances.

    A cache sharded by position (`sharding.shard_cache`) decodes under `jax.set_mesh(mesh)` of
    a mesh with a 'context' axis (and optionally 'data'), implementation 'xla': every device
    selects among the rows it holds and the devices merge (score, id) pairs (the same picks, bit
    for bit), then attend where the rows live and combine softmax partials (logits equal up to
    float summation order); tests/multidevice/test_sharded_decode.py.

    'pallas_interpret' runs the step op by op, not jitted: the Mosaic GPU interpreter blocks
    XLA:CPU threads in its callbacks, and inside one larger jitted program its kernels can
    deadlock under CPU async dispatch, JAX's default (observed on a 2-core machine; not with
    `jax_cpu_enable_async_dispatch=False` at start-up). Unjitted, each kernel is its own small
    program and they run one at a time.
    """
    tokens = jnp.asarray(tokens)
    model._check_tokens(tokens, 1)
    if tokens.shape[0] != cache.batch:
        raise ValueError(
            f"tokens: expected shape [{cache.batch}] (the cache's batch), got {tokens.shape}"
        )
    if not isinstance(cache.lengths, jax.core.Tracer) and cache.lengths.size:
        if int(cache.lengths.max()) >= cache.max_len:
            raise ValueError(
                f"cache: full; a sequence already holds {int(cache.lengths.max())} tokens and "
                f"max_len is {cache.max_len}"
            )
        if int(cache.lengths.min()) < 0:
            raise ValueError(
                f"cache.lengths: expected tokens held >= 0, got {int(cache.lengths.min())}"
            )
    check_implementation(implementation, decode=True)
    check_decode_implementation(implementation)
    check_kernel_config(model.config, implementation)
    interpreted = implementation == "pallas_interpret"
    if debug:
        return _checked(
            _decode_step_impl,
            model,
            tokens,
            cache,
            compile=not interpreted,
            implementation=implementation,
            debug=True,
        )
    if interpreted:  # unjitted: nothing to donate to
        return _decode_step_impl(model, tokens, cache, implementation=implementation, debug=False)
    step = _decode_step_donated if donate_cache else _decode_step
    return step(model, tokens, cache, implementation=implementation, debug=False)


def with_fields(model: Model, **changes) -> Model:
    """The same parameters under a config with other non-parameter fields (the main-KV format,
    the pool's size, the block score): the graph of a model built with the changed config takes
    `model`'s state as it is (shared, not copied). ValueError if a change alters the shape or
    dtype of a parameter.

    Example: post-training quantization of the main KV, or a trained model evaluated with a
    pool of one block:
        >>> ptq = with_fields(model, kv_format="nvfp4")
        >>> one = with_fields(model, candidate_topk_blocks=1)
    """
    config = model.config.replace(**changes)
    graphdef, shapes = nnx.split(nnx.eval_shape(lambda: Model(config, rngs=nnx.Rngs(0))))
    state = nnx.state(model)
    want = jax.tree.map(lambda x: (x.shape, x.dtype), shapes)
    got = jax.tree.map(lambda x: (x.shape, x.dtype), state)
    if want != got:
        raise ValueError(
            f"changes: {sorted(changes)} change the model's parameters; expected "
            "fields that leave them as they are"
        )
    return nnx.merge(graphdef, state)


def parameter_counts(config: ModelConfig) -> dict[str, int]:
    """Parameters of `Model(config)`, counted on an abstract instance (`nnx.eval_shape`: nothing
    is allocated, so the real V4.1-Flash stack can be counted on a laptop).

    Returns a dict with 'attention' (all attention layers), one 'attention/<role>' entry per role,
    'ffn', 'embed_and_head' (embedding, final norm, head) and 'total'.
    """
    abstract = nnx.eval_shape(lambda: Model(config, rngs=nnx.Rngs(0)))

    def count(module) -> int:
        return sum(x.size for x in jax.tree.leaves(nnx.state(module, nnx.Param)))

    counts = {"attention": 0, "ffn": 0}
    for plan, block in zip(config.layers, abstract.blocks, strict=True):
        n = count(block.attn) + count(block.attn_norm)
        counts["attention"] += n
        key = f"attention/{plan.role.value}"
        counts[key] = counts.get(key, 0) + n
        counts["ffn"] += count(block.ffn) + count(block.ffn_norm)
    counts["total"] = count(abstract)
    counts["embed_and_head"] = counts["total"] - counts["attention"] - counts["ffn"]
    return counts
