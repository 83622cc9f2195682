"""Decode on the Pallas kernels against decode in XLA (DESIGN §6; issue 5, item 4).

`model.decode_step(..., implementation='pallas')` attends with `fp4_sparse_attention` on the
packed caches, selects inside the candidate pool with `pooled_scores` and builds the pool with
the candidate source's scan (`source_scan`, the same scoring kernel over every block); 'xla'
gathers, unpacks and computes in float32. Both start from the same prefilled cache of a ragged
batch (one row with fewer compressed entries than the top-k: −1 padded picks; one where the
candidate pool bites).
On the CPU the kernels run in the Mosaic GPU interpreter ('pallas_interpret') on a reduced
kernel-shaped config (compiled, 'pallas', when a GPU is the default backend); the `-m gpu` cases
run compiled at `config.small_kernels()` size, batch 8, 8 steps.

Tolerances, and why:
- Per layer, on the same inputs: the attention kernel's output is bf16 (unit roundoff 2⁻⁹) and
  so are its probabilities before PV, with float32 accumulation: ~2e-3 relative error
  (measured), bounded by `LAYER_RTOL` = 1e-2 as in the kernel's own tests. Everything else
  (cache writes, window-only layers, the full scans of the other Full layers) is the same XLA
  code on the same inputs: equal (on the CPU bit for bit; on a GPU, compiled into two
  programs, a float32 last bit may round differently, so up to `CACHE_MISMATCH` of the cache
  bytes and ties among picks may differ). Picks and pool blocks scored by the kernel (Reindex
  layers, the candidate source) equal XLA's except between scores equal to float32 rounding
  (`TIE_RTOL` of the row's largest).
- End to end: the per-layer errors of the n layers that run the kernel add up in the residual
  stream like independent errors, so logits differ by up to LAYER_RTOL·√n times their RMS
  (`logit_atol`; measured with the interpreter: 0.2–0.3 of it at small_kernels() size). They
  also move index queries across MXFP4 rounding boundaries, which flips near-tied picks of later
  layers: at small_kernels() size with the pool biting, in 7 of 8 sequences at the first step.
  A flipped pick swaps one of a layer's top-k keys, and the cache rows written after it differ:
  logits then moved by up to 0.29·RMS (median 0.02·RMS). So, per sequence: logits within
  logit_atol up to its first step where any selection differs, within `FLIPPED_RTOL`·RMS after
  it, median over everything within `MEDIAN_RTOL`·RMS; greedy tokens equal wherever XLA's top-2
  margin exceeds twice the bound that applies (measured disagreements: margins < 0.08·RMS). A
  sequence whose every visible entry is selected cannot flip: each case has one, and one GPU
  case selects everything everywhere, so that all of it is held to logit_atol.
"""

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from v41jax.nn import config, dispatch, model
from v41jax.nn.cache import Cache, init_cache
from v41jax.nn.config import Role
from v41jax.nn.dispatch import KERNEL_IMPLEMENTATIONS, check_kernel_config
from v41jax.nn.selection import SharedState
from v41jax.ops import pool, scoring

ON_GPU = jax.default_backend() == "gpu"
gpu = pytest.mark.skipif(not ON_GPU, reason="needs a GPU as jax's default backend")

LAYER_RTOL = 1e-2
TIE_RTOL = 1e-5
CACHE_MISMATCH = 1e-3
FLIPPED_RTOL = 1.0
MEDIAN_RTOL = 0.1


def cpu_config() -> config.ModelConfig:
    """small_kernels() cut to what the interpreter runs in seconds, keeping the kernels' shapes
    (head_dim 256, index_head_dim 128, blocks of 8, NVFP4/FP8/MXFP4) and every role the kernels
    touch: 0 window only, 1 Full (ratio 1) and candidate source, 2 Reindex, 3 Reuse. The pool
    (4 blocks of 8) bites from 32 compressed entries on."""
    return config.small_kernels().replace(
        n_layers=4,
        dim=128,
        n_heads=2,
        head_dim=256,
        rope_head_dim=16,
        q_lora_rank=64,
        o_groups=1,
        o_lora_rank=64,
        window_size=16,
        index_n_heads=4,
        index_topk=16,
        compress_ratios=(0, 1, 1, 1),
        kv_source_layers=(1,),
        index_source_layers=(1, 2),
        candidate_source_layer=1,
        candidate_topk_blocks=4,
        vocab_size=64,
        ffn_dim=128,
    )


