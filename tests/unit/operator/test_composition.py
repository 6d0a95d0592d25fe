"""Compositions (`spec.compose`): what one is built from (pure), how the store publishes it on a
real volume, and how the controller follows its members (real store, pods in memory)."""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
from lora_operator.controller import needs_staging
from lora_operator.rules import composition, errors
from lora_operator.rules.model import StagedRef, adapter_info
from lora_operator.store import sources, staging
from lora_volume import description, formats, layout, stacks

from tests.support.controller import NS, Rig, adapter, pod
from tests.support.loras import lora_bytes
from tests.support.polling import until

A, B = "a" * 64, "b" * 64


DUO_SPEC = {"baseModel": "sd", "compose": [{"name": "b", "scale": 0.5}, {"name": "a"}]}


def info(name: str, spec: dict[str, Any], **meta: Any) -> Any:
    return adapter_info(
        {"metadata": {"namespace": NS, "name": name, "generation": 1, **meta}, "spec": spec}
    )


DUO = info("duo", DUO_SPEC)
PLAIN = {"baseModel": "sd", "source": {"uri": "/x"}}


def member(
    name: str, sha: str | None = B, spec: dict[str, Any] = PLAIN, **meta: Any
) -> composition.MemberState:
    return composition.MemberState(
        info=info(name, spec, **meta), staged=StagedRef(sha, 10) if sha else None
    )


def members(**staged: str | None) -> dict[str, composition.MemberState]:
    return {name: member(name, sha) for name, sha in staged.items()}


def declaring(name: str, fmt: formats.Format) -> composition.MemberState:
    """A staged member whose file is of format `fmt`."""
    adapter = description.Description(fmt, rank=4, targets=("unet",), trigger_words=())
    return dataclasses.replace(member(name), adapter=adapter)


def test_members_whose_files_stack_compose() -> None:
    for fmt in (formats.LORA, formats.LOHA, formats.LOKR, formats.LORA_BIAS, formats.XLABS):
        state = {**members(a=A), "b": declaring("b", fmt)}
        assert len(composition.plan_composition(DUO, state)) == 2, fmt


def test_a_composition_is_built_from_its_members_staged_revisions() -> None:
    entries = composition.plan_composition(DUO, members(a=A, b=B))
    assert entries == (stacks.StackEntry("b", B, 0.5), stacks.StackEntry("a", A, 1.0))
    # The revision follows the members' revisions and scales, not their order.
    again = composition.composed_revision(tuple(reversed(entries)))
    assert composition.composed_revision(entries) == again
    other = composition.plan_composition(DUO, members(a=B, b=B))
    assert composition.composed_revision(other) != again


def test_block_weights_are_carried_in_spec_order_and_make_their_own_revision() -> None:
    """One member with blocks is a composition (a block-weighted variant of an adapter); its
    blocks reach the manifest in group order, and changing one stages a new revision."""
    spec = {"baseModel": "sd", "compose": [{"name": "a", "blocks": {"up": 0, "down": 0.5}}]}
    (entry,) = composition.plan_composition(info("a-blocks", spec), members(a=A))
    assert entry == stacks.StackEntry("a", A, 1.0, blocks=(("down", 0.5), ("up", 0.0)))
    plain = stacks.StackEntry("a", A, 1.0)
    assert composition.composed_revision((entry,)) != composition.composed_revision((plain,))
    spec["compose"][0]["blocks"] = {"up": 0, "down": 0.25}  # type: ignore[index]
    (moved,) = composition.plan_composition(info("a-blocks", spec), members(a=A))
    assert composition.composed_revision((moved,)) != composition.composed_revision((entry,))


