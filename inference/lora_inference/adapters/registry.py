"""The names this server answers to, and which validated file each one means.

Registration is unlimited and cheap: a record is a path and a hash. Records are immutable; an
in-place swap registers a new record under the same name with a new `version`, so requests that
were admitted before the swap keep the record they resolved and finish with the old weights.

Imports no torch: it is pure bookkeeping.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

Origin = Literal["static", "api", "resolver", "request"]

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

    @property
    def key(self) -> str:
        """The name the adapter has inside the pipeline.

        peft stores adapters in ModuleDicts, whose keys may not contain '.', and a swapped
        adapter must coexist with its predecessor for a moment; a version-derived key gives both.
        """
        return f"lora_v{self.version}"


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
