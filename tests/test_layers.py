"""The import layers of DESIGN §2: each layer imports only the layers below it.

    ops (v41jax.ops) ← kernels (pallas_kernels) ← model (v41jax.nn)
      ← training (v41jax.train, accounting, tables) ← entry points (cli)
      ← experiments, notebooks

Every import in every file is read with `ast` (function bodies included), resolved to the
project module it names, and checked against that table. A lazy project import (inside a
function) is refused outside the command line, which may defer imports for start-up speed: a
lazy import is how a cycle gets hidden. The ops import only jax and its numeric companions.
"""

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("v41jax", "pallas_kernels", "experiments", "notebooks")
LAYERS = (  # (name, module prefixes), lowest first
    ("ops", ("v41jax.ops", "v41jax.provenance")),  # and what every report records of its run
    ("kernels", ("pallas_kernels",)),
    ("model", ("v41jax.nn",)),
    ("training", ("v41jax.train", "v41jax.accounting", "v41jax.tables")),
    ("entry points", ("v41jax.cli", "v41jax.__main__")),
    ("experiments and notebooks", ("experiments", "notebooks")),
)
DEFERRED_IMPORTS_ALLOWED = ("v41jax.cli",)  # `v41jax bytes` need not import jax and flax
OPS_THIRD_PARTY = {"jax", "jaxlib", "numpy", "ml_dtypes", "chex", "jaxtyping"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {
    module_name(p): p
    for package in PACKAGES
    for p in sorted((ROOT / package).rglob("*.py"))
    if "__pycache__" not in p.parts
}


def layer_of(module: str) -> int:
    for index, (_, prefixes) in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return index
    raise AssertionError(f"{module}: in no layer of LAYERS (add it)")


def imports(module: str) -> list[tuple[str, int, bool]]:
    """(imported name, line, inside a function) of every import statement of `module`."""
    path = MODULES[module]
    tree = ast.parse(path.read_text())
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    in_function = {
        id(node)
        for fn in ast.walk(tree)
        if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef)
        for node in ast.walk(fn)
    }
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            # `from pkg import mod` imports pkg.mod when that is a module, else names of pkg.
            names = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names
            ]
        else:
            continue
        found += [(name, node.lineno, id(node) in in_function) for name in names]
    return found


def project_module(name: str) -> str | None:
    """The project module `name` refers to (its longest importable prefix), or None."""
    parts = name.split(".")
    while parts:
        if ".".join(parts) in MODULES:
            return ".".join(parts)
        parts.pop()
    return None


def test_every_module_is_in_a_layer():
    for module in MODULES:
        if module not in PACKAGES:
            layer_of(module)


def test_the_top_package_imports_nothing():
    """`import v41jax.ops` runs `v41jax/__init__.py` first: anything it imported would sit
    below the ops."""
    assert imports("v41jax") == []


@pytest.mark.parametrize("module", [m for m in MODULES if m not in PACKAGES])
def test_imports_go_down_the_layers(module):
    layer = layer_of(module)
    for name, line, deferred in imports(module):
        target = project_module(name)
        if target is None or target in PACKAGES:
            continue
        where = f"{MODULES[module].relative_to(ROOT)}:{line} imports {name}"
        assert layer_of(target) <= layer, (
            f"{where}: {LAYERS[layer_of(target)][0]} is above {LAYERS[layer][0]}"
        )
        assert not deferred or module in DEFERRED_IMPORTS_ALLOWED, (
            f"{where} inside a function: import it at the top (a lazy import hides a cycle)"
        )


def test_the_ops_import_only_jax_and_its_companions():
    for module in (m for m in MODULES if m.startswith("v41jax.ops")):
        for name, line, _ in imports(module):
            top = name.split(".")[0]
            allowed = top in OPS_THIRD_PARTY or top in sys.stdlib_module_names
            allowed |= name.startswith("v41jax.ops") or name == "__future__"
            assert allowed, f"{MODULES[module].relative_to(ROOT)}:{line} imports {name}"


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("from v41jax.nn import model\n", "model is above ops"),
        ("def f():\n    from v41jax.ops import formats\n", "inside a function"),
    ],
    ids=["upward", "lazy"],
)
def test_the_check_fails_on_a_bad_import(tmp_path, monkeypatch, source, message):
    """The checker itself: an ops module importing the model layer, or importing lazily."""
    fake = tmp_path / "v41jax" / "ops" / "bad.py"
    fake.parent.mkdir(parents=True)
    fake.write_text(source)
    monkeypatch.setitem(MODULES, "v41jax.ops.bad", fake)
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    with pytest.raises(AssertionError, match=message):
        test_imports_go_down_the_layers("v41jax.ops.bad")
