"""The device timer's bookkeeping (`pallas_kernels.timing`): what it makes of the kernels each
call launched, and that a benchmark's failed timing is recorded, not raised. The timing itself
needs CUPTI on a GPU (the benchmarks)."""

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import timing


def test_summary_of_the_timed_calls():
    calls = [
        [("fusion", 1.0), ("mosaic_gpu_kernel", 2.0)],
        [("fusion", 4.0)],
        [("mosaic_gpu_kernel", 0.5), ("sort", 0.25)],
    ]
    got = timing._summary(calls)
    assert got["times_ms"] == [3.0, 4.0, 0.75]
    assert (got["median_ms"], got["min_ms"], got["max_ms"], got["runs"]) == (3.0, 0.75, 4.0, 3)
    assert got["longest_kernel_ms"] == 2.0  # median of 2.0, 4.0 and 0.5
    assert got["mosaic_kernel_ms"] == 0.5  # median of 2.0, 0.0 and 0.5
    assert got["kernels"] == [
        {"name": "mosaic_gpu_kernel", "ms": 0.5},
        {"name": "sort", "ms": 0.25},
    ]
    assert "mosaic_kernel_ms" not in timing._summary([[("fusion", 1.0)]])


@pytest.mark.parametrize(
    "untimed",
    [("set_case_condition", 0.002), ("topk_radix_select", 0.0)],
    ids=["graph_conditional", "zero_ms_kernel"],
)
def test_a_call_with_untimed_kernels_is_refused(untimed):
    calls = [[("fusion", 1.0)], [("fusion", 1.0), untimed]]
    with pytest.raises(RuntimeError, match=f"did not time 1 of the call's 2 kernels.*{untimed[0]}"):
        timing._summary(calls)


def test_importing_the_timer_keeps_conditionals_out_of_cuda_graphs():
    import os

    assert timing.NO_GRAPH_CONDITIONALS in os.environ["XLA_FLAGS"]


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="times on a GPU")
def test_a_failed_timing_is_recorded_not_raised():
    entry = {}
    timing.record(entry, "op", lambda x: x + 1, [(jax.numpy.ones(4),)], 2)
    assert set(entry["op"]) == {"error", "trace"}


def _donating_step():
    """A step that donates its state, as `decode_step(donate_cache=True)` does: a second call on
    the same input finds it deleted (on the CPU as on the GPU)."""
    return jax.jit(lambda state: state + 1.0, donate_argnums=0)


def test_the_chain_hands_each_state_to_the_step_once(monkeypatch):
    def one_call(fn, *args):  # the CUPTI timer's stand-in: one call, one fake kernel
        return jax.block_until_ready(fn(*args)), [("fusion", 1.0)]

    monkeypatch.setattr(timing, "time_one_call", one_call)
    got, state = timing.measure_chain(_donating_step(), jax.numpy.zeros(4), steps=3, warmup=2)
    assert got["runs"] == 3 and got["times_ms"] == [1.0, 1.0, 1.0]
    assert state.tolist() == [5.0] * 4  # 2 warm-up steps + 3 timed, each once


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU as jax's default backend")
def test_the_chain_times_a_donating_step_gpu():
    got, state = timing.measure_chain(_donating_step(), jax.numpy.zeros(1 << 20), steps=3)
    assert got["runs"] == 3 and all(ms > 0 for ms in got["times_ms"])
    assert float(state[0]) == 4.0


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU as jax's default backend")
def test_a_conditional_branch_is_timed_gpu():
    """The source-scan route's guard is a `lax.cond`: the branch it takes must be in the sum
    (on 2026-12-04, inside a CUDA graph, CUPTI gave its kernels 0 ms)."""

    def guarded(x):
        return jax.lax.cond(jnp.all(x < jnp.inf), lambda x: jnp.sort(x)[::-1], jnp.sort, x)

    x = jax.random.normal(jax.random.key(0), (1 << 22,))
    got, out = timing.measure(guarded, [(x,)], iterations=3)
    assert got["runs"] == 3
    assert any("sort" in k["name"] and k["ms"] > 0 for k in got["kernels"]), got["kernels"]
    assert float(out[0]) == float(x.max())


def test_every_profile_of_ncu_sh_is_a_command_line_the_profiler_driver_takes(capsys):
    """`scripts/ncu.sh` names its profiles as `pallas_kernels.profile` command lines: each one
    parses (target, attention variant), and a wrong one is refused by name."""
    import re
    from pathlib import Path

    from pallas_kernels import profile

    script = (Path(__file__).resolve().parent.parent / "scripts" / "ncu.sh").read_text()
    entries = dict(re.findall(r'^\s+\[(\w+)\]="([^"]*)"$', script, re.MULTILINE))
    assert {"attention_b128", "pooled", "scan"} <= set(entries), entries
    for name, command in entries.items():
        args = profile.parse(command.split())
        assert args.target in profile.TARGETS and name.startswith(args.target), (name, command)
    default_names = re.search(r"names=\((attention_b128[^)]*)\)", script).group(1).split()
    assert set(default_names) == set(entries)
    for bad, message in (
        (["attention", "--variant", "fastest"], "--variant: expected one of"),
        (["scan", "--variant", "behind_pv"], "--variant: only for 'attention'"),
        (["pooled", "--calls", "0"], "--calls: expected >= 1, got 0"),
    ):
        with pytest.raises(SystemExit):
            profile.parse(bad)
        assert message in capsys.readouterr().err
