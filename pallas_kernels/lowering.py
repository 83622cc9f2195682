"""Lower a function for an NVIDIA GPU on any host, the CPU included: the check that a kernel's
Pallas program is one its GPU backend can express, before a GPU is at hand.

Pallas turns a kernel into Triton IR or the Mosaic GPU dialect in Python, at lowering time,
with the target's compute capability taken from the device, or from an abstract device when
one is set (`jax.sharding.AbstractDevice`). So `lower_for_gpu` on a CPU-only machine runs the
same lowering rules a GPU run would, and a kernel that uses an op or a type combination its
backend cannot lower fails here, in CI, with the error the GPU would give (the radix-select
kernel's first H200 run, 2026-12-03, failed in exactly this step: an int32 add of a boolean).

What it cannot check: the Triton and ptxas compiles that follow on a GPU (register and
shared-memory limits), and the results. Those stay the GPU tests' (`-m gpu`). One part of the
ptxas compile it can reach: the inline PTX programs a Mosaic GPU kernel writes by hand
(`recording_inline_ptx` collects them while a kernel lowers, `assemble_inline_ptx` runs each
through ptxas for sm_90a where ptxas is on PATH), so a misspelt instruction or operand fails
on the CPU rather than at the kernel's first GPU run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import sys
from collections.abc import Callable, Iterator
from typing import Any

import jax
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jaxlib.mlir import ir

from pallas_kernels import ptxas

DEVICE_KIND = "NVIDIA H200"
"""The project's GPU (DESIGN: Hopper, sm_90a), as its devices name their kind."""

CUSTOM_CALLS = {"triton": "__gpu$xla.gpu.triton", "mosaic_gpu": "mosaic_gpu"}
"""The custom-call target (a prefix: Mosaic GPU's carries a version, `mosaic_gpu_v2`) that a
lowered module holds for a Pallas kernel of each GPU backend."""


def lower_for_gpu(
    fn: Callable[..., Any], *args: Any, device_kind: str = DEVICE_KIND, **kwargs: Any
) -> jax.stages.Lowered:
    """`jax.jit(fn).trace(*args, **kwargs).lower(...)` for CUDA, with `device_kind` as the
    abstract device that the Pallas GPU backends read their target from. `args` may be arrays
    or `jax.ShapeDtypeStruct`s; nothing is compiled or run. Raises what the lowering raises."""
    device = jax.sharding.AbstractDevice(device_kind=device_kind, num_cores=None, platform="gpu")
    mesh = jax.sharding.AbstractMesh((1,), ("lowering",), abstract_device=device)
    with jax.sharding.use_abstract_mesh(mesh):
        return jax.jit(fn).trace(*args, **kwargs).lower(lowering_platforms=("cuda",))


def custom_calls(lowered: jax.stages.Lowered) -> dict[str, int]:
    """How many calls of each Pallas GPU backend (`CUSTOM_CALLS`) `lowered` holds."""
    text = lowered.as_text()
    return {name: text.count(f"custom_call @{target}") for name, target in CUSTOM_CALLS.items()}


_DUMP_NAME = re.compile(r'(mosaic_gpu\.dump_basename = )"[^"]*"')


def mosaic_gpu_modules(lowered: jax.stages.Lowered) -> list[str]:
    """The Mosaic GPU program of each of `lowered`'s Mosaic GPU calls, as MLIR text without
    source locations: the module its custom call carries serialized, read back, with the
    dump name Mosaic GPU numbers per process (`kernel_0`, `kernel_1`, …) written `kernel`, so
    that the text does not depend on what lowered before. Two versions of a kernel whose texts
    are equal lower to the same program (a refactor checked op for op:
    `sparse_attention.programs`), and the text names the instructions a kernel will issue
    (its wgmma shapes)."""
    texts = []
    stablehlo = lowered.compiler_ir("stablehlo")

    def walk(op: ir.Operation) -> None:
        for region in op.regions:
            for block in region.blocks:
                for inner in block.operations:
                    inner = inner.operation
                    if inner.name == "stablehlo.custom_call" and ir.StringAttr(
                        inner.attributes["call_target_name"]
                    ).value.startswith(CUSTOM_CALLS["mosaic_gpu"]):
                        config = inner.attributes["mhlo.backend_config"]
                        module = ir.Module.parse(ir.StringAttr(config["module"]).value_bytes)
                        text = module.operation.get_asm(enable_debug_info=False)
                        texts.append(_DUMP_NAME.sub(r'\1"kernel"', text))
                    walk(inner)

    with stablehlo.context as context:
        context.allow_unregistered_dialects = True  # Mosaic GPU's dialects, where unloaded
        walk(stablehlo.operation)
    return texts


