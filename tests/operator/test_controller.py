"""The controller's memory after an operator restart, rebuilt from what the status says."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lora_operator.config import OperatorConfig
from lora_operator.controller import Controller, needs_staging
from lora_operator.model import adapter_info
from lora_operator.status import summarise

SHA = "d" * 64


def body(generation: int, staged_reason: str, staged_status: str, observed: int) -> dict[str, Any]:
    return {
        "metadata": {"namespace": "ns", "name": "a", "generation": generation},
        "spec": {"baseModel": "sd", "source": {"uri": "/v/ns/a"}},
        "status": {
            "observedGeneration": observed,
            "staged": {"sha256": SHA, "sizeBytes": 3, "path": "/v/ns/a/revisions/" + SHA},
            "conditions": [
                {"type": "Staged", "status": staged_status, "reason": staged_reason, "message": "m"}
            ],
        },
    }


def test_a_permanent_failure_of_the_current_generation_survives_a_restart(tmp_path: Path) -> None:
    c = Controller(OperatorConfig(volume_root=tmp_path))
    b = body(generation=2, staged_reason="ChecksumMismatch", staged_status="False", observed=2)
    c.adapter_changed(b)
    state = c.staging[("ns", "a")]
    assert (state.permanent, state.error_reason) == (True, "ChecksumMismatch")
    info = adapter_info(b)
    assert summarise(info, state, []).phase == "Failed"
    # Generation 1's revision is still on the volume: resuming does not download again.
    assert not needs_staging(info, state.observed_generation, volume_current=SHA)


def test_a_staged_generation_is_seeded_as_staged(tmp_path: Path) -> None:
    c = Controller(OperatorConfig(volume_root=tmp_path))
    c.adapter_changed(body(generation=3, staged_reason="Staged", staged_status="True", observed=3))
    state = c.staging[("ns", "a")]
    assert state.permanent is False
    assert state.path == "/v/ns/a/revisions/" + SHA
    assert state.staged is not None and state.staged.sha256 == SHA
