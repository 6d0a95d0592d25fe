"""The engine: one worker that owns the pipeline, the request queue, and the adapter tiers.

Everything here runs on the event loop except the two kinds of blocking work it hands off:
reading and checking adapter files (a small thread pool; touches no pipeline state) and anything
that touches the pipeline (one dedicated thread, always entered under `_pipeline_lock`). So adapter
changes happen only between batches, and the cache policy (adapters.cache) and the batch policy
(scheduling) decide while this module acts.

Admin changes are ordered by versions, not by draining the queue: a request resolves its adapter
record when it is admitted and keeps it, so requests admitted before an in-place swap or an
unload finish with the weights they asked for, and the old version leaves the pipeline once the
last of them is done.

The pipeline has a fixed set of `--max-loras` slots, named when the engine is made. An adapter
that enters the pipeline is copied into a free slot or into the slot of the adapter it evicts;
no adapter is ever loaded through diffusers while the server runs.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import random
import time
from collections.abc import AsyncIterator, Callable, Collection
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from PIL import Image

from lora_inference import errors, scheduling
from lora_inference.adapters import cache, files, layout, targeting
from lora_inference.adapters.registry import (
    AdapterRecord,
    Origin,
    Registry,
    next_version,
    plan_register,
)
from lora_inference.config import ServerConfig
from lora_inference.metrics import Metrics
from lora_inference.pipeline import BatchOutcome, DiffusionBackend, ImageJob, ParsedAdapter

log = logging.getLogger(__name__)
T = TypeVar("T")
# Process-wide, like adapter versions: slot names differ between engines around the same
# pipeline (tests run several), so one engine never writes into another's slots.
_engine_numbers = itertools.count(1)


@dataclass(frozen=True)
class GenerationParams:
    """A validated generation request (see api.parse_generation)."""

    prompt: str
    negative_prompt: str | None
    n: int
    width: int
    height: int
    steps: int
    guidance_scale: float
    seed: int | None
    scale: float | None  # None: the adapter's default scale (its load call's `scale`)


@dataclass(frozen=True)
class GeneratedImage:
    image: Image.Image
    seed: int


@dataclass(frozen=True)
class Occupancy:
    """What the engine holds at one moment, as a fleet reads it (GET /v1/adapters, /metrics)."""

    waiting: int  # requests queued, not yet in a batch
    running: int  # requests in the batch being generated (its adapters being placed included)
    resident: frozenset[str]  # registered adapters in GPU slots, by name
    # Adapters that queued requests name and that are not in a GPU slot, by name.
    awaited: frozenset[str]


@dataclass
class _Pending:
    key: scheduling.BatchKey
    record: AdapterRecord | None
    job: ImageJob
    future: asyncio.Future[list[GeneratedImage]]
    abandoned: Callable[[], bool]
    skipped: int = 0

    @property
    def images(self) -> int:
        return len(self.job.seeds)

    def gone(self) -> bool:
        return self.future.done() or self.abandoned()


class Engine:
    def __init__(self, backend: DiffusionBackend, config: ServerConfig, metrics: Metrics) -> None:
        self.backend = backend
        self.config = config
        self.metrics = metrics
        self.registry = Registry()
        self._by_key: dict[str, AdapterRecord] = {}  # every record still referenced anywhere
        self.gpu = cache.LRUTier("gpu", config.max_loras, label=self._label)
        self.cpu = cache.LRUTier("cpu", config.max_cpu_loras, label=self._label)
        self._parsed: dict[str, ParsedAdapter] = {}
        # Resident adapter -> its slot, the peft adapter name of the layers holding it.
        self._slots: dict[str, str] = {}
        engine = next(_engine_numbers)
        self._free_slots = [f"e{engine}_slot{i}" for i in reversed(range(config.max_loras))]
        self._refs: collections.Counter[str] = collections.Counter()
        self._retired: set[str] = set()  # keys replaced or unloaded, to drop when unreferenced
        self._queue: list[_Pending] = []
        self._running: list[_Pending] = []  # the batch taken off the queue, until it is answered
        self._wake = asyncio.Event()
        self._pipeline_lock = asyncio.Lock()
        self._register_lock = asyncio.Lock()
        # Requests between arriving and reaching the queue because their adapter is being
        # registered (read and checked); a batch that is not full waits a little for them.
        self._admitting = 0
        self._admitted = asyncio.Event()
        self._admission_s = 0.05  # a running mean, seeded with a typical small parse
        self._pipeline_thread = ThreadPoolExecutor(1, thread_name_prefix="pipeline")
        self._parse_pool = ThreadPoolExecutor(2, thread_name_prefix="adapter-parse")
        self._worker: asyncio.Task[None] | None = None
        self._idle = asyncio.Event()
        self._idle.set()

    # -- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        if self.config.merge == "auto":
            await self._in_pipeline(self.backend.calibrate)
        self._worker = asyncio.create_task(self._run(), name="pipeline-worker")
        for static in self.config.static_loras:
            await self.register(static.name, static.path, pinned=True, origin="static")

    async def stop(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._worker
        for pending in self._queue:
            if not pending.future.done():
                pending.future.set_exception(errors.NotReady("the server is shutting down"))
        # Leave the pipeline as it was found: a backend may outlive its engine (tests reuse one).
        slots = list(self._slots.values())
        self._slots.clear()
        if slots:
            await self._in_pipeline(self._clear_slots, slots)
            self._free_slots.extend(slots)
        self._pipeline_thread.shutdown(wait=True)
        self._parse_pool.shutdown(wait=True)

    async def idle(self) -> None:
        """Wait until the queue is empty and retired adapters have left the pipeline (for tests)."""
        while True:
            await self._idle.wait()
            if not self._queue and not self._collectable():
                return
            await asyncio.sleep(0.01)

    # -- adapter registration -------------------------------------------------------------------

    async def register(
        self,
        name: str,
        path: str | Path,
        *,
        pinned: bool = False,
        load_inplace: bool = False,
        origin: Origin = "api",
        scale: float = 1.0,
    ) -> AdapterRecord:
        """Validate the adapter at `path` and register it as `name` (the load endpoint).

        The file is read, hashed and checked against the model before anything changes; a
        refusal leaves the registry, the caches and the pipeline as they were. Pinned adapters are
        made resident at once, so a pin that cannot be honoured fails here rather than later.
        """
        layout.check_adapter_name(name)
        if origin == "static":
            resolved = Path(path).resolve(strict=True)
        else:
            resolved = layout.resolve_allowed(
                path, self.config.path_roots, param=_path_param(origin)
            )
        async with self._register_lock:
            existing = self.registry.get(name)
            decision = plan_register(existing, origin, resolved, load_inplace=load_inplace)
            if decision == "reuse" and existing is not None:
                return existing
            if pinned and (existing is None or not existing.pinned):
                pinned_now = len(self.registry.pinned())
                if pinned_now >= self.config.max_loras:
                    raise cache.SlotsExhausted(
                        f"cannot pin {name!r}: all {self.config.max_loras} GPU slots already hold "
                        f"pinned adapters ({', '.join(r.name for r in self.registry.pinned())}); "
                        "unpin or unload one, or raise --max-loras"
                    )
            self._check_base_model(resolved, name)
            parsed = await self._parse(resolved, name)
            record = AdapterRecord(
                name=name,
                path=resolved,
                weights_file=parsed.weights_file,
                sha256=parsed.sha256,
                size_bytes=parsed.size_bytes,
                rank=parsed.rank,
                pinned=pinned,
                origin=origin,
                version=next_version(),
                scale=scale,
            )
            self._cache_parsed(record.key, parsed)
            self._by_key[record.key] = record
            previous = self.registry.put(record)
            if previous is not None:
                self._retire(previous)
            self._update_tier_gauges()
        log.info("registered adapter %s v%d from %s (%s)", name, record.version, resolved, origin)
        if pinned:
            try:
                async with self._pipeline_lock:
                    await self._make_resident(record, wanted=set())
            except errors.InferenceError:
                self._restore(record, previous)
                raise
        return record

    def _restore(self, failed: AdapterRecord, previous: AdapterRecord | None) -> None:
        """Undo a registration whose pin could not be honoured; a replaced record comes back."""
        if self.registry.get(failed.name) in (failed, None):
            self.registry.remove(failed.name)
            if previous is not None:
                self.registry.put(previous)
                self._retired.discard(previous.key)
        self._retire(failed)

    async def unregister(self, name: str, *, force: bool = False) -> AdapterRecord:
        record = self.registry.get(name)
        if record is None:
            raise errors.AdapterNotFound(f"adapter {name!r} is not loaded", param="lora_name")
        if record.origin == "static" and not force:
            raise errors.AdapterConflict(
                f"adapter {name!r} was given on the command line (--lora) and cannot be unloaded",
                param="lora_name",
            )
        self.registry.remove(name)
        self._retire(record)
        self._wake.set()
        log.info("unregistered adapter %s v%d", name, record.version)
        return record

    async def resolve(self, name: str, *, param: str = "model") -> AdapterRecord:
        """The record for `name`: registered, or found on the adapter root and registered now.

        A name a request registered is looked up on the adapter root too: what the operator
        published under that name replaces it.
        """
        record = self.registry.get(name)
        if record is not None and record.origin != "request":
            return record
        layout.check_adapter_name(name, param=param)
        try:
            found = self._published(name, param=param)
        except errors.AdapterNotFound:
            if record is not None:
                return record  # published, but for other pods: the request's adapter stays
            raise
        if found is None and record is not None:
            return record
        if found is None:
            raise errors.AdapterNotFound(
                f"the model '{name}' does not exist: it is neither the base model "
                f"'{self.config.model_id}' nor a loaded adapter",
                param=param,
            )
        try:
            async with self._admission():
                return await self.register(name, found, origin="resolver")
        except errors.AdapterConflict:
            # Another request resolved the same name first.
            record = self.registry.get(name)
            if record is None:
                raise
            return record

    def _published(self, name: str, *, param: str) -> Path | None:
        """The adapter `name` on the adapter root, if it is there and meant for this pod.

        Published for other pods (their LoRAAdapter's selector or base model does not match
        this one): AdapterNotFound, as for an unknown name, saying why. A server that does not
        know its labels, or an adapter without a target (a volume filled by hand), serves it.
        """
        root = self.config.adapter_root
        found = layout.resolve_on_root(root, name) if root is not None else None
        labels_file = self.config.pod_labels_file
        if found is None or root is None or labels_file is None:
            return found
        target = layout.read_target(root, name)
        if target is None:
            return found
        try:
            labels = targeting.parse_pod_labels(labels_file.read_text())
        except OSError as e:
            raise errors.AdapterNotFound(
                f"the model '{name}' cannot be resolved: this pod's labels ({labels_file}) "
                f"cannot be read: {e}",
                param=param,
            ) from e
        reason = targeting.refusal(target, labels, self.config.model_id)
        if reason is not None:
            raise errors.AdapterNotFound(
                f"the model '{name}' is not served by this pod: {reason}; send the request to "
                "a pod its LoRAAdapter selects",
                param=param,
            )
        return found

    async def register_from_request(self, name: str, local_path: str) -> AdapterRecord:
        """The request-level path (`lora.local_path`): same checks and cache as the API."""
        if not self.config.allow_request_adapters:
            raise errors.Forbidden(
                "this server does not let requests register adapters (lora.local_path): name "
                "an adapter it serves in 'model' (GET /v1/models), or start the server with "
                "--allow-request-adapters (the chart's inference.allowRequestAdapters)",
                param="lora.local_path",
            )
        resolved = layout.resolve_allowed(
            local_path, self.config.path_roots, param="lora.local_path"
        )
        existing = self.registry.get(name)
        if plan_register(existing, "request", resolved) == "reuse" and existing is not None:
            return existing
        async with self._admission():
            return await self.register(name, resolved, origin="request")

    def occupancy(self) -> Occupancy:
        """The queue, the running batch and the GPU slots now: what routers and schedulers read."""
        return Occupancy(
            waiting=len(self._queue),
            running=len(self._running),
            resident=frozenset(r.name for r in self.registry.records() if r.key in self.gpu),
            awaited=frozenset(
                p.record.name
                for p in self._queue
                if p.record is not None and p.record.key not in self.gpu
            ),
        )

    def update_fleet_gauges(self) -> None:
        """Set the vLLM-named gauges from `occupancy()`; called at each scrape, so never stale."""
        held = self.occupancy()
        model = self.config.model_id
        self.metrics.requests_waiting.labels(model).set(held.waiting)
        self.metrics.requests_running.labels(model).set(held.running)
        self.metrics.set_lora_info(
            self.config.max_loras, running=held.resident, waiting=held.awaited, at=time.time()
        )

    def tier_of(self, record: AdapterRecord) -> str:
        if record.key in self.gpu:
            return "gpu"
        if record.key in self.cpu:
            return "cpu"
        return "disk"

    # -- generation -----------------------------------------------------------------------------

    async def generate(
        self,
        params: GenerationParams,
        record: AdapterRecord | None,
        *,
        abandoned: Callable[[], bool] = lambda: False,
    ) -> list[GeneratedImage]:
        # Requests whose clients left hold no place: a full queue of abandoned work must not
        # turn a live client away.
        self._drop_gone()
        if len(self._queue) >= self.config.max_queue:
            self.metrics.requests.labels("rejected").inc()
            raise errors.QueueFull(
                f"the queue is full ({self.config.max_queue} requests); retry later",
                retry_after_s=1,
            )
        seed = params.seed if params.seed is not None else random.randrange(2**31)
        pending = _Pending(
            key=scheduling.BatchKey(
                adapter=record.key if record is not None else None,
                scale=_scale_for(params, record),
                width=params.width,
                height=params.height,
                steps=params.steps,
                guidance_scale=params.guidance_scale,
            ),
            record=record,
            job=ImageJob(
                prompt=params.prompt,
                negative_prompt=params.negative_prompt,
                seeds=tuple(seed + i for i in range(params.n)),
            ),
            future=asyncio.get_running_loop().create_future(),
            abandoned=abandoned,
        )
        if record is not None:
            self._refs[record.key] += 1
            self.registry.record_hit(record.name)
        self._queue.append(pending)
        self.metrics.queue_depth.set(len(self._queue))
        self._wake.set()
        return await pending.future

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            self._idle.clear()
            try:
                await self._drain()
            except Exception:  # a bug must not kill the worker and hang every request
                log.exception("pipeline worker failed")
            finally:
                self._idle.set()

    @contextlib.asynccontextmanager
    async def _admission(self) -> AsyncIterator[None]:
        """Count a request whose adapter is being registered until it can be queued."""
        self._admitting += 1
        started = time.perf_counter()
        try:
            yield
        finally:
            self._admitting -= 1
            self._admission_s += 0.2 * (time.perf_counter() - started - self._admission_s)
            self._admitted.set()

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        hold_until: float | None = None
        while True:
            await self._collect_garbage()
            self._drop_gone()
            pinned = self.gpu.pinned()
            plan = scheduling.plan_next_batch(
                self._queue,
                set(self.gpu),
                max_batch_images=self.config.max_batch_size,
                max_skips=self.config.max_skips,
                max_adapters=max(1, self.config.max_loras - len(pinned)),
                pinned=pinned,
            )
            if plan is None:
                return
            hold = scheduling.fill_wait(
                sum(self._queue[i].images for i in plan.members),
                self.config.max_batch_size,
                self._admitting,
                self._admission_s,
            )
            if hold > 0:
                hold_until = hold_until or loop.time() + hold
                if loop.time() < hold_until:
                    self._admitted.clear()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._admitted.wait(), hold_until - loop.time())
                    continue
            hold_until = None
            if plan.skipped_head:
                self._queue[0].skipped += 1
            batch = [self._queue[i] for i in plan.members]
            chosen = set(plan.members)
            self._queue = [p for i, p in enumerate(self._queue) if i not in chosen]
            self.metrics.queue_depth.set(len(self._queue))
            self._running = batch
            try:
                await self._run_batch(batch)
            finally:
                self._running = []

    def _drop_gone(self) -> None:
        kept = []
        for pending in self._queue:
            if pending.gone():
                self.metrics.requests.labels("dropped").inc()
                self._release(pending)
                if not pending.future.done():
                    pending.future.cancel()
            else:
                kept.append(pending)
        self._queue = kept

    async def _run_batch(self, batch: list[_Pending]) -> None:
        records = list({p.record.key: p.record for p in batch if p.record is not None}.values())
        try:
            async with self._pipeline_lock:
                needed = {r.key for r in records}
                wanted = scheduling.adapters_wanted(self._queue)
                for record in records:
                    self.metrics.lookups.labels("hit" if record.key in self.gpu else "miss").inc()
                    await self._make_resident(record, wanted=wanted, protected=needed)
                started = time.perf_counter()
                outcome = await self._in_pipeline(self._generate_batch, batch)
                self.metrics.generation_seconds.observe(time.perf_counter() - started)
                self.metrics.batch_images.observe(len(outcome.images))
                self.metrics.batches.labels(outcome.path).inc()
                images = outcome.images
        except Exception as e:
            failure = (
                e
                if isinstance(e, errors.InferenceError)
                else errors.InferenceError(f"generation failed: {e}")
            )
            if not isinstance(e, errors.InferenceError):
                log.exception("generation failed")
            for pending in batch:
                self._release(pending)
                if not pending.future.done():
                    pending.future.set_exception(failure)
            self.metrics.requests.labels("failed").inc(len(batch))
            return
        cursor = 0
        for pending in batch:
            count = pending.images
            out = [
                GeneratedImage(image=img, seed=seed)
                for img, seed in zip(
                    images[cursor : cursor + count], pending.job.seeds, strict=True
                )
            ]
            cursor += count
            self._release(pending)
            if not pending.future.done():
                pending.future.set_result(out)
        self.metrics.requests.labels("ok").inc(len(batch))

    def _generate_batch(self, batch: list[_Pending]) -> BatchOutcome:
        """Pipeline thread: one pipeline call, each request through its adapter's slot."""
        slots = [self._slots[p.key.adapter] if p.key.adapter else None for p in batch]
        scales = {
            self._slots[p.key.adapter]: p.key.scale for p in batch if p.key.adapter is not None
        }
        shape = batch[0].key
        return self.backend.run_batch(
            [p.job for p in batch],
            slots,
            scales,
            width=shape.width,
            height=shape.height,
            steps=shape.steps,
            guidance_scale=shape.guidance_scale,
            merge=self.config.merge,
        )

    def _release(self, pending: _Pending) -> None:
        if pending.record is not None:
            self._refs[pending.record.key] -= 1
            if self._refs[pending.record.key] <= 0:
                del self._refs[pending.record.key]

    # -- residency (called with _pipeline_lock held) ----------------------------------------------

    async def _make_resident(
        self, record: AdapterRecord, *, wanted: set[str], protected: Collection[str] = ()
    ) -> None:
        if record.key in self.gpu:
            self.gpu.touch(record.key)
            return
        parsed = self._parsed.get(record.key)
        if parsed is None:
            parsed = await self._parse(record.path, record.name)
            if parsed.sha256 != record.sha256:
                self._drop_broken(record)
                raise errors.IncompatibleAdapter(
                    f"the files of adapter {record.name!r} changed since it was loaded "
                    f"(sha256 {record.sha256[:12]} -> {parsed.sha256[:12]}); load it again",
                    param="model",
                )
            self._cache_parsed(record.key, parsed)
        else:
            self.cpu.touch(record.key)
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
        self._update_tier_gauges()

    def _place(self, slot: str, parsed: ParsedAdapter, stale: list[str]) -> None:
        """Pipeline thread: copy `parsed` into `slot`; empty slots freed beside it."""
        self._clear_slots(stale)
        self.backend.place(slot, parsed)

    def _drop_broken(self, record: AdapterRecord) -> None:
        """An adapter the pipeline refused after all: unregister it so nobody asks again."""
        if self.registry.get(record.name) == record:
            self.registry.remove(record.name)
        self._retire(record)
        log.warning(
            "adapter %s v%d was refused by the pipeline and unregistered",
            record.name,
            record.version,
        )

    def _retire(self, record: AdapterRecord) -> None:
        self._retired.add(record.key)
        self._wake.set()

    def _collectable(self) -> list[str]:
        return [key for key in self._retired if self._refs.get(key, 0) == 0]

    async def _collect_garbage(self) -> None:
        """Remove retired adapters nobody references any more from every tier and the pipeline."""
        keys = self._collectable()
        if not keys:
            return
        slots = [self._slots.pop(k) for k in keys if k in self._slots]
        if slots:
            async with self._pipeline_lock:
                await self._in_pipeline(self._clear_slots, slots)
            self._free_slots.extend(slots)
        for key in keys:
            self.gpu.remove(key)
            self.cpu.remove(key)
            self._parsed.pop(key, None)
            self._by_key.pop(key, None)
            self._retired.discard(key)
        self._update_tier_gauges()

    def _clear_slots(self, slots: list[str]) -> None:
        """Pipeline thread: empty `slots` (the caller returns them to the free list)."""
        for slot in slots:
            self.backend.clear(slot)

    # -- helpers --------------------------------------------------------------------------------

    def _cache_parsed(self, key: str, parsed: ParsedAdapter) -> None:
        evict = self.cpu.plan_admit(key)
        for old in evict:
            self._parsed.pop(old, None)
        self.metrics.evictions.labels("cpu").inc(len(evict))
        self.cpu.admit(key, evicted=evict)
        self._parsed[key] = parsed
        self.metrics.loads.labels("cpu", "ok").inc()

    async def _parse(self, path: Path, name: str) -> ParsedAdapter:
        started = time.perf_counter()
        try:
            parsed = await asyncio.get_running_loop().run_in_executor(
                self._parse_pool,
                lambda: self.backend.parse_adapter(
                    path, name=name, max_rank=self.config.max_lora_rank
                ),
            )
        except errors.InferenceError:
            self.metrics.loads.labels("cpu", "error").inc()
            raise
        self.metrics.load_seconds.labels("cpu").observe(time.perf_counter() - started)
        return parsed

    def _check_base_model(self, path: Path, name: str) -> None:
        config = files.read_adapter_config(path)
        if config is None or config.base_model is None:
            return
        accepted = {self.config.model_id, *self.config.accepted_base_models}
        declared = config.base_model.rstrip("/")
        if declared in accepted or declared.rsplit("/", 1)[-1] in accepted:
            return
        raise errors.IncompatibleAdapter(
            f"adapter {name!r} declares base model {config.base_model!r} in adapter_config.json, "
            f"but this server serves {self.config.model_id!r}; load it on a server for that "
            "model, or start this one with --accept-base-model if they are compatible",
            param="lora_path",
        )

    async def _in_pipeline(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pipeline_thread, fn, *args)

    def _label(self, key: str) -> str:
        record = self._by_key.get(key)
        return record.name if record is not None else key

    def _update_tier_gauges(self) -> None:
        counts = collections.Counter(self.tier_of(r) for r in self.registry.records())
        for tier in ("gpu", "cpu", "disk"):
            self.metrics.adapters.labels(tier).set(counts.get(tier, 0))


def _path_param(origin: Origin) -> str:
    return "lora.local_path" if origin == "request" else "lora_path"


def _scale_for(params: GenerationParams, record: AdapterRecord | None) -> float:
    """The request's scale, else the adapter's default; the base model has none."""
    if record is None:
        return 0.0
    return record.scale if params.scale is None else params.scale
