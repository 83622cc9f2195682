"""Training: the indexer KL loss reaches only the indexer, runs survive interruption."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests._models import FOUR_LAYER_TRAIN, assert_hands_back_its_results_only, fake_evaluations
from v41jax import train
from v41jax.nn.model import with_fields
from v41jax.train import evaluate

# Small enough to compile and run in seconds on 2 CPU cores: four layers with every role a run
# trains (`FOUR_LAYER_TRAIN`, half of tiny()'s compilation), and a pool of 2 blocks of 8 that bites.
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


def _batch(cfg, step=0):
    b = cfg.make_task().batch_at(cfg.seed, step, cfg.batch_size)
    return jnp.asarray(b.tokens), jnp.asarray(b.targets), jnp.asarray(b.loss_mask)


def _is_indexer(path) -> bool:
    return any("indexer" in str(p) for p in path)


@pytest.mark.parametrize("dense", [True, False])
def test_indexer_kl_reaches_only_the_indexer_and_task_loss_never_does(dense):
    model, _ = train.build(SMOKE)
    tokens, targets, mask = _batch(SMOKE)

    def task_loss(m):
        return train.loss_fn(m, tokens, targets, mask, dense=dense, indexer_kl_weight=0.0)[1][
            "task_loss"
        ]

    def kl_loss(m):
        return train.loss_fn(m, tokens, targets, mask, dense=dense, indexer_kl_weight=1.0)[1][
            "indexer_kl"
        ]

    for loss, reaches_indexer in ((task_loss, False), (kl_loss, True)):
        grads = nnx.jit(nnx.grad(loss))(model)  # compiled: eager dispatch of a backward is slow
        leaves = jax.tree_util.tree_leaves_with_path(grads)
        indexer = [float(jnp.abs(g).max()) for p, g in leaves if _is_indexer(p)]
        others = [float(jnp.abs(g).max()) for p, g in leaves if not _is_indexer(p)]
        assert indexer and others
        if reaches_indexer:
            assert max(indexer) > 0 and max(others) == 0
        else:
            assert max(indexer) == 0 and max(others) > 0


def test_kl_loss_is_zero_when_the_indexer_matches_the_attention():
    from v41jax.nn.indexer import indexer_kl

    rng = np.random.default_rng(0)
    probs = jnp.asarray(rng.random((3, 2, 5)), jnp.float32)  # [rows, heads, keys]
    mask = jnp.asarray([[1, 1, 0, 1, 0], [0, 0, 0, 0, 0], [1, 1, 1, 1, 1]], bool)
    target = jnp.where(mask, probs.sum(1), 0.0)
    scores = jnp.log(jnp.where(mask, target, 1.0))  # log-softmax over the mask = log target
    kl, rows = indexer_kl(scores, probs, mask)
    assert float(rows) == 2 and abs(float(kl)) < 1e-6
    kl_off, _ = indexer_kl(jnp.zeros_like(scores), probs, mask)
    assert float(kl_off) > 0.01


def test_train_step_updates_parameters_and_reports_metrics():
    model, optimizer = train.build(SMOKE)
    before = jax.tree.map(jnp.copy, nnx.state(model, nnx.Param))
    for step in range(2):  # the learning rate warms up from 0: step 0 changes nothing
        metrics = train.train_step(
            model, optimizer, *_batch(SMOKE, step), dense=False, indexer_kl_weight=1.0
        )
    assert set(metrics) >= {"loss", "task_loss", "indexer_kl", "accuracy", "grad_norm"}
    assert all(np.isfinite(float(v)) for v in metrics.values())
    after = nnx.state(model, nnx.Param)
    changed = jax.tree.map(lambda a, b: bool(jnp.any(a != b)), before, after)
    assert all(jax.tree.leaves(changed))


def test_resume_reproduces_the_uninterrupted_run(tmp_path):
    full = train.run(SMOKE, tmp_path / "full", progress=False, log_every=1)
    train.run(SMOKE, tmp_path / "cut", progress=False, log_every=1, stop_after=3)
    assert not (tmp_path / "cut" / "checkpoints" / "6").exists()
    resumed = train.run(SMOKE, tmp_path / "cut", progress=False, log_every=1, resume=True)
    assert resumed == {**full, "train_seconds": resumed["train_seconds"], "resumed_from": 3}
    assert full["resumed_from"] == 0
    assert train.read_metrics(tmp_path / "cut" / "metrics.jsonl") == train.read_metrics(
        tmp_path / "full" / "metrics.jsonl"
    )
    # Resuming a finished run changes no record.
    again_resumed = train.run(SMOKE, tmp_path / "cut", progress=False, log_every=1, resume=True)
    assert again_resumed["accuracy"] == full["accuracy"]
    assert again_resumed["resumed_from"] == 6
    assert "all trained before: evaluated again" in train.summarize(SMOKE, "cut", again_resumed)
    assert train.read_metrics(tmp_path / "cut" / "metrics.jsonl") == train.read_metrics(
        tmp_path / "full" / "metrics.jsonl"
    )
    assert (tmp_path / "full" / "training.png").stat().st_size > 10_000
    # The saved model is the trained one: it evaluates to the run's final numbers.
    cfg, model = train.load(tmp_path / "full")
    assert cfg == SMOKE
    again = evaluate.evaluate(
        model,
        cfg.make_task(),
        seed=cfg.seed + train.EVAL_SEED_OFFSET,
        batches=cfg.eval_batches,
        batch_size=cfg.batch_size,
        dense=False,
    )
    assert again["task_loss"] == full["task_loss"]
    # The summary's pool of one block is these weights evaluated with candidate_topk_blocks=1.
    one = evaluate.evaluate(
        with_fields(model, candidate_topk_blocks=1),
        cfg.make_task(),
        seed=cfg.seed + train.EVAL_SEED_OFFSET,
        batches=cfg.eval_batches,
        batch_size=cfg.batch_size,
        dense=False,
    )
    assert model.config.candidate_topk_blocks == 2 and one["task_loss"] != again["task_loss"]
    assert (full["pool1_accuracy"], full["pool1_task_loss"]) == (one["accuracy"], one["task_loss"])
    assert "same weights, a pool of one block: " in train.summarize(SMOKE, "full", full)
    with pytest.raises(train.RunDirectoryError, match="step: expected one of"):
        train.load(tmp_path / "full", step=5)


def test_run_directory_is_never_overwritten(tmp_path):
    run_dir = tmp_path / "run"
    cfg = SMOKE  # the config other tests train: its programs are compiled once per worker
    train.run(cfg, run_dir, progress=False)
    snapshot = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    with pytest.raises(train.RunDirectoryError, match="already holds a run"):
        train.run(cfg, run_dir, progress=False)
    with pytest.raises(train.RunDirectoryError, match=r"another config.*learning_rate"):
        train.run(cfg.replace(learning_rate=1e-4), run_dir, progress=False, resume=True)
    # Damage the newest checkpoint's array data: the resume must fail clearly and change nothing.
    for f in (run_dir / "checkpoints" / str(cfg.steps)).rglob("*"):
        if f.is_file() and f.stat().st_size > 0 and f.suffix not in (".json",):
            f.write_bytes(b"\0garbage" * 4)
    damaged = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    with pytest.raises(train.RunDirectoryError, match="could not be restored"):
        train.run(cfg, run_dir, progress=False, resume=True)
    assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == damaged
    assert snapshot.keys() == damaged.keys()


def _params(model) -> dict:
    return {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def test_init_from_starts_a_stage_from_the_weights_of_another_run(tmp_path):
    short = SMOKE.replace(seed=5)  # the seed changes no compiled program
    train.run(short, tmp_path / "short" / "seed5", progress=False)
    _, trained = train.load(tmp_path / "short" / "seed5")
    # The next stage: a fresh optimizer; {seed} names the seed's own first stage. The same task,
    # so its programs are the first stage's: a longer one would compile its own (~15 s of the
    # suite), and stages that climb in length run in test_experiments' long_context_task smoke.
    stage2 = short.replace(init_from=str(tmp_path / "short" / "seed{seed}"))
    model, _ = train.build(stage2)
    fresh = _params(model)
    assert train.initialize_from(model, stage2) == tmp_path / "short" / "seed5"
    start = _params(model)
    assert start.keys() == _params(trained).keys()
    for path, value in _params(trained).items():
        np.testing.assert_array_equal(start[path], value)
    assert any(not np.array_equal(fresh[p], start[p]) for p in start)
    result = train.run(stage2, tmp_path / "long", progress=False, stop_after=1)
    cfg, _ = train.load(tmp_path / "long")
    assert cfg.init_from == stage2.init_from and result["step"] == 1
    # A resumed stage continues from its own checkpoint, not from init_from again: it ends
    # where the stage run in one go ends (starting over from init_from at step 1 would not).
    train.run(stage2, tmp_path / "long", progress=False, resume=True)
    done = _params(train.load(tmp_path / "long")[1])
    assert any(not np.array_equal(start[p], v) for p, v in done.items())
    train.run(stage2, tmp_path / "whole", progress=False)
    for path, value in _params(train.load(tmp_path / "whole")[1]).items():
        np.testing.assert_array_equal(done[path], value, err_msg=str(path))
    # Another model shape: refused, naming the parameter; no run there: refused.
    wider = stage2.with_model(ffn_dim=64)
    with pytest.raises(ValueError, match=r"init_from: parameter .* expected float32\[.*64"):
        train.initialize_from(train.build(wider)[0], wider)
    with pytest.raises(train.RunDirectoryError, match="expected a run directory"):
        train.initialize_from(model, stage2.replace(init_from=str(tmp_path / "none")))
    with pytest.raises(ValueError, match=r"TrainConfig\.init_from: expected"):
        SMOKE.replace(init_from=3)


def test_a_run_stops_once_its_final_stage_meets_the_convergence_rule(tmp_path, monkeypatch):
    cfg = SMOKE.replace(eval_every=1, dense_warmup_steps=2, converge_accuracy=0.5, converge_evals=2)
    # Evaluations at steps 1..6; step 1 is dense (not counted); sparse from step 2:
    # 0.6, 0.3, 0.7, 0.8 -> the last two reach 0.5 after step 5.
    fake_evaluations(monkeypatch, {cfg.seed: [0.6, 0.3, 0.7, 0.8, 0.9, 0.9]})
    result = train.run(cfg, tmp_path / "run", progress=False, log_every=1)
    assert result["step"] == 5 and result["converged"] and not result["stopped_early"]
    assert (tmp_path / "run" / "checkpoints" / "5").exists()  # not a checkpoint_every step
    assert "converged: the last 2 evaluations >= 50%" in train.summarize(cfg, "run", result)
    # Resumed, it trains nothing more.
    again = train.run(cfg, tmp_path / "run", progress=False, resume=True)
    assert again["step"] == 5 and again["resumed_from"] == 5 and again["converged"]
    # The rule itself: off at 0; only the final stage's evaluations count; consecutive ones.
    assert not SMOKE.converged([(6, 1.0), (7, 1.0)])
    rule = SMOKE.replace(converge_accuracy=0.9, converge_evals=2, dense_warmup_steps=4)
    assert not rule.converged([(2, 1.0), (4, 1.0)])  # step 2 is dense
    assert rule.converged([(2, 1.0), (4, 1.0), (5, 0.9)])
    assert not rule.converged([(4, 1.0), (5, 0.8), (6, 0.95)])
    for bad in (-0.1, 1.5, True, float("nan")):
        with pytest.raises(ValueError, match=r"TrainConfig\.converge_accuracy"):
            SMOKE.replace(converge_accuracy=bad)
    with pytest.raises(ValueError, match=r"TrainConfig\.converge_evals"):
        SMOKE.replace(converge_evals=0)


def test_a_run_written_before_newer_fields_still_resumes(tmp_path):
    # A run directory from before adam_b2, the convergence rule and init_from existed: its
    # config.json lacks them, and it trained with optax's b2 = 0.999.
    old = SMOKE.replace(steps=3, adam_b2=0.999)
    train.run(old, tmp_path / "run", progress=False, stop_after=2)
    path = tmp_path / "run" / "config.json"
    saved = json.loads(path.read_text())
    for field in train.trainer.LEGACY_FIELDS:
        del saved[field]
    path.write_text(json.dumps(saved))
    assert train.TrainConfig.from_json(saved) == old
    result = train.run(old, tmp_path / "run", progress=False, resume=True)
    assert result["step"] == 3 and result["resumed_from"] == 2
    with pytest.raises(train.RunDirectoryError, match=r"adam_b2.: \(0\.999, 0\.95\)"):
        train.run(old.replace(adam_b2=0.95), tmp_path / "run", progress=False, resume=True)


def test_ctrl_c_saves_a_checkpoint(tmp_path, monkeypatch):
    real_step = train.StepRunner.__call__
    calls = []

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real_step(*args, **kwargs)

    monkeypatch.setattr(train.StepRunner, "__call__", interrupted)
    with pytest.raises(KeyboardInterrupt):
        train.run(SMOKE, tmp_path / "run", progress=False)
    assert (tmp_path / "run" / "checkpoints" / "1").exists()


def test_bad_train_config_names_the_field():
    with pytest.raises(ValueError, match=r"TrainConfig\.steps"):
        SMOKE.replace(steps=0)
    with pytest.raises(ValueError, match=r"TrainConfig\.attention"):
        SMOKE.replace(attention="full")
    for b2 in (1.0, -0.1, float("nan"), True):
        with pytest.raises(
            ValueError, match=r"TrainConfig\.adam_b2: expected a number in \[0, 1\)"
        ):
            SMOKE.replace(adam_b2=b2)
    with pytest.raises(ValueError, match=r"ModelConfig\.kv_format"):
        SMOKE.with_model(kv_format="fp4")
    with pytest.raises(ValueError, match="seq_len"):
        SMOKE.replace(task_overrides=(("seq_len", 4),))
    assert train.TrainConfig.from_json(json.loads(json.dumps(SMOKE.to_json()))) == SMOKE


def test_a_config_read_back_from_json_is_the_config_saved():
    # Tuple-valued overrides (layer lists, id ranges) come back from JSON as lists: read back,
    # they are tuples again, so the config compares equal and stays hashable.
    cfg = SMOKE.with_task(key_ids=(4, 68))
    assert isinstance(dict(cfg.model_overrides)["compress_ratios"], tuple)
    again = train.TrainConfig.from_json(json.loads(json.dumps(cfg.to_json())))
    assert again == cfg and hash(again) == hash(cfg)
    assert dict(again.task_overrides)["key_ids"] == (4, 68)


def test_equal_configs_share_one_compiled_train_step():
    # The optimizer's transformation is static graph data: equal configs must produce the same
    # object, or `train_step` would recompile for every run (10+ s each on the CPU).
    _, first = train.build(SMOKE)
    _, second = train.build(SMOKE)
    assert nnx.graphdef(first) == nnx.graphdef(second)
    for change in ({"learning_rate": 1e-4}, {"adam_b2": 0.5}):
        _, other = train.build(SMOKE.replace(**change))
        assert nnx.graphdef(other) != nnx.graphdef(first), change


def test_the_loop_step_runner_equals_train_step():
    """`StepRunner` (the loop's step, the graph traversed once) updates the model and the
    optimizer as `train_step` does."""
    cfg = SMOKE.replace(batch_size=2)
    task = cfg.make_task()
    (m1, o1), (m2, o2) = train.build(cfg), train.build(cfg)
    runner = train.StepRunner(m2, o2)
    for step, dense in ((0, True), (1, False), (2, False)):
        b = task.batch_at(cfg.seed, step, cfg.batch_size)
        args = [jnp.asarray(x) for x in (b.tokens, b.targets, b.loss_mask)]
        want = train.train_step(m1, o1, *args, dense=dense, indexer_kl_weight=1.0)
        got = runner(*args, dense=dense, indexer_kl_weight=1.0)
        for name in want:
            np.testing.assert_allclose(got[name], want[name], rtol=1e-5, err_msg=name)
    pairs = zip(
        jax.tree.leaves(nnx.state((m1, o1))), jax.tree.leaves(nnx.state((m2, o2))), strict=True
    )
    for a, b in pairs:
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-6)


@pytest.fixture(scope="module")
def evidence_case():
    """An untrained tiny() on one multi-passkey example of 256 tokens with a pool of 2 blocks,
    evaluated once (`evaluate` on that example alone)."""
    cfg = train.make_config(
        train.TrainConfig(),
        task="multi_passkey",
        task_changes=dict(seq_len=256),
        model_changes=dict(candidate_topk_blocks=2),
    )
    model, task = train.build(cfg)[0], cfg.make_task()
    got = evaluate.evaluate(model, task, seed=7, batches=1, batch_size=1, dense=False)
    return model, task, cfg.model_config(), got


def test_evidence_metrics_count_the_answer_position_in_the_pool_and_the_selections(evidence_case):
    """`evidence_in_pool` and each Reindex layer's `evidence_selected` / `evidence_topk` equal a
    count over the model's own trace, query by query, at scored queries beyond the pool."""
    model, task, c, got = evidence_case
    b = task.batch_at(7, 0, 1)
    run = nnx.jit(lambda m, t: m.run(t, dense=False, diagnostics=True))  # not op by op
    _, trace = run(model, jnp.asarray(b.tokens))
    pool = np.asarray(trace[c.candidate_source_layer].shared.pool.mask)
    layers = [(p.layer, s) for p, s in zip(c.layers, trace, strict=True) if p.uses_candidates]
    counts = {"evidence_in_pool": 0}
    n = 0
    for i, t in zip(*np.nonzero(b.loss_mask), strict=True):
        e = b.evidence[i, t]  # every layer here has compress ratio 1
        if not (0 <= e <= t and t + 1 > c.candidate_pool_size):
            continue
        n += 1
        counts["evidence_in_pool"] += bool(pool[i, t, e])
        for layer, step in layers:
            for name, picks in (
                ("selected", step.shared.topk),
                ("topk", step.aux["unrestricted_topk"]),
            ):
                key = f"layer{layer}/evidence_{name}"
                counts[key] = counts.get(key, 0) + bool(e in np.asarray(picks)[i, t])
    assert n > 0 and len(counts) == 1 + 2 * len(layers)
    for key, count in counts.items():
        assert got[key] == pytest.approx(count / n), key


@pytest.mark.parametrize("program", ["eval_batch", "snapshot_arrays"])
def test_the_evaluation_programs_hand_back_no_parameter(evidence_case, program):
    """`evaluate`'s and `pool_snapshot`'s compiled programs return their results and nothing
    else (`nnx.jit(graph_updates=False)`, as the model's prefill and decode steps,
    tests/test_model.py): with nnx.jit's default every Variable of the model left the program
    too, a copy of each parameter at every call. Counted on the lowered program."""
    model, task, c, _ = evidence_case
    b = task.batch_at(7, 0, 1)
    if program == "eval_batch":
        fn, impl, kwargs = evaluate._eval_batch, evaluate._eval_batch.fun, {"dense": False}
        args = (b.tokens, b.targets, b.loss_mask, b.evidence)
        args = (model, *map(jnp.asarray, args), jax.random.key(0))
    else:
        fn, impl, kwargs = evaluate._snapshot_arrays, evaluate._snapshot_arrays.fun, {}
        ratio = c.layers[c.candidate_source_layer].compress_ratio
        lens = (np.arange(b.tokens.shape[1]) + 1) // ratio  # as `pool_snapshot` passes them
        args = (model, jnp.asarray(b.tokens), jnp.asarray(lens))
    assert_hands_back_its_results_only(fn, impl, args, kwargs)


def test_a_pool_snapshot_agrees_with_the_pool_and_the_evidence_metrics(evidence_case):
    model, task, c, got = evidence_case
    snap = evaluate.pool_snapshot(model, task, seed=7, scores_for=2)
    queries = snap["queries"]
    assert [q["t"] for q in queries] == list(np.flatnonzero(task.batch_at(7, 0, 1).loss_mask[0]))
    assert sum("block_scores" in q for q in queries) == 2
    for q in queries:
        assert len(q["pool_blocks"]) <= c.candidate_topk_blocks
        in_pool = q["evidence_block"] in q["pool_blocks"]
        # The pool keeps the best blocks: every block scoring above one in it is in it too.
        assert not in_pool or q["evidence_block_rank"] < c.candidate_topk_blocks
        if "block_scores" in q:
            pinned = (q["visible"] - 1) // snap["block_size"]
            score = [
                np.inf if i == pinned else -np.inf if v is None else v
                for i, v in enumerate(q["block_scores"])
            ]
            kept = [score[i] for i in q["pool_blocks"]]
            others = [v for i, v in enumerate(score) if i not in q["pool_blocks"]]
            assert pinned in q["pool_blocks"] and min(kept) >= max(others)
        for layer in snap["reindex_layers"]:
            assert set(q[f"{layer}/selected_blocks"]) <= set(q["pool_blocks"])
            if q[f"{layer}/evidence_selected"]:
                assert in_pool and q["evidence_block"] in q[f"{layer}/selected_blocks"]
    # The same example through `evaluate`: the same fraction of evidence in the pool and selected.
    beyond = [q for q in queries if q["visible"] > c.candidate_pool_size]
    assert beyond
    want = np.mean([q["evidence_block"] in q["pool_blocks"] for q in beyond])
    assert got["evidence_in_pool"] == pytest.approx(want)
    for layer in snap["reindex_layers"]:
        selected = np.mean([q[f"{layer}/evidence_selected"] for q in beyond])
        assert got[f"{layer}/evidence_selected"] == pytest.approx(selected)
