"""Hostile headers against the operator: the store refuses each bomb as NotALora, with the
memory it spends doing so measured in a child process, and the controller makes every refusal,
and any exception no check names, a Failed adapter that a restarted operator does not stage
again (a bomb that killed the operator once killed every operator started after it)."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from lora_operator.controller import stager
from lora_operator.store import publishing
from lora_volume import layout

from tests.support import bombs
from tests.support.controller import NS, RecordingStore, Rig, adapter, pod
from tests.support.loras import lora_bytes
from tests.support.polling import until

MIB = 1024 * 1024

# The real store on a temporary volume, in a process of its own: a good adapter staged first (so
# that the imports, the threads and the sink's buffers are counted before), then the bombs, all
# at once (the store stages 4 at a time, as the operator does). Prints the peak RSS (VmHWM)
# before and after, and what each staging raised.
CHILD = textwrap.dedent(
    """
    import asyncio, json, sys
    from pathlib import Path
    from lora_operator.store import sources, staging

    def peak_kib():
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])

    async def main(root, good, paths):
        store = staging.Store(root)
        await store.stage("team-a", "good", sources.VolumeSource(good))
        before = peak_kib()
        results = await asyncio.gather(
            *(
                store.stage("team-a", f"bomb-{i}", sources.VolumeSource(p))
                for i, p in enumerate(paths)
            ),
            return_exceptions=True,
        )
        refused = [[getattr(r, "reason", repr(r)), getattr(r, "message", "")] for r in results]
        print(json.dumps({"before": before, "after": peak_kib(), "refused": refused}))

    asyncio.run(main(Path(sys.argv[1]), Path(sys.argv[2]), [Path(p) for p in sys.argv[3:]]))
    """
)
# One bomb: its header's text decoded (8 MiB at most, ASCII) and its largest string at 4 bytes
# a character (32 MiB), or 250000 values (tens of MiB), with room for the allocator; the sink's
# buffers while a 64 MiB file is copied come on top. Four at once: the operator's 1 GiB limit
# keeps more than 600 MiB above its own ~100 MiB for them, over twice this bound.
ONE_BOMB_MIB = 96
ALL_AT_ONCE_MIB = 4 * ONE_BOMB_MIB


def stage_in_a_child(volume: Path, paths: list[Path]) -> tuple[float, list[list[str]]]:
    """How much the peak RSS of a store grew while staging `paths`, and their refusals."""
    good = volume / layout.SHARED / "good.safetensors"
    good.write_bytes(lora_bytes(1))
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(volume), str(good), *map(str, paths)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    return (result["after"] - result["before"]) / 1024, result["refused"]


@pytest.fixture
def volume(tmp_path: Path) -> Path:
    (tmp_path / layout.SHARED).mkdir()
    return tmp_path


@pytest.mark.parametrize("bomb", bombs.bombs(), ids=lambda b: b.name)
def test_refusing_a_bomb_costs_the_operator_little_memory(volume: Path, bomb: bombs.Bomb) -> None:
    path = bombs.write_bomb(volume / layout.SHARED, bomb)
    grown_mib, [(reason, message)] = stage_in_a_child(volume, [path])
    print(f"{bomb.name}: staging grew the peak RSS by {grown_mib:.1f} MiB")
    assert reason == "NotALora"
    assert bomb.message in message
    assert grown_mib <= ONE_BOMB_MIB


def test_every_bomb_at_once_stays_within_the_operators_memory(volume: Path) -> None:
    paths = [bombs.write_bomb(volume / layout.SHARED, b) for b in bombs.bombs()]
    grown_mib, refused = stage_in_a_child(volume, paths)
    print(f"all {len(paths)} bombs at once: staging grew the peak RSS by {grown_mib:.1f} MiB")
    assert [reason for reason, _ in refused] == ["NotALora"] * len(paths)
    assert grown_mib <= ALL_AT_ONCE_MIB


def failed_condition(rig: Rig, name: str) -> dict[str, str]:
    status = rig.api.status[name][-1]
    assert status["phase"] == "Failed"
    return next(c for c in status["conditions"] if c["type"] == "Staged")


class CountingStore(RecordingStore):
    """The real store, counting stagings, raising `crash` (an exception no check names) for
    the adapter `crashes`; the rig's controller stages with it."""

    def __init__(self, rig: Rig, crashes: str = "", crash: Exception | None = None) -> None:
        super().__init__(rig.volume, rig.log)
        self.staged: list[str] = []
        self.crashes, self.crash = crashes, crash
        rig.store = self
        rig.controller.volume = self

    async def stage(
        self, namespace: str, name: str, *args: Any, **kwargs: Any
    ) -> publishing.StagedRevision:
        self.staged.append(name)
        if name == self.crashes and self.crash is not None:
            raise self.crash
        return await super().stage(namespace, name, *args, **kwargs)


