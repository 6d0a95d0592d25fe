"""Child processes of the supervisor: start with a log file, stop with SIGTERM then SIGKILL.

Owns: spawning one process in its own session (so its children are signalled with it), and
stopping it within a grace period.
Must not: know what the process is (control plane, pod holder, container).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path


class Proc:
    def __init__(self, name: str, process: asyncio.subprocess.Process, log: Path) -> None:
        self.name = name
        self.process = process
        self.log = log

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def running(self) -> bool:
        return self.process.returncode is None

    def signal_group(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, sig)

    async def stop(self, grace: float) -> int:
        """SIGTERM the process group, wait up to `grace` seconds, then SIGKILL it."""
        if self.running:
            self.signal_group(signal.SIGTERM)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.process.wait(), timeout=max(grace, 0.0))
        # SIGKILL the group even after the leader exited: a child it forked may linger.
        self.signal_group(signal.SIGKILL)
        return await self.process.wait()


async def start(
    name: str,
    argv: list[str],
    log: Path,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
) -> Proc:
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        process = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=out,
            stderr=asyncio.subprocess.STDOUT,
            env=dict(env) if env is not None else None,
            cwd=cwd,
            start_new_session=True,
        )
    return Proc(name, process, log)


async def stop_all(started: list[Proc], grace: float = 10) -> None:
    """Stop processes in the reverse of their start order (clients before their servers)."""
    for proc in reversed(started):
        await proc.stop(grace=grace)


async def run_checked(argv: Sequence[str], env: Mapping[str, str] | None = None) -> str:
    """Run a short command (ctr, kubectl, ...); its output, or an error that shows it."""
    process = await asyncio.create_subprocess_exec(
        *argv,
        env=dict(env) if env is not None else None,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await process.communicate()
    text = out.decode(errors="replace")
    if process.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({process.returncode}):\n{text.strip()}")
    return text


def tail(path: Path, lines: int = 30) -> str:
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return f"(no log at {path})"
    return "\n".join(text.splitlines()[-lines:])


async def wait_until(what: str, check: Callable[[], bool], proc: Proc, timeout: float) -> None:
    """Poll the blocking `check` (off the event loop) until it holds; fail at once, with the
    log's last lines, if `proc` exits meanwhile, and after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not proc.running:
            raise RuntimeError(
                f"{proc.name} exited with {proc.process.returncode} while starting; "
                f"last lines of {proc.log}:\n{tail(proc.log)}"
            )
        if await asyncio.to_thread(check):
            return
        await asyncio.sleep(0.2)
    raise RuntimeError(
        f"{what} not ready after {timeout:.0f} s; last lines of {proc.log}:\n{tail(proc.log)}"
    )
