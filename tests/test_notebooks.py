"""Every notebook executes end to end at smoke size (DESIGN §1: notebooks are executed in CI).

Each `notebooks/*.py` (jupytext py:percent) is converted to a notebook in memory and run cell by
cell with nbclient on a kernel of this interpreter, with `V41JAX_SMOKE=1`; any cell error fails
the test. Executed copies go to pytest's temporary directory, never into the repository.
"""

import json
import os
import sys
from pathlib import Path

import pytest

jupytext = pytest.importorskip("jupytext")
nbclient = pytest.importorskip("nbclient")
nbformat = pytest.importorskip("nbformat")
from jupyter_client.kernelspec import KernelSpecManager  # noqa: E402
from jupyter_client.manager import KernelManager  # noqa: E402

from v41jax import train  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.py"))
TIMEOUT_S = 300  # per cell; a smoke run takes well under that
KERNEL = "v41jax-test"
# Notebooks that train a model: over a minute each on 2 CPU cores, mostly XLA compilation.
TRAINING = {"02_candidate_pool", "03_training"}


@pytest.fixture(scope="session")
def kernel_dir(tmp_path_factory) -> Path:
    """A kernelspec that runs this interpreter (the venv's python, whatever is on PATH)."""
    kernels = tmp_path_factory.mktemp("kernels")
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "v41jax test kernel",
        "language": "python",
    }
    (kernels / KERNEL).mkdir()
    (kernels / KERNEL / "kernel.json").write_text(json.dumps(spec))
    return kernels


@pytest.fixture(scope="session")
def compile_cache(tmp_path_factory) -> Path:
    """One JAX compilation cache for the session: the training notebooks compile the same
    smoke-size train step, so the second one loads it instead of compiling it again. It is the
    suite's own (tests/conftest.py), shared by both xdist workers, where there is one."""
    shared = os.environ.get("JAX_COMPILATION_CACHE_DIR")
    return Path(shared) if shared else tmp_path_factory.mktemp("jax_compilation_cache")


