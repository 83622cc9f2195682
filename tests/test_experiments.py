"""The ablation scripts run end to end at smoke size and write the report they promise."""

import argparse
import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from scipy import stats

from experiments import (
    _common,
    block_score_ablation,
    kv_format_study,
    long_context_studies,
    long_context_task,
    main_job_seeds,
    merge_reports,
    pool_size_sweep,
    study_tables,
)
from v41jax import train
from v41jax.nn import config as config_lib
from v41jax.nn.model import with_fields

REPO = Path(__file__).resolve().parents[1]
POOL_METRICS = (
    "pool_recall",
    "pool_recall_random",
    "pool_recall_recent",
    "pool_recall_oracle",
    "within_pool_recall",
    "mass_selected",
    "pool_recall_by_distance",
)


def _check_report(out_dir, name: str, variants: list[str], sparse: list[str]) -> dict:
    report = json.loads((out_dir / f"{name}.json").read_text())
    assert set(report) == {"config", "results", "summary"}
    config = report["config"]
    assert config["smoke"] and config["seeds"] == [0] and config["reindex_layers"]
    pairs = [(r["variant"], r["seed"]) for r in report["results"]]
    assert sorted(pairs) == sorted((v, s) for v in variants for s in config["seeds"])
    for r in report["results"]:
        assert {"accuracy", "task_loss", "accuracy_by_distance"} <= set(r)
        if not r["variant"].startswith("ptq/"):  # trained runs: their first step at threshold
            assert r["steps_to_threshold"] is None or r["steps_to_threshold"] <= r["step"]
        pool_keys = {f"{layer}/{m}" for layer in config["reindex_layers"] for m in POOL_METRICS}
        if r["variant"] in sparse:
            assert pool_keys | {"dense_accuracy"} <= set(r)
        else:
            assert not pool_keys & set(r)
    assert set(report["summary"]) == set(variants)
    assert report["summary"][variants[0]]["accuracy"]["n"] == len(config["seeds"])
    assert (out_dir / f"{name}.png").stat().st_size > 10_000
    return report


def test_summary_is_mean_and_sample_std_over_seeds_per_variant():
    records = [
        {"variant": "a", "seed": 0, "accuracy": 0.5, "by_distance": [0.0, None], "note": "x"},
        {"variant": "a", "seed": 1, "accuracy": 1.0, "by_distance": [1.0, None], "note": "y"},
        {"variant": "b", "seed": 0, "accuracy": None},
    ]
    summary = _common.summarize(records)
    std = 0.5**0.5 / 2
    ci95 = stats.t.interval(0.95, 1, loc=0.75, scale=std / 2**0.5)
    assert summary["a"]["accuracy"] == {
        "mean": 0.75,
        "std": pytest.approx(std),
        "ci95": pytest.approx(list(ci95)),
        "n": 2,
    }
    bucket = stats.t.interval(0.95, 1, loc=0.5, scale=0.5**0.5 / 2**0.5)  # of [0.0, 1.0]
    assert summary["a"]["by_distance"]["ci95"] == [pytest.approx(list(bucket)), None]
    assert summary["a"]["by_distance"]["mean"] == [0.5, None]
    assert summary["a"]["by_distance"]["n"] == [2, 0]
    assert "seed" not in summary["a"] and "note" not in summary["a"]
    assert summary["b"] == {}


@pytest.mark.parametrize(
    "script", [block_score_ablation, kv_format_study, pool_size_sweep, main_job_seeds]
)
def test_smoke_outputs_never_go_to_the_results_folder(script):
    with pytest.raises(SystemExit, match="not results"):
        script.main(["--smoke", "--out-dir", str(_common.RESULTS_DIR)])


def test_study_options_reach_the_train_config():
    """A study's recipe options (learning rate, initialization, evaluation) set the base run's
    fields, and what is not given keeps TrainConfig's default."""
    parser = argparse.ArgumentParser()
    _common.add_arguments(parser)
    argv = ["--lr", "1e-3", "--init-from", "runs/x/seed{seed}/short", "--eval-every", "50"]
    base = _common.train_config(parser.parse_args([*argv, "--eval-batches", "8"]))
    assert (base.learning_rate, base.init_from) == (1e-3, "runs/x/seed{seed}/short")
    assert (base.eval_every, base.eval_batches) == (50, 8)
    default = _common.train_config(parser.parse_args([]))
    assert default == train.TrainConfig()


@pytest.mark.slow
def test_block_score_ablation_smoke(tmp_path):
    # Two of the four variants, in the order asked, which is not the file's: the reference
    # ('max', whose paired differences the tables print) and dense. Each is a compilation; the
    # other reducers ('mean', 'top2') run the same script code and are `ops.pool`'s, tested there.
    argv = ["--smoke", "--out-dir", str(tmp_path), "--variants", "dense", "max"]
    block_score_ablation.main(argv)
    report = _check_report(tmp_path, "block_score_ablation", ["dense", "max"], ["max"])
    assert [r["variant"] for r in report["results"]] == ["dense", "max"]