class Case(NamedTuple):
    model: model.Model
    cache: Cache
    tokens: jax.Array  # [B] the greedy next tokens after the prefill


def selection_coverage(cfg, lengths) -> tuple[bool, bool]:
    """(the pool drops blocks for some sequence, some sequence has −1 padded picks) at the first
    decode step after a prefill of `lengths`, from the candidate source's compressed entries."""
    entries = (np.asarray(lengths) + 1) // cfg.compress_ratios[cfg.candidate_source_layer]
    return bool(entries.max() > cfg.candidate_pool_size), bool(entries.min() < cfg.index_topk)


def make_case(cfg, lengths, max_len, seed=0) -> Case:
    """A model and the cache of a ragged prefill of `lengths` tokens."""
    lengths = np.asarray(lengths)
    m = model.Model(cfg, rngs=nnx.Rngs(seed))
    seq = int(lengths.max())
    tokens = jax.random.randint(jax.random.key(seed + 1), (len(lengths), seq), 0, cfg.vocab_size)
    logits, cache, _ = model.prefill(m, tokens, jnp.asarray(lengths), max_len=max_len)
    last = logits[np.arange(len(lengths)), lengths - 1]
    return Case(m, cache, jnp.argmax(last, axis=-1).astype(jnp.int32))


def n_kernel_layers(cfg) -> int:
    """Layers whose attention runs on the kernel: every layer with compressed KV."""
    return sum(plan.role is not Role.WINDOW for plan in cfg.layers)


def logit_atol(cfg, logits: np.ndarray) -> np.ndarray:
    """Per-sequence logit tolerance [B, 1] (module docstring): LAYER_RTOL·√n·RMS(logits)."""
    rms = np.sqrt(np.mean(np.square(logits), axis=-1, keepdims=True))
    return LAYER_RTOL * math.sqrt(n_kernel_layers(cfg)) * rms


def rel_err_rows(out, ref) -> np.ndarray:
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return np.linalg.norm(out - ref, axis=-1) / np.maximum(np.linalg.norm(ref, axis=-1), 1e-30)


def assert_picks_equal_up_to_ties(picks, reference, scores, where):
    """Per row, the same picks, except positions whose scores tie within TIE_RTOL of the row's
    largest finite score (either order is right for them)."""
    picks, reference, scores = np.asarray(picks), np.asarray(reference), np.asarray(scores)
    for b in np.flatnonzero((picks != reference).any(-1)):
        swapped = sorted((set(picks[b]) ^ set(reference[b])) - {-1})
        row = scores[b][np.isfinite(scores[b])]
        assert len(picks[b][picks[b] >= 0]) == len(reference[b][reference[b] >= 0]), (where, b)
        values = scores[b, swapped]
        assert np.ptp(values) <= TIE_RTOL * np.abs(row).max(), (where, b, swapped, values)


@nnx.jit(static_argnames="implementation")
def _decode_layer_jit(attn, x, shared, cache, positions, implementation):
    return attn.decode(x, shared, cache, positions, implementation=implementation)


def decode_layer(attn, x, shared, cache, positions, implementation):
    """`Attention.decode`, jitted except in the interpreter (which `model.decode_step` runs
    unjitted too: see its docstring)."""
    if implementation == "pallas_interpret":
        return attn.decode(x, shared, cache, positions, implementation=implementation)
    return _decode_layer_jit(attn, x, shared, cache, positions, implementation)


@nnx.jit(static_argnames=("ratio", "in_pool"))
def _index_scores(attn, x, shared, positions, ratio, in_pool):
    """The XLA index scores [B, S] of a layer's queries against `shared`'s keys (−inf where
    invisible, and outside the pool when `in_pool`)."""
    qr = attn.q_norm(attn.wq_a(x))
    q, weights = attn.indexer.queries(qr[:, None], x[:, None], positions[:, None])
    lens = (positions + 1) // ratio
    scores = scoring.index_scores(q, weights, shared.index_k, lens[:, None])[:, 0]
    return jnp.where(shared.pool.mask[:, 0], scores, -jnp.inf) if in_pool else scores


