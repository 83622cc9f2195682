"""Many seeds in one program: a seed trained in a group equals the seed trained alone, each
seed's run directory behaves as a single run's, and a group resumes exactly."""

import json
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests._models import FOUR_LAYER_TRAIN, TRAIN_TASK, fake_evaluations
from v41jax import train
from v41jax.train import rundir

# Four layers (window; Full and candidate source; Reindex; Reuse) with a pool of 2 blocks of 8
# that bites at 64 tokens; an evaluation and a checkpoint every 2 steps; sparse from step 0 (the
# dense stage's program is the same vmapped step with `dense=True`: its choice per step is
# checked on a recording runner below, without compiling it twice more).
CFG = train.TrainConfig(
    task="mqar",
    steps=4,
    batch_size=2,
    lr_warmup_steps=1,
    dense_warmup_steps=0,
    eval_every=2,
    eval_batches=1,
    checkpoint_every=2,
    task_overrides=TRAIN_TASK,
    model_overrides=FOUR_LAYER_TRAIN,
)
SEEDS = (1, 0)  # seed 1 first: a seed's place in the group is not its seed
OPTIONS = dict(progress=False, log_every=1)
# The pool's statistics count discrete selections: a float-level difference of the vmapped
# step can move one pick, which moves these by a few percent.
SELECTION_STATS = ("pool_recall", "within_pool_recall", "mass_selected", "mass_pool")


