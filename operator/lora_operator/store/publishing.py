"""Publishing on the adapter volume: a verified download, or a composition's manifest and its
members' weights, made a namespace's current revision; and what a published revision declares.

`publish_download` hard-links a download its namespace verified into the content store
(`.objects/sha256/<hex>.safetensors`, stored once: another namespace's object is linked to, never
handed out) and builds the revision on it; `publish_composition` builds a composition's revision
from its manifest and hard links to the weights of its members' revisions in the same namespace.
Both admit the revision into the namespace's quota before anything is linked (`quota.Ledger`),
build it and point the target and `current` by the atomic operations of `volumefiles` (a kill at
any point leaves at most files under `.tmp/`), then commit it to the ledger. `describe_revision`
and `describe_file` read what weights declare from their headers.

Blocking file-system calls only: the store (`staging.Store`) runs them in a thread, under the
namespace's publish lock (`publishlocks`), so no collection and no other publish in the
namespace runs in between; other namespaces may publish meanwhile (an object both store at once
is linked by one, found by the other). Raises only StagingErrors. Must not: fetch, or
decide what is collected.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from lora_volume import description, files, layout, stacks, targeting
from lora_volume import errors as volume_errors

from lora_operator.rules import errors
from lora_operator.store import quota, sinks, volumefiles


@dataclass(frozen=True)
class StagedRevision:
    namespace: str
    name: str
    sha256: str
    size: int
    path: Path  # the revision directory, what a pod's load call names
    reused: bool  # the content was already in the store: nothing new was written
    adapter: description.Description  # what its weights declare (`describe_revision`)
    # What the source resolved to when this staging fetched it (`fetchers.fetch`: an oci://
    # reference's manifest by digest); None when nothing was fetched (a pin already held, a
    # composition) or the source names no resolution. The store sets it; publishing never does.
    resolved: str | None = None
    # `current` pointed at another revision before: that one may be in use by nothing now (a
    # first staging, or one of the revision already current, leaves nothing to collect).
    superseded: bool = False


def publish_download(
    root: Path,
    ledger: quota.Ledger,
    namespace: str,
    name: str,
    digest: str,
    tmp: Path | None,
    target: targeting.Target | None,
    adapter: description.Description | None = None,
    reservation: quota.Reservation | None = None,
) -> StagedRevision:
    """Publish `digest` (from the download at `tmp`, or already held by the namespace) as
    `name`'s current revision; `adapter`: what the download declares, already read (None:
    read it from the stored object); `reservation`: the download's, which the published
    revision takes over."""
    try:
        return _publish_download(
            root, ledger, namespace, name, digest, tmp, target, adapter, reservation
        )
    except OSError as e:
        raise sinks.disk_error(e) from e


def _publish_download(
    root: Path,
    ledger: quota.Ledger,
    namespace: str,
    name: str,
    digest: str,
    tmp: Path | None,
    target: targeting.Target | None,
    adapter: description.Description | None,
    reservation: quota.Reservation | None,
) -> StagedRevision:
    obj = layout.object_path(root, digest)
    obj.parent.mkdir(parents=True, exist_ok=True)
    reused = True
    if tmp is not None:
        # Verified by this namespace's own download, so it may hold the bytes, stored
        # once: the object already there (another namespace's) or the download.
        stored = obj.stat() if obj.exists() else tmp.stat()
        ledger.admit(
            namespace,
            reservation,
            {(stored.st_dev, stored.st_ino): stored.st_size},
        )
        os.chmod(tmp, 0o444)
        try:
            os.link(tmp, obj)
            reused = False
            volumefiles.fsync_dir(obj.parent)
        except FileExistsError:
            pass
    ns_root = layout.namespace_root(root, namespace)
    revision = layout.revision_dir(ns_root, name, digest)
    volumefiles.build_revision(root, revision, lambda d: os.link(obj, d / layout.WEIGHTS_FILE))
    ledger.commit(namespace, reservation, volumefiles.revision_files(revision))
    superseded = volumefiles.point(root, ns_root, name, digest, target)
    return StagedRevision(
        namespace=namespace,
        name=name,
        sha256=digest,
        size=obj.stat().st_size,
        path=revision,
        reused=reused,
        adapter=adapter or describe_revision(revision, name),
        superseded=superseded,
    )


def publish_composition(
    root: Path,
    ledger: quota.Ledger,
    namespace: str,
    name: str,
    digest: str,
    manifest: bytes,
    entries: Sequence[stacks.StackEntry],
    target: targeting.Target | None,
) -> StagedRevision:
    """Publish the composition of `entries` as `name`'s current revision `digest` (the hash of
    `manifest`), its members' weights linked from their revisions in `namespace`; the
    namespace's usage must have been read into `ledger`."""
    ns_root = layout.namespace_root(root, namespace)
    # Through the namespace's own door: its members' revisions, which it staged itself.
    weights = {
        e.name: layout.revision_dir(ns_root, e.name, e.sha256) / layout.WEIGHTS_FILE
        for e in entries
    }
    gone = [n for n, path in weights.items() if not path.is_file()]
    if gone:
        # Collected between the member's staging and this one: staging the member again
        # (its next change, or the operator's restart) brings the content back.
        raise errors.MemberNotStaged(
            f"the staged revisions of {', '.join(map(repr, gone))} are no longer on the "
            "volume; waiting for them to be staged again"
        )

    def fill(building: Path) -> None:
        (building / stacks.MEMBERS_DIR).mkdir()
        for entry in entries:
            os.link(weights[entry.name], building / entry.file)
        (building / stacks.STACK_FILE).write_bytes(manifest)
        os.chmod(building / stacks.STACK_FILE, 0o444)
        os.chmod(building / stacks.MEMBERS_DIR, 0o755)
        volumefiles.fsync_dir(building / stacks.MEMBERS_DIR)

    revision = layout.revision_dir(ns_root, name, digest)
    reused = revision.is_dir()
    try:
        if not reused:
            members = [path.stat() for path in weights.values()]
            ledger.admit(
                namespace,
                None,
                {(st.st_dev, st.st_ino): st.st_size for st in members},
                extra=len(manifest),
            )
        volumefiles.build_revision(root, revision, fill)
        ledger.commit(namespace, None, volumefiles.revision_files(revision))
        superseded = volumefiles.point(root, ns_root, name, digest, target)
        size = len(manifest) + sum(path.stat().st_size for path in weights.values())
    except OSError as e:
        raise sinks.disk_error(e) from e
    return StagedRevision(
        namespace=namespace,
        name=name,
        sha256=digest,
        size=size,
        path=revision,
        reused=reused,
        adapter=describe_revision(revision, name),
        superseded=superseded,
    )


def describe_revision(revision: Path, name: str) -> description.Description:
    """What the weights of a published revision declare, from their headers only (a few
    kilobytes each, however large the file): a composition's is its members' stacked
    (`description.stacked`), in the manifest's order. Raises only StagingErrors."""
    try:
        if stacks.is_stack(revision):
            manifest = revision / stacks.STACK_FILE
            entries = stacks.parse_manifest(manifest.read_bytes(), where=str(manifest))
            return description.stacked(
                [
                    describe_file(revision / e.file, f"member {e.name!r} of {name!r}")
                    for e in entries
                ]
            )
        return describe_file(revision / layout.WEIGHTS_FILE, repr(name))
    except volume_errors.VolumeError as e:
        raise errors.from_volume(e) from e
    except OSError as e:
        raise sinks.disk_error(e) from e


def describe_file(path: Path, what: str) -> description.Description:
    """What the safetensors file at `path` declares; refuses one that is not an adapter the
    server serves, with the server's own checks (`lora_volume.errors.InvalidAdapter`)."""
    return description.describe(files.read_safetensors_header(path, name=what), name=what)
