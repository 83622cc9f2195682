"""The decode step at long context, whole and op by op, XLA against the kernels (issue 16 item 4).

    PYTHONPATH=. python3 experiments/bench_decode.py --out experiments/results/bench_decode.json
    PYTHONPATH=. python3 experiments/bench_decode.py --check   # CPU: tiny, each call once, untimed

The model is `config.small_kernels()` with V4.1's selection sizes (a pool of 2,048 blocks of 8,
top-512; `--pool-blocks`, `--index-topk`), randomly initialized: its weights do not change the
work of a step. Each cache is filled with random packed rows (drawn from a few thousand random
rows of each table's format, so that scores rarely tie) instead of a prefill, every sequence
holding `context` tokens minus 0–7 (ragged last blocks).

Per context and implementation ('xla', 'pallas'):
- `step`: `model.decode_step(donate_cache=True)`, chained over `--steps` tokens and each timed on
  its own (`pallas_kernels.timing.measure_chain`: CUPTI, after a warm-up step); tokens/s is the
  batch over the median step.
- the step's ops, timed alone on the same cache (`timing.record`, medians over fresh queries):
  the candidate source's scan (pool and own top-k; layer 4), the other Full layer's scan (its
  own top-k; layer 1, compress ratio 2), one Reindex layer's pooled top-k (layers 6 and 9 each
  run one) and one attention call over each main-KV source (layer 1's for layers 1–3, layer 4's
  for layers 4–11). `per_step` multiplies each by its count in a step; `rest` is the step
  minus their sum (projections, the compressor, the window, the FFN, the cache writes).
- `indexer_stack_over_source_scan`: (source scan + 2 pooled top-k) / source scan, the issue's
  target ≤ 1.3 (the pool makes the deep layers' selection nearly free).

Errors (out of memory at a size, a kernel that does not compile) are recorded, not raised.
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx
from tqdm import tqdm

from experiments import _common
from pallas_kernels import timing
from v41jax.nn import cache as cache_lib
from v41jax.nn import config as config_lib
from v41jax.nn import dispatch
from v41jax.nn import model as model_lib
from v41jax.nn.config import Role
from v41jax.ops import formats, scoring

DISTINCT_ROWS = 4096


def bench_config(pool_blocks: int, index_topk: int) -> config_lib.ModelConfig:
    """`small_kernels()` with V4.1's pool and top-k sizes."""
    return config_lib.small_kernels().replace(
        candidate_topk_blocks=pool_blocks, index_topk=index_topk
    )


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4, 5))
def _random_rows(key, batch: int, rows: int, fmt: str, dim: int, distinct: int):
    """[batch, rows, row_bytes] packed rows of `fmt`, each one of `distinct` random rows."""
    k_values, k_pick = jax.random.split(key)
    pool = formats.pack(jax.random.normal(k_values, (distinct, dim), jnp.float32), fmt)
    return pool[jax.random.randint(k_pick, (batch, rows), 0, distinct)]


def random_cache(
    config, batch: int, context: int, steps: int, key, distinct: int = DISTINCT_ROWS
) -> cache_lib.Cache:
    """A cache of `context` − (b mod 8) tokens per sequence b, room for `steps` more, holding
    random packed rows (each one of `distinct` per table) in every table (the compressors'
    buffers empty)."""
    c = config
    rows_of = functools.partial(_random_rows, distinct=min(distinct, context))
    empty = jax.eval_shape(lambda: cache_lib.init_cache(c, batch, context + steps + 1))
    layers = []
    for i, (plan, layer) in enumerate(zip(c.layers, empty.layers, strict=True)):
        k = jax.random.fold_in(key, i)
        filled = {"window": rows_of(k, batch, c.window_size, c.window_format, c.head_dim)}
        if layer.main_kv is not None:
            rows = layer.main_kv.shape[1]
            filled["main_kv"] = rows_of(k, batch, rows, c.kv_format, c.head_dim)
        if layer.index_k is not None:
            rows = layer.index_k.shape[1]
            k_index = jax.random.fold_in(k, 1)
            filled["index_k"] = rows_of(k_index, batch, rows, c.index_format, c.index_head_dim)
        if layer.kv_state is not None:
            ratio = plan.compress_ratio
            filled["kv_state"] = jnp.zeros((batch, ratio, c.head_dim), jnp.float32)
            filled["score_state"] = jnp.full((batch, ratio, c.head_dim), -jnp.inf, jnp.float32)
        layers.append(cache_lib.LayerCache(**filled))
    lengths = context - jnp.arange(batch, dtype=jnp.int32) % 8
    return cache_lib.Cache(lengths=lengths, layers=tuple(layers), max_len=empty.max_len)


