"""The package's shape, as ``docs/architecture.md`` describes it: a thin strategy, small modules and functions,
private torch/Lightning names behind one compatibility module, and command-line tools that start without the
strategy or torch's pipelining."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
PACKAGE = REPO_ROOT / "lightning_hybrid"
MODULES = sorted(PACKAGE.rglob("*.py"))


def _functions(tree: ast.AST) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    return [node for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]


def test_the_strategy_is_glue_and_modules_and_functions_stay_small() -> None:
    lines = {path.relative_to(PACKAGE).as_posix(): len(path.read_text().splitlines()) for path in MODULES}
    assert lines["strategy.py"] <= 350  # glue: each hook short and delegating (issue 28)
    assert {name: count for name, count in lines.items() if count > 400} == {}
    long_functions = [
        f"{path.relative_to(PACKAGE)}:{node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for path in MODULES for node in _functions(ast.parse(path.read_text()))
        if node.end_lineno - node.lineno + 1 > 50
    ]
    assert long_functions == []


def _private_uses(path: Path) -> list[str]:
    """Underscore names of torch or Lightning that ``path`` imports or reads (``torch._C...``)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in ("torch", "lightning"):
            private = [part for part in node.module.split(".") if part.startswith("_")]
            private += [alias.name for alias in node.names if alias.name.startswith("_")]
            found += [f"{node.module}: {name}" for name in private]
        elif isinstance(node, ast.Import):
            found += [alias.name for alias in node.names if any(p.startswith("_") for p in alias.name.split("."))]
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and root.id == "torch":
                found.append(f"torch...{node.attr}")
    return found


def test_only_the_compatibility_module_uses_private_torch_or_lightning_names() -> None:
    uses = {path.relative_to(PACKAGE).as_posix(): _private_uses(path) for path in MODULES}
    assert uses.pop("_compat/__init__.py") and uses.pop("_compat/pipelining.py")  # the one place they are allowed
    assert {name: found for name, found in uses.items() if found} == {}


def _loaded_after(statement: str, tmp_path: Path) -> set[str]:
    """The modules loaded by a fresh interpreter after running ``statement`` (which may exit)."""
    script = tmp_path / "probe.py"
    script.write_text(
        f"import sys\nsys.path.insert(0, {str(REPO_ROOT)!r})\n"
        f"try:\n    {statement}\nexcept SystemExit:\n    pass\n"
        "print('MODULES', ' '.join(sorted(sys.modules)))\n"
    )
    done = subprocess.run([sys.executable, str(script)], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    line = next(line for line in done.stdout.splitlines() if line.startswith("MODULES "))
    return set(line.split()[1:])


@pytest.mark.parametrize("command", ["['plan', '--help']", "['export', 'missing-folder', 'out.ckpt']"])
def test_the_command_line_loads_neither_the_strategy_nor_torchs_pipelining(command: str, tmp_path: Path) -> None:
    loaded = _loaded_after(f"from lightning_hybrid.cli import main; main({command})", tmp_path)
    assert "lightning_hybrid.cli" in loaded
    assert {"lightning_hybrid.strategy", "torch.distributed.pipelining", "lightning.pytorch"} & loaded == set()
    if "--help" in command:
        assert "torch" not in loaded  # the help needs only the GPU preset names


def test_importing_the_package_loads_the_strategy_only_when_lightning_is_loaded(tmp_path: Path) -> None:
    assert "lightning_hybrid.strategy" not in _loaded_after("import lightning_hybrid", tmp_path)
    with_lightning = _loaded_after("import lightning.pytorch, lightning_hybrid", tmp_path)
    assert "lightning_hybrid.strategy" in with_lightning  # so Trainer(strategy="hybrid") resolves