@pytest.mark.parametrize(
    ("state", "error", "says"),
    [
        pytest.param(members(a=A), errors.MemberMissing, "names 'b', which is no", id="missing"),
        pytest.param(
            {**members(a=A), "b": member("b", deletionTimestamp="t")},
            errors.MemberMissing,
            "is being deleted",
            id="deleting",
        ),
        pytest.param(
            {**members(a=A), "b": member("b", spec={**DUO_SPEC, "compose": [{"name": "a"}]})},
            errors.MemberInvalid,
            "'b', which is a composition",
            id="nested",
        ),
        pytest.param(
            {**members(a=A), "b": member("b", spec={**PLAIN, "baseModel": "sdxl"})},
            errors.MemberInvalid,
            "'b' is for 'sdxl'",
            id="base-model",
        ),
        pytest.param(
            members(a=A, b=None), errors.MemberNotStaged, "waiting for 'b'", id="unstaged"
        ),
        pytest.param(
            {**members(a=A), "b": declaring("b", formats.LOKR_FULL)},
            errors.MemberInvalid,
            "'b' is a LyCORIS LoKr with a full w2 file",
            id="merged-only",
        ),
        pytest.param(
            {**members(a=A), "b": declaring("b", formats.DORA)},
            errors.MemberInvalid,
            "'b' is a DoRA (peft) file",
            id="dora",
        ),
    ],
)
def test_what_stops_a_composition_is_named(
    state: dict[str, composition.MemberState], error: type[errors.StagingError], says: str
) -> None:
    with pytest.raises(error) as e:
        composition.plan_composition(DUO, state)
    assert says in e.value.message
    assert e.value.degrades_at_once is (error is not errors.MemberNotStaged)


def test_a_composition_is_staged_again_when_its_members_make_another_revision() -> None:
    entries = composition.plan_composition(DUO, members(a=A, b=B))
    now = composition.composed_revision(entries)
    staged = adapter_info(
        {
            "metadata": {"namespace": NS, "name": "duo", "generation": 1},
            "spec": DUO_SPEC,
            "status": {"staged": {"sha256": now, "sizeBytes": 1}},
        }
    )
    assert not needs_staging(staged, 1, now, now)
    assert needs_staging(staged, 1, now, "c" * 64)  # a member's revision changed
    assert needs_staging(staged, 1, now, None)  # a member is missing: the attempt says so


# ---- the store


async def test_a_composed_revision_holds_its_manifest_and_links_to_the_members_weights(
    tmp_path: Path,
) -> None:
    store = staging.Store(tmp_path)
    staged = {}
    for seed, name in enumerate(("a", "b")):
        src = tmp_path / NS / "src" / f"{name}.safetensors"
        src.parent.mkdir(parents=True, exist_ok=True)
        src.write_bytes(lora_bytes(seed))
        staged[name] = await store.stage(NS, name, sources.VolumeSource(src))
    entries = (
        stacks.StackEntry("b", staged["b"].sha256, 0.5),
        stacks.StackEntry("a", staged["a"].sha256, 1.0),
    )
    duo = await store.stage_composition(NS, "duo", entries)
    assert duo.sha256 == composition.composed_revision(entries) and not duo.reused
    found = layout.resolve_on_root(layout.namespace_root(tmp_path, NS), "duo")
    assert found == duo.path and stacks.is_stack(found)
    manifest = (found / stacks.STACK_FILE).read_bytes()
    assert stacks.parse_manifest(manifest, where="x") == (entries[1], entries[0])  # name order
    for entry in entries:
        weights = found / entry.file
        assert os.path.samefile(weights, layout.object_path(tmp_path, entry.sha256))
    assert duo.size == len(manifest) + sum(s.size for s in staged.values())
    # Again: the same revision, reused; a member's revision gone (collected with its object):
    # waiting, nothing published.
    assert (await store.stage_composition(NS, "duo", entries)).reused
    shutil.rmtree(staged["a"].path)
    layout.object_path(tmp_path, staged["a"].sha256).unlink()
    moved = (stacks.StackEntry("a", staged["a"].sha256, 0.9), entries[0])
    with pytest.raises(errors.MemberNotStaged, match="'a'"):
        await store.stage_composition(NS, "duo", moved)
    assert store.current_revision(NS, "duo") == duo.sha256
    # The collected object's weights live on in the composed revision (a hard link).
    assert (found / entries[1].file).read_bytes() == lora_bytes(0)