def _op_inputs(key, config, batch: int):
    """Random indexer queries (MXFP4 fake-quantized), head weights and attention queries."""
    k_q, k_w, k_a = jax.random.split(key, 3)
    c = config
    q = formats.mxfp4_fake_quant(
        jax.random.normal(k_q, (batch, c.index_n_heads, c.index_head_dim), jnp.float32)
    )
    weights = jax.random.normal(k_w, (batch, c.index_n_heads)) * c.index_n_heads**-0.5
    q_attention = jax.random.normal(k_a, (batch, c.n_heads, c.head_dim), jnp.bfloat16)
    return q, weights, q_attention


def _layer_counts(config) -> dict[str, int]:
    """How many times a step runs each timed op."""
    c = config
    kv_users = {source: 0 for source in c.kv_source_layers}
    for plan in c.layers:
        if plan.kv_source is not None:
            kv_users[plan.kv_source] += 1
    counts = {
        "source_scan": sum(p.is_candidate_source for p in c.layers),
        "full_scan": sum(p.role is Role.FULL and not p.is_candidate_source for p in c.layers),
        "pooled_topk": sum(p.uses_candidates for p in c.layers),
    }
    counts.update({f"attention_kv{source}": n for source, n in kv_users.items()})
    return counts


def _op_tables(config, cache) -> dict:
    """What the timed ops read besides their queries, as arrays to pass to them (a jitted
    function would embed arrays it closes over as constants, the caches included): the
    candidate source's and the other Full layer's index keys and lengths, a pool of random
    visible blocks for the pooled top-k (which blocks does not change the work), and per
    main-KV source its rows, window ring, random picks and window validity."""
    c, layers = config, cache.layers
    source = c.candidate_source_layer
    full = next(p.layer for p in c.layers if p.role is Role.FULL and not p.is_candidate_source)
    lens = {layer: (cache.lengths + 1) // c.compress_ratios[layer] for layer in (source, full)}
    n_blocks = -(-layers[source].index_k.shape[1] // c.candidate_block_size)
    visible = -(-lens[source] // c.candidate_block_size)
    draw = jax.random.uniform(jax.random.key(source), (cache.batch, n_blocks))
    draw = jnp.where(jnp.arange(n_blocks) < visible[:, None], draw, -jnp.inf)
    valid = cache_lib.window_slot_valid(cache.lengths, c.window_size)
    attention = {}
    for layer in c.kv_source_layers:
        n_kv = layers[layer].main_kv.shape[1]
        picks = jax.random.randint(jax.random.key(layer), (cache.batch, c.index_topk), 0, n_kv)
        attention[layer] = (layers[layer].main_kv, picks, layers[layer].window, valid)
    return {
        "source": (layers[source].index_k, lens[source]),
        "full": (layers[full].index_k, lens[full]),
        "pool": scoring.topk(draw, c.candidate_topk_blocks).indices,
        "attention": attention,
    }


def _ops(config, implementation: str) -> dict:
    """The timed ops as functions of (`_op_tables`, index queries, head weights, attention
    queries)."""
    c, impl = config, implementation

    def source_scan(tables, q, w, _):
        keys, lens = tables["source"]
        found = dispatch.candidate_source(c, keys, q, w, lens, impl)
        return found.block_ids, found.topk.indices

    def full_scan(tables, q, w, _):
        keys, lens = tables["full"]
        return dispatch.candidate_source(c, keys, q, w, lens, impl, pool=False).topk.indices

    def pooled_topk(tables, q, w, _):
        keys, lens = tables["source"]
        return dispatch.pooled_topk(c, keys, q, w, tables["pool"], lens, impl).indices

    def attention(kv_layer):
        sink = jnp.zeros((c.n_heads,), jnp.float32)

        def run(tables, _, __, q_attention):
            main_kv, picks, window, valid = tables["attention"][kv_layer]
            return dispatch.attend_packed(c, q_attention, main_kv, picks, window, valid, sink, impl)

        return run

    ops = {"source_scan": source_scan, "full_scan": full_scan, "pooled_topk": pooled_topk}
    ops.update({f"attention_kv{layer}": attention(layer) for layer in c.kv_source_layers})
    return ops


def run_context(model, config, *, context: int, batch: int, steps: int, iterations: int,
                check: bool, implementations: tuple[str, ...], progress) -> dict:  # fmt: skip
    """One context's entry: the whole step and each op, per implementation."""
    entry = {"context": context, "batch": batch, "counts": _layer_counts(config)}
    graphdef, state = nnx.split(model)
    tokens = jnp.arange(batch, dtype=jnp.int32) % config.vocab_size

    def filled_cache():
        return jax.block_until_ready(
            random_cache(config, batch, context, steps + 1, jax.random.key(context))
        )

    for impl in implementations:
        out = entry.setdefault(impl, {})
        try:
            cache = filled_cache()
        except Exception as e:  # recorded in the JSON
            out["error"] = repr(e)
            continue

        def step(cache, impl=impl):
            m = nnx.merge(graphdef, state)
            _, cache, _ = model_lib.decode_step(
                m, tokens, cache, implementation=impl, donate_cache=True
            )
            return cache

        if check:  # the CPU: every op once, untimed; the whole step in XLA only (the
            # interpreted kernel step is tests/test_decode_kernels.py's, and takes minutes here)
            if impl == "xla":
                cache = step(cache)
                out["step"] = {"ran": True}
        else:
            try:
                out["step"], cache = timing.measure_chain(step, cache, steps)
                out["tokens_per_s"] = batch / (out["step"]["median_ms"] / 1e3)
            except Exception as e:  # recorded in the JSON
                out["step"] = {"error": repr(e)}
        progress()
        if any(leaf.is_deleted() for leaf in jax.tree.leaves(cache)):  # donated to a failed step
            cache = filled_cache()
        tables = _op_tables(config, cache)
        datasets = [(tables, *_op_inputs(jax.random.key(100 + i), config, batch)) for i in range(2)]
        for name, fn in _ops(config, impl).items():
            op = jax.jit(fn)  # checked as it is timed: one program (op by op, the check
            # compiled some 600 small ones, 41 s against 30 s for its test on 2 cores)
            if check:
                jax.block_until_ready(op(*datasets[0]))
                out[name] = {"ran": True}
            else:
                timing.record(out, name, op, datasets, iterations)
            progress()
        _per_step(entry, impl)
        del cache, tables, datasets
    return entry


def _per_step(entry: dict, impl: str) -> None:
    """Each op's time per step (its median × its count), the rest of the step, the ratio."""
    out = entry[impl]
    ms = {
        name: out[name]["median_ms"] for name in entry["counts"] if "median_ms" in out.get(name, {})
    }
    if len(ms) < len(entry["counts"]):
        return
    per_step = {name: ms[name] * entry["counts"][name] for name in ms}
    out["per_step_ms"] = per_step
    if "median_ms" in out.get("step", {}):
        out["rest_ms"] = out["step"]["median_ms"] - sum(per_step.values())
    out["indexer_stack_over_source_scan"] = (
        per_step["source_scan"] + per_step["pooled_topk"]
    ) / per_step["source_scan"]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write the JSON here")
    parser.add_argument("--contexts", type=int, nargs="+", default=[65536, 262144, 1048576])
    parser.add_argument(
        "--batch", type=int, nargs="+", default=[64, 64, 32],
        help="sequences per context (one value, or one per context)",
    )  # fmt: skip
    parser.add_argument("--steps", type=int, default=8, help="timed decode steps (chained)")
    parser.add_argument("--iterations", type=int, default=10, help="timed calls per op data set")
    parser.add_argument("--pool-blocks", type=int, default=2048)
    parser.add_argument("--index-topk", type=int, default=512)
    parser.add_argument("--implementations", nargs="+", default=["xla", "pallas"])
    parser.add_argument(
        "--check", action="store_true",
        help="run every call once at a tiny size without timing (the CPU; kernels interpreted)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.check:
        args.contexts, args.batch, args.steps = [320], [2], 1
        args.pool_blocks, args.index_topk = 8, 16
        args.implementations = ["xla", "pallas_interpret"]
    batches = args.batch * len(args.contexts) if len(args.batch) == 1 else args.batch
    if len(batches) != len(args.contexts):
        parser.error(f"--batch: expected 1 or {len(args.contexts)} values, got {len(args.batch)}")
    config = bench_config(args.pool_blocks, args.index_topk)
    dispatch.check_kernel_config(config, "pallas")
    report = {
        **_common.environment(),
        "date": time.strftime("%Y-%m-%d"),
        "config": "small_kernels()",
        "pool_blocks": args.pool_blocks,
        "index_topk": args.index_topk,
        "steps": args.steps,
        "check": args.check,
        "contexts": {},
    }

    def save():
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(report, indent=1))

    model = model_lib.Model(config, rngs=nnx.Rngs(0))
    for context, batch in tqdm(list(zip(args.contexts, batches, strict=True)), desc="contexts"):
        report["contexts"][str(context)] = run_context(
            model,
            config,
            context=context,
            batch=batch,
            steps=args.steps,
            iterations=args.iterations,
            check=args.check,
            implementations=tuple(args.implementations),
            progress=save,
        )
        save()
    return report


if __name__ == "__main__":
    main()
