"""Property and fuzz tests: the invariants of the ops, the model, the CLI and the run directory
on random shapes (empty and ragged included), random non-finite injections and random kills.

Invariants:
- NaN and ±inf never become finite, and never leak across rows, groups or to earlier positions:
  a non-finite value stays in its format group, its query row, its key column, its pool block,
  and a non-finite embedding at position p reaches no logit before p;
- selections hold only pickable positions (visible, in the pool, never NaN or −inf), ascending,
  as many as there are; the newest block is always in the pool;
- bad input is an error that names the argument; the CLI answers bad values with a usage error
  (exit status 2) and writes nothing;
- a run killed at a random moment (SIGKILL, or Ctrl-C, once or twice) and resumed ends with a
  metrics.jsonl byte-identical to the uninterrupted run's.

The number of examples comes from the hypothesis profile: 'ci' (the default, bounded for CI's
two cores) or 'long' (`HYPOTHESIS_PROFILE=long`, for a long run or the H200), registered in
tests/conftest.py.
"""

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given
from hypothesis import strategies as st

from tests._models import FOUR_LAYER_TRAIN
from v41jax import cli
from v41jax.nn import config, model
from v41jax.ops import formats
from v41jax.ops.attention import masked_attention, sliding_window_rows, sparse_attention
from v41jax.ops.pool import select_candidate_blocks
from v41jax.ops.scoring import index_scores, topk

ROOT = Path(__file__).resolve().parents[1]
QUANTIZED = ("nvfp4", "mxfp4", "fp8")
NONFINITE = (np.nan, np.inf, -np.inf)


def inject(rng: np.random.Generator, x: np.ndarray, count: int) -> np.ndarray:
    """`x` with `count` random elements replaced by NaN, +inf or −inf."""
    x = x.copy()
    if x.size and count:
        flat = x.reshape(-1)
        flat[rng.integers(0, x.size, count)] = rng.choice(NONFINITE, count)
    return x


# --- formats ---


_fake_quant = jax.jit(formats.fake_quant, static_argnums=1)


@given(
    fmt=st.sampled_from(QUANTIZED),
    rows=st.sampled_from([0, 3]),  # a few shapes: each new one compiles
    groups=st.sampled_from([1, 3]),
    bad=st.integers(0, 5),
    seed=st.integers(0, 2**31 - 1),
)
def test_nonfinite_stays_in_its_group(fmt, rows, groups, bad, seed):
    rng = np.random.default_rng(seed)
    size = formats.FORMATS[fmt].group_size
    scale = 10.0 ** rng.integers(-3, 4)
    clean = (rng.normal(size=(rows, groups * size)) * scale).astype(np.float32)
    x = inject(rng, clean, bad)
    y = np.asarray(_fake_quant(x, fmt)).reshape(rows, groups, size)
    hit = ~np.isfinite(x.reshape(rows, groups, size)).all(-1)
    assert np.isnan(y[hit]).all()  # a group with a non-finite value is NaN, whole
    want = np.asarray(_fake_quant(clean, fmt)).reshape(rows, groups, size)
    np.testing.assert_array_equal(y[~hit], want[~hit])  # the other groups are untouched


# --- index scores, top-k, pool ---


@given(
    t=st.integers(1, 5),
    s=st.integers(0, 12),
    heads=st.integers(1, 3),
    seed=st.integers(0, 2**31 - 1),
    poison=st.sampled_from(["q", "k", "weights"]),
)
def test_nonfinite_index_inputs_stay_in_their_row_or_column(t, s, heads, seed, poison):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(t, heads, 8)).astype(np.float32)
    w = rng.normal(size=(t, heads)).astype(np.float32)
    k = rng.normal(size=(s, 8)).astype(np.float32)
    lens = rng.integers(0, s + 1, t)
    clean = np.asarray(index_scores(q, w, k, lens))
    args = {"q": q, "weights": w, "k": k}
    if poison == "k" and not s:
        return
    which = rng.integers(0, s if poison == "k" else t)
    args[poison] = args[poison].copy()
    args[poison][which] = np.nan
    got = np.asarray(index_scores(args["q"], args["weights"], args["k"], lens))
    visible = np.arange(s) < lens[:, None]
    touched = np.zeros((t, s), bool)
    if poison == "k":
        touched[:, which] = True
    else:
        touched[which] = True
    assert np.isnan(got[touched & visible]).all()
    np.testing.assert_array_equal(got[~touched], clean[~touched])
    assert np.isneginf(got[~visible]).all()


