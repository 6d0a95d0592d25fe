"""The temporary file a download is written into: hashed, counted and size-limited as it goes.

Fetchers (fetchers.py) write into a `Sink`; the store (staging.py) opens one on a file under
`.tmp/`, hands it to the fetcher and publishes what `finish` hashed. Both import this module, and
it imports neither, so fetching and staging depend on each other in one direction only
(staging -> fetchers -> sinks). Nothing here speaks a network protocol or knows the volume's
layout.
"""

from __future__ import annotations

import errno
import hashlib
import os
import queue
import threading
from collections.abc import Callable
from typing import BinaryIO

from lora_operator.rules import errors

ProgressCallback = Callable[[int], None]


class _Lane:
    """One thread applying `work` to each batch handed to it, in order; at most `depth`
    batches wait, so a full lane makes the caller wait. The first OSError is kept in `failure`
    and later batches are skipped."""

    def __init__(self, name: str, work: Callable[[list[bytes]], None], depth: int) -> None:
        self._name = name
        self._work = work
        self._batches: queue.Queue[list[bytes] | None] = queue.Queue(maxsize=depth)
        self._thread: threading.Thread | None = None
        self._stopped = False
        self.failure: OSError | None = None

    def put(self, batch: list[bytes]) -> None:
        if self._stopped:  # the sink was closed under a fetcher still running: drop it
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
            self._thread.start()
        self._batches.put(batch)

    def join(self) -> None:
        """Wait until every batch handed over is done."""
        if self._thread is not None:
            self._batches.join()

    def stop(self) -> None:
        self._stopped = True
        if self._thread is not None:
            self._batches.put(None)
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        while True:
            batch = self._batches.get()
            try:
                if batch is None:
                    return
                if self.failure is None:
                    self._work(batch)
            except OSError as e:
                self.failure = e
            finally:
                self._batches.task_done()