def test_pool_sizes_are_whole_blocks_of_the_source_positions():
    cfg = config_lib.tiny()  # candidate source: layer 3, ratio 1; blocks of 8
    positions = 2048 // cfg.compress_ratios[cfg.candidate_source_layer]
    assert pool_size_sweep.source_positions(cfg, 2048) == positions == 2048
    sizes = pool_size_sweep.pool_sizes(cfg, 2048, (64, 32, 16, 8, 4, 2))
    assert sizes == [positions // (d * 8) for d in (64, 32, 16, 8, 4, 2)]  # 4 ... 128 blocks
    # Fractions below one block round up to one, and equal sizes run once.
    assert pool_size_sweep.pool_sizes(cfg, 64, (64, 32, 16, 8, 4, 2)) == [1, 2, 4]


@pytest.mark.slow
def test_pool_size_sweep_smoke(tmp_path):
    # One pool (4 blocks: half of the 64 positions) beside the dense reference: each size is a
    # compilation; the sizes that fractions give are tested above.
    report = pool_size_sweep.main(["--smoke", "--out-dir", str(tmp_path), "--fractions", "2"])
    variants = [pool_size_sweep.variant_name(4), "dense"]
    _check_report(tmp_path, "pool_size_sweep", variants, variants[:1])
    for r in report["results"]:
        run_cfg = train.TrainConfig.from_json(
            json.loads((Path(r["run_dir"]) / "config.json").read_text())
        )
        if r["variant"] == "dense":
            assert run_cfg.attention == "dense" and "pool_blocks" not in r
        else:  # the run trained with the pool the record names
            assert run_cfg.model_config().candidate_topk_blocks == r["pool_blocks"]
            assert r["pool_fraction"] == r["pool_blocks"] * 8 / 64


@pytest.mark.slow
def test_kv_format_study_smoke_and_ptq_reads_the_trained_parameters(tmp_path):
    kv_format_study.main(["--smoke", "--out-dir", str(tmp_path)])
    variants = ["f32", "qat/nvfp4", "ptq/nvfp4"]
    report = _check_report(tmp_path, "kv_format_study", variants, variants)
    by_variant = {r["variant"]: r for r in report["results"]}
    # The f32 run's parameters read through f32 again reproduce its own evaluation exactly, and
    # through NVFP4 the ptq record: the state transfer moves the trained weights, nothing else.
    run_dir = tmp_path / "runs" / "f32" / "seed0"
    cfg = train.TrainConfig.from_json(json.loads((run_dir / "config.json").read_text()))
    trained = _common.load_model(cfg, run_dir)
    for fmt, variant in (("f32", "f32"), ("nvfp4", "ptq/nvfp4")):
        again = kv_format_study.evaluate_like_run(with_fields(trained, kv_format=fmt), cfg, 2)
        assert again["task_loss"] == by_variant[variant]["task_loss"]
    assert by_variant["ptq/nvfp4"]["task_loss"] != by_variant["f32"]["task_loss"]


def _part(seed: int, **config) -> dict:
    base = {"experiment": "x", "seeds": [seed], "argv": [f"--seeds {seed}"], "runs_dir": f"r{seed}"}
    base |= {"commit": "abc", "train_config": {"steps": 10}} | config
    results = [{"variant": v, "seed": seed, "accuracy": 0.5 + seed / 10} for v in ("max", "mean")]
    return {"config": base, "results": results}


def test_merge_reports_is_the_union_of_the_seeds():
    config, records = merge_reports.merge([_part(1), _part(0)])
    assert config["seeds"] == [0, 1]
    assert [(r["variant"], r["seed"]) for r in records] == [
        ("max", 0),
        ("mean", 0),
        ("max", 1),
        ("mean", 1),
    ]
    summary = _common.summarize(records)
    assert summary["max"]["accuracy"]["n"] == 2
    assert summary["max"]["accuracy"]["mean"] == pytest.approx(0.55)


def test_merge_reports_refuses_parts_that_do_not_belong_together():
    with pytest.raises(ValueError, match=r"reports\[1\]: its config differs .*train_config"):
        merge_reports.merge([_part(0), _part(1, train_config={"steps": 20})])
    with pytest.raises(ValueError, match="variant 'max' of seed 0 appears twice"):
        merge_reports.merge([_part(0), _part(0)])
    with pytest.raises(ValueError, match="at least one report"):
        merge_reports.merge([])


def test_study_table_prints_the_summary_in_the_study_order():
    def record(variant, seed, accuracy, step=400, pool=None):
        r = {"variant": variant, "seed": seed, "step": step, "accuracy": accuracy}
        r["stopped_early"] = step < 400
        r["task_loss"] = 1 - accuracy
        if pool is not None:
            r |= {f"layer4/{m}": pool for m in POOL_METRICS if m != "pool_recall_by_distance"}
            r["dense_accuracy"] = accuracy
        return r

    records = [
        record("ptq/nvfp4", 0, 0.5, pool=0.25),
        record("qat/nvfp4", 0, 1.0, step=300, pool=0.5),
        record("f32", 0, 0.75, pool=0.75),
        record("ptq/nvfp4", 1, 0.25, pool=0.25),
        record("qat/nvfp4", 1, 1.0, pool=0.5),
        record("f32", 1, 0.25, pool=0.75),
        record("dense", 0, 0.5),
    ]
    report = {
        "config": {"reindex_layers": ["layer4"]},
        "results": records,
        "summary": _common.summarize(records),
    }
    lines = study_tables.table(report, study_tables.format_order(["nvfp4"])).splitlines()
    rows = [line.split(" | ") for line in lines[2:6]]
    # Plain variants keep the report's order, then each format's QAT row above its PTQ row.
    assert [row[0].strip("| ") for row in rows] == ["f32", "dense", "qat/nvfp4", "ptq/nvfp4"]
    assert rows[0][1:4] == ["400", "50.0 ± 35.4", "50.0 ± 35.4"]  # mean ± sample std, in %
    assert rows[2][1] == "300–400 (capped)"
    assert rows[2][5] == "50.0 / 50.0 / 50.0 / 50.0"
    assert rows[1][2] == "50.0" and rows[1][3:6] == ["—", "0.500", "—"]  # one seed, no pool
    assert lines[-1].startswith("Per seed (accuracy %, f32 / dense / qat/nvfp4 / ptq/nvfp4): ")
    assert "seed 1 25.0 / 100.0 / 25.0" in lines[-1]


def test_paired_differences_are_taken_on_the_same_seed():
    records = [
        {"variant": "f32", "seed": 0, "accuracy": 0.5, "task_loss": 1.0},
        {"variant": "f32", "seed": 1, "accuracy": 1.0, "task_loss": 0.0},
        {"variant": "ptq/fp8", "seed": 1, "accuracy": 0.75, "task_loss": 0.5},
        {"variant": "ptq/fp8", "seed": 0, "accuracy": 0.75, "task_loss": 0.25},
        {"variant": "qat/fp8", "seed": 2, "accuracy": 1.0, "task_loss": 0.0},  # no f32 to pair
    ]
    lines = study_tables.paired({"results": records}, "f32").splitlines()
    # Differences, seed by seed: accuracy +25 and -25 points, loss -0.75 and +0.5.
    acc = stats.t.ppf(0.975, 1) * stats.tstd([25.0, -25.0]) / 2**0.5
    loss = stats.t.ppf(0.975, 1) * stats.tstd([-0.75, 0.5]) / 2**0.5
    assert lines[2] == (
        f"| ptq/fp8 | +0.0 [{-acc:+.1f}, {acc:+.1f}] | -25.0 … +25.0 "
        f"| -0.1250 [{-0.125 - loss:+.4f}, {-0.125 + loss:+.4f}] | 2 |"
    )
    assert lines[3] == "| qat/fp8 | — (no run of f32 from the same starting weights) | — | — | 0 |"
    one = [r for r in records if r["seed"] != 0]  # one pair: no interval
    assert (
        study_tables.paired({"results": one}, "f32")
        .splitlines()[2]
        .startswith("| ptq/fp8 | -25.0 [—] | -25.0 … -25.0 |")
    )


def test_paired_differences_pair_runs_from_the_same_prefix_instance_only():
    # Seed 0's f32 run started from another training of the prefix than its fp8 run: no pair.
    records = [
        {"variant": "f32", "seed": 0, "accuracy": 0.5, "task_loss": 1.0, "prefix_instance": "a"},
        {"variant": "f32", "seed": 1, "accuracy": 1.0, "task_loss": 0.0, "prefix_instance": "b"},
        {"variant": "fp8", "seed": 0, "accuracy": 0.75, "task_loss": 0.5, "prefix_instance": "b"},
        {"variant": "fp8", "seed": 1, "accuracy": 0.75, "task_loss": 0.5, "prefix_instance": "b"},
    ]
    lines = study_tables.paired({"results": records}, "f32").splitlines()
    assert lines[2] == "| fp8 | -25.0 [—] | -25.0 … -25.0 | +0.5000 [—] | 1 |"


def test_study_tables_reference_option_pairs_against_the_variant_named(
    tmp_path, monkeypatch, capsys
):
    records = [
        {
            "variant": v,
            "seed": s,
            "step": 50,
            "accuracy": a,
            "task_loss": 0.0,
            "evidence_in_pool": e,
        }
        for v, s, a, e in [
            ("max", 0, 0.5, 0.75),
            ("max", 1, 1.0, 0.5),
            ("mean", 0, 0.75, 0.25),
            ("mean", 1, 0.75, 0.0),
            ("top2", 0, 1.0, 0.5),
            ("top2", 1, 0.5, 0.5),
        ]
    ]
    config = {"experiment": "block_score_ablation", "seeds": [0, 1], "device": "cpu"}
    report = {
        "config": {**config, "reference": "max", "reindex_layers": []},
        "results": records,
        "summary": _common.summarize(records),
    }
    path = tmp_path / "report.json"
    path.write_text(json.dumps(report))

    def printed(*argv):
        monkeypatch.setattr("sys.argv", ["study_tables.py", *argv])
        study_tables.main()
        return capsys.readouterr().out

    by_default = printed(str(path))
    assert "Δ accuracy vs max" in by_default and "Δ accuracy vs mean" not in by_default
    lines = printed("--reference", "mean", "--", str(path)).splitlines()
    header = next(i for i, line in enumerate(lines) if "Δ accuracy vs mean" in line)
    rows = {line.split(" | ")[0].strip("| "): line for line in lines[header + 2 : header + 4]}
    assert set(rows) == {"max", "top2"}
    # top2 - mean, seed by seed: accuracy +25 and -25 points; evidence +25 and +50 points.
    half = stats.t.ppf(0.975, 1) * stats.tstd([25.0, 50.0]) / 2**0.5
    assert rows["top2"].startswith("| top2 | +0.0 [")
    assert f"| +37.5 [{37.5 - half:+.1f}, {37.5 + half:+.1f}] | 2 |" in rows["top2"]
    with pytest.raises(SystemExit):
        printed("--reference", "median", "--", str(path))
    assert "--reference: expected one of the variants" in capsys.readouterr().err
    only_paired = printed("--only", "paired", "--", str(path))
    assert "Δ accuracy vs max" in only_paired and "| steps |" not in only_paired
    assert only_paired.startswith(f"{path} (block_score_ablation")
    assert printed("--only", *study_tables.TABLES, "--", str(path)) == by_default


def test_the_tables_printed_in_the_experiments_readme_are_the_scripts_output(capsys, monkeypatch):
    """Every fenced block of experiments/README.md that shows study tables is preceded by the
    commands that print it (`<!-- printed by: python3 experiments/study_tables.py ... -->`, one
    line each, outputs concatenated): the numbers are the committed JSON's, not retyped."""
    monkeypatch.chdir(REPO)  # the commands name the reports from the repository root
    lines = (REPO / "experiments" / "README.md").read_text().splitlines()
    fences = [i for i, line in enumerate(lines) if line.startswith("```")]
    checked = 0
    for start, end in zip(fences[::2], fences[1::2], strict=True):
        commands = []
        above = start - 1
        while above >= 0 and lines[above].startswith("<!-- printed by: "):
            commands.insert(0, lines[above].removeprefix("<!-- printed by: ").removesuffix(" -->"))
            above -= 1
        block = "\n".join(lines[start + 1 : end])
        if not commands:
            assert not block.startswith("experiments/results/"), (
                f"experiments/README.md line {start + 1}: a block of study tables without the "
                "'<!-- printed by: ... -->' line of the command that prints it"
            )
            continue
        printed = []
        for command in commands:
            program, script, *argv = shlex.split(command)  # as a shell would
            assert (program, script) == ("python3", "experiments/study_tables.py"), command
            study_tables.main(argv)
            printed.append(capsys.readouterr().out)
        assert "".join(printed).rstrip("\n") == block, (
            f"experiments/README.md line {start + 1}: the block differs from what {commands} print"
        )
        checked += 1
    assert checked >= 3


def test_through_the_pool_is_the_same_weights_with_a_pool_of_one_block():
    records = [
        {"variant": "max", "seed": 0, "accuracy": 0.9, "pool1_accuracy": 0.5},
        {"variant": "max", "seed": 1, "accuracy": 0.8, "pool1_accuracy": 0.6},
        {"variant": "dense", "seed": 0, "accuracy": 1.0},  # no pool: no row
    ]
    lines = study_tables.through_the_pool({"results": records}).splitlines()
    half = stats.t.ppf(0.975, 1) * stats.tstd([-40.0, -20.0]) / 2**0.5
    assert lines[2:] == [
        f"| max | 85.0 | 55.0 | -30.0 [{-30 - half:+.1f}, {-30 + half:+.1f}] | -40.0 … -20.0 | 2 |"
    ]


def test_intervals_print_the_summarys_mean_and_t_interval():
    records = [
        {"variant": "max", "seed": 0, "accuracy": 0.5, "task_loss": 1.0},
        {"variant": "max", "seed": 1, "accuracy": 1.0, "task_loss": 0.5},
        {"variant": "mean", "seed": 0, "accuracy": 0.25},
    ]
    report = {"results": records, "summary": _common.summarize(records)}
    lines = study_tables.intervals(report, ["accuracy", "task_loss"]).splitlines()
    lo, hi = stats.t.interval(0.95, 1, loc=75.0, scale=stats.tstd([50.0, 100.0]) / 2**0.5)
    loss_lo, loss_hi = stats.t.interval(0.95, 1, loc=0.75, scale=stats.tstd([1.0, 0.5]) / 2**0.5)
    assert lines[2] == (
        f"| max | 75.0 [{lo:.1f}, {hi:.1f}] (2) | 0.7500 [{loss_lo:.4f}, {loss_hi:.4f}] (2) |"
    )
    assert lines[3] == "| mean | 25.0 [—] (1) | — |"


def test_main_job_seeds_target_and_interval():
    records = [
        {"seed": s, "step": 400, "accuracy": a, "dense_accuracy": d, "stopped_early": False}
        for s, (a, d) in enumerate([(0.96, 0.97), (0.99, 1.0), (0.94, 0.94), (0.97, 1.0)])
    ]
    summary = main_job_seeds.target_summary(records)
    assert summary["seeds_meeting_target"] == [0, 1]  # seed 2 below 95 %, seed 3 3 points below
    acc = summary["accuracy"]
    assert acc["n"] == 4 and acc["min"] == 0.94 and abs(acc["mean"] - 0.965) < 1e-12
    lo, hi = acc["ci95"]
    assert lo < 0.94 < 0.99 < hi  # 4 seeds: the t-interval is wider than their range
    assert main_job_seeds.interval([0.5])["ci95"] is None
    table = main_job_seeds.table({"results": records, "target": summary})
    assert table.count("\n") == len(records) + 2 and "| 2/4 |" in table and "100.0%]" in table
    assert summary["pool1_accuracy"] is None and "| +1.0% | — | yes |" in table  # older reports
    for r, one in zip(records, [0.5, 1.0, 0.75, 1.0], strict=True):
        r["pool1_accuracy"] = one
    summary = main_job_seeds.target_summary(records)
    assert summary["pool1_accuracy"]["mean"] == 0.8125
    table = main_job_seeds.table({"results": records, "target": summary})
    assert "| +1.0% | 50.0% | yes |" in table and "| 81.2% [" in table


def test_recipe_sweep_table_counts_seeds_and_steps_to_target():
    from experiments import recipe_sweep

    curves = [{"50": 0.2, "100": 0.96, "150": 1.0}, {"50": 0.1, "100": 0.5, "150": 0.97}]
    curves.append({"50": 0.1, "100": 0.2, "150": 0.9})
    rows = [
        {"variant": "lr5e-3_b2", "seed": s, "accuracy": c["150"], "curve": c}
        for s, c in enumerate(curves)
    ]
    assert [recipe_sweep.steps_to(c, 0.95) for c in curves] == [100, 150, None]
    table = recipe_sweep.table({"results": rows})
    row = table.splitlines()[2]
    assert "learning_rate=0.005, adam_b2=0.95" in row and "| 2/3 |" in row
    assert "| 125 |" in row  # the median of the steps of the seeds that got there (100, 150)
    assert "100% 97% 90%" in row and "95.7% [" in row


def test_long_context_task_smoke_runs_the_curriculum_to_the_convergence_rule(tmp_path, capsys):
    out, runs = tmp_path / "report.json", tmp_path / "runs"
    argv = ["--smoke", "--out", str(out), "--runs-dir", str(runs), "--short-lrs", "5e-3", "1e-3"]
    argv += ["--converge-accuracy", "1e-9", "--short-steps", "50", "--long-steps", "50"]
    assert long_context_task.main(argv) == 0
    report = json.loads(out.read_text())
    assert not report["partial"]
    # Accuracy >= 1e-9 holds once two evaluations in a row get one answer right: every stage
    # does so within a few steps, well before its cap of 50, and the next starts from it.
    assert all(s["summary"]["converged"] for s in report["stages"])
    assert all(s["summary"]["step"] < 50 for s in report["stages"])
    names = [s["stage"] for s in report["stages"]]
    assert names == ["short48-lr0.005", "short48-lr0.001", "short64-lr0.005", "long"] or names == [
        "short48-lr0.005",
        "short48-lr0.001",
        "short64-lr0.001",
        "long",
    ]
    firsts, rung, long = report["stages"][:2], report["stages"][2], report["stages"][3]
    assert all(s["done"] for s in report["stages"])
    # The best first-rung run (by final accuracy; the first on a tie) seeds the next rung, at
    # its learning rate; the last rung seeds the long stage.
    best = max(firsts, key=lambda s: s["summary"]["accuracy"])
    rung_cfg = train.TrainConfig.from_json(rung["train_config"])
    best_cfg = train.TrainConfig.from_json(best["train_config"])
    # init_from names every seed's own run of the chosen stage ({seed}).
    assert rung_cfg.init_from.format(seed=0) == best["run_dir"]
    assert rung_cfg.learning_rate == best_cfg.learning_rate and rung_cfg.attention == "dense"
    assert report["chosen_short"]["run_dir"].format(seed=0) == rung["run_dir"]
    long_cfg = train.TrainConfig.from_json(long["train_config"])
    assert long_cfg.init_from.format(seed=0) == rung["run_dir"]
    assert long_cfg.attention == "sparse"
    lens = [
        train.TrainConfig.from_json(s["train_config"]).make_task().seq_len
        for s in (best, rung, long)
    ]
    assert lens == sorted(set(lens))  # the ladder climbs
    # Run again: every stage is finished, so it only re-evaluates (no step trained twice).
    assert long_context_task.main(argv) == 0
    again = json.loads(out.read_text())
    assert [s["summary"]["resumed_from"] for s in again["stages"]] == [
        s["summary"]["step"] for s in report["stages"]
    ]
    capsys.readouterr()
    assert long_context_task.main(["--table", str(out)]) == 0
    rows = [r for r in capsys.readouterr().out.splitlines() if r.startswith("| ")]
    assert len(rows) == 1 + 4 and "short48-lr0.005" in rows[1] and "| long |" in rows[4]
    totals = [float(r.split("|")[8].split("/")[1]) for r in rows[1:]]
    assert totals == sorted(totals)  # the running total of training seconds


def test_a_stage_record_of_a_seed_stopped_before_its_first_record_has_no_history(tmp_path):
    # The guard can stop a seed after one step, before metrics.jsonl exists (H200, 2026-12-01).
    cfg = train.make_config(preset="tiny")
    record = long_context_task._stage_record("long", cfg, tmp_path, {"step": 1})
    assert record["history"] == [] and not record["done"]
    assert _common.steps_to(tmp_path, 0.9) is None  # the block-score phases read it too


def test_wilson_interval():
    lo, hi = long_context_task.wilson(0.5, 100)
    assert lo == pytest.approx(0.4038, abs=1e-4) and hi == pytest.approx(0.5962, abs=1e-4)
    for p, n in ((0.0, 10), (0.215, 1024), (1.0, 50)):
        lo, hi = long_context_task.wilson(p, n)
        assert 0.0 <= lo <= p <= hi <= 1.0
        wider = long_context_task.wilson(p, n // 4)
        assert wider[0] <= lo and hi <= wider[1]


def _studies_plan(tmp_path, smoke=False, studies=None, phases=(), group_size=1):
    return long_context_studies.Plan(
        argparse.Namespace(
            smoke=smoke,
            seeds=[0, 1],
            group_size=group_size,
            work_dir=tmp_path,
            study=studies or list(long_context_studies.STUDIES),
            phases=list(phases),
        )
    )


def test_long_context_studies_phases_named_run_first_in_their_order(tmp_path):
    default = _studies_plan(tmp_path, studies=["block_score", "pool_size"]).phases
    names = ["ratio4-top2", "ratio16-dense", "ratio2-max"]
    plan = _studies_plan(tmp_path, studies=["block_score", "pool_size"], phases=names)
    assert [p.name for p in plan.phases[:3]] == names
    assert sorted(plan.phases, key=str) == sorted(default, key=str)  # the same phases
    rest = [p for p in default if p.name not in names]
    assert list(plan.phases[3:]) == rest
    with pytest.raises(ValueError, match=r"--phases: expected phases of the studies.*ratio3-max"):
        _studies_plan(tmp_path, studies=["block_score"], phases=["ratio4-max", "ratio3-max"])


def test_long_context_studies_phases_start_sparse_from_their_prefix_with_the_ratio_pool(tmp_path):
    plan = _studies_plan(tmp_path)
    for phase in plan.phases:
        if phase.variant == "ptq":
            continue
        parser = argparse.ArgumentParser()
        _common.add_arguments(parser)
        parser.add_argument("--variants", nargs="+")
        args = parser.parse_args(plan.phase_argv(phase, 5.0))
        cfg = _common.train_config(args)
        model, task = cfg.model_config(), cfg.make_task()
        assert (
            task.seq_len == 4096
            and cfg.dense_warmup_steps == 0
            and args.variants == [phase.variant]
        )
        # 1/ratio of the candidate source's positions, in whole blocks of 8.
        assert model.candidate_topk_blocks * 8 * phase.ratio == 4096
        assert model.kv_format == (phase.kv_format or "nvfp4")
        assert cfg.init_from == str(plan.init_from(phase.prefix_kv))
        assert cfg.converge_accuracy == 0.9 and args.max_minutes == 5.0
        assert args.group_size == 1  # one seed after another, as the committed phases
    grouped = _studies_plan(tmp_path, group_size=2)
    for argv in (grouped.phase_argv(grouped.phases[0], 5.0), grouped.prefix_argv(None, 5.0)):
        assert argv[argv.index("--group-size") + 1] == "2"
    # Every KV-format phase starts from the f32 prefix; the others from the preset's.
    kv = {p.prefix_kv for p in plan.studies["kv_format"]}
    assert kv == {"f32"} and {p.prefix_kv for p in plan.studies["block_score"]} == {None}
    argv = plan.prefix_argv("f32", 3.0)
    assert argv[argv.index("--kv-format") + 1] == "f32" and "--kv-format" not in plan.prefix_argv(
        None, 3.0
    )


def _fake_phase_report(plan, phase, accuracies):
    path = plan.report_path(phase)
    path.parent.mkdir(parents=True, exist_ok=True)
    records = [
        {"variant": phase.variant, "seed": s, "step": 50, "accuracy": a, "task_loss": 1 - a}
        for s, a in zip(plan.seeds, accuracies, strict=False)
    ]
    config = {"experiment": "block_score_ablation", "argv": [phase.name], "commit": "c"}
    path.write_text(json.dumps({"config": config, "results": records}))


def test_long_context_studies_combine_the_phases_into_each_studys_report(tmp_path):
    plan = _studies_plan(tmp_path, studies=["block_score", "pool_size"])
    P = long_context_studies.Phase
    _fake_phase_report(plan, P(16, "max"), [0.9, 0.8])
    _fake_phase_report(plan, P(16, "mean"), [0.7, 0.6])
    _fake_phase_report(plan, P(16, "dense"), [1.0, 1.0])
    _fake_phase_report(plan, P(64, "max"), [0.5])  # one seed of two: not done
    report = long_context_studies.block_score_report(plan, 16)
    assert report["config"]["partial"]  # top2 is missing
    assert set(report["summary"]) == {"max", "mean", "dense"}
    assert report["summary"]["mean"]["accuracy"]["mean"] == pytest.approx(0.65)
    assert report["config"]["pool_blocks"] == 32 and report["config"]["ratio"] == 16
    pool = long_context_studies.pool_size_report(plan)
    by_variant = {r["variant"]: r for r in pool["results"] if r["seed"] == 0}
    assert set(by_variant) == {"pool8", "pool32", "dense"} and pool["config"]["partial"]
    assert by_variant["pool8"]["pool_fraction"] == pytest.approx(1 / 64)
    assert by_variant["pool32"]["pool_blocks"] == 32 and "pool_blocks" not in by_variant["dense"]
    assert not plan.phase_done(P(64, "max")) and plan.phase_done(P(16, "max"))
    assert "ratio64-max: partial" in long_context_studies.status(plan)

    # A fresh machine's work directory, restored from the combined report: the finished
    # phases count as done (and combine to the same records), the unfinished one does not.
    combined = tmp_path / "ratio16.json"
    combined.write_text(json.dumps(report))
    fresh = _studies_plan(tmp_path / "fresh", studies=["block_score", "pool_size"])
    restored = long_context_studies.restore(fresh, combined)
    assert restored == ["ratio16-max", "ratio16-mean", "ratio16-dense"]
    assert all(fresh.phase_done(P(16, v)) for v in ("max", "mean", "dense"))
    again = long_context_studies.block_score_report(fresh, 16)
    assert again["results"] == report["results"] and again["config"]["commit"] == ["c"]
    assert again["config"]["prefix_instances"] == report["config"]["prefix_instances"]
    assert long_context_studies.restore(fresh, combined) == []  # already there: left alone
    with pytest.raises(ValueError, match="--restore: expected a combined report of"):
        long_context_studies.restore(fresh, plan.report_path(P(16, "max")))
    merged = dict(report, config=dict(report["config"], argv=[report["config"]["argv"]]))
    combined.write_text(json.dumps(merged))  # merge_reports.py's form: one argv per report
    with pytest.raises(ValueError, match="3 phases: ratio16-max, ratio16-mean, ratio16-dense"):
        long_context_studies.restore(_studies_plan(tmp_path / "other"), combined)


def test_long_context_studies_pool_size_report_summarizes_each_pool_apart(tmp_path):
    # Two ratios' 'max' phases whose per-distance lists differ in length (the H200 run of
    # 2026-12-02 crashed summarizing them as one variant before naming their pools), from two
    # prefix instances: each record names its pool and its instance.
    plan = _studies_plan(tmp_path, studies=["pool_size"])
    P = long_context_studies.Phase
    for phase, by_distance, instance in (
        (P(16, "max"), [0.5, 0.5, 0.5], "a"),
        (P(64, "max"), [1.0, 0.0], "b"),
    ):
        _fake_phase_report(plan, phase, [0.9, 0.8])
        report = json.loads(plan.report_path(phase).read_text())
        for record in report["results"]:
            record["layer6/pool_recall_by_distance"] = by_distance
        plan.report_path(phase).write_text(json.dumps(report))
        plan.instance_path(phase).write_text(json.dumps(instance))
    pool = long_context_studies.pool_size_report(plan)
    assert set(pool["summary"]) == {"pool8", "pool32"}
    assert pool["summary"]["pool8"]["layer6/pool_recall_by_distance"]["mean"] == [1.0, 0.0]
    assert {(r["variant"], r["prefix_instance"]) for r in pool["results"]} == {
        ("pool32", "a"),
        ("pool8", "b"),
    }


def test_long_context_studies_kv_smoke_trains_from_the_f32_prefix_and_resumes(tmp_path, capsys):
    out, work = tmp_path / "out", tmp_path / "work"
    argv = ["--smoke", "--study", "kv_format", "--seeds", "0"]
    argv += ["--out-dir", str(out), "--work-dir", str(work)]
    assert long_context_studies.main(argv) == 0
    prefix = json.loads((out / "long_context_prefix_kvf32.json").read_text())
    assert not prefix["partial"] and prefix["stages"][-1]["stage"] == "long"
    long_cfg = train.TrainConfig.from_json(prefix["stages"][-1]["train_config"])
    assert long_cfg.attention == "dense" and long_cfg.model_config().kv_format == "f32"
    report = json.loads((out / "kv_format_4k.json").read_text())
    assert (out / "kv_format_4k.png").exists() and not report["config"]["partial"]
    assert set(report["summary"]) == {"f32", "qat/mxfp4", "ptq/mxfp4"}
    by_variant = {r["variant"]: r for r in report["results"]}
    for variant in ("f32", "qat/mxfp4"):
        cfg = train.TrainConfig.from_json(
            json.loads((Path(by_variant[variant]["run_dir"]) / "config.json").read_text())
        )
        assert cfg.init_from.format(seed=0) == prefix["stages"][-1]["run_dir"]
        assert cfg.model_config().kv_format == variant.removeprefix("qat/")
    # Each trained phase keeps seed 0's final pools on one held-out example.
    for variant in ("f32", "qat/mxfp4"):
        snapshot = by_variant[variant]["pool_snapshot"]
        assert snapshot["seed"] == 0 + train.EVAL_SEED_OFFSET and snapshot["queries"]
    assert "pool_snapshot" not in by_variant["ptq/mxfp4"]
    # ... and every trained record its accuracy with a pool of one block.
    assert all(0 <= by_variant[v]["pool1_accuracy"] <= 1 for v in ("f32", "qat/mxfp4"))
    assert "pool1_accuracy" in report["summary"]["f32"]
    # Every phase names the prefix instance it started from: here one for all.
    instances = report["config"]["prefix_instances"]
    assert set(instances) == {"ratio16-max-kvf32", "ratio16-ptq-kvf32", "ratio16-max-kvmxfp4"}
    assert len(set(instances.values())) == 1 and None not in instances.values()
    # PTQ reads the f32 run's final weights.
    assert by_variant["ptq/mxfp4"]["run_dir"] == by_variant["f32"]["run_dir"]
    assert by_variant["ptq/mxfp4"]["step"] == by_variant["f32"]["step"]
    # Run again: every phase is done, so nothing trains and the reports stay as they were.
    before = {p.name: p.read_text() for p in out.glob("*.json")}
    capsys.readouterr()
    assert long_context_studies.main(argv) == 0
    assert "== " not in capsys.readouterr().out
    assert {p.name: p.read_text() for p in out.glob("*.json")} == before


def _session(phases: dict[str, tuple], instance: str | None, **config) -> dict:
    """A long_context_studies pool-size report of one session: `phases` maps a phase to its
    (blocks, accuracies by seed); the config is the first phase's, as `_combined` writes it."""
    first = next(iter(phases.values()))[0]
    base = {
        "experiment": "pool_size_sweep",
        "plan": "experiments/long_context_studies.py",
        "phases": ["ratio64-max", "ratio16-max", "ratio4-max", "ratio16-dense"],
        "seeds": [0, 1],
        "argv": [[name] for name in phases],
        "runs_dir": f"runs/{first}",
        "commit": [f"c{first}"],
        "max_minutes": float(first),
        "distance_edges": sorted({64, first * 8}),
        "prefix_instances": dict.fromkeys(phases, instance),
        "reference": "dense",
        "reindex_layers": ["layer6"],
        "train_config": {
            "preset": "tiny",
            "task": "multi_passkey",
            "steps": 300,
            "model_overrides": {"candidate_topk_blocks": first},
        },
        "source_positions": 4096,
        "device": "cpu",
        "smoke": False,
        "model_config": {"candidate_topk_blocks": first, "window_size": 64},
        "partial": True,
    } | config
    records = [
        {
            "variant": "dense" if name.endswith("dense") else f"pool{blocks}",
            "seed": seed,
            "step": 50,
            "accuracy": accuracy,
            "phase": name,
            "prefix_instance": instance,
        }
        | ({} if name.endswith("dense") else {"pool_fraction": blocks * 8 / 4096})
        for name, (blocks, accuracies) in phases.items()
        for seed, accuracy in enumerate(accuracies)
    ]
    return {"config": base, "results": records}


def test_merge_reports_joins_the_sessions_of_a_study_plan(tmp_path):
    one = _session({"ratio4-max": (128, [0.9, 0.8]), "ratio16-max": (32, [0.7, 0.6])}, "a")
    two = _session({"ratio64-max": (8, [0.5, 0.4])}, None)
    config, records = merge_reports.merge([one, two])
    # The sweep's order (by pool size), each seed's records after it; instances kept.
    assert [(r["variant"], r["seed"], r["prefix_instance"]) for r in records] == [
        ("pool8", 0, None),
        ("pool8", 1, None),
        ("pool32", 0, "a"),
        ("pool32", 1, "a"),
        ("pool128", 0, "a"),
        ("pool128", 1, "a"),
    ]
    assert config["prefix_instances"] == {
        "ratio4-max": "a",
        "ratio16-max": "a",
        "ratio64-max": None,
    }
    assert config["commit"] == ["c128", "c8"] and config["seeds"] == [0, 1]
    assert config["partial"]  # ratio16-dense has no record
    assert config["distance_edges"] is None  # each phase's own: no one value holds
    assert "max_minutes" not in config
    dense = _session({"ratio16-dense": (32, [1.0, 1.0])}, "c")
    assert not merge_reports.merge([one, two, dense])[0]["partial"]
    one_seed = _session({"ratio16-dense": (32, [1.0])}, "c")
    assert merge_reports.merge([one, two, one_seed])[0]["partial"]  # seed 1 is missing
    # Another protocol, or the same phase twice, does not merge.
    steps = dict(one["config"]["train_config"], steps=20)
    other = _session({"ratio64-max": (8, [0.5, 0.4])}, None, train_config=steps)
    with pytest.raises(ValueError, match=r"reports\[1\]: its config differs .*train_config"):
        merge_reports.merge([one, other])
    window = _session({"ratio64-max": (8, [0.5])}, None, model_config={"window_size": 128})
    with pytest.raises(ValueError, match=r"reports\[1\]: its config differs .*model_config"):
        merge_reports.merge([one, window])
    with pytest.raises(ValueError, match="variant 'pool8' of seed 0 appears twice"):
        merge_reports.merge([two, two])
    # The merged table says which rows come from which instance.
    report = {"config": config, "results": records, "summary": _common.summarize(records)}
    assert study_tables.table(report).splitlines()[-1] == (
        "Prefix instances (runs pair only within one; unnamed: a report older than instance "
        "names): pool8 (unnamed), pool32 a, pool128 a."
    )
    one_instance = {"config": config, "results": records[2:]}
    one_instance["summary"] = _common.summarize(records[2:])
    assert "Prefix instances" not in study_tables.table(one_instance)
    # The command writes the JSON and the figure under --name.
    paths = []
    for i, part in enumerate((one, two)):
        paths.append(tmp_path / f"part{i}.json")
        paths[-1].write_text(json.dumps(part))
    merge_reports.main(
        ["pool_size_sweep", *map(str, paths), "--out-dir", str(tmp_path), "--name", "sweep"]
    )
    assert json.loads((tmp_path / "sweep.json").read_text())["summary"]["pool8"]
    assert (tmp_path / "sweep.png").stat().st_size > 0


def test_bench_decode_check_runs_every_op_of_the_step(tmp_path):
    """`bench_decode.py --check` (the CPU form of the decode-step benchmark): it fills a cache
    with random packed rows, runs the XLA step, and runs each op of the step in XLA and with
    the kernels interpreted; the ops it counts cover every attention call and every pooled
    top-k of a step. Timing needs the GPU."""
    from experiments import bench_decode
    from v41jax.nn.config import Role

    out = tmp_path / "decode.json"
    report = bench_decode.main(["--check", "--out", str(out)])
    assert json.loads(out.read_text()) == report
    (entry,) = report["contexts"].values()
    counts = entry["counts"]
    for implementation in ("xla", "pallas_interpret"):
        assert all(entry[implementation][name] == {"ran": True} for name in counts)
    assert entry["xla"]["step"] == {"ran": True}
    layers = bench_decode.bench_config(8, 16).layers
    attention = sum(n for name, n in counts.items() if name.startswith("attention_"))
    assert attention == sum(plan.role is not Role.WINDOW for plan in layers)
    assert counts["pooled_topk"] == sum(plan.role is Role.REINDEX for plan in layers)
    assert counts["source_scan"] + counts["full_scan"] == sum(
        plan.role is Role.FULL for plan in layers
    )


@pytest.mark.parametrize(
    "doc",
    [
        "BENCHMARKS.md",
        *(str(p.relative_to(REPO)) for p in sorted(REPO.glob("pallas_kernels/*/NOTES.md"))),
    ],
)
def test_every_printed_table_in_benchmarks_md_is_what_its_command_prints(doc, capsys, monkeypatch):
    """After each "Printed by `python3 experiments/bench_tables.py ...`" in BENCHMARKS.md (and in
    the kernels' NOTES.md), before the next, stands that command's output on the committed JSON
    today, verbatim: no table retyped, and none left behind when a printer changes."""
    import re

    from experiments import bench_tables

    text = (REPO / doc).read_text()
    found = list(re.finditer(r"Printed by\s+`python3\s+experiments/bench_tables\.py([^`]*)`", text))
    if doc == "BENCHMARKS.md":
        assert len(found) >= 19, len(found)
    monkeypatch.chdir(REPO)
    for i, match in enumerate(found):
        argv = match.group(1)
        if "<" in argv:  # a template (`<new json>`), not a command
            continue
        end = found[i + 1].start() if i + 1 < len(found) else len(text)
        bench_tables.main(shlex.split(argv))
        printed = capsys.readouterr().out.strip()
        assert printed and printed in text[match.end() : end], argv


def test_the_table_printer_imports_no_jax():
    """`bench_tables.py` reads JSON and prints tables: importing it (the register report
    included, `pallas_kernels.registers` → `ptxas`) loads no jax, which took a second and a
    half of every print when the report imported the lowering module for ptxas's path."""
    probe = (
        "import json, sys, experiments.bench_tables; "
        "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 0, done.stderr
    loaded = set(json.loads(done.stdout))
    assert "experiments" in loaded and not loaded & {"jax", "jaxlib"}, sorted(loaded)


def test_the_topk_benchmark_times_the_kernel_at_each_warp_count(monkeypatch):
    """`topk.bench --kernel-warps --kernel-segments --scores distinct`: the kernel alone at each
    warp count and row split it takes, its picks checked against the sort, one table column
    each, the scores' kind in the title (the device timer faked)."""
    from experiments import bench_tables
    from pallas_kernels import timing
    from pallas_kernels.topk import bench as topk_bench

    fake = {"median_ms": 1.0, "mosaic_kernel_ms": 0.5, "runs": 1, "kernels": []}
    monkeypatch.setattr(timing, "measure", lambda fn, datasets, iterations=10: (fake, None))
    report = topk_bench.run(
        shapes={"pool": (64, 8)},
        batch=2,
        digit_bits=(1,),
        n_datasets=1,
        implementation="pallas_interpret",
        kernel_warps=(2, 4),
        kernel_segments=(2, 3),  # 3 is not a split the kernel takes: no entry
        scores="distinct",
        kernel_row_output=True,
    )
    entry = report["shapes"]["pool"]
    labels = ("kernel_1bit_2w", "kernel_1bit_4w", "kernel_1bit_2seg", "kernel_1bit_2seg_rows")
    for label in ("kernel_1bit", *labels):
        assert entry[label]["equal_to_sort"], (label, entry[label])
    assert "kernel_1bit_3seg" not in entry
    table = bench_tables.topk(report)
    header = "| kernel_1bit | kernel_1bit_2seg | kernel_1bit_2seg_rows | kernel_1bit_2w | "
    assert header in table, table
    assert "(batch 2; distinct normal scores, as a full pool's):" in table, table


def test_bench_tables_print_what_the_kernel_and_decode_benchmarks_write(monkeypatch):
    """BENCHMARKS.md's tables of the top-k, the source scan and the decode step read the keys
    their benchmarks write: the benchmarks run on the CPU at toy sizes with the device timer
    replaced by one that returns 1, 2, 3 ... ms (CUPTI needs a GPU), and the tables print
    those figures and the ratios the benchmarks derive from them."""
    import itertools

    from experiments import bench_decode, bench_tables
    from pallas_kernels import timing
    from pallas_kernels.pooled_scoring import bench as pooled_bench
    from pallas_kernels.source_scan import bench as scan_bench
    from pallas_kernels.topk import bench as topk_bench

    clock = itertools.count(1)

    def fake_timing():
        ms = float(next(clock))
        kernels = [{"name": "mosaic", "ms": ms / 2}, {"name": "tiny", "ms": 0.001}]
        return {"median_ms": ms, "mosaic_kernel_ms": ms / 2, "runs": 1, "kernels": kernels}

    monkeypatch.setattr(
        timing, "measure", lambda fn, datasets, iterations=10: (fake_timing(), None)
    )
    monkeypatch.setattr(timing, "measure_chain", lambda step, state, steps: (fake_timing(), state))
    monkeypatch.setenv("V41JAX_COMMIT", "c0ffee1")  # every report names the code it timed

    picks = topk_bench.run(
        shapes={"pool": (64, 8)},
        batch=2,
        digit_bits=(4,),
        n_datasets=1,
        implementation="pallas_interpret",
    )
    table = bench_tables.topk(picks)
    assert "| blocks | radix_4bit | kernel_4bit |" in table, table
    assert "| pool | 64 | 8 | 1.000 ms | 2.000 ms | 3.000 ms | 4.000 ms | 0.5× | True |" in table

    scan = scan_bench.run(contexts=(64,), batch=2, n_heads=2, n_datasets=1, copy_gbps=1e3)
    table = bench_tables.source_scan(scan)
    entry = scan["contexts"]["64"]
    speedup = entry["xla_scan"]["median_ms"] / entry["pallas_route"]["median_ms"]
    assert f"| 64 | 5.000 ms | 6.000 ms | {speedup:.1f}× | 7.000 ms | 9.000 ms (" in table, table
    assert "| 8.000 ms (" in table and "| 14.000 ms | 15.000 ms |" in table, table
    assert "A ragged batch at 64 (lengths spread evenly over (0, S]): route, max 11.000 ms; " \
        "kernel block maxima 12.000 ms, with the ids listed 13.000 ms." in table, table  # fmt: skip
    assert "with the blocks' ids read from memory (`every_block`'s, as a pool hands them): " \
        "10.000 ms (" in table, table  # fmt: skip
    assert table.endswith(
        "Route, max, at 64: its kernels of 5 µs or more, in launch order: mosaic 3000.0 µs."
    ), table

    pooled = pooled_bench.run(
        contexts=(64,), batch=2, n_blocks=4, topk=8, n_heads=2, n_datasets=1, copy_gbps=1e3
    )
    table = bench_tables.pooled_scoring(pooled)
    e = pooled["contexts"]["64"]
    assert (
        f"| 64 | {e['full_scan_topk']['median_ms']:.3f} ms | {e['xla_pool_topk']['median_ms']:.3f}"
        f" ms | {e['pallas_topk']['median_ms']:.3f} ms | {e['pallas_scores']['median_ms']:.4f} ms"
    ) in table, table
    assert f"| {e['speedup_vs_full_scan_topk']:.0f}× |" in table, table
    for kernel_report in (picks, scan, pooled):
        assert kernel_report["commit"] == "c0ffee1", kernel_report.keys()

    argv = ["--contexts", "320", "--batch", "2", "--steps", "1", "--pool-blocks", "8"]
    report = bench_decode.main([*argv, "--index-topk", "16"])
    table = bench_tables.decode(report)
    for implementation in ("xla", "pallas"):
        e = report["contexts"]["320"][implementation]
        assert e["rest_ms"] == e["step"]["median_ms"] - sum(e["per_step_ms"].values())
        assert f"| {implementation} | {e['step']['median_ms']:.3f} ms |" in table, table
        assert f"| {e['indexer_stack_over_source_scan']:.2f} |" in table, table


def test_bench_kernels_resumes_a_report_part_by_part(monkeypatch, tmp_path, capsys):
    """`bench_kernels.py --parts ... --resume` adds parts to the report at --out and keeps the
    others, each part with the commit it was measured at (BENCHMARKS.md's table names both);
    a report of another device, or none, is refused by name."""
    from experiments import _common, bench_kernels, bench_tables
    from pallas_kernels import timing

    monkeypatch.setattr(timing, "copy_ceiling", lambda: {"GBps": 4000.0, "bytes": 2**31})
    monkeypatch.setattr(timing, "matmul_ceiling", lambda iterations: {"TFLOPs": 800.0, "n": 8192})
    out = tmp_path / "report.json"
    environment = {"jax": "x", "device": "H200", "commit": "aaaa"}
    monkeypatch.setattr(_common, "environment", lambda: dict(environment))
    first = bench_kernels.main(["--out", str(out), "--parts", "copy"])
    assert "matmul" not in first and first["commits"] == {"copy": "aaaa"}
    environment["commit"] = "bbbb"
    second = bench_kernels.main(["--out", str(out), "--parts", "matmul", "--resume"])
    assert second["copy"] == first["copy"] and second["matmul"]["TFLOPs"] == 800.0
    assert second["commits"] == {"copy": "aaaa", "matmul": "bbbb"}
    assert json.loads(out.read_text())["commits"] == second["commits"]
    assert bench_tables._commits(second) == "Commits aaaa (copy); bbbb (matmul)"
    assert bench_tables._commits(first) == "Commit aaaa"

    environment["device"] = "H100"
    with pytest.raises(SystemExit):
        bench_kernels.main(["--out", str(out), "--parts", "matmul", "--resume"])
    assert "measured on 'H200', this machine is 'H100'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench_kernels.main(["--out", str(tmp_path / "none.json"), "--parts", "copy", "--resume"])
    assert "--resume: no report at --out" in capsys.readouterr().err


def test_the_targets_table_reads_each_target_from_its_report_and_says_whether_it_is_met(tmp_path):
    """`bench_tables --targets`: each of issue 16's targets from the last report of its kind,
    met or not against its bound in the right direction (a speed-up at least, a time at
    most), a kind not given named as missing, a report of no known kind refused by name."""
    from experiments import bench_tables

    def timing(ms, share=None):
        out = {"median_ms": ms, "mosaic_kernel_ms": ms, "min_ms": ms, "max_ms": ms, "runs": 1}
        return out | ({"kernel_fraction_of_copy": share} if share is not None else {})

    million = "1048576"
    scan = {"contexts": {million: {
        "pallas_route": timing(2.4), "xla_scan": timing(72.0),
        "speedup_route_vs_xla_scan": 30.0, "pallas_block_max": timing(2.2, 0.61),
    }}}  # fmt: skip
    slower = {
        "contexts": {million: scan["contexts"][million] | {"speedup_route_vs_xla_scan": 29.9}}
    }
    pooled = {
        "contexts": {million: {"pallas_topk": timing(0.0901), "pallas_scores": timing(0.05, 0.5)}}
    }
    decode = {
        "contexts": {
            million: {"counts": {}, "batch": 32, "pallas": {"indexer_stack_over_source_scan": 1.3}}
        }
    }
    paths = [tmp_path / f"{name}.json" for name in ("scan", "slower", "pooled", "decode")]
    table = bench_tables.targets([scan, slower, pooled, decode], paths)
    rows = {line.split(" | ")[0].lstrip("| "): line for line in table.splitlines()[2:]}
    assert len(rows) == len(bench_tables.TARGETS), table
    assert "| 29.9× (route 2.400 ms against 72.000 ms) | no | `slower.json` |" in table, table
    assert "| 61% (block maxima 2.200 ms) | yes | `slower.json` |" in table, table
    assert "| 90.1 µs (median of 1 calls, 90.1–90.1) | no | `pooled.json` |" in table, table
    assert "| 50% (kernel 50.0 µs) | yes | `pooled.json` |" in table, table
    assert "| 1.30× (batch 32) | yes | `decode.json` |" in table, table
    assert table.count("| no attention report given | — | — |") == 2, table
    with pytest.raises(ValueError, match=r"paths: .*other\.json is not a source-scan"):
        bench_tables.targets([{"contexts": {}}], [tmp_path / "other.json"])
    # A combined run's parts count as the reports they are: here its scan (met) comes after
    # the slower one, and its attention part is read.
    attention = {"results": [], "speedups": {}}
    combined = {"copy": {}, "source_scan": scan, "sparse_attention": attention}
    paths = [*paths[1:], tmp_path / "combined.json"]
    table = bench_tables.targets([slower, pooled, decode, combined], paths)
    assert "| 30.0× (route 2.400 ms against 72.000 ms) | yes | `combined.json` |" in table, table
    assert table.count("| — | — | `combined.json` |") == 2, table  # no attention entries
    assert "`pooled.json`" in table and "`slower.json`" not in table, table
    with pytest.raises(ValueError, match=r"paths: .*other\.json is not a source-scan"):
        bench_tables.targets([{"copy": {}, "source_scan": {}}], [tmp_path / "other.json"])
    # Issue 16's targets are the H200's: a figure from another card names it, on a part's
    # device or its combined report's, and a note under the table says why.
    combined |= {"device": "NVIDIA H100 80GB HBM3"}
    on_h200 = pooled | {"device": "NVIDIA H200"}
    table = bench_tables.targets([combined, on_h200], [tmp_path / "c.json", tmp_path / "p.json"])
    assert "| 30.0× (route 2.400 ms against 72.000 ms) | yes (H100) | `c.json` |" in table, table
    assert "| 90.1 µs (median of 1 calls, 90.1–90.1) | no | `p.json` |" in table, table
    assert table.endswith("the share of that card's ceiling."), table
    assert "(H100)" not in bench_tables.targets([on_h200], [tmp_path / "p.json"])


def test_a_context_the_benchmark_could_not_run_is_printed_with_its_error():
    """A context whose benchmark failed (`{"error": repr(exception)}`: a 1 M cache on an 80 GB
    card runs out of memory) is a row that says so, in the pooled and the source-scan tables,
    and the targets read at 1 M say why they have no figure; the other contexts print as
    before (the notes below the tables come from the longest context measured)."""
    from experiments import bench_tables

    error = repr(RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 16GiB"))
    million = {"1048576": {"n_pos": 1048576, "error": error}}
    scan = {
        "sizes": {"batch": 64, "topk_blocks": 2048, "index_topk": 512},
        "heads": 32, "dim": 128,
        "contexts": {"65536": {"xla_scan": {"median_ms": 5.0}, "pallas_route": {
            "median_ms": 0.25, "kernels": [{"name": "scan", "ms": 0.2}]}}} | million,
    }  # fmt: skip
    table = bench_tables.source_scan(scan)
    assert "| 1M | error: RESOURCE_EXHAUSTED: Out of memory while trying to allocate 16GiB |" \
        in table, table  # fmt: skip
    assert "| 64K | 5.000 ms | 0.250 ms |" in table, table
    assert table.endswith("at 64K: its kernels of 5 µs or more, in launch order: scan 200.0 µs.")

    timing = {"median_ms": 0.09, "mosaic_kernel_ms": 0.05, "kernel_GBps": 1.5e3,
              "kernel_fraction_of_copy": 0.5, "kernels": [{"name": "k", "ms": 0.05}]}  # fmt: skip
    measured = {"full_scan_topk": timing, "xla_pool_topk": timing, "pallas_topk": timing,
                "pallas_scores": timing, "speedup_vs_full_scan_topk": 1.0,
                "speedup_vs_xla_pool_topk": 1.0}  # fmt: skip
    pooled = {"contexts": {"65536": measured} | million}
    table = bench_tables.pooled_scoring(pooled)
    assert "| 1M | error: RESOURCE_EXHAUSTED: Out of memory" in table, table
    assert "| 64K | 0.090 ms |" in table and "top-k at 64K, its longest" in table, table

    rows = bench_tables.targets([scan, pooled], [Path("scan.json"), Path("pooled.json")])
    assert rows.count("| — (1 M: error: RESOURCE_EXHAUSTED: Out of memory") == 4, rows

    # A route that failed where the others ran (the XLA full scan's scores at 1 M on an 80 GB
    # card): its cells say so, the ratio against it is left out, a note names the error.
    pooled["contexts"]["1048576"] = measured | {"full_scan_topk": {"error": error}}
    del pooled["contexts"]["1048576"]["speedup_vs_full_scan_topk"]
    table = bench_tables.pooled_scoring(pooled)
    assert "| 1M | error | 0.090 ms | 0.090 ms | 0.0900 ms | 0.0500 ms |" in table, table
    assert "= 50% | — | 1.00× |" in table, table
    assert "Not measured: full_scan_topk at 1M, error: RESOURCE_EXHAUSTED: Out of memory" \
        in table, table  # fmt: skip
    rows = bench_tables.targets([pooled], [Path("pooled.json")])
    assert "| 90.0 µs | yes |" in rows and "| 50% (kernel 50.0 µs) | yes |" in rows, rows
    del pooled["contexts"]["1048576"]
    rows = bench_tables.targets([pooled], [Path("pooled.json")])
    assert rows.count("| — (1 M not run) | — | `pooled.json` |") == 2, rows


def test_attention_runs_pair_each_variant_with_its_own_runs_default():
    """`bench_tables --attention-runs`: one column per run (the Mosaic kernel's median over the
    run's calls, the call), the median over runs, and each variant's difference to the default
    of the same run, of the kernel and of the whole call (the variant here spends 3 µs less
    outside its kernel); a row the runs could not time is named below the table with its
    error; a row whose longest kernel is not the Mosaic one is refused."""
    from experiments import bench_tables

    def run(default_us, variant_us):
        def row(label, us):
            return {
                "batch": 8,
                "implementation": label,
                "time_us": us + (5.0 if label == "pallas_mgpu" else 2.0),
                "longest_kernel_us": us,
                # The last call only: its Mosaic time differs from the median over calls.
                "kernels_us": [["input_fusion", 1.0], ["anonymous_mosaic_gpu_kernel", us + 0.3]],
            }

        rows = [row("pallas_mgpu", default_us), row("pallas_mgpu[fast]", variant_us)]
        rows.append({"batch": 8, "implementation": "xla_packed", "time_us": 99.0})
        return {"device": "GPU X", "results": rows}

    reports = [run(10.0, 9.0), run(12.0, 10.5), run(11.0, 11.5)]
    table = bench_tables.attention_runs(reports, [Path(f"r{i}.json") for i in range(3)])
    assert "Runs: (1) `r0.json`, (2) `r1.json`, (3) `r2.json`." in table
    assert "| 8 | pallas_mgpu | 10.00 (15.00) | 12.00 (17.00) | 11.00 (16.00) | 11.00 |  |" in table
    assert (
        "| 8 | pallas_mgpu[fast] | 9.00 (11.00) | 10.50 (12.50) | 11.50 (13.50) | 10.50 " in table
    )
    assert "| -1.00 (-1.50 … +0.50) | -4.00 (-4.50 … -2.50) |" in table
    assert "xla_packed" not in table and "Not timed" not in table
    # A variant that did not compile in two runs is named with its error, not left out.
    for i in (0, 2):
        failed = {"batch": 8, "implementation": "pallas_mgpu[big]", "error": "E: ptxas\nmore"}
        reports[i]["results"].append(failed)
    table = bench_tables.attention_runs(reports, [Path(f"r{i}.json") for i in range(3)])
    assert table.endswith("Not timed: pallas_mgpu[big] at batch 8, runs (1), (3): E: ptxas")
    reports[1]["results"][0]["kernels_us"][0][1] = 50.0  # an XLA op outlasts the kernel
    with pytest.raises(ValueError, match=r"batch 8 pallas_mgpu: .*got 'input_fusion'"):
        bench_tables.attention_runs(reports, [Path(f"r{i}.json") for i in range(3)])


def test_attention_versions_pair_each_run_after_with_the_run_before():
    """`bench_tables --attention-runs AFTER... --against BEFORE...`: per batch and label both
    versions timed, each version's median and the differences after − before paired run by
    run, of the kernel and of the whole call; unequal run counts are refused by name."""
    from experiments import bench_tables

    def run(us: float, call_extra: float) -> dict:
        row = {
            "batch": 64,
            "implementation": "pallas_mgpu",
            "time_us": us + call_extra,
            "longest_kernel_us": us,
            "kernels_us": [["input_fusion", 1.0], ["mosaic_gpu_kernel", us]],
        }
        only_before = row | {"batch": 32}
        return {"device": "GPU X", "results": [row, only_before]}

    before = [run(30.0, 1.0), run(31.0, 1.0), run(29.0, 1.0)]
    after = [run(29.5, 1.0), run(29.0, 2.0), run(29.2, 0.5)]
    paths = [Path(f"b{i}.json") for i in range(3)], [Path(f"a{i}.json") for i in range(3)]
    table = bench_tables.attention_versions(before, after, *paths)
    assert "Pairs: (1) `b0.json` then `a0.json`, (2) `b1.json` then `a1.json`" in table, table
    # Kernel deltas -0.5, -2.0, +0.2; whole-call deltas -0.5, -1.0, -0.3.
    assert "| 64 | pallas_mgpu | 30.00 | 29.20 | -0.50 (-2.00 … +0.20) | -0.50 (-1.00 … -0.30) |" \
        in table, table  # fmt: skip
    del after[1]["results"][1]  # batch 32 only in some runs of one version: no row
    table = bench_tables.attention_versions(before, after, *paths)
    assert "| 32 |" not in table, table
    with pytest.raises(ValueError, match="expected as many runs before as after"):
        bench_tables.attention_versions(before, after[:2], paths[0], paths[1][:2])


def test_decode_versions_pair_each_step_after_with_the_step_before():
    """`bench_tables --decode AFTER... --against BEFORE...`: per context and implementation both
    versions timed, each version's median step, the differences after − before paired run by
    run, tokens/s and the rest at the lower median run, and the step's device copies; a
    context or implementation that some run lacks gets no row; unequal run counts are refused."""
    from experiments import bench_tables

    def run(step_ms: float, copies: int, commit: str) -> dict:
        kernels = [{"name": "memcpy", "ms": 0.002}] * copies + [{"name": "fusion", "ms": 1.0}]
        entry = {
            "step": {"median_ms": step_ms, "kernels": kernels},
            "tokens_per_s": 64 / (step_ms / 1e3),
            "rest_ms": step_ms - 1.0,
        }
        contexts = {"65536": {"batch": 64, "pallas": entry, "xla": {"step": {"error": "OOM"}}}}
        return {"device": "GPU X", "commit": commit, "contexts": contexts}

    before = [run(2.2, 177, "old"), run(2.3, 177, "old")]
    after = [run(1.8, 1, "new"), run(1.85, 1, "new")]
    paths = [Path("b0.json"), Path("b1.json")], [Path("a0.json"), Path("a1.json")]
    table = bench_tables.decode_versions(before, after, *paths)
    assert "Commits: before old; after new." in table, table
    # Step deltas -0.40 and -0.45; lower median runs: 2.2 (29,091 tokens/s) and 1.8 (35,556).
    assert "| 64K | 64 | pallas | 2.250 | 1.825 | -0.425 (-0.450 … -0.400) | 29,091 | 35,556 | " \
        "1.200 | 0.800 | 177 (354.0 µs) | 1 (2.0 µs) |" in table, table  # fmt: skip
    assert "| xla |" not in table, table  # not timed
    del after[1]["contexts"]["65536"]["pallas"]
    assert "| pallas |" not in bench_tables.decode_versions(before, after, *paths)
    with pytest.raises(ValueError, match="expected as many runs before as after"):
        bench_tables.decode_versions(before, after[:1], paths[0], paths[1][:1])


def test_step_kernels_group_a_steps_kernels_by_kind():
    """`bench_tables --step-kernels`: a decode step's kernels grouped by their name without
    XLA's numbering, largest first, with the kinds past `shown` summed in one row; an
    implementation whose step did not run is left out."""
    from experiments import bench_tables

    kernels = [
        {"name": "gemm_fusion_dot.3", "ms": 0.004},
        {"name": "gemm_fusion_dot.12", "ms": 0.005},
        {"name": "topk_radix_select__2", "ms": 0.02},
        {"name": "loop_add_fusion_1", "ms": 0.001},
    ]
    report = {
        "commit": "abc",
        "device": "GPU X",
        "contexts": {
            "65536": {"batch": 64, "pallas": {"step": {"kernels": kernels}}, "xla": {"step": {}}}
        },
    }
    table = bench_tables.step_kernels(report, shown=2)
    assert "64K tokens, batch 64, pallas: 4 kernels, 0.030 ms:" in table, table
    rows = [ln for ln in table.splitlines() if ln.startswith("| ") and not ln.startswith("| kind")]
    assert rows == [
        "| topk_radix_select | 1 | 20.0 | 66.7% |",
        "| gemm_fusion_dot | 2 | 9.0 | 30.0% |",
        "| 1 other kinds | 1 | 1.0 | 3.3% |",
    ], table
    assert "xla" not in table, table


def test_bench_tables_refuses_against_without_a_kind_of_run_to_pair(capsys):
    """`--against` pairs attention or decode runs; with neither it would have printed the
    paths as kernel reports, the pairing silently dropped. It is refused by name."""
    from experiments import bench_tables

    with pytest.raises(SystemExit):
        bench_tables.main(["a.json", "--against", "b.json"])
    assert "--against: pairs runs of --attention-runs or --decode" in capsys.readouterr().err
