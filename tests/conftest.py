"""Shared test settings: the hypothesis profiles of the property and fuzz tests.

'ci' (the default) keeps every property test within CI's budget on two cores; 'long'
(`HYPOTHESIS_PROFILE=long python -m pytest tests/test_fuzz.py`) runs many more examples, for a
long run or the H200. Tests that set `max_examples` themselves keep their own.
"""

import atexit
import gc
import os
import shutil
import tempfile
from pathlib import Path

from tests import _xla_env

# Before jax starts (its configuration reads the environment when imported); xdist workers
# start after this ran in the controller and inherit it, so they share one cache directory.
if _xla_env.cpu_only() and os.environ.get("V41JAX_TEST_XLA_OPT") != "1":
    _flags = os.environ.get("XLA_FLAGS", "").split()
    _flags += [f for f in _xla_env.FAST_COMPILE if f not in _flags]
    os.environ["XLA_FLAGS"] = " ".join(_flags)
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache = tempfile.mkdtemp(prefix="v41jax-tests-jax-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
    # Every program, the small ones too: a process started later (an xdist worker's subprocess,
    # a notebook's kernel, a CLI run) loads the eager ops' programs that another compiled. A
    # training smoke run a second time in a fresh process took 36.6 s with every program cached
    # against 40.3 s with those over 0.5 s only (2026-12-06, one run each).
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)

import jax
import pytest
from hypothesis import HealthCheck, settings

# Before any test starts the GPU backend: the device timer keeps conditionals out of CUDA graphs,
# whose kernels CUPTI does not time (its docstring), for the GPU tests that time.
from pallas_kernels import timing  # noqa: F401

settings.register_profile(
    "ci", max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "long", max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# tests/multidevice needs 8 devices in its own process: tests/test_multidevice.py starts it with
# 8 simulated CPU devices (and V41JAX_MULTIDEVICE=1); a normal run does not collect it.
collect_ignore = [] if os.environ.get("V41JAX_MULTIDEVICE") == "1" else ["multidevice"]

# The longest items first: pytest-xdist hands items out in collection order, and an 8-device
# subprocess (several minutes on one worker) collected last would leave the other worker idle
# at the end. Started first, it runs beside everything else.
LONGEST_FIRST = (
    "tests/test_multidevice.py::test_the_multidevice_tests_pass_on_8_simulated_cpu_devices[the-rest]",
    "tests/test_multidevice.py::test_the_multidevice_tests_pass_on_8_simulated_cpu_devices[data-parallel]",
    "tests/test_multidevice.py::test_a_data_parallel_run_across_two_processes_equals_one_device",
)


def pytest_collection_modifyitems(config, items):
    rank = {nodeid: i for i, nodeid in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid, len(rank)))


# Every program XLA compiles for the CPU keeps its JIT-compiled code in memory mappings of its
# own, about a thousand for a train step of the test models, until jax's caches let it go. A
# worker that runs hundreds of tests reaches Linux's limit on mappings per process
# (vm.max_map_count, 65,530 by default): the next compilation fails, and unwinding the C++
# exception that reports it crashes the worker (SIGSEGV in `_Unwind_Find_FDE`; a core dump of a
# crashed xdist worker held 65,104 mappings). So when a test leaves the process past 3/4 of the
# limit, the compiled programs are released; later tests compile theirs again.
MAPS, MAX_MAPS = Path("/proc/self/maps"), Path("/proc/sys/vm/max_map_count")
MAP_BUDGET = int(MAX_MAPS.read_text()) * 3 // 4 if MAX_MAPS.exists() else None


def memory_mappings() -> int:
    with MAPS.open("rb") as maps:
        return sum(1 for _ in maps)


@pytest.fixture(autouse=True)
def release_compiled_programs_near_the_mapping_limit():
    yield
    if MAP_BUDGET is not None and memory_mappings() > MAP_BUDGET:
        jax.clear_caches()
        gc.collect()
