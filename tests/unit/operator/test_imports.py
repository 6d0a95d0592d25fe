"""The operator's modules import each other in one direction only: a cycle (fetchers and staging
once imported each other) means a shared piece belongs in a module both can import. And the
operator image's code (the operator and the router) runs without torch or the inference server."""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

import lora_operator

from tests.support.imports import import_everything

PACKAGE = Path(lora_operator.__file__).parent


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The package's modules that `path` imports, TYPE_CHECKING imports included."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module == "lora_operator":
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("lora_operator."):
            found.add(str(node.module).split(".")[1])
        elif isinstance(node, ast.Import):
            found |= {
                alias.name.split(".")[1]
                for alias in node.names
                if alias.name.startswith("lora_operator.")
            }
    return (found & modules) - {path.stem}


def test_no_module_of_the_operator_imports_itself_back() -> None:
    files = {p.stem: p for p in PACKAGE.glob("*.py")}
    graph = {name: _imports(path, set(files)) for name, path in files.items()}
    assert graph["staging"] >= {"fetchers", "sinks"}  # the scan sees the imports it checks
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
    modules = len(list(PACKAGE.glob("*.py"))) - 1  # walk_packages lists no __init__
    assert len(names) >= modules, "the script imported fewer modules than the operator has"
