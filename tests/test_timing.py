"""The device timer's bookkeeping (`pallas_kernels.timing`): what it makes of the kernels each
call launched, and that a benchmark's failed timing is recorded, not raised. The timing itself
needs CUPTI on a GPU (the benchmarks)."""

import jax
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


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="times on a GPU")
def test_a_failed_timing_is_recorded_not_raised():
    entry = {}
    timing.record(entry, "op", lambda x: x + 1, [(jax.numpy.ones(4),)], 2)
    assert set(entry["op"]) == {"error", "trace"}
