"""The status writes of a burst of adapters do not grow with its size (the controller's rig:
pods in memory, a recording API, the real store), counted, not timed.

K adapters are applied at once in NS namespaces of 2 pods each, and staged one at a time
(`max_concurrent_stagings` 1, each download a little slow), so the last ones wait for their turn
many times the status intervals: K = 20 in 2 namespaces (a queue shorter than the settle
interval) and K = 200 in 10 (several times it). At both sizes an adapter's status is written
at most once before it is staged (`Pending` while it waits for a download slot, however long:
not `Staging` at 0 bytes and again when its turn comes) and at most 3 times from apply to
`Ready` (kopf's finalizer makes it 4 API writes), and the writes in all grow linearly with K.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from lora_operator.store import sinks, sources, staging

from tests.support.controller import Rig, pod
from tests.support.loras import lora_bytes
from tests.support.polling import until

SMALL, LARGE = (20, 2), (200, 10)  # (adapters, namespaces)
PODS = 2  # per namespace
MARGIN = 2.0
SETTLE_S, PROGRESS_S = 1.0, 2.0
FETCH_S = 0.02  # each download's own time: the queue of the large burst lasts 4 s or more
BASE = lora_bytes(0)


class OneAtATime(staging.Store):
    """The real store, one download at a time, each a little slow."""

    def __init__(self, root: Path) -> None:
        super().__init__(root, max_concurrent=1, fetch=self._slow)

    async def _slow(
        self, source: sources.Source, credentials: sources.Credentials, sink: sinks.Sink
    ) -> str | None:
        await asyncio.sleep(FETCH_S)
        return await self._default_fetch(source, credentials, sink)


def _adapter(volume: Path, namespace: str, i: int) -> dict[str, Any]:
    src = volume / namespace / "src" / f"a-{i}.safetensors"
    src.parent.mkdir(parents=True, exist_ok=True)
    data = bytearray(BASE)
    data[-4:] = i.to_bytes(4, "little")  # distinct content
    src.write_bytes(bytes(data))
    return {
        "metadata": {"namespace": namespace, "name": f"a-{i}", "uid": f"u-{i}", "generation": 1},
        "spec": {"baseModel": "sd", "source": {"uri": str(src)}},
    }


async def burst(tmp_path: Path, k: int, namespaces: int) -> dict[str, list[dict[str, Any]]]:
    """Apply K adapters at once; the status writes of each until every one is Ready."""
    async with Rig(tmp_path, status_settle_s=SETTLE_S, status_progress_s=PROGRESS_S) as rig:
        c = rig.controller
        c.volume = OneAtATime(rig.volume)
        c.start()
        spaces = [f"team-{n}" for n in range(namespaces)]
        for ns in spaces:
            for j in range(PODS):
                c.pod_changed(pod(f"{ns}-p{j}", ns))  # unique names: the fake pods key by name
        bodies = [_adapter(rig.volume, spaces[i % namespaces], i) for i in range(k)]
        for body in bodies:
            c.adapter_changed(body)
        names = [b["metadata"]["name"] for b in bodies]
        await until("all Ready", lambda: all(rig.ready(n) for n in names), timeout=120)
        return {n: list(rig.api.status[n]) for n in names}


@pytest.fixture(scope="module")
def writes(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, list[dict[str, Any]]]]:
    async def both() -> dict[int, dict[str, list[dict[str, Any]]]]:
        return {k: await burst(tmp_path_factory.mktemp(f"k{k}"), k, ns) for k, ns in (SMALL, LARGE)}

    return asyncio.run(both())


@pytest.mark.parametrize("size", [SMALL, LARGE], ids=["K=20", "K=200"])
def test_a_queued_adapter_is_written_once_and_ready_within_three_writes(
    writes: dict[int, dict[str, list[dict[str, Any]]]], size: tuple[int, int]
) -> None:
    by_adapter = writes[size[0]]
    for name, patches in by_adapter.items():
        phases = [p["phase"] for p in patches]
        before_staged = [p for p in patches if p.get("staged") is None]
        assert len(before_staged) <= 1, (name, phases)
        assert phases[-1] == "Ready" and len(phases) <= 3, (name, phases)
        if before_staged:
            # Waiting for its turn is Pending, and says so; Staging is a download under way.
            assert before_staged[0]["phase"] in ("Pending", "Staging"), (name, phases)


def test_the_writes_grow_linearly_with_the_burst(
    writes: dict[int, dict[str, list[dict[str, Any]]]],
) -> None:
    small = sum(len(p) for p in writes[SMALL[0]].values())
    large = sum(len(p) for p in writes[LARGE[0]].values())
    linear = LARGE[0] / SMALL[0]
    assert large <= MARGIN * linear * small, (small, large)
    # The large burst waited: its adapters' Pending was written, once each.
    pending = sum(1 for ps in writes[LARGE[0]].values() if ps[0]["phase"] == "Pending")
    assert pending >= LARGE[0] // 2, pending