@pytest.fixture
def smoke_env(monkeypatch, tmp_path, compile_cache):
    """The kernel inherits this process's environment; its temporary files (the notebooks' run
    directories) go to the test's `tmp_path`."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setenv("V41JAX_SMOKE", "1")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(compile_cache))
    monkeypatch.delenv("V41JAX_RUN_DIR", raising=False)
    monkeypatch.delenv("V41JAX_RESULTS_DIR", raising=False)
    return monkeypatch


def execute(source: Path, workdir: Path, kernel_dir: Path) -> None:
    """Runs the notebook of `source` in `workdir`; raises `CellExecutionError` on a failed cell.
    The executed notebook is kept in `workdir` for inspection."""
    nb = jupytext.read(source)
    manager = KernelManager(
        kernel_name=KERNEL, kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(kernel_dir)])
    )
    client = nbclient.NotebookClient(
        nb, km=manager, timeout=TIMEOUT_S, resources={"metadata": {"path": str(workdir)}}
    )
    try:
        client.execute()
    finally:
        nbformat.write(nb, workdir / f"{source.stem}.ipynb")


def test_notebooks_found():
    assert {"01_formats", "02_candidate_pool", "03_training"} <= {p.stem for p in NOTEBOOKS}
    for path in NOTEBOOKS:
        text = path.read_text()
        assert text.startswith("# ---\n# jupyter:\n#   jupytext:"), f"{path.name}: no header"
        assert 'os.environ.get("V41JAX_SMOKE", "0") == "1"' in text, f"{path.name}: no SMOKE"


@pytest.mark.parametrize(
    "source",
    [pytest.param(p, marks=[pytest.mark.slow] if p.stem in TRAINING else []) for p in NOTEBOOKS],
    ids=[p.stem for p in NOTEBOOKS],
)
def test_notebook_executes(source, tmp_path, kernel_dir, smoke_env):
    execute(source, tmp_path, kernel_dir)


def _fake_run(run_dir: Path) -> None:
    """A run directory as `train.run` writes it, with made-up numbers (nothing is trained)."""
    cfg = train.TrainConfig(steps=100, dense_warmup_steps=20, eval_every=50)
    run_dir.mkdir()
    (run_dir / "config.json").write_text(json.dumps(cfg.to_json()))
    lines = []
    for step in range(10, 101, 10):
        progress = step / 100
        lines.append(
            {
                "step": step,
                "split": "train",
                "loss": 3 - 2 * progress,
                "task_loss": 2.5 - 2 * progress,
                "indexer_kl": 0.5 - 0.4 * progress,
                "accuracy": progress,
                "grad_norm": 1.0,
            }
        )
        if step % 50 == 0:
            record = {"step": step, "split": "eval", "task_loss": 1.0, "accuracy": progress}
            record["accuracy_by_distance"] = [1.0, None, progress]
            for layer in ("layer4", "layer6"):
                for suffix, value in (("", 0.9), ("_random", 0.5), ("_recent", 0.6)):
                    record[f"{layer}/pool_recall{suffix}"] = value * progress
                record[f"{layer}/pool_recall_oracle"] = 0.95
                record[f"{layer}/pool_recall_by_distance"] = [1.0, 0.8, None]
                record[f"{layer}/mass_selected"] = 0.6
                record[f"{layer}/mass_pool"] = 0.8
            lines.append(record)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    summary = {"step": 100, "accuracy": 0.9, "dense_accuracy": 0.95, "dense_task_loss": 0.2}
    (run_dir / "summary.json").write_text(json.dumps(summary))


def _fake_results(results_dir: Path) -> None:
    """Ablation reports as experiments/ writes them ({"config", "results", "summary"}, records
    holding `train.run`'s result keys), with gaps the notebook must tolerate."""
    results_dir.mkdir()
    block_score = []
    for variant in ("max", "mean", "dense"):
        for seed in (0, 1, 2):
            record = {"variant": variant, "seed": seed, "run_dir": "runs/x", "step": 100}
            record |= {"accuracy": 0.8 + 0.05 * seed, "dense_accuracy": 0.9, "task_loss": 0.5}
            if variant != "dense":
                for layer in ("layer4", "layer6"):
                    record[f"{layer}/pool_recall"] = 0.7 + 0.01 * seed
                    for suffix in ("_random", "_recent", "_oracle"):
                        record[f"{layer}/pool_recall{suffix}"] = 0.5
                    record[f"{layer}/pool_recall_by_distance"] = [1.0, None, 0.5]
            block_score.append(record)
    block_score[0].pop("layer4/pool_recall")
    block_score[1]["accuracy"] = None
    report = {"config": {}, "results": block_score, "summary": {}}
    (results_dir / "block_score_ablation.json").write_text(json.dumps(report))
    # The simpler format the notebook was first written against: a plain 'pool_recall'.
    kv_format = [
        {"variant": f"{mode}/{fmt}", "seed": 0, "accuracy": 0.5, "pool_recall": 0.6}
        for fmt in ("nvfp4", "fp8")
        for mode in ("qat", "ptq")
    ]
    (results_dir / "kv_format_study.json").write_text(json.dumps({"results": kv_format}))


def test_training_notebook_reads_a_given_run(tmp_path, kernel_dir, smoke_env):
    """03 with V41JAX_RUN_DIR (no training) and ablation results present."""
    _fake_run(tmp_path / "run")
    _fake_results(tmp_path / "results")
    smoke_env.setenv("V41JAX_RUN_DIR", str(tmp_path / "run"))
    smoke_env.setenv("V41JAX_RESULTS_DIR", str(tmp_path / "results"))
    execute(ROOT / "notebooks" / "03_training.py", tmp_path, kernel_dir)


@pytest.mark.slow
def test_pool_notebook_reads_a_given_run_of_another_task(tmp_path, kernel_dir, smoke_env):
    """02 with V41JAX_RUN_DIR: no training, the run's own model and task (here multi_passkey,
    whose example has several answers and no needle depth)."""
    run_dir = tmp_path / "given" / "run"
    cfg = train.TrainConfig.smoke(task="multi_passkey")
    train.run(cfg, run_dir, progress=False)
    smoke_env.setenv("V41JAX_RUN_DIR", str(run_dir))
    execute(ROOT / "notebooks" / "02_candidate_pool.py", tmp_path, kernel_dir)
    nb = nbformat.read(tmp_path / "02_candidate_pool.ipynb", as_version=4)
    printed = "".join(
        o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
    )
    assert f"reading the run in {run_dir}" in printed and "multi_passkey" in printed