class Sink:
    """The temporary file a fetcher writes into: hashes, counts, enforces the size limit.

    `write` is synchronous, so thread-based fetchers (downloads, file copies) can call it too; it
    only counts the chunk and keeps it. Every `BATCH_BYTES` the batch goes to two threads of the
    sink's own, one hashing and one writing it (hashlib and file writes release the GIL), so
    the two run side by side and overlap reading what comes next: one thread doing both was
    the slowest part of a fast download. At most `depth` batches wait in each, so memory stays
    flat in the file size, and a full lane makes the caller wait. The data is synced every
    `SYNC_BYTES` as it goes, so `finish`'s fsync has little left to do. The progress callback
    and `announced` are called from the fetcher's thread and must be quick. Use it as a context
    manager: leaving stops the threads, and a fetcher still writing gets an error at its next
    chunk.
    """

    SYNC_BYTES = 64 * 1024 * 1024
    # Four reads of a fast download (downloads.CHUNK_BYTES) per hand-over: each one wakes both
    # lanes' threads, and an https download is bound by its reader (decrypting). 1 MiB batches
    # hold about 18 MiB less at the peak of a 1 GiB staging, but on two cores an https one took
    # 8-15% longer in the median (its times spread as widely) and S3 gained nothing; 8 MiB
    # batches gained nothing either.
    BATCH_BYTES = 4 * 1024 * 1024

    def __init__(
        self,
        file: BinaryIO,
        *,
        max_bytes: int,
        description: str,
        progress: ProgressCallback | None = None,
        announced: Callable[[int | None], None] | None = None,
        depth: int = 4,
    ) -> None:
        self._file = file
        self._max = max_bytes
        self._progress = progress
        self._announced = announced
        self.description = description
        self._hash = hashlib.sha256()
        self.size = 0
        self._hashing = _Lane("sink-hash", self._hash_batch, depth)
        self._writing = _Lane("sink-write", self._write_batch, depth)
        self._unsynced = 0
        # Chunks not yet handed over: kept as the fetcher's own bytes objects, since copying
        # a gigabyte into one buffer and out again costs as much as hashing it.
        self._pending: list[bytes] = []
        self._pending_bytes = 0
        self._closed = False

    def __enter__(self) -> Sink:
        return self

    def __exit__(self, *exc: object) -> None:
        self._closed = True
        self._hashing.stop()
        self._writing.stop()

    @property
    def limit(self) -> int:
        """The most bytes this sink takes (the staging size limit)."""
        return self._max

    def reset(self) -> None:
        """Start over (a retry after a failed attempt)."""
        self._pending, self._pending_bytes = [], 0
        self._drain()
        self._file.seek(0)
        self._file.truncate()
        self._hash = hashlib.sha256()
        self._unsynced = 0
        self.size = 0
        if self._progress:
            self._progress(0)

    def expect(self, declared: int | None) -> None:
        """Refuse at once a source that announces more bytes than the limit; then tell
        `announced` (the store's quota reservation) what the source announced."""
        if declared is not None and declared > self._max:
            raise self._too_large(declared)
        if self._announced is not None:
            self._announced(declared)

    def write(self, chunk: bytes) -> None:
        if self._closed:
            # The staging was cancelled (a new spec, a deletion) while a fetcher's thread
            # still reads: this ends that thread at its next chunk.
            raise errors.SourceUnavailable(f"staging {self.description} was stopped")
        if self.size + len(chunk) > self._max:
            raise self._too_large(self.size + len(chunk))
        self._raise_failure()
        self._pending.append(bytes(chunk))  # a bytes object is kept as it is, not copied
        self._pending_bytes += len(chunk)
        self.size += len(chunk)
        if self._pending_bytes >= self.BATCH_BYTES:
            self._hand_over()
        if self._progress:
            self._progress(self.size)

    def _hand_over(self) -> None:
        """Give what is pending to both lanes: in batches, because every hand-over between
        two threads costs a GIL switch (a slow source's reads are a few KiB)."""
        if not self._pending:
            return
        self._hashing.put(self._pending)
        self._writing.put(self._pending)
        self._pending, self._pending_bytes = [], 0

    def finish(self) -> str:
        """Wait for the queued chunks, flush and fsync; the SHA-256 of everything written. May
        be called again (a fetcher that checks a digest itself calls it first)."""
        self._drain()
        try:
            self._file.flush()
            os.fsync(self._file.fileno())
        except OSError as e:
            raise disk_error(e) from e
        return self._hash.hexdigest()

    def _hash_batch(self, batch: list[bytes]) -> None:
        for chunk in batch:
            self._hash.update(chunk)

    def _write_batch(self, batch: list[bytes]) -> None:
        self._file.writelines(batch)
        self._unsynced += sum(len(c) for c in batch)
        if self._unsynced >= self.SYNC_BYTES:
            # Start writing back what is written so far, without waiting for it.
            self._file.flush()
            end = self._file.tell()
            os.posix_fadvise(
                self._file.fileno(), end - self._unsynced, self._unsynced, os.POSIX_FADV_DONTNEED
            )
            self._unsynced = 0

    def _drain(self) -> None:
        self._hand_over()
        self._hashing.join()
        self._writing.join()
        self._raise_failure()

    def _raise_failure(self) -> None:
        failure = self._writing.failure or self._hashing.failure
        if failure is not None:
            raise disk_error(failure) from failure

    def _too_large(self, size: int) -> errors.TooLarge:
        return errors.TooLarge(
            f"{self.description} is larger than the staging limit of {self._max} bytes "
            f"(at least {size}); a LoRA adapter is rarely that big: check the URI, or raise "
            "the operator's staging size limit"
        )


def disk_error(e: OSError) -> errors.StagingError:
    """What a failed write to the volume means for staging: a full volume is `DiskFull`,
    anything else `SourceUnavailable` (both transient: staging retries)."""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return errors.DiskFull(
            "the shared adapter volume is full; free space or grow the volume (staging retries)"
        )
    return errors.SourceUnavailable(f"writing to the shared adapter volume failed: {e.strerror}")
