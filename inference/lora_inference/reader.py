"""Reading adapters off the event loop: files parsed, hashed and checked, stacks composed, in a
small thread pool of their own that never runs pipeline work, and the record a read becomes.

Owns the read pool. Must not change the registry (admission does, after a read succeeds) or
touch the pipeline's state: of the backend it calls only what `backend.AdapterParser` declares,
`parse_adapter` and `compose`, which read and convert only.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from lora_volume import files
from lora_volume.stacks import Blocks

from lora_inference import errors
from lora_inference.adapters.registry import AdapterRecord, Origin, next_version
from lora_inference.backend import AdapterParser, ParsedAdapter, StackMember
from lora_inference.config import ServerConfig
from lora_inference.metrics import Metrics
from lora_inference.stackkeys import stack_name


class Reader:
    """Reads and checks adapter files in a small thread pool that never touches the pipeline."""

    def __init__(self, backend: AdapterParser, config: ServerConfig, metrics: Metrics) -> None:
        self._backend = backend
        self._config = config
        self._metrics = metrics
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="adapter-parse")

    async def read(self, path: Path, name: str) -> ParsedAdapter:
        """Read, hash, check and convert the adapter at `path` (`AdapterParser.parse_adapter`)."""
        started = time.perf_counter()
        try:
            parsed = await asyncio.get_running_loop().run_in_executor(
                self._pool,
                lambda: self._backend.parse_adapter(
                    path, name=name, max_rank=self._config.max_lora_rank
                ),
            )
        except errors.DOMAIN_ERRORS:
            self._metrics.loads.labels("cpu", "error").inc()
            raise
        self._metrics.load_seconds.labels("cpu").observe(time.perf_counter() - started)
        return parsed

    async def compose(
        self,
        members: Sequence[tuple[AdapterRecord, float]],
        parts: Sequence[ParsedAdapter],
        *,
        blocks: Sequence[Blocks] = (),
        param: str = "lora",
    ) -> ParsedAdapter:
        """One adapter equal to `members` at their scales (`AdapterParser.compose`), from their
        parses (`parts`, in the same order), each member's scale varied by its `blocks` (in the
        same order; none: no member's is); `param` names the field a conflict is about."""
        for (record, _), part in zip(members, parts, strict=True):
            if part.full:  # whole-matrix layers (merge_only): no low-rank pairs to stack
                raise errors.IncompatibleAdapter(
                    f"{record.name} is served merged only (format {part.format}: its delta is "
                    "not low rank), so it cannot be stacked with other adapters or given block "
                    "weights; use it alone",
                    param=param,
                )
        stacked = [
            StackMember(name=record.name, scale=scale, parsed=part, blocks=member_blocks)
            for (record, scale), part, member_blocks in zip(
                members, parts, blocks or [()] * len(members), strict=True
            )
        ]
        name = stack_name([(m.name, m.scale, m.blocks) for m in stacked])
        return await asyncio.get_running_loop().run_in_executor(
            self._pool,
            functools.partial(self._backend.compose, stacked, name=name, param=param),
        )

    async def check_base_model(self, path: Path, name: str) -> None:
        await asyncio.get_running_loop().run_in_executor(
            self._pool, check_base_model, self._config, path, name
        )

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def new_record(
    name: str,
    path: Path,
    parsed: ParsedAdapter,
    *,
    origin: Origin,
    pinned: bool = False,
    scale: float = 1.0,
    members: tuple[tuple[AdapterRecord, float], ...] = (),
) -> AdapterRecord:
    """A new version of `name`, read from `path`: what `parsed` says of its weights."""
    return AdapterRecord(
        name=name,
        path=path,
        weights_file=parsed.weights_file,
        sha256=parsed.sha256,
        size_bytes=parsed.size_bytes,
        rank=parsed.rank,
        pinned=pinned,
        origin=origin,
        version=next_version(),
        scale=scale,
        members=members,
        format="stack" if members else parsed.format,
        targets=tuple(sorted({component for component, _ in (*parsed.layers, *parsed.full)})),
        trigger_words=parsed.trigger_words,
    )


def check_base_model(config: ServerConfig, path: Path, name: str) -> None:
    """Refuse an adapter whose `adapter_config.json` declares another base model (reads it)."""
    adapter_config = files.read_adapter_config(path)
    if adapter_config is None or adapter_config.base_model is None:
        return
    accepted = {config.model_id, *config.accepted_base_models}
    declared = adapter_config.base_model.rstrip("/")
    if declared in accepted or declared.rsplit("/", 1)[-1] in accepted:
        return
    raise errors.IncompatibleAdapter(
        f"adapter {name!r} declares base model {adapter_config.base_model!r} in "
        f"adapter_config.json, but this server serves {config.model_id!r}; load it on a server "
        "for that model, or start this one with --accept-base-model if they are compatible",
        param="lora_path",
    )