@given(
    rows=st.integers(0, 3),
    n_pos=st.integers(0, 20),
    k=st.integers(0, 24),
    seed=st.integers(0, 2**31 - 1),
    bad=st.integers(0, 8),
    masked=st.booleans(),
)
def test_topk_picks_only_pickable_positions(rows, n_pos, k, seed, bad, masked):
    rng = np.random.default_rng(seed)
    scores = inject(rng, rng.normal(size=(rows, n_pos)).astype(np.float32).round(1), bad)
    mask = rng.random((rows, n_pos)) < 0.7 if masked else np.ones((rows, n_pos), bool)
    picks = topk(scores, k, mask if masked else None)
    indices, values = np.asarray(picks.indices), np.asarray(picks.scores)
    assert indices.shape == (rows, k)
    for r in range(rows):
        pickable = mask[r] & ~np.isnan(scores[r]) & (scores[r] > -np.inf)
        # The reference: best score first, ties to the lowest position, NaN never.
        order = sorted(np.flatnonzero(pickable), key=lambda p: (-scores[r, p], p))[:k]
        valid = indices[r][indices[r] >= 0]
        assert valid.tolist() == sorted(order)
        assert (indices[r][len(valid) :] == -1).all()
        assert not np.isnan(values[r]).any()


_select_candidate_blocks = jax.jit(select_candidate_blocks, static_argnums=(2, 3, 4))


@given(
    rows=st.sampled_from([1, 3]),  # a few shapes: each new one compiles
    n_pos=st.sampled_from([7, 40]),
    topk_blocks=st.sampled_from([1, 4]),
    block_size=st.sampled_from([1, 8]),
    seed=st.integers(0, 2**31 - 1),
    bad=st.integers(0, 10),
    reduce=st.sampled_from(["max", "mean"]),
)
def test_pool_invariants_hold_under_nonfinite_scores(
    rows, n_pos, topk_blocks, block_size, seed, bad, reduce
):
    rng = np.random.default_rng(seed)
    scores = inject(rng, rng.normal(size=(rows, n_pos)).astype(np.float32), bad)
    lens = rng.integers(0, n_pos + 1, rows)
    pool = _select_candidate_blocks(scores, lens, topk_blocks, block_size, reduce)
    mask, ids = np.asarray(pool.mask), np.asarray(pool.block_ids)
    for r in range(rows):
        assert not mask[r, lens[r] :].any()  # visible positions only
        kept = ids[r][ids[r] >= 0]
        assert len(kept) <= topk_blocks and kept.tolist() == sorted(set(kept.tolist()))
        if lens[r]:
            assert (lens[r] - 1) // block_size in kept  # the newest block, pinned


# --- attention ---


_masked_attention = jax.jit(masked_attention, static_argnames="window_size")
_sparse_attention = jax.jit(sparse_attention)