@nnx.jit
def _next_block_input(block, following, h, out):
    """The residual after `block` (attention output `out`, then the FFN) and the normalized
    input of the `following` block."""
    h = h + out
    h = h + block.ffn(block.ffn_norm(h))
    return h, following.attn_norm(h)


def check_layerwise(case: Case, implementation: str) -> None:
    """One decode step in which every layer runs both implementations on the inputs of the XLA
    run (input, shared state, cache), so that each difference belongs to that layer's kernels."""
    m, cache = case.model, case.cache
    cfg = m.config
    positions = cache.lengths
    h = m.embed(case.tokens)
    x = m.blocks[0].attn_norm(h)
    shared = SharedState()
    reindex_rows = 0
    for plan, block, layer_cache in zip(cfg.layers, m.blocks, cache.layers, strict=True):
        args = (block.attn, x, shared, layer_cache, positions)
        out, ref_shared, ref_cache = decode_layer(*args, "xla")
        got, got_shared, got_cache = decode_layer(*args, implementation)
        where = f"layer {plan.layer} ({plan.role.value})"
        # The cache rows are written before the attention by the same XLA code (bit for bit on
        # the CPU); compiled into two programs, a GPU may fuse it differently and round a float32
        # last bit across a format's rounding boundary. A wiring error changes whole rows.
        for a, b in zip(jax.tree.leaves(got_cache), jax.tree.leaves(ref_cache), strict=True):
            assert np.mean(np.asarray(a) != np.asarray(b)) <= CACHE_MISMATCH, where
        if plan.role is Role.WINDOW:  # XLA in both (unjitted in the interpreter: last bits)
            assert (rel_err_rows(got, out) <= 1e-6).all(), where
        else:
            err = rel_err_rows(got, out)
            assert (err <= LAYER_RTOL).all(), (where, err)
            assert err.max() > 0, (where, "the kernel did not run")
        if plan.role in (Role.FULL, Role.REINDEX):
            # Full layers scan in XLA in both; Reindex layers inside the pool score with the
            # pooled-scoring kernel. Either way: XLA's picks, up to ties.
            scores = _index_scores(
                block.attn, x, ref_shared, positions, plan.compress_ratio, plan.uses_candidates
            )
            picks = (got_shared.topk[:, 0], ref_shared.topk[:, 0])
            assert_picks_equal_up_to_ties(*picks, scores, where)
            reindex_rows += len(positions) * plan.uses_candidates
        if plan.is_candidate_source:
            # Scored by the kernel (its scan route): XLA's blocks, up to ties of block scores.
            scores = _index_scores(block.attn, x, ref_shared, positions, plan.compress_ratio, False)
            lens = (positions + 1) // plan.compress_ratio
            blocks = pool.block_scores(scores, lens, cfg.candidate_block_size, cfg.block_score)
            pools = (got_shared.pool.block_ids[:, 0], ref_shared.pool.block_ids[:, 0])
            assert_picks_equal_up_to_ties(*pools, blocks, f"{where} pool")
            n_pos = ref_shared.index_k_packed.shape[1]
            mask = pool.pool_mask_from_block_ids(pools[0], n_pos, cfg.candidate_block_size, lens)
            np.testing.assert_array_equal(got_shared.pool.mask[:, 0], mask, err_msg=where)
        shared = ref_shared
        following = m.blocks[min(plan.layer + 1, cfg.n_layers - 1)]
        h, x = _next_block_input(block, following, h, out)
    if cfg.candidate_source_layer is not None:
        assert reindex_rows > 0, "no Reindex layer scored inside the pool"


class Run(NamedTuple):
    logits: np.ndarray  # [steps, B, vocab]
    selections: list[model.Selections]  # per step


def decode_both(case: Case, steps: int, implementation: str) -> tuple[Run, Run]:
    """`steps` decode steps of both implementations from the same cache, both fed XLA's greedy
    tokens (so that a kernel token flipped by a near tie does not change the inputs)."""
    names = ("xla", implementation)
    caches = dict.fromkeys(names, case.cache)
    logits = {name: [] for name in names}
    selections = {name: [] for name in names}
    tokens = case.tokens
    for _ in range(steps):
        for name in names:
            out, caches[name], sel = model.decode_step(
                case.model, tokens, caches[name], implementation=name
            )
            logits[name].append(np.asarray(out))
            selections[name].append(jax.tree.map(np.asarray, sel))
        tokens = jnp.argmax(jnp.asarray(logits["xla"][-1]), axis=-1).astype(jnp.int32)
    ref, got = (Run(np.stack(logits[name]), selections[name]) for name in names)
    return ref, got


