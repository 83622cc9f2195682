"""The test harness's own premise (tests/conftest.py): compiled CPU programs hold memory
mappings until jax's caches release them, and `jax.clear_caches()` does release them."""

import gc
import sys

import jax
import jax.numpy as jnp
import pytest

from tests.conftest import MAP_BUDGET, memory_mappings


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_clearing_the_caches_releases_the_mappings_of_compiled_programs():
    assert MAP_BUDGET is not None and MAP_BUDGET > 0
    jax.clear_caches()
    gc.collect()
    before = memory_mappings()
    programs = [jax.jit(lambda x, i=i: jnp.tanh(x * i) @ x.T + i) for i in range(16)]
    for f in programs:
        f(jnp.ones((4, 4))).block_until_ready()
    compiled = memory_mappings()
    assert compiled - before >= 16, (before, compiled)  # each program maps memory of its own
    jax.clear_caches()
    gc.collect()
    assert memory_mappings() - before < (compiled - before) / 4, (before, compiled)
