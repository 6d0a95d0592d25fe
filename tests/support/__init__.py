"""What the test suites share, in one place: the HTTP origin the staging tests download from
(`origin`), HTTP calls and one image generation from the test process (`http`), LoRA-shaped
safetensors bytes (`loras`), the `phase` fixture that names the phase of a long scenario that
failed (`phases`, a plugin tests/conftest.py loads), the suite's kinds and their markers
(`kinds`), the operator with inference pods on the local cluster (`cluster`), the docs' fenced
blocks and their commands (`docs`), stand-in pods for the router (`stand_ins`), live servers behind
a live router (`fleet`), adapter files of every served format with their deltas (`formats`), a
Hugging Face Hub stand-in serving one model repository (`hubstandin`, also run as a script in a
pod), examples/model-sdxl.yaml's download Job pointed at it (`modeljob`), a
HorizontalPodAutoscaler on a custom metric and a closed-loop load recording every answer
(`autoscaling`), and the benchmarks' scripts imported as modules (`bench_module`, here).

Waiting for pods and adapters, and talking to a release through the API server, are the shipped
demo's (`lora_demo.release`): the tests use those rather than keep their own.

Must not: import torch, except in `cluster` (imported only by the cluster tests and the
benchmarks) and `formats` (only by the inference tests). The operator's, the router's and the
volume's unit tests import from here and must collect without torch (tests/unit/test_layout.py
checks it).
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]  # the checkout


def bench_module(name: str) -> ModuleType:
    """`bench/<name>.py`, or a module of bench/'s packages (`lora_bench.fleet.tally`), imported
    with bench/ on the path as when the scripts run (they import each other by their bare
    names)."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(ROOT / "bench"))
