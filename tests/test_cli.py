"""The `v41jax` command: `bytes` prints the seed's tables, `--json` the same numbers."""

import json
import os
import subprocess
import sys

import pytest

from v41jax import cli

SEED_NUMBERS = (
    "890 B",
    "720",
    "170",
    "432 B",
    "102 B",
    "288 B",
    "68 B",
    "3,514 B",
    "3,157 B",
    "357 B",
    "1,630 B",
    "÷ 2.16",
    "÷ 1.83",
    "3.4 GiB",
    "0.87 GiB",
    "2,703,360 B ≈ 2.7 MB",
    "29 entries/token",
    "10,324 B ≈ 10 kB per token",
    "11.6× V4.1-Flash",
    "4,096",
    "2.8·10¹⁰",
    "1.1·10¹⁰",
    "62 %",
    "6.7·10⁷",
    "1/64",
    "4.2·10⁷",
)


def run(capsys, *argv) -> str:
    assert cli.main(list(argv)) == 0
    return capsys.readouterr().out


def test_bytes_prints_the_seed_numbers(capsys):
    out = run(capsys, "bytes")
    missing = [n for n in SEED_NUMBERS if n not in out]
    assert not missing, out


def test_alias_report_runs_bytes(capsys):
    assert run(capsys, "report") == run(capsys, "bytes")


def test_bare_command_runs_train_with_its_defaults(monkeypatch):
    seen = []
    monkeypatch.setattr(cli, "_train", lambda args: seen.append(args) or 0)
    assert cli.main([]) == 0
    (args,) = seen
    assert args.command == "train" and args.max_minutes is None and args.task is None


def test_help_says_train_is_the_default(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--help"])
    assert exit_info.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "bytes (report)" in out and "Without a command, runs `train`" in out


def test_train_help_lists_the_switches(capsys):
    with pytest.raises(SystemExit):
        cli.main(["train", "--help"])
    out = capsys.readouterr().out
    for flag in (
        "--preset",
        "--task",
        "--steps",
        "--kv-format",
        "--block-score",
        "--seed",
        "--out",
    ):
        assert flag in out


def test_train_rejects_bad_values(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["train", "--kv-format", "fp4"])
    assert exit_info.value.code == 2
    assert "--kv-format" in capsys.readouterr().err


def test_json(capsys):
    data = json.loads(run(capsys, "bytes", "--json"))
    v41 = data["presets"]["v41_flash"]
    assert data["context"] == 2**20
    assert v41["kv_bytes_per_token"]["total_bytes"] == 890
    assert data["presets"]["v4_flash"]["kv_bytes_per_token"]["main_bytes"] == 3157.25
    assert [s["total_bytes"] for s in data["storage_steps"]] == [3514.25, 1630, 890]
    assert v41["indexer"]["reindex_with_pool"] == 4 * 16384 * 4096


def test_context(capsys):
    data = json.loads(run(capsys, "bytes", "--json", "--context", "64K"))
    assert data["context"] == 65536
    indexer = data["presets"]["v41_flash"]["indexer"]
    assert indexer["pool_layer_fraction"] == 0.25
    assert "65,536 (64K)" in run(capsys, "bytes", "--context", "65536")


def test_preset_tiny(capsys):
    out = run(capsys, "bytes", "--preset", "tiny", "--per-layer")
    assert out.startswith("tiny: global KV per token")
    assert "every layer" in out and "Reindex" in out
    data = json.loads(run(capsys, "bytes", "--preset", "tiny", "--json"))
    assert list(data["presets"]) == ["tiny"]


@pytest.mark.parametrize("name", ["small", "v41_flash", "v4_flash"])
def test_other_presets(capsys, name):
    assert run(capsys, "bytes", "--preset", name, "--per-layer")


@pytest.mark.parametrize("value", ["lots", "0", "1.5M"])
def test_bad_context_is_a_usage_error(capsys, value):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bytes", "--context", value])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--context" in err and "such as 65536, 64K or 1M" in err


def test_unknown_preset_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bytes", "--preset", "huge"])
    assert exit_info.value.code == 2
    assert "tiny" in capsys.readouterr().err


def test_python_m_v41jax():
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    done = subprocess.run(
        [sys.executable, "-m", "v41jax", "bytes"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "890 B" in done.stdout


def test_params_counts_toy_and_real_stacks(capsys):
    assert cli.main(["params", "--json"]) == 0
    counts = json.loads(capsys.readouterr().out)
    assert set(counts) == {"tiny", "small", "v41_flash"}
    for c in counts.values():
        assert c["total"] == c["attention"] + c["ffn"] + c["embed_and_head"]
        assert c["attention"] == sum(v for k, v in c.items() if k.startswith("attention/"))
    real = counts["v41_flash"]
    # 40 layers of V4.1-Flash attention: ~5.1e9 parameters, which matches the 4.80 GiB of
    # attention weights in the checkpoint (`v41_architecture.md` §8) at about one byte each.
    assert 4.5e9 < real["attention"] < 5.5e9
    assert set(k for k in real if k.startswith("attention/")) == {
        "attention/window",
        "attention/full",
        "attention/reindex",
        "attention/reuse",
    }
    assert cli.main(["params", "--preset", "tiny"]) == 0
    assert "attention/reindex" in capsys.readouterr().out


def test_model_set_reaches_the_run_and_named_options_win(monkeypatch, tmp_path):
    """`--model-set kv_format=...` was dropped when `--kv-format` was not given (the unset
    option's None replaced it): the run trained the preset's format, silently."""
    from v41jax import train

    seen = []

    def fake_run(cfg, out, **kwargs):
        seen.append(cfg)
        raise KeyboardInterrupt  # stop before any training

    monkeypatch.setattr(train, "run", fake_run)
    out = ["--out", str(tmp_path / "run")]
    changes = ["--model-set", "kv_format=mxfp4", "--model-set", "block_score=mean"]
    assert cli.main(["train", *out, *changes]) == 130
    assert dict(seen[-1].model_overrides) == {"kv_format": "mxfp4", "block_score": "mean"}
    assert cli.main(["train", *out, *changes, "--kv-format", "fp8"]) == 130
    assert dict(seen[-1].model_overrides)["kv_format"] == "fp8"
    assert cli.main(["train", *out, "--model-set", "kv_format=fp4"]) == 2


@pytest.mark.parametrize(
    ("text", "seeds"),
    [("0-4", (0, 1, 2, 3, 4)), ("0,2,5", (0, 2, 5)), ("0-2,7", (0, 1, 2, 7)), ("3", (3,))],
)
def test_seeds_spec(text, seeds):
    assert cli.parse_seeds(text) == seeds


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "expected seeds as N, N-M"),
        ("4-2", "N <= M"),
        ("-1", "integers >= 0"),
        ("a,b", "got 'a,b'"),
        ("0-2,1", "[1] more than once"),
    ],
)
def test_bad_seeds_are_usage_errors(capsys, text, message):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["train", "--seeds", text])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--seeds" in err and message in err


