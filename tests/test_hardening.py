"""Regressions of the twelve defects a careful new user found (issue 11), one test each.

Each test reproduces the report's case and fails on the code before its fix: the item number of
the issue is in the test's name. The property tests that keep these invariants across random
shapes and non-finite inputs are in tests/test_fuzz.py.
"""

import json
import os
import shutil
import signal
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.experimental import checkify

from pallas_kernels.pooled_scoring import pooled_scores
from pallas_kernels.sparse_attention import fp4_sparse_attention
from tests._models import FOUR_LAYER_TRAIN
from v41jax import cli, train
from v41jax.nn import cache as cache_lib
from v41jax.nn import config, model
from v41jax.ops import formats
from v41jax.ops.attention import masked_attention, sliding_window_rows, sparse_attention
from v41jax.ops.pool import select_candidate_blocks
from v41jax.ops.scoring import index_scores, topk
from v41jax.train import rundir, trainer

# The run of tests/test_train.py (same shapes: its compiled programs are reused).
SMOKE = train.TrainConfig(
    task="mqar",
    steps=6,
    batch_size=2,
    eval_every=3,
    eval_batches=1,
    checkpoint_every=3,
    dense_warmup_steps=2,
    task_overrides={"seq_len": 64, "n_pairs": 4, "n_queries": 2},
    model_overrides=FOUR_LAYER_TRAIN,
)


@pytest.fixture(scope="module")
def uninterrupted_dir(tmp_path_factory) -> Path:
    """The run directory of SMOKE run start to end in one call (read it, never change it)."""
    run_dir = tmp_path_factory.mktemp("uninterrupted") / "run"
    train.run(SMOKE, run_dir, progress=False)
    return run_dir


@pytest.fixture(scope="module")
def uninterrupted(uninterrupted_dir) -> bytes:
    """metrics.jsonl of SMOKE run start to end in one call."""
    return (uninterrupted_dir / "metrics.jsonl").read_bytes()


def files(run_dir: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}


# --- 1. Ctrl-C during an evaluation or a save checkpoints under the steps the model holds ---


@pytest.mark.parametrize("where", ["evaluation", "save"])
def test_1_ctrl_c_after_a_step_saves_that_step_and_resume_is_exact(
    tmp_path, monkeypatch, uninterrupted, where
):
    run_dir = tmp_path / "run"
    target = (trainer.evaluate_lib, "evaluate") if where == "evaluation" else (rundir, "save")
    real = getattr(*target)

    def interrupted(*args, **kwargs):  # the first evaluation / save: after step 3
        monkeypatch.setattr(*target, real)
        raise KeyboardInterrupt

    monkeypatch.setattr(*target, interrupted)
    with pytest.raises(KeyboardInterrupt):
        train.run(SMOKE, run_dir, progress=False)
    assert (run_dir / "checkpoints" / "3").exists(), "the model held 3 updates"
    assert not (run_dir / "checkpoints" / "2").exists()
    train.run(SMOKE, run_dir, progress=False, resume=True)
    assert (run_dir / "metrics.jsonl").read_bytes() == uninterrupted


# --- 2. --out at a directory that holds no run: refused, the user's files untouched ---


@pytest.mark.parametrize(
    "contents",
    [
        {"metrics.jsonl": '{"step": 0, "split": "train"}\n{"step": 5, "split": "eval"}\n'},
        {"metrics.jsonl": "not json\n", "notes.txt": "mine"},
        {"summary.json": "{}", "training.png": "png"},
    ],
    ids=["metrics", "non-json-metrics", "summary"],
)
def test_2_a_directory_of_other_files_is_refused_untouched(tmp_path, contents):
    for name, text in contents.items():
        (tmp_path / name).write_text(text)
    before = files(tmp_path)
    with pytest.raises(train.RunDirectoryError, match="not a run"):
        train.run(SMOKE, tmp_path, progress=False)
    assert files(tmp_path) == before
    assert cli.main(["train", "--out", str(tmp_path), "--steps", "2"]) == 2
    assert files(tmp_path) == before


