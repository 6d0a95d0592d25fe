"""The store's staging path grows linearly: the work of staging one adapter does not grow with
the number of adapters the volume holds, counted, not timed (as test_scaling.py counts the
planners; speed figures belong in bench/).

A staging's work is counted three ways, in every thread (the store runs its file operations in
worker threads): the file-system calls it makes (stat, open, link, rename, fsync...), the
directory entries it lists (a listing of a namespace or of the whole volume would be the step
that grows), and the lines of the project's own code it runs (the ledger's lookups included).
Each is measured on a volume holding V = 50 adapters in 5 namespaces and on one holding
V = 500 in 25 namespaces, for a download of a new adapter, a pin the namespace already holds,
and a new spec of an adapter staged before (each into namespaces the store has read), and held
to MARGIN times the small volume's figure: a staging that listed its namespace or the volume
would grow 2x or 10x. The work that is linear by design is held to linear growth: the first
staging of a namespace after a restart reads that namespace once (its quota usage), and a
collection scans the volume (the collector paces it).
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable, Coroutine, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from lora_operator.store import sources, staging
from lora_volume import layout

from tests.support.linecount import project_lines
from tests.support.loras import lora_bytes, sha

HERE = Path(__file__).resolve()
SMALL, LARGE = (50, 5), (500, 25)  # (adapters on the volume, namespaces)
MARGIN = 2.0  # the growth allowed (a listing of the namespace per staging would be 2x more)
M = 8  # stagings measured per case
# The file-system calls counted: what pathlib, tempfile and shutil reach os through.
CALLS = (
    "stat",
    "lstat",
    "open",
    "fsync",
    "link",
    "symlink",
    "readlink",
    "rename",
    "replace",
    "mkdir",
    "rmdir",
    "unlink",
    "chmod",
    "listdir",
    "scandir",
)
BASE = lora_bytes(0)


def content(i: int) -> bytes:
    """A distinct small LoRA file for each i (the last float of a tensor changed)."""
    data = bytearray(BASE)
    data[-4:] = i.to_bytes(4, "little")
    return bytes(data)


@dataclass
class Work:
    calls: int = 0  # file-system calls
    listed: int = 0  # directory entries listed
    lines: int = 0  # lines of the project's own code run
    by_call: dict[str, int] = field(default_factory=dict)

    def __str__(self) -> str:
        return f"{self.calls} calls, {self.listed} entries listed, {self.lines} lines"


@contextmanager
def counted(monkeypatch: pytest.MonkeyPatch) -> Iterator[Work]:
    """Count, in every thread, the file-system calls, the entries listed and the lines of
    the project's code run inside the block; threads started inside it are traced (run the
    work on a new event loop, whose executor starts its own)."""
    work, lock = Work(), threading.RLock()

    def wrap(name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            result = real(*args, **kwargs)
            with lock:
                work.calls += 1
                work.by_call[name] = work.by_call.get(name, 0) + 1
                if name == "listdir":
                    work.listed += len(result)
            if name == "scandir":
                return _Counting(result, work, lock)
            return result

        return call

    for name in CALLS:
        monkeypatch.setattr(os, name, wrap(name, getattr(os, name)))

    def one() -> None:
        with lock:
            work.lines += 1

    try:
        with project_lines(one, threads=True, skip=HERE):
            yield work
    finally:
        monkeypatch.undo()


class _Counting:
    """An os.scandir iterator that counts the entries it yields."""

    def __init__(self, it: Any, work: Work, lock: threading.RLock) -> None:
        self._it, self._work, self._lock = it, work, lock

    def __enter__(self) -> _Counting:
        return self

    def __exit__(self, *exc: object) -> None:
        self._it.close()

    def __iter__(self) -> _Counting:
        return self

    def __next__(self) -> Any:
        entry = next(self._it)
        with self._lock:
            self._work.listed += 1
        return entry

    def close(self) -> None:
        self._it.close()


def run(coro: Callable[[], Coroutine[Any, Any, object]]) -> None:
    """On a new event loop: its worker threads start inside the counted block, traced."""
    asyncio.run(coro())


class Volume:
    """A volume holding `adapters` staged adapters over `namespaces`, each namespace read by
    the store already (its quota usage), and sources for more."""

    def __init__(self, root: Path, adapters: int, namespaces: int) -> None:
        self.root, self.namespaces = root, [f"team-{n}" for n in range(namespaces)]
        self.sources = root / layout.SHARED / "incoming"
        self.sources.mkdir(parents=True)
        self.store = staging.Store(root, namespace_quota=10 * 1024**3)
        self.next = 0

        async def fill() -> None:
            for _ in range(adapters):
                await self.stage_new()

        asyncio.run(fill())

    def source(self, i: int) -> sources.VolumeSource:
        path = self.sources / f"a-{i}.safetensors"
        if not path.exists():
            path.write_bytes(content(i))
        return sources.VolumeSource(path)

    def namespace(self, i: int) -> str:
        return self.namespaces[i % len(self.namespaces)]

    async def stage_new(self) -> None:
        i, self.next = self.next, self.next + 1
        await self.store.stage(self.namespace(i), f"a-{i}", self.source(i))

    def measure(self, monkeypatch: pytest.MonkeyPatch, case: str) -> Work:
        """The work of M stagings of `case`, or of one collection."""
        if case == "a new adapter downloaded":

            async def work() -> None:
                for _ in range(M):
                    await self.stage_new()

        elif case == "a pin the namespace holds":

            async def work() -> None:
                for i in range(M):  # adapter i's content, pinned, under another name
                    ns = self.namespace(i)
                    source = sources.VolumeSource(self.sources / "absent.safetensors")
                    await self.store.stage(ns, f"pin-{i}", source, sha256=sha(content(i)))

        elif case == "a new spec of a staged adapter":

            async def work() -> None:
                for i in range(M):
                    await self.store.stage(self.namespace(i), f"a-{i}", self.source(i))

        elif case == "the first staging after a restart":
            self.store = staging.Store(self.root, namespace_quota=10 * 1024**3)

            async def work() -> None:
                await self.stage_new()

        elif case == "a collection":

            async def work() -> None:
                await self.store.collect(set())

        else:
            raise ValueError(case)
        with counted(monkeypatch) as counts:
            run(work)
        return counts


PER_STAGING = (
    "a new adapter downloaded",
    "a pin the namespace holds",
    "a new spec of a staged adapter",
)
LINEAR = ("the first staging after a restart", "a collection")


@pytest.fixture(scope="module")
def volumes(tmp_path_factory: pytest.TempPathFactory) -> tuple[Volume, Volume]:
    return (
        Volume(tmp_path_factory.mktemp("small"), *SMALL),
        Volume(tmp_path_factory.mktemp("large"), *LARGE),
    )


@pytest.mark.parametrize("case", PER_STAGING + LINEAR)
def test_staging_work_does_not_grow_with_the_volume(
    volumes: tuple[Volume, Volume], monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    small_volume, large_volume = volumes
    small = small_volume.measure(monkeypatch, case)
    large = large_volume.measure(monkeypatch, case)
    # Per staging the work is the same at any size; what reads a namespace (after a restart)
    # or the volume (a collection) grows with it, linearly.
    growth = LARGE[0] / SMALL[0] if case in LINEAR else 1.0
    for what in ("calls", "listed", "lines"):
        s, g = getattr(small, what), getattr(large, what)
        assert g <= MARGIN * growth * max(s, 1), (
            f"{case}: {what} {g} on a volume of {LARGE[0]} adapters against {s} on one of "
            f"{SMALL[0]} ({large.by_call} against {small.by_call})"
        )
    if case in PER_STAGING:
        assert small.listed <= M and large.listed <= M, (small, large)  # no listing per staging