def first_selection_difference(ref: Run, got: Run) -> np.ndarray:
    """Per sequence, the first step at which any index source's picks or the pool differ
    (the number of steps if none)."""
    steps, batch = ref.logits.shape[:2]
    first = np.full(batch, steps)
    for step, (a, b) in enumerate(zip(ref.selections, got.selections, strict=True)):
        differs = (a.pool_blocks != b.pool_blocks).any(-1)[:, 0]
        for layer in a.topk:
            differs |= (a.topk[layer] != b.topk[layer]).any(-1)[:, 0]
        first = np.where(differs & (first == steps), step, first)
    return first


def check_decode(case: Case, steps: int, implementation: str) -> int:
    """Greedy decode with both implementations against the module docstring's bounds; returns
    the number of sequence-steps held to `logit_atol` (those before a selection differs)."""
    ref, got = decode_both(case, steps, implementation)
    assert np.isfinite(got.logits).all()
    strict = np.arange(steps)[:, None] < first_selection_difference(ref, got)[None, :]
    rms = np.sqrt(np.mean(np.square(ref.logits), axis=-1, keepdims=True))
    bound = np.where(
        strict[..., None], logit_atol(case.model.config, ref.logits), FLIPPED_RTOL * rms
    )
    diff = np.abs(got.logits - ref.logits)
    worst = (diff / bound).max(axis=-1)  # [steps, B]
    assert (worst <= 1).all(), dict(strict=strict, worst=worst)
    assert np.median(diff / rms) <= MEDIAN_RTOL, np.median(diff / rms)
    top2 = np.sort(ref.logits, axis=-1)[..., -2:]
    decided = top2[..., 1] - top2[..., 0] > 2 * bound[..., 0]
    np.testing.assert_array_equal(got.logits.argmax(-1)[decided], ref.logits.argmax(-1)[decided])
    return int(strict.sum())


# --- The reduced config: interpreted on the CPU, compiled on a GPU ---

SMALL_IMPLEMENTATION = "pallas" if ON_GPU else "pallas_interpret"
CPU_LENGTHS = (56, 9)  # entries at the first step: 57 > the pool's 32 positions; 10 < top-k 16


@pytest.fixture(scope="module")
def cpu_case() -> Case:
    cfg = cpu_config()
    assert selection_coverage(cfg, CPU_LENGTHS) == (True, True)
    return make_case(cfg, CPU_LENGTHS, max_len=64)


def test_each_layer_matches_xla_small(cpu_case, monkeypatch):
    # The candidate source's picks must come from its scan route, not from the XLA scan that
    # would match them trivially.
    routed = route_recorder(monkeypatch)
    check_layerwise(cpu_case, SMALL_IMPLEMENTATION)
    assert routed == [(SMALL_IMPLEMENTATION, True)]


def route_recorder(monkeypatch) -> list:
    """Records (implementation, pool) of each call of the scan route (dispatch.candidate_source)."""
    routed, scan = [], dispatch.candidate_source

    def recorded(*args, **kwargs):
        routed.append((args[-1], kwargs.get("pool", True)))
        return scan(*args, **kwargs)

    monkeypatch.setattr(dispatch, "candidate_source", recorded)
    return routed


def test_a_full_layer_without_a_pool_scans_on_the_kernels_small(monkeypatch):
    """A Full layer that is not the candidate source (here: a config without a pool) scans its
    packed keys on the kernel route too, for its own top-k only, and still picks XLA's picks up
    to ties; with index keys the scan cannot take, it scans in XLA (`scans_on_kernels`)."""
    cfg = cpu_config().replace(candidate_source_layer=None)
    routed = route_recorder(monkeypatch)
    check_layerwise(make_case(cfg, CPU_LENGTHS, max_len=64), SMALL_IMPLEMENTATION)
    assert routed == [(SMALL_IMPLEMENTATION, False)]
    full = cfg.layers[1]
    assert dispatch.scans_on_kernels(cfg, full, "pallas")
    assert not dispatch.scans_on_kernels(cfg.replace(index_format="bf16"), full, "pallas")
    assert not dispatch.scans_on_kernels(cfg, full, "xla")