def test_2_an_unreadable_metrics_file_is_refused_before_a_resume_writes(tmp_path):
    run_dir = tmp_path / "run"
    rundir.prepare(run_dir, SMOKE.to_json(), resume=False)
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "split": "train"}\ngarbage\n')
    before = files(run_dir)
    with pytest.raises(train.RunDirectoryError, match="line 2 is not a metrics record"):
        train.run(SMOKE, run_dir, progress=False, resume=True)
    assert files(run_dir) == before


# --- 3. a NaN sink logit never gives a finite, unnormalised output ---


def _attention_case(rng, batch=2, heads=3, dim=256, n_kv=9, topk_=5, window=4):
    q = rng.normal(size=(batch, heads, dim)).astype(np.float32)
    kv = rng.normal(size=(batch, n_kv, dim)).astype(np.float32)
    win = rng.normal(size=(batch, window, dim)).astype(np.float32)
    indices = rng.integers(0, n_kv, (batch, topk_)).astype(np.int32)
    valid = np.ones((batch, window), bool)
    return q, kv, win, indices, valid


def test_3_a_nan_sink_gives_nan_in_every_form_of_attention():
    q, kv, win, indices, valid = _attention_case(np.random.default_rng(0))
    sink = np.array([0.5, np.nan, -1.0], np.float32)
    out = np.asarray(sparse_attention(q, win, valid, kv, indices, sink))
    assert np.isnan(out[:, 1]).all() and np.isfinite(out[:, [0, 2]]).all()
    result = sparse_attention(q, win, valid, kv, indices, sink, return_probs=True)
    assert np.isnan(np.asarray(result.probs)[:, 1]).all()

    key_mask = np.zeros((2, 1, 9), bool)
    key_mask[:, 0, :5] = True
    masked = masked_attention(q[:, None], win[:, :1], kv, key_mask, sink, window_size=4)
    assert np.isnan(np.asarray(masked.out)[:, 0, 1]).all()

    kv_packed = formats.pack(kv, "nvfp4")
    win_packed = formats.pack(win, "fp8")
    for implementation in ("xla", "pallas_interpret"):
        out = fp4_sparse_attention(
            q, kv_packed, indices, win_packed, valid, sink, implementation=implementation
        )
        out = np.asarray(out, np.float32)
        assert np.isnan(out[:, 1]).all() and np.isfinite(out[:, [0, 2]]).all(), implementation


def test_3_a_nan_sink_parameter_gives_nan_logits_and_debug_reports_them():
    cfg = config.tiny()
    m = model.Model(cfg, rngs=nnx.Rngs(0))
    m.blocks[1].attn.sink[...] = jnp.full((cfg.n_heads,), jnp.nan)
    tokens = jnp.ones((1, 12), jnp.int32)
    graphdef, state = nnx.split(m)

    def logits(state, tokens):
        return nnx.merge(graphdef, state).run(tokens, debug=True)[0]

    error, out = jax.jit(checkify.checkify(logits))(state, tokens)
    assert np.isnan(np.asarray(out)).all()
    assert "hold NaN" in error.get() or "expected finite values" in error.get()


# --- 4. out-of-vocabulary ids: an error, and never NaN at earlier positions ---


def test_4_out_of_vocabulary_ids_are_refused():
    cfg = config.tiny()
    m = model.Model(cfg, rngs=nnx.Rngs(0))
    for bad in (cfg.vocab_size, -1):
        tokens = jnp.ones((2, 16), jnp.int32).at[0, 12].set(bad)
        with pytest.raises(ValueError, match=rf"tokens: .*got {bad} at index \(0, 12\)"):
            m(tokens)
        with pytest.raises(ValueError, match="tokens"):
            model.prefill(m, tokens, jnp.array([16, 9]), max_len=16)
    with pytest.raises(ValueError, match="vocab_size"):
        SMOKE.with_task(vocab_size=512)


def test_4_under_jit_a_bad_id_spoils_no_earlier_position_and_debug_reports_it():
    cfg = config.tiny()
    m = model.Model(cfg, rngs=nnx.Rngs(0))
    tokens = jnp.ones((1, 16), jnp.int32).at[0, 12].set(cfg.vocab_size)
    logits = np.asarray(nnx.jit(lambda m, t: m(t))(m, tokens))
    assert np.isfinite(logits[0, :12]).all()
    graphdef, state = nnx.split(m)

    def logits(state, tokens):  # traced tokens: only the staged check can see them
        return nnx.merge(graphdef, state).run(tokens, debug=True)[0]

    error, _ = jax.jit(checkify.checkify(logits))(state, tokens)
    assert "tokens: expected ids in [0, vocab_size=256)" in error.get()


