"""Each namespace's share of the adapter volume: what it holds, what its downloads in progress
take, and whether more fits its quota (`--namespace-quota`).

A namespace's usage is the bytes of the distinct files its revisions hold (`<ns>/*/revisions/`),
counted once per file however many of its revisions link it (a hard link is the same file:
`ObjectKey`), plus the bytes its downloads in progress have reserved. A file that several
namespaces hold counts in full in each of them: what a namespace may serve is what it holds,
and its usage must not change when another namespace stages or deletes the same bytes. So the
namespaces' usages may add up to more than the volume holds.

`check` decides (pure); `Ledger` is the store's record of every namespace's usage, which the
store (`staging.Store`) loads from the volume (`volumefiles.held_objects`) and keeps up to date
as it publishes (`publishing`) and collects. A download's share is a `Reservation`, grown as the
download's sink hears of bytes announced and written, on the fetchers' worker threads, so the
ledger has a lock of its own. Must not: read or write the volume.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from lora_operator.rules import errors

ObjectKey = tuple[int, int]  # (st_dev, st_ino): one file, whatever links name it
UsageCallback = Callable[[str, int], None]  # (namespace, bytes): a namespace's usage changed


@dataclass(frozen=True)
class Usage:
    stored: int  # the distinct files its revisions hold
    downloading: int  # reserved by its downloads in progress

    @property
    def total(self) -> int:
        return self.stored + self.downloading


def check(namespace: str, usage: Usage, adding: int, limit: int | None) -> None:
    """Refuse `adding` more bytes to `namespace` when they would take its usage past `limit`
    (None: no limit); adding nothing is always allowed (pure)."""
    if limit is None or adding <= 0 or usage.total + adding <= limit:
        return
    downloading = (
        f", {size(usage.downloading)} of it downloads in progress" if usage.downloading else ""
    )
    raise errors.QuotaExceeded(
        f"namespace {namespace} uses {size(usage.total)} of its {size(limit)} quota on the "
        f"adapter volume{downloading}; this adapter needs {size(adding)} more. Delete "
        "LoRAAdapters of this namespace that are no longer needed (their files are freed once "
        "no pod uses them, and staging retries) or ask the platform team to raise the "
        "operator's --namespace-quota (operator.namespaceQuota)"
    )


def size(n: int) -> str:
    """Bytes as a person reads them: '1.5 GiB (1610612736 bytes)', '512 bytes' (pure)."""
    for unit, factor in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= factor:
            return f"{n / factor:.1f} {unit} ({n} bytes)"
    return f"{n} bytes"


class Ledger:
    """Every namespace's usage as the store knows it: the files its revisions hold (loaded from
    the volume, then kept by the store's publishes and collections) and its downloads'
    reservations. Thread-safe. `on_usage` hears every change of a namespace's total."""

    def __init__(self, limit: int | None, on_usage: UsageCallback | None = None) -> None:
        self.limit = limit
        self._on_usage = on_usage
        self._lock = threading.Lock()
        self._held: dict[str, dict[ObjectKey, int]] = {}
        self._stored: dict[str, int] = {}  # the sum of each namespace's `_held`, kept
        self._reserved: dict[str, dict[object, int]] = {}

    def loaded(self, namespace: str) -> bool:
        with self._lock:
            return namespace in self._held

    def load(self, held: Mapping[str, Mapping[ObjectKey, int]], *, every: bool = False) -> None:
        """Take what the volume says the namespaces of `held` hold; `every`: `held` is the whole
        volume, and a namespace it does not name holds nothing."""
        with self._lock:
            changed = set(held) | (set(self._held) if every else set())
            if every:
                self._held, self._stored = {}, {}
            for namespace, files in held.items():
                self._held[namespace] = dict(files)
                self._stored[namespace] = sum(files.values())
            totals = {ns: self._usage(ns).total for ns in changed}
        self._tell(totals)

    def holds(self, namespace: str, key: ObjectKey) -> bool:
        """Whether a revision of `namespace` holds the file `key`."""
        with self._lock:
            return key in self._held.get(namespace, {})

    def usage(self, namespace: str) -> Usage:
        with self._lock:
            return self._usage(namespace)

    def usages(self) -> dict[str, Usage]:
        with self._lock:
            return {ns: self._usage(ns) for ns in self._held.keys() | self._reserved.keys()}

    def reserve(self, namespace: str, token: object, nbytes: int) -> None:
        """Reserve `nbytes` for the download `token` (replacing what it reserved before);
        raises QuotaExceeded, reserving nothing more, when growing it passes the limit."""
        with self._lock:
            reserved = self._reserved.setdefault(namespace, {})
            before = reserved.get(token, 0)
            if nbytes > before:
                check(namespace, self._usage(namespace), nbytes - before, self.limit)
            reserved[token] = nbytes
            total = self._usage(namespace).total
        self._tell({namespace: total})

    def admit(
        self, namespace: str, token: object, files: Mapping[ObjectKey, int], extra: int = 0
    ) -> None:
        """Check that a revision holding `files` (those the namespace holds already add
        nothing) and `extra` new bytes fits, the download `token`'s reservation no longer
        counted: it is what the revision takes over. Raises QuotaExceeded."""
        with self._lock:
            held = self._held.get(namespace, {})
            adding = extra + sum(n for key, n in files.items() if key not in held)
            mine = self._reserved.get(namespace, {}).get(token, 0)
            usage = self._usage(namespace)
            check(namespace, Usage(usage.stored, usage.downloading - mine), adding, self.limit)

    def commit(self, namespace: str, token: object, files: Mapping[ObjectKey, int]) -> None:
        """A revision of `namespace` holding `files` is published: they count as stored, and
        the download `token`'s reservation is released."""
        with self._lock:
            held = self._held.setdefault(namespace, {})
            for key, n in files.items():
                if key not in held:
                    held[key] = n
                    self._stored[namespace] = self._stored.get(namespace, 0) + n
            self._release(namespace, token)
            total = self._usage(namespace).total
        self._tell({namespace: total})

    def release(self, namespace: str, token: object) -> None:
        """The download `token` ended without publishing: its reservation is freed."""
        with self._lock:
            if token not in self._reserved.get(namespace, {}):
                return
            self._release(namespace, token)
            total = self._usage(namespace).total
        self._tell({namespace: total})

    def _release(self, namespace: str, token: object) -> None:
        reserved = self._reserved.get(namespace, {})
        reserved.pop(token, None)
        if not reserved:
            self._reserved.pop(namespace, None)

    def _usage(self, namespace: str) -> Usage:
        return Usage(
            stored=self._stored.get(namespace, 0),
            downloading=sum(self._reserved.get(namespace, {}).values()),
        )

    def _tell(self, totals: Mapping[str, int]) -> None:
        if self._on_usage is not None:
            for namespace, total in sorted(totals.items()):
                self._on_usage(namespace, total)


class Reservation:
    """One download's share of its namespace's quota (`Ledger.reserve`, with itself as
    the token): what its source announced or what it has written, whichever is more, less
    `credit` (the size of the adapter's current revision, which the download most often
    repeats). `announced` and `written` are the download's sink's hooks, so a share that would
    pass the quota raises QuotaExceeded where the fetcher writes, which ends the download.
    `progress` (the staging's) hears what is written."""

    def __init__(
        self,
        ledger: Ledger,
        namespace: str,
        progress: Callable[[int], None] | None,
        credit: int = 0,
    ) -> None:
        self._ledger, self._namespace, self._progress = ledger, namespace, progress
        self._credit = credit
        self._announced = self._written = 0

    def announced(self, declared: int | None) -> None:
        self._announced = declared or 0
        self._reserve()

    def written(self, n: int) -> None:  # the sink's progress callback: the fetcher's thread
        self._written = n
        self._reserve()
        if self._progress is not None:
            self._progress(n)

    def _reserve(self) -> None:
        share = max(self._announced, self._written) - self._credit
        self._ledger.reserve(self._namespace, self, max(0, share))

    def release(self) -> None:
        self._ledger.release(self._namespace, self)