@given(
    seq=st.sampled_from([1, 5]),  # a few shapes: each new one compiles
    n_kv=st.sampled_from([1, 7]),
    window=st.sampled_from([0, 3]),
    in_window=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_a_nonfinite_key_reaches_only_the_queries_that_attend_to_it(
    seq, n_kv, window, in_window, seed
):
    rng = np.random.default_rng(seed)
    heads, dim = 2, 8
    q = rng.normal(size=(1, seq, heads, dim)).astype(np.float32)
    win = rng.normal(size=(1, seq, dim)).astype(np.float32)
    kv = rng.normal(size=(1, n_kv, dim)).astype(np.float32)
    key_mask = rng.random((1, seq, n_kv)) < 0.5
    in_window = in_window and window > 0
    bad = rng.integers(0, seq if in_window else n_kv)
    (win if in_window else kv)[0, bad, rng.integers(0, dim)] = rng.choice(NONFINITE)
    sink = rng.normal(size=heads).astype(np.float32)
    out = np.asarray(_masked_attention(q, win, kv, key_mask, sink, window_size=window).out)[0]
    rows, valid = sliding_window_rows(win, window)
    for t in range(seq):
        selected = np.where(key_mask[0, t], np.arange(n_kv), -1).astype(np.int32)
        want = np.asarray(
            _sparse_attention(q[0, t], rows[0, t], valid[0, t], kv[0], selected, sink)
        )
        attends = bad <= t < bad + window if in_window else key_mask[0, t, bad]
        if attends:
            assert not np.isfinite(out[t]).all() and not np.isfinite(want).all()
        else:
            assert np.isfinite(out[t]).all()
            np.testing.assert_allclose(out[t], want, rtol=1e-4, atol=1e-5)


# --- the model: non-finite values never reach earlier positions ---


@pytest.fixture(scope="module")
def tiny_model():
    return model.Model(config.tiny(), rngs=nnx.Rngs(0))


_run = nnx.jit(lambda m, tokens: m(tokens))


@given(position=st.integers(0, 23), seed=st.integers(0, 2**31 - 1))
def test_a_nan_embedding_reaches_no_earlier_position(tiny_model, position, seed):
    cfg = tiny_model.config
    tokens = np.random.default_rng(seed).integers(4, cfg.vocab_size, (2, 24)).astype(np.int32)
    token = int(tokens[0, position])
    tokens[1] = np.where(tokens[1] == token, 4 if token != 4 else 5, tokens[1])  # row 1: clean
    embedding = tiny_model.embed.embedding
    saved = embedding[...]
    embedding[...] = saved.at[token].set(jnp.nan)
    try:
        first = int(np.flatnonzero(tokens[0] == token)[0])
        logits = np.asarray(_run(tiny_model, jnp.asarray(tokens)))
    finally:
        embedding[...] = saved
    assert np.isfinite(logits[0, :first]).all()
    assert np.isnan(logits[0, first:]).any(axis=-1).all()
    assert np.isfinite(logits[1]).all()  # no leak across the batch


@given(batch=st.integers(0, 3), seq=st.integers(1, 12), bad=st.integers(-3, 3))
def test_token_ids_outside_the_vocabulary_are_named(tiny_model, batch, seq, bad):
    """Checked before anything runs: every shape, empty batches included."""
    vocab = tiny_model.config.vocab_size
    tokens = np.ones((batch, seq), np.int32)
    if batch and bad:
        tokens[-1, -1] = bad - 1 if bad < 0 else vocab + bad - 1
        with pytest.raises(ValueError, match=r"^tokens: expected ids in"):
            tiny_model(jnp.asarray(tokens))
        with pytest.raises(ValueError, match=r"^tokens: expected ids in"):
            model.prefill(tiny_model, tokens, np.full(batch, seq), max_len=seq)
    else:
        tiny_model._check_tokens(jnp.asarray(tokens), 2)  # the same check passes


# --- the command line: bad values are usage errors, and nothing is written ---


def _not_a_positive_int(text: str) -> bool:
    try:
        return int(text) <= 0
    except ValueError:
        return True


BAD_VALUES = st.one_of(
    st.tuples(st.just("--steps"), st.integers(-(10**6), 0).map(str)),
    st.tuples(st.just("--batch-size"), st.integers(-100, 0).map(str)),
    st.tuples(st.just("--seed"), st.integers(-(10**6), -1).map(str)),
    st.tuples(st.just("--lr"), st.sampled_from(["nan", "inf", "-inf", "-0.5"])),
    st.tuples(st.just("--adam-b2"), st.sampled_from(["nan", "1", "1.5", "-0.1", "x"])),
    st.tuples(
        st.just("--steps"),
        st.text(min_size=1, max_size=6).filter(_not_a_positive_int),
    ),
    st.tuples(st.just("--task-set"), st.sampled_from(["n_pairs=abc", "seq_len=-4", "nope=1", "="])),
    st.tuples(
        st.just("--model-set"), st.sampled_from(["dim=0", "index_topk=x", "zzz=3", "kv_format=fp4"])
    ),
    st.tuples(st.just("--max-minutes"), st.sampled_from(["-1", "nan", "inf", "soon"])),
)


@given(bad=BAD_VALUES)
def test_bad_cli_values_are_usage_errors_and_write_nothing(tmp_path_factory, bad):
    out = tmp_path_factory.mktemp("cli") / "run"
    try:
        code = cli.main(["train", "--out", str(out), *bad])
    except SystemExit as exit_info:  # argparse's own usage errors
        code = exit_info.code
    assert code == 2
    assert not out.exists()


# --- kill at a random moment, resume: the same metrics.jsonl, byte for byte ---

# The four-layer training model of the trainer's tests (every role a run trains; half of
# tiny()'s compilation, which the reference run pays in full in its own cache).
KILL_RUN = [
    *("--task", "mqar", "--task-set", "seq_len=64", "--task-set", "n_pairs=4"),
    *("--task-set", "n_queries=2", "--steps", "8", "--batch-size", "2"),
    *("--dense-warmup-steps", "3", "--checkpoint-every", "2", "--max-minutes", "0"),
    *(f"--model-set={name}={json.dumps(value)}" for name, value in FOUR_LAYER_TRAIN.items()),
]


@pytest.fixture(scope="module")
def kill_env(tmp_path_factory):
    """The environment of the killed runs: one compilation cache, so that only the first run
    compiles and every start after a kill reaches the training loop quickly."""
    cache = tmp_path_factory.mktemp("jax_cache")
    return {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": str(ROOT),
        "JAX_COMPILATION_CACHE_DIR": str(cache),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    }


def _start(out: Path, env: dict) -> subprocess.Popen:
    resume = ["--resume"] if (out / "config.json").exists() else []
    argv = ["train", *KILL_RUN, "--out", str(out), *resume]
    # `v41jax train` with Python's Ctrl-C handler, as in a terminal, also where the test runner
    # was started with SIGINT ignored (a background job passes that on to its children).
    start = (
        "import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
        f"from v41jax.cli import main; sys.exit(main({argv!r}))"
    )
    return subprocess.Popen(
        [sys.executable, "-c", start],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        cwd=ROOT,
    )


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory, kill_env) -> bytes:
    """metrics.jsonl of the run uninterrupted (it also fills the compilation cache)."""
    out = tmp_path_factory.mktemp("reference") / "run"
    process = _start(out, kill_env)
    assert process.wait(timeout=600) == 0, process.stderr.read().decode()[-2000:]
    return (out / "metrics.jsonl").read_bytes()


