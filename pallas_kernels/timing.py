"""The one device timer of the project's benchmarks, and the two ceilings (DESIGN §6).

`measure` times a function with CUPTI (`jax.experimental.mosaic.gpu.profiler.measure`, what jax's
own Hopper kernels use): GPU time summed over every kernel a call launches, the small XLA ops
around a Pallas kernel included, after a warm-up call, over `iterations` calls on each of several
fresh data sets. Host timers around `block_until_ready` add tens of microseconds of dispatch and
overstate small kernels 2–5× (DESIGN §6): never use them for kernels.

`copy_ceiling` and `matmul_ceiling` are the two numbers every kernel figure is read against.
GPU only: CUPTI is not available on the CPU.

CUPTI does not time the kernels of a conditional that XLA records into a CUDA graph (a
`lax.cond`, such as the source-scan route's guard): they come back at 0 ms, and back-to-back
calls report them out of order (the H200, 2026-12-04). Importing this module therefore asks XLA
to run conditionals from the host (`NO_GRAPH_CONDITIONALS` in XLA_FLAGS, read when the GPU
backend starts), and every timing refuses a call that reports a 0 ms kernel or a graph
conditional, rather than summing a time that leaves kernels out.
"""

from __future__ import annotations

import json
import os
import statistics
import traceback
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

NO_GRAPH_CONDITIONALS = "--xla_gpu_enable_command_buffer=-CONDITIONAL,-WHILE"
if NO_GRAPH_CONDITIONALS not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {NO_GRAPH_CONDITIONALS}".strip()
# The kernel XLA launches to pick a graph conditional's branch (its branches go untimed).
_GRAPH_CONDITIONAL = "set_case_condition"


def measure(fn: Callable, datasets: Sequence[tuple], iterations: int = 10) -> tuple[dict, object]:
    """Device time of `fn(*args)` for every `args` in `datasets`.

    Args:
      fn: the function (jitted here unless it already is).
      datasets: argument tuples, each a fresh random data set.
      iterations: timed calls per data set, after one warm-up call.

    Returns:
      (timing, the output of the last call). timing: 'median_ms', 'min_ms', 'max_ms' over all
      calls, 'runs', 'times_ms' (every call), 'longest_kernel_ms' (median over calls of the
      call's longest kernel), 'kernels' (name and ms of each kernel of the last call), and
      'mosaic_kernel_ms' (median of the Mosaic GPU kernels' share) when the call launches any.
    """
    from jax.experimental.mosaic.gpu import profiler  # needs the CUDA build of jaxlib

    fn = fn if hasattr(fn, "lower") else jax.jit(fn)
    calls, out = [], None
    for args in datasets:
        out, per_call = profiler.measure(fn, iterations=iterations, aggregate=False)(*args)
        if per_call is None:
            raise RuntimeError("measure: the function launched no GPU kernel")
        if iterations == 1:  # profiler.measure drops the per-call level for a single call
            per_call = [per_call]
        calls += per_call
    return _summary(calls), out


def _summary(calls: list[list[tuple[str, float]]]) -> dict:
    """`measure`'s timing dict from the (kernel name, ms) list of every timed call.

    Raises:
      RuntimeError: a call reported a graph conditional or a 0 ms kernel (kernels CUPTI did not
        time; the module docstring says why, and how it is avoided)."""
    for kernels in calls:
        untimed = [name for name, ms in kernels if ms <= 0 or name == _GRAPH_CONDITIONAL]
        if untimed:
            raise RuntimeError(
                f"measure: CUPTI did not time {len(untimed)} of the call's {len(kernels)} "
                f"kernels ({', '.join(sorted(set(untimed))[:4])}): a conditional or loop ran "
                f"inside a CUDA graph. Start the process with XLA_FLAGS containing "
                f"{NO_GRAPH_CONDITIONALS!r} (importing pallas_kernels.timing before the GPU "
                f"backend starts does it)."
            )
    totals = [sum(ms for _, ms in kernels) for kernels in calls]
    longest = [max(ms for _, ms in kernels) for kernels in calls]
    mosaic = [sum(ms for name, ms in kernels if "mosaic_gpu" in name) for kernels in calls]
    timing = {
        "median_ms": statistics.median(totals),
        "min_ms": min(totals),
        "max_ms": max(totals),
        "runs": len(totals),
        "times_ms": totals,
        "longest_kernel_ms": statistics.median(longest),
        "kernels": [{"name": name[:80], "ms": ms} for name, ms in calls[-1]],
    }
    if any(mosaic):  # the Pallas kernel alone, without the small XLA ops around it
        timing["mosaic_kernel_ms"] = statistics.median(mosaic)
    return timing


