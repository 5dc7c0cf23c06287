"""The package's layering: which folder may import which, checked on every import statement.

Function-local imports count too (they used to hide cycles). The rules:
- model/ only computes: it imports nothing from checkpoint/, parallel/, schedule/, train/ (nor the
  CLI, parity or recipes);
- recipe/ never imports train/ (validation must not need the trainer);
- checkpoint/ never imports train/;
- data/ (conversations, packing) is torch-free and imports none of the other layers;
- the library never imports the CLI (gptoss_cli/cli/) or rich;
- nothing under gptoss_cli/ imports benchmark or test scaffolding: bench/, tests/, or
  torch.testing._internal (simulated links and fake process groups live in bench/).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "gptoss_cli"

FORBIDDEN = {
    "model": ("checkpoint", "parallel", "schedule", "train", "cli", "parity", "recipe"),
    "recipe": ("train", "cli"),
    "checkpoint": ("train", "cli", "parallel", "schedule"),
    "parallel": ("train", "cli", "checkpoint", "recipe"),
    "schedule": ("train", "cli", "checkpoint", "recipe"),
    "fp8": ("train", "cli", "checkpoint", "recipe", "parallel", "schedule"),
    "train": ("cli",),
    "parity": ("cli", "train"),
    "generate": ("cli", "train", "schedule"),
    "rl": ("cli",),
    "data": ("cli", "train", "model", "checkpoint", "parallel", "schedule", "fp8", "recipe", "parity"),
}


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in a file, nested ones included."""
    package = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1])
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            found.append((node.lineno, module))
            found += [(node.lineno, f"{module}.{alias.name}") for alias in node.names]
    return found


def _files(folder: str) -> list[Path]:
    return sorted((PACKAGE / folder).rglob("*.py"))


@pytest.mark.parametrize("folder", sorted(FORBIDDEN))
def test_folder_imports_only_what_its_layer_allows(folder):
    bad = []
    for path in _files(folder):
        for line, module in imported_modules(path):
            parts = module.split(".")
            if parts[0] == "gptoss_cli" and len(parts) > 1 and parts[1] in FORBIDDEN[folder]:
                bad.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {module}")
    assert not bad, "\n".join(bad)


def test_library_never_imports_rich():
    bad = [f"{p.relative_to(PACKAGE.parent)}:{line}" for p in PACKAGE.rglob("*.py")
           if "cli" not in p.relative_to(PACKAGE).parts[:1]
           for line, module in imported_modules(p) if module.split(".")[0] == "rich"]
    assert not bad, bad


SCAFFOLDING = ("bench", "tests", "torch.testing._internal")


def test_package_never_imports_bench_or_test_scaffolding():
    bad = [f"{p.relative_to(PACKAGE.parent)}:{line} imports {module}" for p in sorted(PACKAGE.rglob("*.py"))
           for line, module in imported_modules(p)
           if any(module == s or module.startswith(s + ".") for s in SCAFFOLDING)]
    assert not bad, "\n".join(bad)


def test_the_checker_sees_nested_imports():
    # A function-local import is what used to hide the cycles; the checker must see it.
    probe = PACKAGE / "model" / "hybrid.py"
    lines = [module for _, module in imported_modules(probe)]
    assert "gptoss_cli.model.config" in lines
    nested = ast.parse("def f():\n    from gptoss_cli.train import loop\n")
    assert any(isinstance(n, ast.ImportFrom) and n.module == "gptoss_cli.train" for n in ast.walk(nested))
