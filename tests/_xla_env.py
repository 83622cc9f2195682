"""How the test processes compile (set up by tests/conftest.py before jax starts; subprocesses
inherit it through the environment).

The test models are tiny: a test's time is XLA compiling, not running. On a CPU-only machine the
suite therefore compiles with LLVM's optimizer off (`FAST_COMPILE`), which cut a training test's
time by about a third (114 s to 73 s for three tests of tests/test_train.py on 2 cores). The
programs are the same programs with the same IEEE float semantics (XLA's CPU fast-math stays
off); what changes is how the machine code is scheduled, so results may move at the last bit
where an operation's rounding differs (e.g. a multiply-add fused or not). What users run compiles
at XLA's default level; `V41JAX_TEST_XLA_OPT=1` runs the suite that way too.

Each session also shares one persistent compilation cache among its processes (the xdist
workers and the subprocesses of the CLI, fuzz, notebook and multi-device tests), so a program
one process compiled loads in the others. Both together, with tests/multidevice split in two
items: the whole suite (`pytest -n 2`) took 1,285 s instead of 1,877 s on this project's 2-core
workplace (2026-12-02, the same checkout, one run each).
"""

import os
import shutil

FAST_COMPILE = ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true")


def cpu_only() -> bool:
    return os.environ.get("JAX_PLATFORMS") == "cpu" or shutil.which("nvidia-smi") is None
