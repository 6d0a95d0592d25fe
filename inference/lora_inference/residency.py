"""Residency: the one record of where each adapter version is, and the code that moves it.

Owns, for one engine: the GPU tier (which version holds which of the pipeline's `--max-loras`
slots, and which slots are free), the CPU tier (parsed adapters kept in host memory), the pins,
and the versions that admitted requests still hold (a retired version leaves every tier once the
last of them is done). The LRU tiers (`adapters.cache`) decide what must go for an adapter to fit
(`plan_admit`); this module acts on their decision: it copies the newcomer into a freed or free
slot, empties slots, drops parsed adapters, and keeps the tier metrics. The pipeline has a fixed
set of `--max-loras` slots, named here; an adapter enters it only by being copied into a slot,
never loaded through diffusers while the server runs.

A version a request holds is always servable, retired or not: its parse, read ahead for the
request, is cached whether or not the registry still names the version, and once a read ahead of
it has finished (failed, or its parse dropped from the CPU tier since) the version counts as
ready, so the batch that takes the request reads it again itself. A request therefore waits for
one read ahead of its version at most, never for a parse that churn keeps dropping.

It must not decide names (admission and the registry do) or batches (scheduling), and it reads
no adapter file itself: a version whose parse the CPU tier dropped is read again through the
injected `read`. It touches the pipeline only through the injected `in_pipeline` (the engine's
pipeline thread) and only with the engine's pipeline lock held, and calls on it only what
`backend.SlotPipeline` declares: copying an adapter into a slot, and emptying a slot.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import itertools
import logging
import time
from collections.abc import Awaitable, Callable, Collection, Sequence
from pathlib import Path
from typing import Any, Protocol, TypeVar

from lora_inference import errors
from lora_inference.adapters import cache
from lora_inference.adapters.registry import AdapterRecord, Registry
from lora_inference.backend import ParsedAdapter, SlotPipeline
from lora_inference.config import ServerConfig
from lora_inference.metrics import Metrics

log = logging.getLogger(__name__)
T = TypeVar("T")
# Process-wide, like adapter versions: slot names differ between engines around the same
# pipeline (tests run several), so one engine never writes into another's slots.
_engine_numbers = itertools.count(1)

Read = Callable[[Path, str], Awaitable[ParsedAdapter]]
# Builds a stack's adapter from its members (each at its scale) and their parses.
Compose = Callable[
    [Sequence[tuple[AdapterRecord, float]], Sequence[ParsedAdapter]], Awaitable[ParsedAdapter]
]


class InPipeline(Protocol):
    """Runs `fn(*args)` on the pipeline thread."""

    def __call__(self, fn: Callable[..., T], *args: Any) -> Awaitable[T]: ...


class Residency:
    def __init__(
        self,
        backend: SlotPipeline,
        config: ServerConfig,
        metrics: Metrics,
        registry: Registry,
        *,
        in_pipeline: InPipeline,
        lock: asyncio.Lock,
        read: Read,
        compose: Compose,
        wake: Callable[[], None],
    ) -> None:
        self.backend = backend
        self.metrics = metrics
        self.gpu = cache.LRUTier("gpu", config.max_loras, label=self._label)
        self.cpu = cache.LRUTier("cpu", config.max_cpu_loras, label=self._label)
        self._registry = registry
        self._records: dict[str, AdapterRecord] = {}  # every version still referenced anywhere
        self._parsed: dict[str, ParsedAdapter] = {}  # what the CPU tier holds
        # Resident version -> its slot, the peft adapter name of the layers holding it.
        self._slots: dict[str, str] = {}
        engine = next(_engine_numbers)
        self._free_slots = [f"e{engine}_slot{i}" for i in reversed(range(config.max_loras))]
        self._refs: collections.Counter[str] = collections.Counter()  # held by requests
        self._retired: set[str] = set()  # replaced or unloaded, to drop when unreferenced
        self._in_pipeline = in_pipeline
        self._lock = lock
        self._read = read
        self._compose = compose
        self._wake = wake  # the worker collects retired versions
        # Versions being read into the CPU tier off the pipeline lock (`prepare`), and held
        # versions whose read ahead has finished (failed, or its parse dropped since): a batch
        # takes them and reads again itself (reporting the error, if any), so no request waits
        # for a second read ahead. Forgotten when no request holds the version.
        self._preparing: dict[str, asyncio.Task[None]] = {}
        self._read_ahead: set[str] = set()

    # -- versions -------------------------------------------------------------------------------

    def add(self, record: AdapterRecord, parsed: ParsedAdapter) -> None:
        """A version admission just read: its parse goes on the CPU tier."""
        self._cache_parsed(record.key, parsed)
        self._records[record.key] = record

    def hold(self, record: AdapterRecord) -> None:
        """A request was admitted with `record`: it stays until `release`, retired or not."""
        key = record.key
        if key not in self._records:
            # Collected since the request looked it up: tracked again, and retired unless the
            # registry names it, so it leaves every tier once its requests are answered.
            self._records[key] = record
            if self._registry.get(record.name) != record:
                self._retired.add(key)
        self._refs[key] += 1

    def release(self, record: AdapterRecord) -> None:
        self._refs[record.key] -= 1
        if self._refs[record.key] <= 0:
            del self._refs[record.key]
            self._read_ahead.discard(record.key)

    def retire(self, record: AdapterRecord) -> None:
        """`record` left the registry: drop it from every tier once no request holds it."""
        self._retired.add(record.key)
        self._wake()

    def unretire(self, record: AdapterRecord) -> None:
        """`record` is registered again (a replacement was undone)."""
        self._retired.discard(record.key)

    def collectable(self) -> list[str]:
        return [key for key in self._retired if self._refs.get(key, 0) == 0]

    async def collect(self) -> None:
        """Remove retired versions nobody holds any more from every tier and the pipeline.

        Under the pipeline lock throughout, so a pin's copy never plans with a slot that is
        being emptied here."""
        if not self.collectable():
            return
        async with self._lock:
            keys = self.collectable()
            slots = [self._slots.pop(k) for k in keys if k in self._slots]
            if slots:
                await self._in_pipeline(self._clear_slots, slots)
                self._free_slots.extend(slots)
            for key in keys:
                self.gpu.remove(key)  # its slot is empty now, whoever holds it
                if self._refs.get(key, 0) > 0:
                    continue  # held again while its slot was emptied: collected later
                self.cpu.remove(key)
                self._parsed.pop(key, None)
                self._records.pop(key, None)
                self._retired.discard(key)
                self._read_ahead.discard(key)
        self.update_gauges()

    # -- where ----------------------------------------------------------------------------------

    def tier_of(self, record: AdapterRecord) -> str:
        if record.key in self.gpu:
            return "gpu"
        if record.key in self.cpu:
            return "cpu"
        return "disk"

    def slot_of(self, key: str) -> str:
        """The slot of a resident version (any thread: the dict is not changed mid-batch)."""
        return self._slots[key]

    def update_gauges(self) -> None:
        counts = collections.Counter(self.tier_of(r) for r in self._registry.records())
        for tier in ("gpu", "cpu", "disk"):
            self.metrics.adapters.labels(tier).set(counts.get(tier, 0))

    # -- moving (the pipeline lock held) --------------------------------------------------------

    async def pin(self, record: AdapterRecord) -> None:
        """Make a pinned version resident now, so a pin that cannot be honoured fails at once."""
        async with self._lock:
            await self.make_resident(record, wanted=set())

    async def make_resident(
        self, record: AdapterRecord, *, wanted: set[str], protected: Collection[str] = ()
    ) -> None:
        """Put `record` in a GPU slot (the caller holds the pipeline lock).

        The GPU tier names what to evict, least wanted first (`wanted`: what queued requests
        ask for next; `protected`: the batch being prepared); the newcomer takes an evicted
        adapter's slot or a free one. A failure leaves the slots consistent and unregisters a
        version the pipeline refused.
        """
        if record.key in self.gpu:
            self.gpu.touch(record.key)
            return
        if record.key in self._parsed:
            self.cpu.touch(record.key)
        parsed = await self.parse(record)
        if record.key not in self._parsed:
            self._cache_parsed(record.key, parsed)
        evict = self.gpu.plan_admit(
            record.key,
            pinned=record.pinned,
            protected={record.key, *protected},
            prefer_keep=wanted,
        )
        started = time.perf_counter()
        freed = [self._slots.pop(old) for old in evict if old in self._slots]
        slot = freed[0] if freed else self._free_slots.pop()
        try:
            await self._in_pipeline(self._place, slot, parsed, freed[1:])
        except Exception as e:
            self._free_slots.extend(freed or [slot])  # emptied, or never filled
            self.metrics.loads.labels("gpu", "error").inc()
            for old in evict:
                self.gpu.remove(old)
            self._drop_broken(record)
            if isinstance(e, errors.InferenceError):
                raise
            raise errors.InferenceError(f"copying adapter {record.name!r} failed: {e}") from e
        finally:
            self.metrics.evictions.labels("gpu").inc(len(evict))
        self._slots[record.key] = slot
        self._free_slots.extend(freed[1:])
        self.gpu.admit(record.key, pinned=record.pinned, evicted=evict)
        self.metrics.loads.labels("gpu", "ok").inc()
        self.metrics.load_seconds.labels("gpu").observe(time.perf_counter() - started)
        self.update_gauges()

    async def prepare(self, record: AdapterRecord) -> None:
        """Put `record`'s parse (its packed slot row included) on the CPU tier, reading it if it
        is not there: without the pipeline lock, so the pipeline keeps generating meanwhile.
        Concurrent calls for one version share one read, and the worker is woken when it ends,
        whoever started it (a batch that failed on another adapter leaves its reads running)."""
        if record.key in self._parsed or record.key in self.gpu:
            return
        task = self._preparing.get(record.key)
        if task is None:
            task = asyncio.create_task(self._prepare(record), name=f"prepare-{record.name}")
            self._preparing[record.key] = task
            task.add_done_callback(functools.partial(self._prepared, record.key))
        await asyncio.shield(task)

    def _prepared(self, key: str, task: asyncio.Task[None]) -> None:
        self._preparing.pop(key, None)
        if self._refs.get(key, 0) > 0:
            self._read_ahead.add(key)
        self._wake()

    def ready(self, record: AdapterRecord | None) -> bool:
        """Whether a batch may take `record` now: it needs no file read (None: the base model),
        or a read of it for the requests holding it has finished, so the batch reads it again
        if it must (its parse was dropped since, or the read failed: the batch answers with the
        error)."""
        if record is None:
            return True
        key = record.key
        return key in self._parsed or key in self.gpu or key in self._read_ahead

    def prefetch(self, records: Collection[AdapterRecord]) -> None:
        """Start preparing `records` (what queued requests will need) in the background; the
        worker is woken when each is done. A read that fails here fails again, and is reported,
        when a batch needs the adapter."""
        for record in records:
            if self.ready(record) or record.key in self._preparing:
                continue
            task = asyncio.create_task(self.prepare(record), name=f"prefetch-{record.name}")
            task.add_done_callback(_prefetched)

    async def _prepare(self, record: AdapterRecord) -> None:
        parsed = await self.parse(record)
        # Cached while a request holds the version, retired or not (it is collected once the
        # last of them is answered), or while the registry names it (a swap that was undone
        # names an old version again). One that nobody holds or names any more is not.
        held = self._refs.get(record.key, 0) > 0
        named = self._registry.get(record.name) == record and record.key not in self._retired
        if (held or named) and record.key not in self._parsed:
            self._records.setdefault(record.key, record)
            self._cache_parsed(record.key, parsed)

    async def parse(self, record: AdapterRecord) -> ParsedAdapter:
        """`record`'s parsed weights: from the CPU tier, else read again (a stack: built again
        from its members'). Caches nothing: the caller decides what enters the CPU tier."""
        parsed = self._parsed.get(record.key)
        if parsed is not None:
            return parsed
        if record.members:
            parts = [await self.parse(member) for member, _ in record.members]
            return await self._compose(record.members, parts)
        try:
            parsed = await self._read(record.path, record.name)
        except FileNotFoundError as e:
            self._drop_broken(record)
            raise errors.AdapterNotFound(
                f"the files of adapter {record.name!r} are gone from {record.path} since it was "
                "loaded; load it again",
                param="model",
            ) from e
        if parsed.sha256 != record.sha256:
            self._drop_broken(record)
            raise errors.IncompatibleAdapter(
                f"the files of adapter {record.name!r} changed since it was loaded "
                f"(sha256 {record.sha256[:12]} -> {parsed.sha256[:12]}); load it again",
                param="model",
            )
        return parsed

    async def empty(self) -> None:
        """Take every version out of the pipeline (the worker has stopped): a backend may
        outlive its engine (tests reuse one), so it is left as it was found."""
        slots = list(self._slots.values())
        self._slots.clear()
        if slots:
            await self._in_pipeline(self._clear_slots, slots)
            self._free_slots.extend(slots)

    def _place(self, slot: str, parsed: ParsedAdapter, stale: list[str]) -> None:
        """Pipeline thread: copy `parsed` into `slot`; empty slots freed beside it."""
        self._clear_slots(stale)
        self.backend.place(slot, parsed)

    def _clear_slots(self, slots: list[str]) -> None:
        """Pipeline thread: empty `slots` (the caller returns them to the free list)."""
        for slot in slots:
            self.backend.clear(slot)

    def _drop_broken(self, record: AdapterRecord) -> None:
        """An adapter the pipeline refused after all: unregister it so nobody asks again."""
        if self._registry.get(record.name) == record:
            self._registry.remove(record.name)
        self.retire(record)
        log.warning(
            "adapter %s v%d was refused by the pipeline and unregistered",
            record.name,
            record.version,
        )

    def _cache_parsed(self, key: str, parsed: ParsedAdapter) -> None:
        evict = self.cpu.plan_admit(key)
        for old in evict:
            self._parsed.pop(old, None)
        self.metrics.evictions.labels("cpu").inc(len(evict))
        self.cpu.admit(key, evicted=evict)
        self._parsed[key] = parsed
        self.metrics.loads.labels("cpu", "ok").inc()

    def _label(self, key: str) -> str:
        record = self._records.get(key)
        return record.name if record is not None else key


def _prefetched(task: asyncio.Task[None]) -> None:
    """A read ahead ended; its error, if any, comes again from the batch's own read."""
    if not task.cancelled() and task.exception() is not None:
        log.debug("reading an adapter ahead failed: %s", task.exception())