def test_greedy_decode_matches_xla_small(cpu_case):
    strict = check_decode(cpu_case, steps=3, implementation=SMALL_IMPLEMENTATION)
    assert strict >= 3  # the shortest sequence selects every visible entry: nothing can flip


@pytest.mark.parametrize(
    ("changes", "messages"),
    [
        (
            dict(kv_format="fp8"),
            ["config.kv_format: expected 'nvfp4', got 'fp8'"],
        ),
        (
            dict(window_format="bf16", head_dim=128),
            [
                "config.window_format: expected 'fp8', got 'bf16'",
                "config.head_dim: expected 256 or 512, got 128",
            ],
        ),
        (
            dict(index_format="bf16", index_head_dim=64, candidate_block_size=4),
            [
                "config.index_format: expected 'mxfp4', got 'bf16'",
                "config.index_head_dim: expected 128, got 64",
                "config.candidate_block_size: expected 8, got 4",
            ],
        ),
    ],
)
def test_unsupported_configs_are_named(changes, messages):
    cfg = cpu_config().replace(**changes)
    m = nnx.eval_shape(lambda: model.Model(cfg, rngs=nnx.Rngs(0)))
    cache = init_cache(cfg, batch=1, max_len=8)
    for implementation in KERNEL_IMPLEMENTATIONS:
        with pytest.raises(ValueError) as err:
            model.decode_step(m, jnp.zeros((1,), jnp.int32), cache, implementation=implementation)
        text = str(err.value)
        assert repr(implementation) in text
        for message in messages:
            assert message in text, text


def test_pool_free_configs_skip_the_scoring_checks():
    """Without a candidate pool no layer runs the pooled-scoring kernel: its limits do not
    apply."""
    cfg = cpu_config().replace(candidate_source_layer=None, index_format="bf16")
    check_kernel_config(cfg, "pallas")
    with pytest.raises(ValueError, match=r"config\.index_format"):
        check_kernel_config(cfg.replace(candidate_source_layer=1), "pallas")


def test_prefill_and_training_reject_kernel_implementations(cpu_case):
    m = cpu_case.model
    tokens = jnp.zeros((1, 4), jnp.int32)
    for implementation in KERNEL_IMPLEMENTATIONS:
        with pytest.raises(ValueError, match=r"implementation: expected one of \('xla',\)"):
            model.prefill(m, tokens, jnp.array([4]), max_len=8, implementation=implementation)
        with pytest.raises(ValueError, match="prefill and training"):
            m.run(tokens, implementation=implementation)
    with pytest.raises(ValueError, match=r"'pallas_interpret'.*got 'cuda'"):
        model.decode_step(m, cpu_case.tokens, cpu_case.cache, implementation="cuda")


# --- GPU: the compiled kernels at small_kernels() size ---

# Entries at the first step: all > the pool's 256 positions except the last (< top-k 128).
GPU_LENGTHS = (400, 371, 333, 300, 290, 275, 266, 100)
GPU_STEPS = 8


def gpu_config(select_everything: bool = False) -> config.ModelConfig:
    """small_kernels(); with `select_everything`, a top-k and a pool larger than any sequence's
    compressed entries (up to 408 here), so that no selection can differ between the two."""
    cfg = config.small_kernels()
    return cfg.replace(index_topk=512, candidate_topk_blocks=64) if select_everything else cfg


@pytest.mark.gpu
@gpu
def test_each_layer_matches_xla_gpu():
    cfg = gpu_config()
    assert selection_coverage(cfg, GPU_LENGTHS) == (True, True)
    check_layerwise(make_case(cfg, GPU_LENGTHS, max_len=512), "pallas")


@pytest.mark.gpu
@gpu
def test_greedy_decode_matches_xla_gpu():
    case = make_case(gpu_config(), GPU_LENGTHS, max_len=512)
    assert check_decode(case, GPU_STEPS, "pallas") >= GPU_STEPS  # at least the shortest


@pytest.mark.gpu
@gpu
def test_greedy_decode_matches_xla_when_nothing_can_flip_gpu():
    case = make_case(gpu_config(select_everything=True), GPU_LENGTHS, max_len=512)
    assert check_decode(case, GPU_STEPS, "pallas") == GPU_STEPS * len(GPU_LENGTHS)
