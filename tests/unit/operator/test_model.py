"""Reading pods and LoRAAdapters (pure): label selectors, readiness, restarts, annotations."""

from __future__ import annotations

from typing import Any

from lora_operator.controller import needs_staging
from lora_operator.rules import model


def pod_body(**over: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "metadata": {
            "namespace": "ns",
            "name": "p",
            "uid": "u1",
            "labels": {"lora.dev/inference": "true", "tier": "gpu"},
            "annotations": {"lora.dev/port": "9000", "lora.dev/adapter-root": "/mnt/a"},
        },
        "status": {
            "podIP": "10.0.0.5",
            "conditions": [{"type": "Ready", "status": "True"}],
            "containerStatuses": [{"restartCount": 2}, {"restartCount": 1}],
        },
    }
    body.update(over)
    return body


def test_pod_info_reads_address_readiness_and_restarts() -> None:
    p = model.pod_info(pod_body())
    assert (p.ip, p.port, p.ready, p.restarts, p.reachable) == ("10.0.0.5", 9000, True, 3, True)
    assert str(p.adapter_root) == "/mnt/a/ns"
    assert p.url("/v1/models") == "http://10.0.0.5:9000/v1/models"


def test_pod_defaults_and_unready_or_deleting_pods_are_not_reachable() -> None:
    body = pod_body(status={"conditions": [{"type": "Ready", "status": "False"}]})
    body["metadata"]["annotations"] = {}
    p = model.pod_info(body)
    assert (p.port, str(p.volume_root), p.reachable) == (8000, "/var/lib/lora/adapters", False)
    body = pod_body()
    body["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    assert model.pod_info(body).reachable is False


def adapter_body(**status: Any) -> dict[str, Any]:
    return {
        "metadata": {"namespace": "ns", "name": "a", "uid": "x", "generation": 3},
        "spec": {"baseModel": "sd", "source": {"uri": "/v/a"}, "scale": -2, "pinned": True},
        "status": status,
    }


def test_an_adapter_targets_pods_of_its_namespace_selector_and_base_model() -> None:
    a = model.adapter_info(adapter_body(staged={"sha256": "f" * 64, "sizeBytes": 10}))
    assert (a.scale, a.pinned, a.generation, a.staged) == (
        -2.0,
        True,
        3,
        model.StagedRef("f" * 64, 10),
    )
    pod = model.pod_info(pod_body())
    assert a.targets(pod, "sd")
    assert not a.targets(pod, "sdxl")
    other = pod_body()
    other["metadata"]["namespace"] = "elsewhere"
    assert not a.targets(model.pod_info(other), "sd")


def test_staging_is_skipped_only_when_the_volume_holds_this_generations_revision() -> None:
    staged = model.adapter_info(adapter_body(staged={"sha256": "f" * 64}))
    assert not needs_staging(staged, observed_generation=3, volume_current="f" * 64)
    assert needs_staging(staged, observed_generation=2, volume_current="f" * 64)  # new spec
    assert needs_staging(staged, observed_generation=3, volume_current=None)  # volume lost it
    assert needs_staging(model.adapter_info(adapter_body()), 3, "f" * 64)  # never staged