def _wait_for(out: Path, checkpoint: int, process: subprocess.Popen) -> None:
    """Until the run has written config.json (`checkpoint` 0) or that checkpoint, or ended."""
    path = out / "config.json" if checkpoint == 0 else out / "checkpoints" / str(checkpoint)
    deadline = time.monotonic() + 300
    while not path.exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)


# The signals of successive attempts, each followed by `--resume`: Ctrl-C (twice), then a kill
# of the resumed run, then a resume after that kill. A scenario of one kill alone repeated the
# second half of this one (its 28 s went to the suite's budget, 2026-12-06).
SCENARIOS = {"SIGINT-then-SIGKILL": (signal.SIGINT, signal.SIGKILL)}


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_killed_and_resumed_runs_write_the_uninterrupted_metrics(
    tmp_path, kill_env, reference_run, scenario
):
    """Each attempt is killed at a random moment: a random point of progress (started, or
    checkpoint 2 or 4 of 8 written) plus a random delay, so kills land in compilation, in
    training steps, in evaluations and in saves; Ctrl-C is pressed twice."""
    rng = random.Random(scenario)  # random moments, the same ones on every run
    out = tmp_path / "run"
    for sig in SCENARIOS[scenario]:
        process = _start(out, kill_env)
        checkpoint = rng.choice([0, 2, 4])
        _wait_for(out, checkpoint, process)
        time.sleep(rng.uniform(0.0, 0.5))
        process.send_signal(sig)
        if sig == signal.SIGINT:  # a second Ctrl-C right after the first
            time.sleep(0.1)
            process.send_signal(sig)
        code = process.wait(timeout=600)
        # Ctrl-C exits with 130, never a traceback (a second Ctrl-C that lands while the
        # interpreter shuts down ends it by the signal, -SIGINT); a kill after checkpoint 4 may
        # come after the run has finished.
        interrupted = (130, -signal.SIGINT, -signal.SIGKILL)
        allowed = (0, *interrupted) if checkpoint == 4 else interrupted
        assert code in allowed, (code, process.stderr.read().decode()[-2000:])
    process = _start(out, kill_env)
    assert process.wait(timeout=600) == 0, process.stderr.read().decode()[-2000:]
    assert (out / "metrics.jsonl").read_bytes() == reference_run
    assert not [p for p in (out / "checkpoints").iterdir() if "tmp" in p.name]
