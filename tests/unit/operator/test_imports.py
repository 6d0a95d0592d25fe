"""The operator's modules import each other in one direction only: a cycle (fetchers and staging
once imported each other) means a shared piece belongs in a module both can import. And the
operator image's code (the operator and the router) runs without torch or the inference server.
Which folder may import which (rules, store, controller, edges) is .importlinter's to check."""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

import lora_operator

from tests.support.imports import import_everything

PACKAGE = Path(lora_operator.__file__).parent


def _name(path: Path) -> str:
    """`rules/planning.py` -> `rules.planning`; a folder's `__init__.py` -> the folder's name."""
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


# The controller's hub (signals.Hub) names every actor for its types, and every actor imports the
# hub to reach the others: that cycle is for the type checker only, and is the design.
TYPES_ONLY = {"controller.signals"}


def _nodes(path: Path) -> list[ast.AST]:
    """`path`'s syntax nodes; without its `if TYPE_CHECKING:` blocks where it is in TYPES_ONLY."""
    tree = ast.parse(path.read_text())
    if _name(path) in TYPES_ONLY:
        tree.body = [
            n
            for n in tree.body
            if not (isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING")
        ]
    return list(ast.walk(tree))


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The package's modules that `path` imports, TYPE_CHECKING imports included (but in
    TYPES_ONLY): `from lora_operator.rules import planning` names `rules.planning`, `from
    lora_operator.controller import Controller` the folder's `__init__`, `controller`."""
    found: set[str] = set()
    for node in _nodes(path):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("lora_operator"):
            base = str(node.module).removeprefix("lora_operator").removeprefix(".")
            for alias in node.names:
                inner = f"{base}.{alias.name}" if base else alias.name
                found.add(inner if inner in modules else base)
        elif isinstance(node, ast.Import):
            found |= {
                alias.name.removeprefix("lora_operator.")
                for alias in node.names
                if alias.name.startswith("lora_operator.")
            }
    return (found & modules) - {_name(path)}


def test_no_module_of_the_operator_imports_itself_back() -> None:
    files = {_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {name: _imports(path, set(files)) for name, path in files.items()}
    assert graph["store.staging"] >= {"store.fetchers", "store.sinks"}  # the scan sees them
    try:
        tuple(graphlib.TopologicalSorter(graph).static_order())
    except graphlib.CycleError as e:
        raise AssertionError(f"an import cycle: {' -> '.join(e.args[1])}") from e


def test_the_operator_and_the_router_import_no_torch_and_no_inference_server() -> None:
    # In a fresh interpreter (the test process may hold torch for other tests). Every module is
    # imported, so a torch import anywhere in the operator image's code fails here, not in a pod.
    names, loaded = import_everything(["lora_operator", "lora_router"])
    heavy = {"torch", "diffusers", "peft", "transformers", "lora_inference"}
    assert not loaded & heavy, f"imported {sorted(loaded & heavy)}"
    modules = [p for p in PACKAGE.rglob("*.py") if p.name != "__init__.py"]
    assert len(names) >= len(modules), "the script imported fewer modules than the operator has"