async def test_a_composition_takes_no_weights_its_namespace_has_not_staged(
    tmp_path: Path,
) -> None:
    """A member's revision is looked up in the composition's own namespace: another
    namespace's stored weights, named by their sha256, are never linked."""
    store = staging.Store(tmp_path)
    src = tmp_path / "team-b" / "src" / "private.safetensors"
    src.parent.mkdir(parents=True)
    src.write_bytes(lora_bytes(3))
    private = await store.stage("team-b", "private", sources.VolumeSource(src))
    stolen = (stacks.StackEntry("private", private.sha256, 1.0),)
    with pytest.raises(errors.MemberNotStaged, match="'private'"):
        await store.stage_composition(NS, "duo", stolen)
    assert store.current_revision(NS, "duo") is None
    assert not layout.namespace_root(tmp_path, NS).exists()


# ---- the controller


async def test_a_composition_follows_its_members_revisions_and_degrades_without_one(
    tmp_path: Path,
) -> None:
    async with Rig(tmp_path, status_settle_s=0.0) as rig:
        c = rig.controller
        c.start()
        c.pod_changed(pod("p1"))
        # The composition first: it waits for its members, then is built from them.
        c.adapter_changed({**_body("duo"), "spec": DUO_SPEC})
        await until("duo waits", lambda: "MemberMissing" in _reasons(rig, "duo"))
        c.adapter_changed(adapter(rig.volume, "a", seed=1))
        c.adapter_changed(adapter(rig.volume, "b", seed=2))
        await until("duo Ready", lambda: rig.ready("duo"))
        first = _staged(rig, "duo")
        assert rig.pods.held["p1"]["duo"].revision == first
        # A member's new revision makes a new composition, loaded in place on the pod.
        src = rig.volume / NS / "src" / "a.safetensors"
        src.unlink()
        src.write_bytes(lora_bytes(7))
        c.adapter_changed({**adapter(rig.volume, "a"), "metadata": _meta("a", generation=2)})
        await until("a new duo", lambda: _staged(rig, "duo") not in (None, first))
        await until("loaded", lambda: rig.pods.held["p1"]["duo"].revision == _staged(rig, "duo"))
        # A member deleted: Degraded with the reason; the pod keeps the revision it has.
        c.adapter_changed(
            {**adapter(rig.volume, "b"), "metadata": {**_meta("b"), "deletionTimestamp": "now"}}
        )
        await until("duo Degraded", lambda: rig.api.phases("duo")[-1] == "Degraded")
        degraded = rig.api.status["duo"][-1]
        cond = next(x for x in degraded["conditions"] if x["type"] == "Degraded")
        assert cond["reason"] == "MemberMissing" and "'b'" in cond["message"]
        assert rig.pods.held["p1"]["duo"].revision == _staged(rig, "duo")
        # It comes back: staged again at once (not after the failed attempt's backoff) from
        # the same revisions, Ready again.
        waiting = c.adapters[(NS, "duo")].staging.task
        assert waiting is not None and not waiting.done()
        c.adapter_changed(adapter(rig.volume, "b"))
        assert c.adapters[(NS, "duo")].staging.task is not waiting
        await until("duo Ready again", lambda: rig.api.phases("duo")[-1] == "Ready")


def _meta(name: str, generation: int = 1) -> dict[str, Any]:
    return {"namespace": NS, "name": name, "uid": f"uid-{name}", "generation": generation}


def _body(name: str) -> dict[str, Any]:
    return {"metadata": _meta(name)}


def _reasons(rig: Rig, name: str) -> list[str]:
    return [
        cond["reason"]
        for status in rig.api.status.get(name, [])
        for cond in status.get("conditions", [])
        if cond["type"] in ("Staged", "Degraded")
    ]


def _staged(rig: Rig, name: str) -> str | None:
    rec = rig.controller.adapters.get((NS, name))
    staged = rec.staging.state.staged if rec is not None else None
    return staged.sha256 if staged is not None else None
