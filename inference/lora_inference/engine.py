"""The engine: the request queue and the one worker that owns the pipeline; it composes the rest.

Three parts, each with its own module: admission (`admission.Admission`: names and paths to
validated records, every file read off the event loop), residency (`residency.Residency`: the
one record of which version is in a GPU slot, in the CPU tier, pinned or still held by a
request), and this module, which queues requests and runs batches. The batch policy
(`scheduling`) and the tiers' policy (`adapters.cache`) decide; the worker and residency act.
The engine holds the whole pipeline (a `backend.Backend`, which the app is given, exposed as
`backend`) and calls its `calibrate` and `run_batch`; the reader and residency are given it as
only what they call on it (`backend.AdapterParser`, `backend.SlotPipeline`).

Everything here runs on the event loop except what touches the pipeline: one dedicated thread,
always entered under `_pipeline_lock`, which residency takes too when it moves adapters. So
adapter changes happen only between batches.

Admin changes are ordered by versions, not by draining the queue: a request resolves its adapter
record when it is admitted and keeps it, so requests admitted before an in-place swap or an
unload finish with the weights they asked for, and the old version leaves the pipeline once the
last of them is done.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from lora_volume import formats
from PIL import Image

from lora_inference import admission, errors, reader, residency, scheduling
from lora_inference.adapters.registry import AdapterRecord, Registry
from lora_inference.api import GenerationParams
from lora_inference.backend import Backend, BatchOutcome, ImageJob
from lora_inference.config import ServerConfig
from lora_inference.metrics import Metrics

log = logging.getLogger(__name__)
T = TypeVar("T")


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
    def __init__(self, backend: Backend, config: ServerConfig, metrics: Metrics) -> None:
        self.backend = backend
        self.config = config
        self.metrics = metrics
        self.registry = Registry()
        self._queue: list[_Pending] = []
        self._running: list[_Pending] = []  # the batch taken off the queue, until it is answered
        self._wake = asyncio.Event()
        self._pipeline_lock = asyncio.Lock()
        self._pipeline_thread = ThreadPoolExecutor(1, thread_name_prefix="pipeline")
        self._reader = reader.Reader(backend, config, metrics)
        self.residency = residency.Residency(
            backend,
            config,
            metrics,
            self.registry,
            in_pipeline=self._in_pipeline,
            lock=self._pipeline_lock,
            read=self._reader.read,
            compose=self._reader.compose,
            wake=self._wake.set,
        )
        self.admission = admission.Admission(config, self.registry, self.residency, self._reader)
        self._worker: asyncio.Task[None] | None = None
        self._idle = asyncio.Event()
        self._idle.set()

    # -- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        if self.config.merge == "auto":
            await self._in_pipeline(self.backend.calibrate)
        self._worker = asyncio.create_task(self._run(), name="pipeline-worker")
        for static in self.config.static_loras:
            await self.admission.register(static.name, static.path, pinned=True, origin="static")

    async def stop(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._worker
        for pending in self._queue:
            if not pending.future.done():
                pending.future.set_exception(errors.NotReady("the server is shutting down"))
        await self.residency.empty()
        self._pipeline_thread.shutdown(wait=True)
        self._reader.close()

    async def idle(self) -> None:
        """Wait until the queue is empty and retired adapters have left the pipeline (for tests)."""
        while True:
            await self._idle.wait()
            if not self._queue and not self.residency.collectable():
                return
            await asyncio.sleep(0.01)

    def occupancy(self) -> Occupancy:
        """The queue, the running batch and the GPU slots now: what routers and schedulers read."""
        return Occupancy(
            waiting=len(self._queue),
            running=len(self._running),
            resident=frozenset(
                r.name for r in self.registry.records() if r.key in self.residency.gpu
            ),
            awaited=frozenset(
                p.record.name
                for p in self._queue
                if p.record is not None and p.record.key not in self.residency.gpu
            ),
        )

    def queue_length(self) -> int:
        """Requests admitted and not answered by the pipeline yet: waiting plus running. What
        `occupancy` counts, without its sets, so every generation answer can carry it."""
        return len(self._queue) + len(self._running)

    def update_fleet_gauges(self) -> None:
        """Set the vLLM-named gauges from `occupancy()`; called at each scrape, so never stale."""
        held = self.occupancy()
        model = self.config.model_id
        self.metrics.requests_waiting.labels(model).set(held.waiting)
        self.metrics.requests_running.labels(model).set(held.running)
        self.metrics.set_lora_info(
            self.config.max_loras, running=held.resident, waiting=held.awaited, at=time.time()
        )

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
                alone=record is not None and formats.merged_only(record.format),
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
            self.residency.hold(record)
            self.registry.record_hit(record.name)
        self._queue.append(pending)
        self.metrics.queue_depth.set(len(self._queue))
        # Read now if it must be read: while a batch runs, the worker is not there to start it.
        self.residency.prefetch(self._to_read())
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

    async def _drain(self) -> None:
        while True:
            await self.residency.collect()
            self._drop_gone()
            # A request whose adapter must be read first waits for its read off the pipeline
            # (the worker wakes when it is done); batches of ready requests run meanwhile.
            self.residency.prefetch(self._to_read())
            ready = [p for p in self._queue if self.residency.ready(p.record)]
            pinned = self.residency.gpu.pinned()
            plan = scheduling.plan_next_batch(
                ready,
                set(self.residency.gpu),
                max_batch_images=self.config.max_batch_size,
                max_skips=self.config.max_skips,
                max_adapters=max(1, self.config.max_loras - len(pinned)),
                pinned=pinned,
            )
            # Planned from what is ready now: a request whose adapter is still being read for
            # its first use (in admission, or ahead of it here) joins a later batch; this one
            # never waits for it.
            if plan is None:
                return
            if plan.skipped_head:
                ready[0].skipped += 1
            batch = [ready[i] for i in plan.members]
            chosen = {id(p) for p in batch}
            self._queue = [p for p in self._queue if id(p) not in chosen]
            self.metrics.queue_depth.set(len(self._queue))
            self._running = batch
            try:
                await self._run_batch(batch)
            finally:
                self._running = []

    def _to_read(self) -> list[AdapterRecord]:
        """Adapters queued requests name whose files must be read first, oldest request first,
        as many as the CPU tier holds beside the GPU tier's (so reading ahead never evicts what
        a batch is about to use), and at least one, or a request could wait forever."""
        room = max(1, self.config.max_cpu_loras - self.config.max_loras)
        unread: dict[str, AdapterRecord] = {}
        for pending in self._queue:
            record = pending.record
            if record is not None and not self.residency.ready(record) and len(unread) < room:
                unread.setdefault(record.key, record)
        return list(unread.values())

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
        if len(kept) != len(self._queue):
            # The last request of a burst may be one whose client left: the gauge reads 0 then.
            self.metrics.queue_depth.set(len(kept))
        self._queue = kept

    async def _run_batch(self, batch: list[_Pending]) -> None:
        records = list({p.record.key: p.record for p in batch if p.record is not None}.values())
        try:
            # The worker batches only ready requests (`_drain` reads the others ahead); a parse
            # the CPU tier dropped since is read again here, still before the pipeline lock.
            await asyncio.gather(*(self.residency.prepare(r) for r in records))
            async with self._pipeline_lock:
                needed = {r.key for r in records}
                wanted = scheduling.adapters_wanted(self._queue)
                for record in records:
                    hit = record.key in self.residency.gpu
                    self.metrics.lookups.labels("hit" if hit else "miss").inc()
                    await self.residency.make_resident(record, wanted=wanted, protected=needed)
                started = time.perf_counter()
                outcome = await self._in_pipeline(self._generate_batch, batch)
                self.metrics.generation_seconds.observe(time.perf_counter() - started)
                self.metrics.batch_images.observe(len(outcome.images))
                self.metrics.batches.labels(outcome.path).inc()
                images = outcome.images
        except Exception as e:
            failure = (
                e
                if isinstance(e, errors.DOMAIN_ERRORS)
                else errors.InferenceError(f"generation failed: {e}")
            )
            if not isinstance(e, errors.DOMAIN_ERRORS):
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
        for pending in batch:
            named = pending.record.name if pending.record is not None else self.config.model_id
            self.metrics.model_requests.labels(named).inc()

    def _generate_batch(self, batch: list[_Pending]) -> BatchOutcome:
        """Pipeline thread: one pipeline call, each request through its adapter's slot."""
        slot_of = self.residency.slot_of
        slots = [slot_of(p.key.adapter) if p.key.adapter else None for p in batch]
        scales = {slot_of(p.key.adapter): p.key.scale for p in batch if p.key.adapter is not None}
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
            self.residency.release(pending.record)

    async def _in_pipeline(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pipeline_thread, fn, *args)


def _scale_for(params: GenerationParams, record: AdapterRecord | None) -> float:
    """The request's scale, else the adapter's default; the base model has none."""
    if record is None:
        return 0.0
    return record.scale if params.scale is None else params.scale
