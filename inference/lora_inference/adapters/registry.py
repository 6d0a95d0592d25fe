"""The names this server answers to, and which validated file each one means.

Registration is unlimited and cheap: a record is a path and a hash. Records are immutable; an
in-place swap registers a new record under the same name with a new `version`, so requests that
were admitted before the swap keep the record they resolved and finish with the old weights.

Who may take a name is decided here too (`plan_register`): names the operator manages (loaded
through the admin API, resolved from the volume it publishes, or given on the command line) always
win over names a client registered in a generation request.

Imports no torch: it is pure bookkeeping.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from lora_inference import errors

# How a record came to be: given on the command line, loaded through the admin API, found on the
# adapter volume, registered by a request (`lora.local_path`), or stacked from registered records
# for a request that named several (`stack`: never registered under a name, see admission).
Origin = Literal["static", "api", "resolver", "request", "stack"]
# What `plan_register` tells the engine to do with a name: register a new record (`add`),
# register one over the existing record (`replace`: the old one is retired and leaves every tier
# once no request holds it), or answer with the existing record (`reuse`).
Registration = Literal["add", "replace", "reuse"]

_versions = itertools.count(1)


def next_version() -> int:
    return next(_versions)


@dataclass(frozen=True)
class AdapterRecord:
    name: str
    path: Path  # what the client named, resolved: a directory or a file
    weights_file: Path
    sha256: str
    size_bytes: int
    rank: int
    pinned: bool
    origin: Origin
    version: int
    # The weight a request that names the adapter without a `lora.scale` gets (the CRD's
    # `spec.scale`); set by the load call.
    scale: float = 1.0
    # A stack: the records it sums, each at its scale, in name order (empty for a file).
    members: tuple[tuple[AdapterRecord, float], ...] = ()
    # What the file is (lora_volume.formats.Format.key), which components it changes, and the
    # words its metadata says to prompt with: shown to users, never used to serve.
    format: str = "lora"
    targets: tuple[str, ...] = ()
    trigger_words: tuple[str, ...] = ()

    @property
    def key(self) -> str:
        """The name the adapter has inside the pipeline.

        peft stores adapters in ModuleDicts, whose keys may not contain '.', and a swapped
        adapter must coexist with its predecessor for a moment; a version-derived key gives both.
        """
        return f"lora_v{self.version}"


def plan_register(
    existing: AdapterRecord | None,
    origin: Origin,
    path: Path,
    *,
    load_inplace: bool = False,
    pinned: bool = False,
    scale: float = 1.0,
) -> Registration:
    """Decide what registering `path` as a name held by `existing` does (pure: changes nothing).

    Raises AdapterConflict, saying what to do instead, when the registration must be refused.
    A request (`lora.local_path`) never takes or replaces a name the server or its operator
    manages (`static`, `api`, `resolver`): otherwise a client could shadow an adapter before the
    operator loads it and make that load fail. The other way round, an admin load replaces a
    request's or a resolver hit's registration without `load_inplace` (a request may resolve the
    name between the operator's read of `/v1/models` and its load): the operator must not see a
    conflict it did not cause. An admin load that repeats the one that registered the name (same
    path, pin and scale: a retry whose first answer was lost) changes nothing and succeeds;
    `load_inplace` reads the path again.
    """
    if existing is None:
        return "add"
    name = existing.name
    if origin == "request":
        if existing.path == path:
            return "reuse"
        if existing.origin != "request":
            raise errors.AdapterConflict(
                f"adapter {name!r} is managed by the server (loaded through the admin API, "
                f"from the adapter volume or the command line); a request cannot replace it: "
                "name it in 'model' without 'lora.local_path', or use another name",
                param="lora.name",
            )
        raise errors.AdapterConflict(
            f"adapter {name!r} is already loaded from {existing.path}, not {path}; "
            "use another name or replace it with load_lora_adapter and load_inplace",
            param="lora.name",
        )
    if existing.origin == "static":
        raise errors.AdapterConflict(
            f"adapter {name!r} was given on the command line and cannot be replaced",
            param="lora_name",
        )
    if origin == "resolver":
        return "replace" if existing.origin == "request" else "reuse"  # resolved or loaded first
    same = (existing.path, existing.pinned, existing.scale) == (path, pinned, scale)
    if existing.origin == "api" and same and not load_inplace:
        return "reuse"
    if existing.origin in ("request", "resolver"):
        return "replace"
    if not load_inplace:
        raise errors.AdapterConflict(
            f"adapter {name!r} is already loaded (from {existing.path}); unload it first "
            "or pass load_inplace: true to replace it",
            param="lora_name",
        )
    return "replace"


@dataclass
class UsageStats:
    hits: int = 0
    last_used: float | None = None


@dataclass
class Registry:
    _records: dict[str, AdapterRecord] = field(default_factory=dict)
    _stats: dict[str, UsageStats] = field(default_factory=dict)

    def get(self, name: str) -> AdapterRecord | None:
        return self._records.get(name)

    def put(self, record: AdapterRecord) -> AdapterRecord | None:
        """Register `record`; return the record it replaced, if any."""
        previous = self._records.get(record.name)
        self._records[record.name] = record
        self._stats.setdefault(record.name, UsageStats())
        return previous

    def remove(self, name: str) -> AdapterRecord | None:
        self._stats.pop(name, None)
        return self._records.pop(name, None)

    def record_hit(self, name: str) -> None:
        stats = self._stats.setdefault(name, UsageStats())
        stats.hits += 1
        stats.last_used = time.time()

    def stats(self, name: str) -> UsageStats:
        return self._stats.get(name, UsageStats())

    def records(self) -> list[AdapterRecord]:
        return sorted(self._records.values(), key=lambda r: r.name)

    def pinned(self) -> list[AdapterRecord]:
        return [r for r in self.records() if r.pinned]

    def __len__(self) -> int:
        return len(self._records)
