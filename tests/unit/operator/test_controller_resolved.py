"""What an oci:// source resolved to, through the controller (its rig: pods answering from
memory, a recording API) with the real store fetching from a real registry (Debian's
docker-registry on 127.0.0.1, tests/support/registry.py). What is tested: the manifest's digest
`lora-operator adapter push` printed is written in status.staged.resolvedSource with the staging;
a restarted operator keeps it and writes nothing; a tag moved to other content, staged again by
a new spec, is a new revision whose status names the new manifest."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from tests.support import registry as reg
from tests.support.controller import NS, Rig, pod
from tests.support.loras import lora_bytes, sha
from tests.support.polling import until
from tests.support.staging import LOCAL, make_store


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[reg.Registry]:
    with reg.run_registry(tmp_path_factory.mktemp("registry"), "anonymous") as r:
        yield r


def push(registry: reg.Registry, tmp: Path, ref: str, data: bytes) -> str:
    """Push `data` as an adapter artifact; what the push printed (the manifest, by digest)."""
    path = tmp / "adapter.safetensors"
    path.write_bytes(data)
    result = reg.push(registry, path, ref)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def merged(patches: list[dict[str, Any]]) -> dict[str, Any]:
    """The status after these merge patches, as the API server keeps it (RFC 7386: objects
    merged key by key, a None removes the key)."""

    def merge(into: dict[str, Any], patch: Mapping[str, Any]) -> dict[str, Any]:
        for key, value in patch.items():
            if value is None:
                into.pop(key, None)
            elif isinstance(value, Mapping):
                into[key] = merge(dict(into.get(key) or {}), value)
            else:
                into[key] = value
        return into

    out: dict[str, Any] = {}
    for patch in patches:
        merge(out, patch)
    return out


def body(uri: str, generation: int = 1, **spec: Any) -> dict[str, Any]:
    return {
        "metadata": {
            "namespace": NS,
            "name": "pixel",
            "uid": "uid-pixel",
            "generation": generation,
        },
        "spec": {"baseModel": "sd", "source": {"uri": uri}, **spec},
    }


def staged_of(patches: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [p["staged"] for p in patches if p.get("staged")]


async def test_the_resolved_manifest_is_written_with_the_staging_and_kept_by_a_restart(
    registry: reg.Registry, tmp_path: Path
) -> None:
    first, second = lora_bytes(seed=21), lora_bytes(seed=22)
    first_manifest = push(registry, tmp_path, "team/pixel:stable", first)
    uri = f"oci://{registry.address}/team/pixel:stable"
    rules = dataclasses.replace(LOCAL, insecure_registries=(registry.address,))

    async with Rig(tmp_path) as rig:
        store = make_store(rig.volume, rules=rules)
        c = rig.controller
        c.volume = store
        c.start()
        c.pod_changed(pod("p1"))
        c.adapter_changed(body(uri))
        await until("Ready", lambda: rig.ready("pixel"), timeout=30)
        await asyncio.sleep(1.0)  # the last progress writes
        patches = rig.api.status["pixel"]
        # Every write that carries the staged revision names the manifest, from the first on.
        assert [s.get("resolvedSource") for s in staged_of(patches)] == [first_manifest] * len(
            staged_of(patches)
        )
        status = merged(patches)
        assert status["staged"]["sha256"] == sha(first)
        assert status["staged"]["resolvedSource"] == first_manifest
    reads = dict(rig.pods.reads)

    # A restarted operator on the same pods, volume and object.
    restarted, api = rig.restarted(status_progress_s=0.0)
    restarted.volume = store
    restarted.start()
    try:
        restarted.pod_changed(pod("p1"))
        restarted.adapter_changed({**body(uri), "status": status})
        await until(
            "the pod read twice", lambda: rig.pods.reads.get("p1", 0) >= reads.get("p1", 0) + 2
        )
        await asyncio.sleep(1.0)
        assert api.status == {}  # nothing written: the status read back is what it renders
        rec = restarted.adapters[(NS, "pixel")]
        assert rec.staging.task is None  # nothing fetched again
        assert rec.staging.state.resolved == first_manifest

        # The tag moved; a new spec stages it again: a new revision, and the new manifest.
        second_manifest = push(registry, tmp_path, "team/pixel:stable", second)
        selector = {"matchLabels": {"lora.dev/inference": "true"}}
        restarted.adapter_changed({**body(uri, 2, selector=selector), "status": status})
        await until(
            "the new revision staged",
            lambda: any(s["sha256"] == sha(second) for s in staged_of(api.status.get("pixel", []))),
            timeout=30,
        )
        now = merged([status, *api.status["pixel"]])["staged"]
        assert (now["sha256"], now["resolvedSource"]) == (sha(second), second_manifest)
        assert second_manifest != first_manifest
    finally:
        await restarted.stop()
