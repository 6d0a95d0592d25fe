"""Child processes: start with a log file, stop with SIGTERM then SIGKILL, show a log's tail.

Owns: spawning one process in its own session (so its children are signalled with it), and
stopping its process group within a grace period, on an event loop (the supervisor's `Proc`) or
blocking (`stop_group`: the image builds' steps); tying a child's life to its parent's
(`die_with_parent`); the last lines of a log for an error message (`tail`).
Must not: know what the process is (control plane, pod holder, container, build step).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """A `preexec_fn`: the child is SIGKILLed when the thread that started it exits, so a
    killed parent leaves no child running on (Linux' PR_SET_PDEATHSIG)."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def signal_group(pid: int, sig: int) -> None:
    """Send `sig` to the process group that `pid` leads; nothing when it is gone."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def stop_group(proc: subprocess.Popen[Any], grace: float = 10.0) -> int:
    """Blocking: SIGTERM the process group `proc` leads (started with `start_new_session`),
    wait up to `grace` seconds, then SIGKILL the group; its exit code."""
    signal_group(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=max(grace, 0.0))
    # SIGKILL the group even after the leader exited: a child it forked may linger.
    signal_group(proc.pid, signal.SIGKILL)
    return proc.wait()


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
        signal_group(self.process.pid, sig)

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
    """The last `lines` lines of the log at `path` (for an error message); never raises."""
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return f"(no log at {path})"
    except OSError as e:
        return f"(cannot read {path}: {e})"
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