@pytest.mark.parametrize(
    "bomb",
    [b for b in bombs.bombs() if b.name in ("nesting-bomb", "long-number")],
    ids=lambda b: b.name,
)
async def test_a_bomb_fails_its_adapter_and_is_not_staged_again_after_a_restart(
    tmp_path: Path, bomb: bombs.Bomb
) -> None:
    """The two that raised RecursionError and ValueError out of json.loads, leaving the adapter
    Pending behind a dead task: now Failed, NotALora, saying why; a restarted operator resumes
    it from its status as Failed and stages nothing, and the other adapter is Ready."""
    async with Rig(tmp_path) as rig:
        store = CountingStore(rig)
        c = rig.controller
        c.start()
        c.pod_changed(pod("p1"))
        path = rig.volume / NS / "src" / "bomb.safetensors"
        path.parent.mkdir(parents=True)
        path.write_bytes(bomb.build())
        body = adapter(rig.volume, "bomb")
        body["spec"]["source"]["uri"] = str(path)
        c.adapter_changed(body)
        c.adapter_changed(adapter(rig.volume, "good"))
        await until("Failed", lambda: "Failed" in rig.api.phases("bomb"))
        await until("the other Ready", lambda: rig.ready("good"))
        staged = failed_condition(rig, "bomb")
        assert staged["reason"] == "NotALora"
        assert bomb.message in staged["message"]
        assert store.staged.count("bomb") == 1
        written = rig.api.status["bomb"][-1]

    restarted, _ = rig.restarted()
    restarted.start()
    try:
        restarted.pod_changed(pod("p1"))
        restarted.adapter_changed({**body, "status": written})
        assert restarted.adapters[(NS, "bomb")].staging.task is None
        assert restarted.adapters[(NS, "bomb")].staging.state.error_reason == "NotALora"
    finally:
        await restarted.stop()
    assert store.staged.count("bomb") == 1


async def test_an_exception_no_check_names_fails_the_adapter_with_its_traceback_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Whatever escapes the store (here a RecursionError, as json.loads raised on a nested
    header) ends as a Failed adapter with a reason and a message, its traceback in the log,
    never a staging task that died with the adapter left as it was; permanent for the
    generation, so it is not tried again in a loop, and a new generation stages it again."""
    async with Rig(tmp_path) as rig:
        store = CountingStore(rig, crashes="a", crash=RecursionError("too deep"))
        c = rig.controller
        c.start()
        c.pod_changed(pod("p1"))
        body = adapter(rig.volume, "a")
        with caplog.at_level(logging.ERROR, logger="lora_operator"):
            c.adapter_changed(body)
            await until("Failed", lambda: "Failed" in rig.api.phases("a"))
        staged = failed_condition(rig, "a")
        assert staged["reason"] == stager.StagingCrashed.reason == "InternalError"
        assert staged["message"] == (
            "staging stopped on an unexpected RecursionError, a fault of the operator's (its log "
            "has the traceback: report it); change the spec to stage it again"
        )
        crashed = [r for r in caplog.records if "result=crashed" in r.getMessage()]
        assert crashed and crashed[0].exc_info is not None
        assert isinstance(crashed[0].exc_info[1], RecursionError)
        assert not [r for r in caplog.records if "result=died" in r.getMessage()]
        task = rig.controller.adapters[(NS, "a")].staging.task
        assert task is not None and task.done() and task.exception() is None
        assert store.staged == ["a"]
        # A new generation is staged again (and the store no longer crashes).
        store.crash = None
        c.adapter_changed({**body, "metadata": {**body["metadata"], "generation": 2}})
        await until("Ready", lambda: rig.ready("a"))
        assert store.staged == ["a", "a"]
