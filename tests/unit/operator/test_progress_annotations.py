"""The delete handler's progress costs no write of its own: stored and purged in the patch of the
cycle that ran it, it leaves that patch empty, so kopf sends only the finalizer's release."""

from __future__ import annotations

import kopf
import pytest
from lora_operator.edges import handlers


def _patch_after_one_cycle(storage: kopf.ProgressStorage) -> kopf.Patch:
    body = kopf.Body({"metadata": {"name": "pixel", "namespace": "team-a", "annotations": {}}})
    patch = kopf.Patch()
    record: kopf.ProgressRecord = {"started": "2026-12-07T00:00:00", "success": True, "retries": 1}
    storage.store(key=kopf.HandlerId("unload"), record=record, body=body, patch=patch)
    storage.purge(key=kopf.HandlerId("unload"), body=body, patch=patch)
    return patch


def test_a_handler_done_in_one_cycle_leaves_nothing_to_write() -> None:
    patch = _patch_after_one_cycle(handlers.ProgressAnnotations(prefix=handlers.ANNOTATION_PREFIX))
    # An empty patch is not sent (kopf checks its truth: no merge part, no JSON-patch part).
    assert dict(patch) == {} and not patch, dict(patch)


def test_kopfs_own_storage_would_write_its_marker() -> None:
    """The control: kopf's storage leaves its marker in the same patch, a write per deletion."""
    patch = _patch_after_one_cycle(
        kopf.AnnotationsProgressStorage(prefix=handlers.ANNOTATION_PREFIX)
    )
    assert patch["metadata"]["annotations"] == {"lora.dev/kopf-managed": "yes"}


@pytest.mark.parametrize("stored_before", [True, False])
def test_progress_stored_in_an_earlier_cycle_is_still_purged(stored_before: bool) -> None:
    """A handler that did not finish at once (an earlier cycle stored its progress on the object)
    has its annotation removed when it is purged."""
    storage = handlers.ProgressAnnotations(prefix=handlers.ANNOTATION_PREFIX)
    key = "lora.dev/unload"
    annotations = {key: '{"started": "2026-12-07T00:00:00"}'} if stored_before else {}
    body = kopf.Body({"metadata": {"name": "pixel", "annotations": annotations}})
    patch = kopf.Patch()
    storage.purge(key=kopf.HandlerId("unload"), body=body, patch=patch)
    got = dict(patch).get("metadata", {}).get("annotations", {})
    assert got == ({key: None} if stored_before else {}), got