def measure_chain(step: Callable, state, steps: int, warmup: int = 1) -> tuple[dict, object]:
    """Device time of `steps` chained calls `state = step(state)`, each timed on its own, after
    `warmup` untimed ones (compilation): for a step that donates its input, such as a decode
    step writing its cache in place. Each state goes to `step` exactly once: `measure` (and
    `profiler.measure` under it) calls a function twice on the same arguments, a warm-up and the
    timed call, and the second call of a donating step finds its input deleted (the decode
    bench's first H200 run, 2026-12-04).

    Returns (timing with `measure`'s keys, without 'mosaic_kernel_ms' unless a Mosaic GPU kernel
    ran, the state after the last step).
    """
    for _ in range(warmup):
        state = jax.block_until_ready(step(state))
    calls = []
    for _ in range(steps):
        state, kernels = time_one_call(step, state)
        if not kernels:
            raise RuntimeError("measure_chain: the step launched no GPU kernel")
        calls.append(kernels)
    return _summary(calls), state


def time_one_call(fn: Callable, *args) -> tuple[object, list[tuple[str, float]]]:
    """(`fn(*args)`, the (kernel name, ms) of every kernel that one call launched), by CUPTI,
    with no warm-up call: `profiler.measure` without its warm-up, through the same extension
    (jax 0.11.2's `_cupti_init` / `_cupti_get_timings`, the pinned version's private API)."""
    from jax._src.lib import mosaic_gpu as mosaic_gpu_lib  # the CUDA build of jaxlib

    ext = mosaic_gpu_lib._mosaic_gpu_ext
    ext._cupti_init()
    try:
        out = jax.block_until_ready(fn(*args))
    finally:
        kernels = ext._cupti_get_timings(True)
    return out, list(kernels or [])


def record(
    entry: dict,
    name: str,
    fn: Callable,
    datasets: Sequence[tuple],
    iterations: int,
    *,
    n_bytes: int | None = None,
    copy_gbps: float | None = None,
) -> None:
    """`measure(fn, datasets, iterations)` into `entry[name]`, with the achieved bandwidth where
    `n_bytes` (the bytes that must move) is given: 'GBps' and 'fraction_of_copy' (of
    `copy_gbps`), and 'kernel_GBps' / 'kernel_fraction_of_copy' over the Mosaic GPU kernels'
    share when the call launches any. A failure is recorded as {'error', 'trace'}, not raised,
    so the figures timed before it survive."""
    try:
        result, _ = measure(fn, datasets, iterations)
        if n_bytes:
            result["GBps"] = n_bytes / result["median_ms"] / 1e6
            result["fraction_of_copy"] = result["GBps"] / copy_gbps
            if "mosaic_kernel_ms" in result:
                result["kernel_GBps"] = n_bytes / result["mosaic_kernel_ms"] / 1e6
                result["kernel_fraction_of_copy"] = result["kernel_GBps"] / copy_gbps
        entry[name] = result
    except Exception as e:
        entry[name] = {"error": repr(e), "trace": traceback.format_exc()[-2000:]}


def json_writer(path: str | None) -> Callable[[dict], None]:
    """A benchmark's `progress` callback: writes the (partial) result as JSON to `path` each
    time it is called, so a run cut short keeps what it timed; does nothing when `path` is
    None."""

    def save(result: dict) -> None:
        if path:
            with open(path, "w") as f:
                json.dump(result, f, indent=1)

    return save


def copy_ceiling(n_bytes: int = 2**30, iterations: int = 10) -> dict:
    """The copy ceiling: an elementwise pass over `n_bytes` of float32 (2·x), bytes read +
    written over the time (DESIGN §6 measured 3.36 TB/s this way)."""
    x = jax.random.normal(jax.random.key(0), (n_bytes // 4,), jnp.float32)
    timing, _ = measure(lambda x: 2 * x, [(x,)], iterations)
    return {"bytes": 2 * n_bytes, **timing, "GBps": 2 * n_bytes / timing["median_ms"] / 1e6}


def matmul_ceiling(n: int = 8192, iterations: int = 10) -> dict:
    """The bf16 matmul ceiling: an n³ product on random data (DESIGN §6: 811 TFLOP/s at 8192³)."""
    ka, kb = jax.random.split(jax.random.key(1))
    a = jax.random.normal(ka, (n, n), jnp.bfloat16)
    b = jax.random.normal(kb, (n, n), jnp.bfloat16)
    timing, _ = measure(jnp.matmul, [(a, b)], iterations)
    return {"n": n, **timing, "TFLOPs": 2 * n**3 / timing["median_ms"] / 1e9}