# --- 5. masked_attention: a NaN in an unselected key poisons nothing ---


def test_5_masked_attention_keeps_nan_where_sparse_attention_does():
    rng = np.random.default_rng(5)
    b, t, h, d, w, s = 1, 4, 2, 8, 3, 6
    q = rng.normal(size=(b, t, h, d)).astype(np.float32)
    win = rng.normal(size=(b, t, d)).astype(np.float32)
    kv = rng.normal(size=(b, s, d)).astype(np.float32)
    kv[0, 4] = np.nan  # only query 3 selects position 4
    key_mask = np.zeros((b, t, s), bool)
    key_mask[0, 1, :2] = key_mask[0, 3, [0, 4]] = True
    sink = np.zeros(h, np.float32)
    out = np.asarray(masked_attention(q, win, kv, key_mask, sink, window_size=w).out)
    assert np.isfinite(out[0, :3]).all() and np.isnan(out[0, 3]).all()
    rows, valid = sliding_window_rows(win, w)
    for row in range(3):
        idx = np.flatnonzero(key_mask[0, row]).astype(np.int32)
        want = sparse_attention(q[0, row], rows[0, row], valid[0, row], kv[0], idx, sink)
        np.testing.assert_allclose(out[0, row], want, rtol=1e-5, atol=1e-6)


def test_5_a_nan_window_row_reaches_only_the_queries_whose_window_holds_it():
    rng = np.random.default_rng(6)
    b, t, h, d, w, s = 1, 9, 2, 8, 3, 4
    q = rng.normal(size=(b, t, h, d)).astype(np.float32)
    win = rng.normal(size=(b, t, d)).astype(np.float32)
    win[0, 4, 1] = np.inf  # in the windows of queries 4, 5 and 6 only
    kv = rng.normal(size=(b, s, d)).astype(np.float32)
    key_mask = rng.random((b, t, s)) < 0.5
    sink = np.zeros(h, np.float32)
    out = np.asarray(masked_attention(q, win, kv, key_mask, sink, window_size=w).out)
    finite = np.isfinite(out[0]).all(axis=(-2, -1))
    assert finite.tolist() == [True] * 4 + [False] * 3 + [True] * 2


def test_5_masked_attention_checks_its_arguments():
    f32 = np.zeros((1, 2, 2, 8), np.float32)
    args = dict(
        q=f32,
        window_kv=np.zeros((1, 2, 8), np.float32),
        kv=np.zeros((1, 5, 8), np.float32),
        key_mask=np.ones((1, 2, 5), bool),
        sink=np.zeros(2, np.float32),
    )
    for name, bad in (
        ("q", f32.astype(np.int32)),
        ("kv", np.zeros((1, 5, 4), np.float32)),
        ("key_mask", np.ones((1, 2, 4), bool)),
        ("sink", np.zeros(3, np.float32)),
        ("window_kv", np.zeros((1, 2, 3, 8), np.float32)),
        ("window_size", -1),
    ):
        with pytest.raises(ValueError, match=f"^{name}: expected"):
            masked_attention(
                **(args | {name: bad}), **({} if name == "window_size" else dict(window_size=3))
            )


# --- 6. a second Ctrl-C waits for the save instead of aborting it ---


def test_6_ctrl_c_during_a_save_waits_for_it(tmp_path, monkeypatch):
    m, optimizer = train.build(SMOKE)
    manager = rundir.checkpoint_manager(tmp_path, keep=2)
    real_save = manager.save

    def save_interrupted(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)  # a Ctrl-C in the middle of the save
        os.kill(os.getpid(), signal.SIGINT)  # and another one
        return real_save(*args, **kwargs)

    monkeypatch.setattr(manager, "save", save_interrupted)
    # Python's own Ctrl-C handler, also where the test runner was started with SIGINT ignored.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            rundir.save(manager, 4, m, optimizer)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, previous)
    assert manager.all_steps() == [4]
    assert not [p for p in (tmp_path / "checkpoints").iterdir() if "tmp" in p.name]
    manager.close()