def _group(seeds=SEEDS):
    return [CFG.replace(seed=s) for s in seeds]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Each seed alone, and seeds (1, 0) as one group (each program compiled once here)."""
    root = tmp_path_factory.mktemp("group")
    alone = {s: train.run(CFG.replace(seed=s), root / f"alone{s}", **OPTIONS) for s in SEEDS}
    group = train.run_seeds(_group(), root / "group", group_size=2, **OPTIONS)
    return root, alone, group


def _state(run_dir):
    _, model = train.load(run_dir)
    return jax.tree.leaves(nnx.state(model))


def _assert_records_close(got: list[dict], want: list[dict]) -> None:
    """The same records (steps, splits, keys), their numbers within float tolerance."""
    assert [sorted(r.items()) for r in _labels(got)] == [sorted(r.items()) for r in _labels(want)]
    for g, w in zip(got, want, strict=True):
        for key, value in w.items():
            if key in _LABELS or value is None:
                assert g[key] == value, key
                continue
            loose = key.split("/")[-1].startswith(SELECTION_STATS)
            tolerance = dict(atol=0.05) if loose else dict(rtol=2e-3, atol=1e-5)
            np.testing.assert_allclose(
                _numbers(g[key]), _numbers(value), **tolerance, err_msg=f"{w.get('step')} {key}"
            )


def _numbers(value) -> np.ndarray:
    """A number or a list of them (None, for an empty distance bucket, as NaN)."""
    items = value if isinstance(value, list) else [value]
    return np.asarray([np.nan if v is None else v for v in items], np.float64)


_LABELS = ("step", "split", "resumed_from", "stopped_early")


def _labels(records: list[dict]) -> list[dict]:
    return [{k: (v if k in _LABELS else None) for k, v in r.items()} for r in records]


@pytest.mark.parametrize("place", [0, 1])
def test_a_seed_in_a_group_equals_the_seed_alone(trained, place):
    root, alone, group = trained
    seed, other = SEEDS[place], SEEDS[1 - place]
    alone_dir, group_dir = root / f"alone{seed}", root / "group" / f"seed{seed}"
    assert sorted(p.name for p in (root / "group").iterdir()) == ["seed0", "seed1"]
    assert sorted(p.name for p in group_dir.iterdir()) == sorted(
        p.name for p in alone_dir.iterdir()
    )
    config = (group_dir / "config.json").read_text()
    assert config == (alone_dir / "config.json").read_text()
    # Parameters and optimizer state of the final checkpoint, and every metrics record.
    alone_state, group_state = _state(alone_dir), _state(group_dir)
    for a, g in zip(alone_state, group_state, strict=True):
        np.testing.assert_allclose(g, a, rtol=1e-3, atol=1e-4)
    records = train.read_metrics(alone_dir / "metrics.jsonl")
    _assert_records_close(train.read_metrics(group_dir / "metrics.jsonl"), records)
    steps = [(r["step"], r["split"]) for r in records]
    assert steps == [
        (1, "train"),
        (2, "train"),
        (2, "eval"),
        (3, "train"),
        (4, "train"),
        (4, "eval"),
    ]
    assert json.loads((group_dir / "summary.json").read_text()) == group[place]
    without_time = [
        {k: v for k, v in r.items() if k != "train_seconds"} for r in (group[place], alone[seed])
    ]
    _assert_records_close(without_time[:1], without_time[1:])
    # The other seed is another run (so the tolerances above can fail): its own init and data.
    other_state = _state(root / f"alone{other}")
    distance = max(
        float(np.abs(a - o).max()) for a, o in zip(alone_state, other_state, strict=True)
    )
    assert distance > 0.1
    other_records = train.read_metrics(root / f"alone{other}" / "metrics.jsonl")
    with pytest.raises(AssertionError):
        _assert_records_close(other_records, records)


def test_group_resume_equals_the_uninterrupted_group(trained, tmp_path):
    root, _, group = trained
    cut = tmp_path / "cut"
    train.run_seeds(_group(), cut, group_size=2, stop_after=2, **OPTIONS)
    assert all((cut / f"seed{s}" / "checkpoints" / "2").exists() for s in SEEDS)
    assert not (cut / "seed0" / "checkpoints" / "4").exists()
    # Seed 0 lost its checkpoint (a kill between the seeds' saves): it restarts from step 0
    # while seed 1 waits, unchanged, at its step 2.
    shutil.rmtree(cut / "seed0" / "checkpoints" / "2")
    resumed = train.run_seeds(_group(), cut, group_size=2, resume=True, **OPTIONS)
    assert [r["resumed_from"] for r in resumed] == [2, 0]
    for seed, got, want in zip(SEEDS, resumed, group, strict=True):
        assert got == {
            **want,
            "train_seconds": got["train_seconds"],
            "resumed_from": got["resumed_from"],
        }
        assert train.read_metrics(cut / f"seed{seed}" / "metrics.jsonl") == train.read_metrics(
            root / "group" / f"seed{seed}" / "metrics.jsonl"
        )
        cut_state, group_state = _state(cut / f"seed{seed}"), _state(root / "group" / f"seed{seed}")
        for a, b in zip(cut_state, group_state, strict=True):
            np.testing.assert_array_equal(a, b)


def test_ctrl_c_saves_every_seed_of_a_group(trained, tmp_path, monkeypatch):
    real_step = train.GroupStepRunner.__call__
    calls = []

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real_step(*args, **kwargs)

    monkeypatch.setattr(train.GroupStepRunner, "__call__", interrupted)
    with pytest.raises(KeyboardInterrupt):
        train.run_seeds(_group(), tmp_path / "run", group_size=2, **OPTIONS)
    for seed in SEEDS:
        assert sorted(p.name for p in (tmp_path / "run" / f"seed{seed}" / "checkpoints").iterdir())
        assert (tmp_path / "run" / f"seed{seed}" / "checkpoints" / "1").exists()
        assert [
            r["step"]
            for r in train.read_metrics(tmp_path / "run" / f"seed{seed}" / "metrics.jsonl")
        ] == [1]


def test_bad_groups_name_the_argument():
    with pytest.raises(ValueError, match=r"cfgs: expected at least one TrainConfig, got an empty"):
        train.run_seeds([], "unused")
    with pytest.raises(ValueError, match=r"cfgs: expected distinct seeds, got seeds \[1, 0, 1\]"):
        train.run_seeds(_group((1, 0, 1)), "unused")
    want = rf"cfgs\[1\]\.learning_rate: expected {re.escape(repr(CFG.learning_rate))} .*got 0\.001"
    with pytest.raises(ValueError, match=want):
        train.check_group([CFG, CFG.replace(seed=1, learning_rate=1e-3)])
    with pytest.raises(ValueError, match=r"cfgs\[1\]\.task_overrides: expected"):
        train.check_group([CFG, CFG.replace(seed=1).with_task(seq_len=128)])
    with pytest.raises(ValueError, match=r"cfgs\[0\]: expected a TrainConfig, got dict"):
        train.check_group([CFG.to_json()])
    with pytest.raises(ValueError, match=r"group_size: expected an int >= 1 or None, got 0"):
        train.seed_groups(_group(), 0)
    with pytest.raises(ValueError, match=r"log_every: expected an int >= 1, got 0"):
        train.run_seeds(_group(), "unused", log_every=0)
    assert train.seed_groups(_group((0, 1, 2)), 2) == [
        tuple(_group((0, 1))),
        (CFG.replace(seed=2),),
    ]


def test_a_bad_seed_directory_stops_the_group_before_anything_is_written(tmp_path):
    (tmp_path / "seed0").mkdir()
    (tmp_path / "seed0" / "notes.txt").write_text("mine")
    with pytest.raises(train.RunDirectoryError, match="seed0 exists and holds files"):
        train.run_seeds(_group(), tmp_path, group_size=2, **OPTIONS)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["seed0"]  # seed1 was not created
    rundir.prepare(tmp_path / "single", CFG.to_json(), resume=False)  # a single run
    with pytest.raises(train.RunDirectoryError, match="holds a single run"):
        train.run_seeds(_group(), tmp_path / "single", **OPTIONS)


def test_group_runner_refuses_models_of_another_structure():
    pairs = [train.build(CFG), train.build(CFG.with_model(ffn_dim=96))]
    with pytest.raises(ValueError, match=r"pairs\[1\]: expected a model and optimizer of the"):
        train.GroupStepRunner(pairs)


class _RecordingRunner:
    """Stands in for `GroupStepRunner`: records what the loop hands each step."""

    size = 3

    def __init__(self):
        self.calls = []

    def __call__(self, tokens, targets, loss_mask, *, active, dense, indexer_kl_weight):
        self.calls.append((np.asarray(tokens), np.asarray(active).tolist(), dense))
        return {"loss": jnp.zeros(self.size)}


def test_the_group_loop_hands_each_seed_its_batch_stage_and_start():
    cfgs = [CFG.replace(seed=s, dense_warmup_steps=2, steps=5) for s in (4, 2, 7)]
    task, runner, seen = cfgs[0].make_task(), _RecordingRunner(), []

    def hook(done, metrics, active):
        seen.append((done, active))
        return done == 4

    done = train.train_group_steps(runner, cfgs, task, [1, 3, 0], 5, hook)
    assert done == 4  # the hook stopped the loop after step 3
    assert seen == [
        (1, (False, False, True)),
        (2, (True, False, True)),
        (3, (True, False, True)),
        (4, (True, True, True)),
    ]
    assert [dense for _, _, dense in runner.calls] == [True, True, False, False]
    for step, (tokens, active, _) in enumerate(runner.calls):
        assert active == list(seen[step][1])
        for i, cfg in enumerate(cfgs):
            want = task.batch_at(cfg.seed, step, cfg.batch_size).tokens
            np.testing.assert_array_equal(tokens[i], want)
    with pytest.raises(ValueError, match=r"cfgs, starts: expected 3 of each"):
        train.train_group_steps(runner, cfgs[:2], task, [0, 0], 5)


def test_a_group_stops_once_every_seed_meets_the_convergence_rule(tmp_path, monkeypatch):
    cfgs = [c.replace(eval_every=1, converge_accuracy=0.5, converge_evals=1) for c in _group()]
    # Seed 1 meets the rule at step 1, seed 0 at step 2: the group stops after step 2 of 4.
    fake_evaluations(monkeypatch, {1: [0.9, 0.9, 0.9], 0: [0.1, 0.9, 0.9]})
    results = train.run_seeds(cfgs, tmp_path / "group", group_size=2, **OPTIONS)
    assert [r["step"] for r in results] == [2, 2]
    assert all(r["converged"] and not r["stopped_early"] for r in results)
    for seed in SEEDS:
        assert (tmp_path / "group" / f"seed{seed}" / "checkpoints" / "2").exists()


def test_the_time_guard_spans_the_whole_call_not_each_group(tmp_path, monkeypatch):
    """`max_seconds` guards the call: each group starts with what the ones before it left."""
    now, given = [0.0], []

    def fake_run(cfg, run_dir, **options):
        given.append(options["max_seconds"])
        now[0] += 45.0  # each group trains 45 s
        return {"seed": cfg.seed}

    monkeypatch.setattr(train.group.time, "perf_counter", lambda: now[0])
    monkeypatch.setattr(train.group.trainer, "run", fake_run)
    cfgs = [CFG.replace(seed=s) for s in (0, 1, 2)]
    results = train.run_seeds(cfgs, tmp_path / "g", group_size=1, max_seconds=60.0, **OPTIONS)
    # The third group finds the guard spent: it still takes one step (a positive guard).
    assert given == [60.0, 15.0, 1e-9] and [r["seed"] for r in results] == [0, 1, 2]
