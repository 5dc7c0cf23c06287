"""No module reaches another's private names: not another gptoss module's, not torch's but through one module.

A name with a leading underscore is its module's own business; a second module that needs it gets it
under a public name (as model/gemm/grouped.map_experts for fp8/grouped.py).

torch's private names (`torch._grouped_mm`, `torch._dynamo`, a pipeline stage's `_retrieve_recv_grads`,
nn.Module's `_modules`...) carry no compatibility promise: only gptoss_cli/torch_private.py reaches them,
behind its check of the torch version. Everywhere else the checker refuses an import of a private torch
module or name, a private attribute of anything bound by a torch import (`torch._x`, `dist._x`,
`hasattr(torch, "_x")`), and a private attribute the package never defines itself (`stage._x` on a
torch object: the name is a library's).
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "gptoss_cli"
GUARD = "gptoss_cli/torch_private.py"

# Exceptions still to resolve; remove an entry once its name is public (none left).
KNOWN: set[str] = set()
# Library names with an underscore that their library documents as public.
PUBLIC_BY_DOCUMENTATION = {"os._exit"}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


@functools.cache
def package_nodes() -> dict[str, list[ast.AST]]:
    """{'gptoss_cli/...py': every node of the module} (parsed once for all the checks here)."""
    return {path.relative_to(PACKAGE.parent).as_posix(): list(ast.walk(ast.parse(path.read_text(), str(path))))
            for path in sorted(PACKAGE.rglob("*.py"))}


def private_imports() -> set[str]:
    found = set()
    for name, nodes in package_nodes().items():
        for node in nodes:
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("gptoss_cli"):
                found |= {f"{name} imports {node.module}.{a.name}" for a in node.names
                          if a.name.startswith("_") and not a.name.startswith("__")}
    return found


def test_no_module_imports_another_modules_private_names():
    assert sorted(private_imports() - KNOWN) == []


# --- private torch names ---------------------------------------------------------------------------
def defined_names(modules: list[list[ast.AST]]) -> set[str]:
    """Every name the code defines: functions, classes, arguments, assignment targets, attributes set."""
    names = set()
    for nodes in modules:
        for node in nodes:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.keyword) and node.arg:
                names.add(node.arg)
    return names


def _root(node: ast.AST) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Call, ast.Subscript)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def private_torch_uses(nodes: list[ast.AST], where: str, defined: set[str]) -> list[str]:
    """'where:line text' of every private torch name a module (`nodes`) reaches (see the module docstring)."""
    torch_names, found = set(), []
    for node in nodes:
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "torch":
                    torch_names.add(a.asname or "torch")
                    if any(_private(p) for p in a.name.split(".")):
                        found.append((node.lineno, f"import {a.name}"))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            for a in node.names:
                torch_names.add(a.asname or a.name)
                if any(_private(p) for p in node.module.split(".") + [a.name]):
                    found.append((node.lineno, f"from {node.module} import {a.name}"))
    for node in nodes:
        if isinstance(node, ast.Attribute) and _private(node.attr) and isinstance(node.ctx, ast.Load):
            text = ast.unparse(node)
            if text in PUBLIC_BY_DOCUMENTATION:
                continue
            if _root(node) in torch_names or node.attr not in defined:
                found.append((node.lineno, text))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "hasattr", "setattr", "delattr") and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
              and _private(node.args[1].value)
              and (_root(node.args[0]) in torch_names or node.args[1].value not in defined)):
            found.append((node.lineno, ast.unparse(node)))
    return [f"{where}:{line} {text}" for line, text in sorted(set(found))]


def test_only_the_guard_module_reaches_private_torch_names():
    modules = package_nodes()
    defined = defined_names(list(modules.values()))
    bad = [use for where, nodes in modules.items() if where != GUARD for use in private_torch_uses(nodes, where, defined)]
    assert not bad, "route these through gptoss_cli/torch_private.py (it checks the torch version):\n" + "\n".join(bad)


def test_the_guard_module_is_where_the_private_torch_names_are():
    guard = package_nodes()[GUARD]
    assert len(private_torch_uses(guard, GUARD, defined_names([guard]))) >= 10


def test_the_checker_sees_every_way_to_reach_a_private_torch_name():
    code = """
import torch
import torch._dynamo
import torch.distributed as dist
from torch.distributed.pipelining.schedules import _wait_batch_p2p
from torch.distributed._shard.sharded_tensor import Shard
def f(stage, layer):
    torch._grouped_mm(1)
    torch.ops.aten._flash.default
    dist._thing
    hasattr(torch, "_scaled_mm")
    getattr(stage, "_check_chunk_id")(0)
    stage._retrieve_recv_grads(0)
    layer._modules.get("adapter")
    self._own = 1
    return self._own, getattr(self, "_own"), torch.nn.functional.relu, os._exit
"""
    nodes = list(ast.walk(ast.parse(code)))
    found = private_torch_uses(nodes, "m.py", defined_names([nodes]))
    assert [f.split(" ", 1)[1] for f in found] == [
        "import torch._dynamo", "from torch.distributed.pipelining.schedules import _wait_batch_p2p",
        "from torch.distributed._shard.sharded_tensor import Shard", "torch._grouped_mm",
        "torch.ops.aten._flash", "dist._thing", "hasattr(torch, '_scaled_mm')", "getattr(stage, '_check_chunk_id')",
        "stage._retrieve_recv_grads", "layer._modules"]