# --- 7. --resume with nothing to resume says so; checkpoints as often as asked ---


def test_7_resume_without_a_checkpoint_says_so(tmp_path, capsys):
    run_dir = tmp_path / "run"
    rundir.prepare(run_dir, SMOKE.to_json(), resume=False)  # killed here
    result = train.run(SMOKE, run_dir, progress=False, resume=True)
    assert result["resumed_from"] == 0 and result["step"] == SMOKE.steps
    assert "nothing to resume" in capsys.readouterr().out
    assert cli.main(["train", "--resume", "--out", str(tmp_path / "missing")]) == 2
    assert "no run in" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["train", "--help"])
    assert "--checkpoint-every" in capsys.readouterr().out


# --- 8. a time-limited stop adds no record a resume would not write ---


def test_8_a_time_limited_stop_then_resume_gives_the_uninterrupted_file(tmp_path, uninterrupted):
    run_dir = tmp_path / "run"
    first = train.run(SMOKE, run_dir, progress=False, max_seconds=1e-9)
    assert first["stopped_early"] and first["step"] == 1
    train.run(SMOKE, run_dir, progress=False, resume=True)
    assert (run_dir / "metrics.jsonl").read_bytes() == uninterrupted


# --- 9. bad values are refused before anything is written ---


def test_9_bad_values_fail_before_the_run_directory_exists(tmp_path, capsys):
    with pytest.raises(ValueError, match=r"TrainConfig\.seed"):
        SMOKE.replace(seed=-1)
    with pytest.raises(ValueError, match="log_every"):
        train.run(SMOKE, tmp_path / "run", log_every=0)
    with pytest.raises(ValueError, match="max_seconds"):
        train.run(SMOKE, tmp_path / "run", max_seconds=-1)
    assert not (tmp_path / "run").exists()
    for field, value in (
        ("rope_theta", 0.0),
        ("rope_theta", -1.0),
        ("compress_rope_theta", 0.0),
        ("norm_eps", float("nan")),
        ("compress_ratios", (0, 2, 2, 1.5, 1, 1, 1, 1)),
    ):
        with pytest.raises(ValueError, match=rf"ModelConfig\.{field}"):
            config.tiny().replace(**{field: value})
    out = ["train", "--out", str(tmp_path / "cli")]
    assert cli.main([*out, "--seed", "-1"]) == 2
    for minutes in ("-1", "nan", "inf"):
        with pytest.raises(SystemExit) as exit_info:
            cli.main([*out, "--max-minutes", minutes])
        assert exit_info.value.code == 2
    assert "--max-minutes" in capsys.readouterr().err
    assert not (tmp_path / "cli").exists()


# --- 10. empty batches ---


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "fp8", "bf16", "f32"])
def test_10_formats_take_empty_batches(fmt):
    x = np.zeros((0, 64), np.float32)
    assert formats.fake_quant(x, fmt).shape == (0, 64)
    rows = formats.pack(x, fmt)
    assert rows.shape == (0, formats.packed_row_bytes(fmt, 64))
    assert formats.unpack(rows, fmt, 64).shape == (0, 64)


def test_10_kernels_and_prefill_take_empty_batches():
    k = jnp.zeros((0, 16, 68), jnp.uint8)
    q, w = jnp.zeros((0, 2, 128)), jnp.zeros((0, 2))
    ids, lengths = jnp.zeros((0, 2), jnp.int32), jnp.zeros((0,), jnp.int32)
    for implementation in ("xla", "pallas_interpret"):
        assert pooled_scores(k, q, w, ids, lengths, implementation=implementation).shape == (0, 16)
    m = model.Model(config.tiny(), rngs=nnx.Rngs(0))
    logits, cache, _ = model.prefill(m, jnp.zeros((0, 8), jnp.int32), lengths, max_len=8)
    assert logits.shape == (0, 8, 256) and cache.lengths.shape == (0,)
    with pytest.raises(ValueError, match="tokens: expected at least one token"):
        model.prefill(m, jnp.zeros((2, 0), jnp.int32), jnp.array([0, 0]), max_len=8)


# --- 11. selection edges ---


