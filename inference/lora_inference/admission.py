"""Admission: from a name (or a path) to a registered, validated adapter record.

Owns the registry's changes and the path each adapter takes into it, read top to bottom here:
the load endpoint and `--lora` (`register`), a generation request's `model` (`resolve`: a
registered name, or one published on the adapter root for this pod) and `lora.local_path`
(`register_from_request`), and `unregister`. A registration checks the name, resolves the path
inside the allowed roots, asks `registry.plan_register` whether the name may be taken, checks the
base model that `adapter_config.json` declares, reads and checks the weights (the backend's
`parse_adapter`), and only then changes the registry: a refusal changes nothing.

Every filesystem read runs off the event loop: path and adapter-root lookups in
`asyncio.to_thread`, `adapter_config.json` and the weights in a small read pool (`reader`) that
never runs pipeline work. So a slow volume delays the registration that reads it, not /health,
other requests or the worker. Registrations of one name run one at a time (a lock per name), so
the second of two concurrent loads of a name sees the first one's record; other names do not
wait for it.

It must not touch the pipeline, the tiers or the queue: a new version goes to residency, which
keeps its parse and makes a pinned one resident. The worker knows nothing of admissions in
progress: a request reaches the queue once its adapter is read, and no batch waits for it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import hashlib
import logging
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

from lora_volume import errors as volume_errors
from lora_volume import layout, stacks, targeting

from lora_inference import errors
from lora_inference.adapters import cache
from lora_inference.adapters.registry import (
    AdapterRecord,
    Origin,
    Registry,
    plan_register,
)
from lora_inference.api import StackMember
from lora_inference.backend import ParsedAdapter
from lora_inference.config import ServerConfig
from lora_inference.reader import Reader, new_record
from lora_inference.residency import Residency
from lora_inference.stackkeys import stack_name

log = logging.getLogger(__name__)


class Admission:
    def __init__(
        self, config: ServerConfig, registry: Registry, residency: Residency, reader: Reader
    ) -> None:
        self._config = config
        self._registry = registry
        self._residency = residency
        self._reader = reader
        # Stacks built for requests, by their members' versions and scales: a request naming the
        # same adapters at the same scales reuses one (see `resolve_stack`).
        self._stacks: dict[tuple[tuple[str, int, float, stacks.Blocks], ...], AdapterRecord] = {}
        self._name_locks: dict[str, asyncio.Lock] = {}
        self._name_users: collections.Counter[str] = collections.Counter()

    # -- the admin API and --lora ---------------------------------------------------------------

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
        resolved = await asyncio.to_thread(self._resolve_path, path, origin)
        async with self._one_at_a_time(name):
            existing = self._registry.get(name)
            decision = plan_register(
                existing, origin, resolved, load_inplace=load_inplace, pinned=pinned, scale=scale
            )
            if decision == "reuse" and existing is not None:
                return existing
            if pinned:
                self._check_pin_room(name, existing)
            await self._reader.check_base_model(resolved, name)
            parsed, members = await self._read(resolved, name)
            # Nothing awaits from here until the registry holds the record; other names may
            # have been pinned while this one was read.
            if pinned:
                self._check_pin_room(name, self._registry.get(name))
            record = new_record(
                name, resolved, parsed, origin=origin, pinned=pinned, scale=scale, members=members
            )
            self._residency.add(record, parsed)
            previous = self._registry.put(record)
            if previous is not None:
                self._residency.retire(previous)
                self._retire_stale_stacks()
            self._residency.update_gauges()
        log.info("registered adapter %s v%d from %s (%s)", name, record.version, resolved, origin)
        if pinned:
            try:
                await self._residency.pin(record)
            except errors.DOMAIN_ERRORS:
                self._restore(record, previous)
                raise
        return record

    async def _read(
        self, path: Path, name: str
    ) -> tuple[ParsedAdapter, tuple[tuple[AdapterRecord, float], ...]]:
        """Read the adapter at `path`: a file, or a composed revision (`lora_volume.stacks`),
        whose members are read and checked against its manifest and built into one adapter (each
        at its scale and block weights);
        then its members too."""
        if not await asyncio.to_thread(stacks.is_stack, path):
            return await self._reader.read(path, name), ()
        manifest = path / stacks.STACK_FILE
        data = await asyncio.to_thread(manifest.read_bytes)
        members, parts = [], []
        entries = stacks.parse_manifest(data, where=str(manifest))
        for entry in entries:
            part = await self._reader.read(path / entry.file, entry.name)
            if part.sha256 != entry.sha256:
                raise errors.IncompatibleAdapter(
                    f"member {entry.name!r} of composition {name!r} has sha256 {part.sha256}, "
                    f"but {manifest} names {entry.sha256}; stage the composition again",
                    param="lora_path",
                )
            members.append(
                (new_record(entry.name, path / entry.file, part, origin="stack"), entry.scale)
            )
            parts.append(part)
        composed = await self._reader.compose(
            members, parts, blocks=[e.blocks for e in entries], param="lora_path"
        )
        # Named by its manifest, as the volume names the revision: what /v1/models reports.
        parsed = dataclasses.replace(
            composed, sha256=hashlib.sha256(data).hexdigest(), weights_file=manifest
        )
        return parsed, tuple(members)

    async def unregister(self, name: str, *, force: bool = False) -> AdapterRecord:
        record = self._registry.get(name)
        if record is None:
            raise errors.AdapterNotFound(f"adapter {name!r} is not loaded", param="lora_name")
        if record.origin == "static" and not force:
            raise errors.AdapterConflict(
                f"adapter {name!r} was given on the command line (--lora) and cannot be unloaded",
                param="lora_name",
            )
        self._registry.remove(name)
        self._residency.retire(record)
        self._retire_stale_stacks()
        log.info("unregistered adapter %s v%d", name, record.version)
        return record

    # -- generation requests --------------------------------------------------------------------

    async def resolve(self, name: str, *, param: str = "model") -> AdapterRecord:
        """The record for `name`: registered, or found on the adapter root and registered now.

        A name a request registered is looked up on the adapter root too: what the operator
        published under that name replaces it.
        """
        record = self._registry.get(name)
        if record is not None and record.origin != "request":
            return record
        layout.check_adapter_name(name, param=param)
        try:
            found = await asyncio.to_thread(self._published, name, param=param)
        except (errors.AdapterNotFound, volume_errors.NotFound):
            # Looked up again: the name may have been unloaded or replaced meanwhile.
            record = self._registry.get(name)
            if record is not None:
                return record  # published, but for other pods: the request's adapter stays
            raise
        record = self._registry.get(name)
        if found is None and record is not None:
            return record
        if found is None:
            raise errors.AdapterNotFound(
                f"the model '{name}' does not exist: it is neither the base model "
                f"'{self._config.model_id}' nor a loaded adapter",
                param=param,
            )
        try:
            return await self.register(name, found, origin="resolver")
        except errors.AdapterConflict:
            # Another request resolved the same name first.
            record = self._registry.get(name)
            if record is None:
                raise
            return record

    async def register_from_request(self, name: str, local_path: str) -> AdapterRecord:
        """The request-level path (`lora.local_path`): same checks and cache as the API."""
        if not self._config.allow_request_adapters:
            raise errors.Forbidden(
                "this server does not let requests register adapters (lora.local_path): name "
                "an adapter it serves in 'model' (GET /v1/models), or start the server with "
                "--allow-request-adapters (the chart's inference.allowRequestAdapters)",
                param="lora.local_path",
            )
        resolved = await asyncio.to_thread(
            layout.resolve_allowed, local_path, self._config.path_roots, param="lora.local_path"
        )
        existing = self._registry.get(name)
        if plan_register(existing, "request", resolved) == "reuse" and existing is not None:
            return existing
        return await self.register(name, resolved, origin="request")

    async def resolve_stack(self, members: Sequence[StackMember]) -> AdapterRecord:
        """One record for adapters a request stacks (`lora` as a list), built on first use.

        Each member resolves as a lone name does (404 naming it if unknown); a member without a
        scale is applied at its default. The stack is one adapter (the backend's `compose`) that the
        CPU tier caches and a GPU slot holds like any other; requests naming the same members at
        the same scales, in any order, share it. It is never registered: it has no name of its
        own, and it is retired when a member is replaced or unloaded.
        """
        resolved = []
        for i, member in enumerate(members):
            record = await self.resolve(member.name, param=f"lora[{i}].name")
            scale = record.scale if member.scale is None else member.scale
            resolved.append((record, scale, member.blocks))
        resolved.sort(key=lambda m: m[0].name)
        key = tuple(
            (record.name, record.version, scale, blocks) for record, scale, blocks in resolved
        )
        name = stack_name([(record.name, scale, blocks) for record, scale, blocks in resolved])
        weighed = tuple((record, scale) for record, scale, _ in resolved)
        async with self._one_at_a_time(name):
            found = self._stacks.get(key)
            if found is not None:
                return found
            parts = [await self._residency.parse(record) for record, _ in weighed]
            parsed = await self._reader.compose(
                weighed, parts, blocks=[blocks for _, _, blocks in resolved]
            )
            stack = new_record(name, weighed[0][0].path, parsed, origin="stack", members=weighed)
            self._residency.add(stack, parsed)
            self._stacks[key] = stack
            self._retire_stale_stacks()
        log.info("stacked %s as v%d (rank %d)", name, stack.version, stack.rank)
        return stack

    def _retire_stale_stacks(self) -> None:
        """Retire stacks a member left (replaced or unloaded), and stacks no tier holds any more
        (built again if asked for), so that stacks never outgrow the tiers."""
        for key, stack in list(self._stacks.items()):
            stale = any(self._registry.get(m.name) is not m for m, _ in stack.members)
            if stale or self._residency.tier_of(stack) == "disk":
                del self._stacks[key]
                self._residency.retire(stack)

    # -- blocking lookups (run in a thread) -----------------------------------------------------

    def _resolve_path(self, path: str | Path, origin: Origin) -> Path:
        if origin == "static":
            return Path(path).resolve(strict=True)
        param = "lora.local_path" if origin == "request" else "lora_path"
        return layout.resolve_allowed(path, self._config.path_roots, param=param)

    def _published(self, name: str, *, param: str) -> Path | None:
        """The adapter `name` on the adapter root, if it is there and meant for this pod.

        Published for other pods (their LoRAAdapter's selector or base model does not match
        this one): AdapterNotFound, as for an unknown name, saying why. A server that does not
        know its labels, or an adapter without a target (a volume filled by hand), serves it;
        with `published_only` (the chart), an adapter without a target is unknown.
        """
        root = self._config.adapter_root
        published_only = self._config.published_only
        found = (
            layout.resolve_on_root(root, name, published_only=published_only)
            if root is not None
            else None
        )
        labels_file = self._config.pod_labels_file
        if found is None or root is None or (labels_file is None and not published_only):
            return found
        target = layout.read_target(root, name, param=param)
        if target is None:
            # Placed by hand: served by name only where the server allows it (standalone).
            return None if published_only else found
        if labels_file is None:
            return found
        try:
            labels = targeting.parse_pod_labels(labels_file.read_text())
        except OSError as e:
            raise errors.AdapterNotFound(
                f"the model '{name}' cannot be resolved: this pod's labels ({labels_file}) "
                f"cannot be read: {e}",
                param=param,
            ) from e
        reason = targeting.refusal(target, labels, self._config.model_id)
        if reason is not None:
            raise errors.AdapterNotFound(
                f"the model '{name}' is not served by this pod: {reason}; send the request to "
                "a pod its LoRAAdapter selects",
                param=param,
            )
        return found

    # -- helpers --------------------------------------------------------------------------------

    def _check_pin_room(self, name: str, existing: AdapterRecord | None) -> None:
        if existing is not None and existing.pinned:
            return
        pinned = self._registry.pinned()
        if len(pinned) >= self._config.max_loras:
            raise cache.SlotsExhausted(
                f"cannot pin {name!r}: all {self._config.max_loras} GPU slots already hold "
                f"pinned adapters ({', '.join(r.name for r in pinned)}); "
                "unpin or unload one, or raise --max-loras"
            )

    def _restore(self, failed: AdapterRecord, previous: AdapterRecord | None) -> None:
        """Undo a registration whose pin could not be honoured; a replaced record comes back."""
        if self._registry.get(failed.name) in (failed, None):
            self._registry.remove(failed.name)
            if previous is not None:
                self._registry.put(previous)
                self._residency.unretire(previous)
        self._residency.retire(failed)

    @contextlib.asynccontextmanager
    async def _one_at_a_time(self, name: str) -> AsyncIterator[None]:
        """Hold `name`'s lock; it is dropped when no registration of the name waits for it."""
        lock = self._name_locks.setdefault(name, asyncio.Lock())
        self._name_users[name] += 1
        try:
            async with lock:
                yield
        finally:
            self._name_users[name] -= 1
            if self._name_users[name] <= 0:
                del self._name_users[name]
                del self._name_locks[name]