def test_seeds_train_one_group_through_run_seeds(monkeypatch, tmp_path, capsys):
    from v41jax import train

    seen = []

    def fake_run_seeds(cfgs, out, **kwargs):
        seen.append((cfgs, out, kwargs))
        raise KeyboardInterrupt  # stop before any training

    monkeypatch.setattr(train, "run_seeds", fake_run_seeds)
    argv = ["train", "--seeds", "0-2", "--lr", "0.003", "--group-size", "2"]
    assert cli.main([*argv, "--out", str(tmp_path / "g")]) == 130
    cfgs, out, kwargs = seen[-1]
    assert [c.seed for c in cfgs] == [0, 1, 2] and {c.learning_rate for c in cfgs} == {0.003}
    assert cfgs[1] == cfgs[0].replace(seed=1)
    assert out == str(tmp_path / "g") and kwargs["group_size"] == 2
    assert "seeds {0, 1}, {2}" in capsys.readouterr().out
    monkeypatch.chdir(tmp_path)
    assert cli.main(["train", "--seeds", "0-4"]) == 130
    assert seen[-1][1] == "runs/tiny-passkey-sparse-seeds0-4" and seen[-1][2]["group_size"] is None
    assert cli.main(["train", "--seeds", "0,3"]) == 130
    assert seen[-1][1] == "runs/tiny-passkey-sparse-seeds0,3"


def test_seeds_option_errors(capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["train", "--seeds", "0-2", "--seed", "1"])
    assert exit_info.value.code == 2 and "not allowed with argument" in capsys.readouterr().err
    assert cli.main(["train", "--group-size", "2"]) == 2
    assert "--group-size: expected --seeds with it" in capsys.readouterr().err
    assert cli.main(["train", "--seeds", "0-1", "--resume", "--out", str(tmp_path)]) == 2
    assert "no seed's run in" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["train", "--seeds", "0-1", "--group-size", "0"])
    assert "expected an integer >= 1, got '0'" in capsys.readouterr().err


def test_bytes_devices_prints_the_sharded_traffic(capsys):
    out = run(capsys, "bytes", "--devices", "8")
    assert "sharded by position over 8 devices" in out and "train: reduce-scatter" in out
    assert "candidate source" in out.split("sharded by position")[1]
    out = run(capsys, "bytes", "--preset", "tiny", "--context", "64K", "--devices", "2")
    assert "tiny: bytes one device receives" in out