def test_11_a_positive_infinite_score_cannot_push_out_the_newest_block():
    scores = np.full((1, 40), 1.0, np.float32)
    scores[0, :16] = np.inf  # two old blocks score +inf
    pool = select_candidate_blocks(scores, np.array([40]), topk_blocks=2, block_size=8)
    assert 4 in np.asarray(pool.block_ids[0]).tolist(), "the newest block is pinned"


def test_11_topk_keeps_the_finite_picks_of_a_row_with_nan_and_refuses_a_huge_k():
    scores = np.array([[np.nan, 3.0, np.nan, 1.0, 2.0]], np.float32)
    picks = topk(scores, 3)
    assert np.asarray(picks.indices).tolist() == [[1, 3, 4]]
    assert np.isfinite(np.asarray(picks.scores)).all()
    with pytest.raises(ValueError, match=r"^k: expected at most"):
        topk(scores, 10**9)


# --- 12. messages: usage errors, and errors that name the argument ---


@pytest.mark.parametrize(
    "argv",
    [
        ["--steps", "-1"],
        ["--lr", "nan"],
        ["--task-set", "n_pairs=abc"],
        ["--batch-size", "0"],
        ["--model-set", "no_such_field=1"],
    ],
    ids=str,
)
def test_12_bad_cli_values_are_usage_errors(tmp_path, capsys, argv):
    assert cli.main(["train", "--out", str(tmp_path / "run"), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("v41jax train: error:") and "Traceback" not in err
    assert not (tmp_path / "run").exists()


def test_12_argparse_rejects_malformed_settings(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["train", "--task-set", "foo"])
    assert exit_info.value.code == 2 and "NAME=VALUE" in capsys.readouterr().err


def test_12_an_out_that_is_a_file_is_a_usage_error(tmp_path, capsys):
    (tmp_path / "file").write_text("mine")
    for out in (tmp_path / "file", tmp_path / "file" / "run"):
        assert cli.main(["train", "--out", str(out), "--steps", "2"]) == 2
        assert "error" in capsys.readouterr().err
    assert (tmp_path / "file").read_text() == "mine"


def test_12_a_damaged_checkpoint_is_named_plainly(tmp_path, uninterrupted_dir):
    run_dir = tmp_path / "run"
    shutil.copytree(uninterrupted_dir, run_dir)
    for f in (run_dir / "checkpoints").rglob("*"):
        if f.is_file() and f.stat().st_size > 0:
            f.write_bytes(b"\0garbage" * 4)
    with pytest.raises(train.RunDirectoryError) as err:
        train.run(SMOKE, run_dir, progress=False, resume=True)
    assert "could not be restored" in str(err.value) and "<bound method" not in str(err.value)


def test_12_ops_errors_name_the_argument():
    with pytest.raises(ValueError, match=r"^dim: expected a positive int"):
        formats.unpack(np.zeros((2, 288), np.uint8), "nvfp4", -16)
    q = np.zeros((2, 8), np.float32)
    args = (q, np.zeros((3, 8), np.float32), np.ones(3, bool), np.zeros((5, 8), np.float32))
    with pytest.raises(ValueError, match=r"^scale: expected"):
        sparse_attention(*args, np.zeros(2, np.int32), np.zeros(2, np.float32), scale="abc")
    with pytest.raises(ValueError, match=r"^compress_lens: expected lengths >= 0"):
        index_scores(
            np.zeros((1, 2, 8), np.float32),
            np.zeros((1, 2), np.float32),
            np.zeros((4, 8), np.float32),
            np.array([-1]),
        )
    cfg = config.tiny()
    m = model.Model(cfg, rngs=nnx.Rngs(0))
    cache = cache_lib.init_cache(cfg, batch=1, max_len=8)
    cache = cache.replace(lengths=jnp.array([-2], jnp.int32))
    with pytest.raises(ValueError, match=r"^cache\.lengths: expected"):
        model.decode_step(m, jnp.array([1]), cache)


def test_12_a_saved_config_of_another_version_is_named():
    assert train.TrainConfig.from_json(json.loads(json.dumps(SMOKE.to_json()))) == SMOKE
    with pytest.raises(ValueError, match="unknown fields"):
        train.TrainConfig.from_json({**SMOKE.to_json(), "kv_format": "nvfp4"})
