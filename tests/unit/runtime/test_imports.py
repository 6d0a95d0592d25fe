"""What lora_runtime is for: every module of it, and every module of the router, imports in a
fresh interpreter without torch, kopf or the operator (the router runs without them, and the
inference image has no kopf)."""

from __future__ import annotations

from tests.support.imports import import_everything


def test_the_runtime_and_the_router_load_no_torch_no_kopf_and_no_operator() -> None:
    names, loaded = import_everything(["lora_runtime", "lora_router"])
    heavy = {"torch", "kopf", "lora_operator", "lora_inference"}
    assert not loaded & heavy, f"imported {sorted(loaded & heavy)}"
    runtime = {n for n in names if n.startswith("lora_runtime.")}
    assert {"lora_runtime.kube", "lora_runtime.login", "lora_runtime.tokenfiles"} <= runtime
