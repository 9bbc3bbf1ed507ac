"""Dependencies point one way: the package's layers, as ``docs/architecture.md`` documents them, enforced.

Every ``import`` of the package is read from the source (module level and inside functions alike). A module may
import from its own unit (its package, or itself for a top-level module) and from the units of lower layers, never
from a higher layer or from another unit of its own layer: so the units' graph has no cycle, and a lower layer can
be read, tested and reused without the layers above it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_hybrid"

#: Lowest first; each unit is a subpackage or a top-level module of ``lightning_hybrid``.
LAYERS: list[tuple[str, ...]] = [
    ("_compat", "checks"),  # private torch/Lightning names; the shared argument check
    ("hardware",),  # GPU presets and clusters (plain Python)
    ("options",),  # the strategy's arguments, validated
    ("mesh",),  # the degrees against the world size; the named device mesh
    ("probe",),  # the blocks found; the user's step run once at setup and recorded
    ("tensor_parallel", "expert_parallel", "context_parallel", "pipeline", "checkpoint"),  # each parallelism, and checkpoint I/O
    ("parallel", "planner"),  # the driver applying them in order; the layout planner
    ("observe", "resilience"),  # what the run shows; what keeps it alive
    ("glue",),  # Lightning's hooks, loops and plugins
    ("strategy", "cli", "__init__"),  # the entry points
    ("__main__",),  # ``python -m lightning_hybrid``: the command line
]
LAYER_OF = {unit: index for index, units in enumerate(LAYERS) for unit in units}
MODULES = sorted(PACKAGE.rglob("*.py"))


def _unit(module: str) -> str:
    """The unit of a dotted module name inside the package (``lightning_hybrid.probe.record`` → ``probe``)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _imports(path: Path) -> set[str]:
    """The package's modules (or packages) ``path`` imports, anywhere in it."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("lightning_hybrid."))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "lightning_hybrid":  # `from lightning_hybrid import _compat`: the names are modules
                found.update(f"lightning_hybrid.{alias.name}" for alias in node.names)
            elif node.module.startswith("lightning_hybrid."):
                found.add(node.module)
    return found


def _module_name(path: Path) -> str:
    relative = path.relative_to(PACKAGE.parent).with_suffix("")
    return ".".join(relative.parts)


def test_every_unit_has_a_layer() -> None:
    units = {_unit(_module_name(path)) for path in MODULES}
    assert units == set(LAYER_OF), "give every subpackage and top-level module its layer in LAYERS (and the docs)"


@pytest.mark.parametrize("path", MODULES, ids=lambda path: path.relative_to(PACKAGE).as_posix())
def test_imports_point_down(path: Path) -> None:
    source = _unit(_module_name(path))
    wrong = []
    for imported in sorted(_imports(path)):
        target = _unit(imported)
        if target != source and LAYER_OF[target] >= LAYER_OF[source]:
            wrong.append(f"{imported} (layer {LAYER_OF[target]}: {', '.join(LAYERS[LAYER_OF[target]])})")
    assert wrong == [], f"{_module_name(path)} (layer {LAYER_OF[source]}) imports from its layer or above: {wrong}"


def test_the_rule_catches_an_upward_import(tmp_path: Path) -> None:
    module = tmp_path / "low.py"
    module.write_text("def f():\n    from lightning_hybrid.glue.steps import RootStepRouter\n"
                      "from lightning_hybrid import _compat, strategy\n")
    assert _imports(module) == {"lightning_hybrid.glue.steps", "lightning_hybrid._compat", "lightning_hybrid.strategy"}
    assert [LAYER_OF[_unit(name)] for name in sorted(_imports(module))] == [0, 8, 9]  # upward from any layer
