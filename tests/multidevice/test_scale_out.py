"""`experiments/scale_out.py` (issue 15 item 5) end to end on 2 of the 8 simulated devices, at
tiny sizes: what the two-GPU machine will run, checked here for its machinery (the figures of
CPU devices mean nothing)."""

import json
import math

import jax

from experiments import scale_out

if jax.device_count() < 8:
    raise RuntimeError(
        "tests/multidevice needs 8 devices: run it through tests/test_multidevice.py"
    )


def test_scale_out_measures_the_scan_and_context_parallelism_on_two_devices(tmp_path, capsys):
    out = tmp_path / "scale_out.json"
    # The smoke model (tiny() on four layers): 128 tokens plan ~7.0 MiB on one device, 256
    # tokens ~10.7 MiB: a device of 9 MiB usable holds 128.
    # Data parallelism is the training step on a data mesh (tests/multidevice/test_data_parallel)
    # timed as context parallelism is here: left out to save the suite a minute.
    argv = ["--smoke", "--parts", "scan", "cp", "--steps", "1", "--cp-start", "128"]
    argv += ["--cp-max", "512", "--memory-gib", str(9 / 1024 / 0.9), "--scan-context", "2048"]
    assert scale_out.main([*argv, "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    cp, scan = report["cp"], report["scan"]
    assert "dp" not in report
    assert report["config"]["model_changes"]["n_layers"] == 4
    # The ladder stops at the first context that does not fit; N devices train twice the last
    # that did, each planning less than the one device would for it.
    assert [r["seq_len"] for r in cp["one_device_ladder"]] == [128, 256]
    assert cp["longest_one"] == 128 and cp["sharded"]["seq_len"] == 256
    assert cp["sharded"]["mesh"] == {"data": 1, "context": 2}
    assert cp["sharded"]["planned_gib_per_device"] < cp["one_device_ladder"][1]["planned_gib"]
    assert cp["one"]["devices"] == 1 and cp["sharded"]["devices"] == 2
    assert all(math.isfinite(r["final_loss"]) for r in (cp["one"], cp["sharded"]))
    # The sharded scan reads twice the positions and picks the one-device pool.
    assert scan["sharded"]["context"] == 2 * scan["one"]["context"] and scan["pool_equal"]
    assert "| decode candidate scan" in scale_out.table(report)
    capsys.readouterr()
    assert scale_out.main(["--print", str(out)]) == 0
    assert "| context parallel, batch 1, query_chunk 64 | longest 128 tokens" in (
        capsys.readouterr().out
    )
