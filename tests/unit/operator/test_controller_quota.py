"""A namespace over its quota on the volume: its new adapter is Degraded with the reason and what
to do, another namespace's adapter stages and serves meanwhile, and the adapter stages once
the namespace frees room (the controller's rig: the real store on a temporary volume, pods and
API in memory)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lora_operator.rules.model import PodInfo

from tests.support.controller import Rig, adapter, pod
from tests.support.loras import lora_bytes
from tests.support.polling import until

OTHER = "team-b"


def other_pod(name: str) -> PodInfo:
    return pod(name, OTHER, "10.0.0.2")


def other_adapter(volume: Path, name: str, seed: int) -> dict[str, Any]:
    src = volume / OTHER / "src" / f"{name}.safetensors"
    src.parent.mkdir(parents=True, exist_ok=True)
    src.write_bytes(lora_bytes(seed))
    return {
        "metadata": {"namespace": OTHER, "name": name, "uid": f"uid-{name}", "generation": 1},
        "spec": {"baseModel": "sd", "source": {"uri": str(src)}},
    }


def condition(rig: Rig, name: str, type_: str) -> dict[str, Any]:
    return next(c for c in rig.api.status[name][-1]["conditions"] if c["type"] == type_)


async def test_over_its_quota_a_namespaces_new_adapter_degrades_and_no_one_elses(
    tmp_path: Path,
) -> None:
    async with Rig(tmp_path, status_settle_s=0.0) as rig:
        rig.store.ledger.limit = len(lora_bytes(0))  # one adapter per namespace
        c = rig.controller
        c.start()
        c.pod_changed(pod("p1"))
        c.pod_changed(other_pod("q1"))
        first = adapter(rig.volume, "a", seed=1)
        c.adapter_changed(first)
        await until("a Ready", lambda: rig.ready("a"))
        c.adapter_changed(adapter(rig.volume, "b", seed=2))
        await until("b Degraded", lambda: "Degraded" in rig.api.phases("b"))
        degraded = condition(rig, "b", "Degraded")
        assert (degraded["status"], degraded["reason"]) == ("True", "QuotaExceeded")
        assert "namespace ns uses" in degraded["message"]
        assert "--namespace-quota" in degraded["message"]
        assert "QuotaExceeded" in rig.api.reasons("b")
        assert "b" not in rig.pods.held["p1"]
        # Another namespace's quota is its own.
        c.adapter_changed(other_adapter(rig.volume, "c", seed=3))
        await until("c Ready", lambda: rig.ready("c"))
        assert rig.ready("a") and rig.pods.held["q1"].keys() == {"c"}
        # The namespace frees room (an adapter deleted, its files collected): the Degraded
        # adapter's next attempt stages it.
        rig.delete(first)
        await until("b Ready", lambda: rig.ready("b"))
        assert rig.pods.held["p1"].keys() == {"b"}