@dataclasses.dataclass(frozen=True)
class InlinePtx:
    """One inline PTX program a kernel emitted (`mgpu_utils.inline_ptx`): its text, with
    operands `$0, $1, …` (outputs first), and each operand's register kind as LLVM's NVPTX
    constraint letter: 'r' 32-bit, 'l' 64-bit, 'h' 16-bit, 'f' f32, 'b' predicate."""

    text: str
    operands: tuple[str, ...]


_REGISTERS = {  # constraint letter → (PTX register prefix, declaration type)
    "r": ("%r", ".b32"),
    "l": ("%rd", ".b64"),
    "h": ("%rs", ".b16"),
    "f": ("%f", ".f32"),
    "b": ("%p", ".pred"),
}


def _constraint(t: ir.Type) -> str:
    if isinstance(t, ir.IntegerType):
        return {1: "b", 16: "h", 32: "r", 64: "l"}[t.width]
    if isinstance(t, ir.F32Type):
        return "f"
    if isinstance(t, (ir.F16Type, ir.BF16Type)):
        return "h"
    raise NotImplementedError(f"inline PTX operand of type {t}: no register kind known")


@contextlib.contextmanager
def recording_inline_ptx(module_prefix: str = "pallas_kernels") -> Iterator[list[InlinePtx]]:
    """Within the block, every `mgpu_utils.inline_ptx` call made from a module whose name starts
    with `module_prefix` (the project's kernels, not Mosaic GPU's own) is appended to the
    yielded list, then emitted as usual. Lower a kernel inside it (`lower_for_gpu`); jax's
    caches are cleared first, so the kernel's lowering runs again rather than being reused."""
    programs: list[InlinePtx] = []
    original = mgpu_utils.inline_ptx

    def record(ptx, *args, result_types=None, predicate=None, **kwargs):
        if sys._getframe(1).f_globals.get("__name__", "").startswith(module_prefix):
            if result_types is None:
                outputs = []
            elif isinstance(result_types, ir.Type):
                outputs = [result_types]
            else:
                outputs = list(result_types)
            operands = [*outputs, *(a.type for a in args)]
            text = ptx if predicate is None else f"@${len(operands)} {ptx}"
            if predicate is not None:
                operands.append(predicate.type)
            programs.append(InlinePtx(text, tuple(_constraint(t) for t in operands)))
        return original(ptx, *args, result_types=result_types, predicate=predicate, **kwargs)

    jax.clear_caches()
    mgpu_utils.inline_ptx = record
    try:
        yield programs
    finally:
        mgpu_utils.inline_ptx = original


def ptx_entry(program: InlinePtx, arch: str = "sm_90a", name: str = "inline_ptx") -> str:
    """A PTX module holding `program` alone in a kernel `name`, each operand `$i` a register of
    its kind set to zero first (predicates to false)."""
    n = len(program.operands)
    lines = [
        ".version 8.0",
        f".target {arch}",
        ".address_size 64",
        f".visible .entry {name}()",
        "{",
    ]
    lines += [f"    .reg {kind} {prefix}<{n + 1}>;" for prefix, kind in _REGISTERS.values()]
    registers = [f"{_REGISTERS[letter][0]}{i}" for i, letter in enumerate(program.operands)]
    zero = f"%r{n}"
    lines.append(f"    mov.b32 {zero}, 0;")
    for register, letter in zip(registers, program.operands, strict=True):
        if letter == "b":
            lines.append(f"    setp.ne.u32 {register}, {zero}, 0;")
        elif letter == "f":
            lines.append(f"    mov.f32 {register}, 0f00000000;")
        else:
            lines.append(f"    mov{_REGISTERS[letter][1]} {register}, 0;")
    body = re.sub(r"\$(\d+)", lambda m: registers[int(m.group(1))], program.text)
    lines += ["    " + line for line in body.splitlines()]
    lines += ["    ret;", "}"]
    return "\n".join(lines) + "\n"


def assemble_inline_ptx(programs: list[InlinePtx], arch: str = "sm_90a") -> int:
    """Assembles each distinct program (`ptx_entry`) with `ptxas -arch=arch`; returns how many
    were assembled. Raises `RuntimeError` with ptxas's message and the module for the first
    that fails, and where ptxas is not on PATH (`ptxas.run`)."""
    distinct = list(dict.fromkeys(programs))
    for i, program in enumerate(distinct):
        module = ptx_entry(program, arch)
        done = ptxas.run(module, arch=arch)
        if done.returncode:
            raise RuntimeError(
                f"ptxas rejected inline PTX program {i} of {len(distinct)}:\n"
                f"{done.stderr.strip()}\n--- module ---\n{module}"
            )
    return len(distinct)
