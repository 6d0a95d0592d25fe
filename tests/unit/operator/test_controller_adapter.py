"""What the staged file declares reaches `status.adapter`: for an adapter, for a composition of
adapters, and after a restart of an operator whose status did not record it (the controller's
rig: the real store on a temporary volume, pods and API in memory)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.support.controller import NS, Rig, adapter, pod
from tests.support.loras import lora_bytes
from tests.support.polling import until

DECLARED_A = {"format": "lora", "rank": 4, "targets": ["unet"], "triggerWords": []}
DECLARED_B = {"format": "lora", "rank": 8, "targets": ["unet"], "triggerWords": ["pixel", "8bit"]}


def last(statuses: list[dict[str, Any]]) -> dict[str, Any]:
    return statuses[-1] if statuses else {}


async def test_the_status_says_what_the_staged_file_declares(tmp_path: Path) -> None:
    async with Rig(tmp_path) as rig:
        c = rig.controller
        c.start()
        c.pod_changed(pod("p1"))
        body = adapter(rig.volume, "a", seed=1)
        c.adapter_changed(body)
        b_file = rig.volume / NS / "src" / "b.safetensors"
        b_file.write_bytes(
            lora_bytes(2, rank=8, metadata={"modelspec.trigger_phrase": "pixel, 8bit"})
        )
        c.adapter_changed(adapter(rig.volume, "b"))
        c.adapter_changed(
            {
                "metadata": {"namespace": NS, "name": "ab", "uid": "uid-ab", "generation": 1},
                "spec": {"baseModel": "sd", "compose": [{"name": "b"}, {"name": "a"}]},
            }
        )
        await until("all Ready", lambda: all(rig.ready(n) for n in ("a", "b", "ab")))
        assert last(rig.api.status["a"])["adapter"] == DECLARED_A
        assert last(rig.api.status["b"])["adapter"] == DECLARED_B
        # A stack: ranks added, words of its members in the manifest's (name) order.
        assert last(rig.api.status["ab"])["adapter"] == {
            "format": "stack",
            "rank": 12,
            "targets": ["unet"],
            "triggerWords": ["pixel", "8bit"],
        }
        written = last(rig.api.status["a"])

    # A status without it (written by a release that did not record it): the restarted
    # operator reads the staged revision's header and writes it, without staging again.
    older = {k: v for k, v in written.items() if k != "adapter"}
    restarted, api = rig.restarted(status_progress_s=0.0)
    restarted.start()
    try:
        restarted.pod_changed(pod("p1"))
        restarted.adapter_changed({**body, "status": older})
        await until("described again", lambda: last(api.status.get("a", [])).get("adapter"))
        assert last(api.status["a"])["adapter"] == DECLARED_A
        assert restarted.adapters[(NS, "a")].staging.task is None
    finally:
        await restarted.stop()
