"""Linux namespace and mount syscalls through ctypes (Python 3.11 has no os.setns).

Owns: setns, unshare and mount wrappers, and entering a network namespace from a process that
is already running (the pytest process, the `exec` subcommand).
Must not: decide anything about pods or clusters.

Note: setns(CLONE_NEWNET) moves only the calling thread. Threads created later inherit the new
namespace from the thread that creates them; threads that already exist stay where they were.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from pathlib import Path

CLONE_NEWNS = 0x00020000
CLONE_NEWNET = 0x40000000
CLONE_NEWUTS = 0x04000000
MS_RDONLY = 1
MS_REMOUNT = 32
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


class NamespaceError(OSError):
    """A namespace or mount syscall failed; the message names the call and its arguments."""


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise NamespaceError(err, f"{what}: {os.strerror(err)}")


def setns(path: str | Path, nstype: int) -> None:
    """Move the calling thread into the namespace at `path` (e.g. /proc/PID/ns/net)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        _check(_libc.setns(fd, nstype), f"setns({path})")
    finally:
        os.close(fd)


def unshare(flags: int) -> None:
    _check(_libc.unshare(flags), f"unshare({flags:#x})")


def mount(source: str, target: str, fstype: str | None, flags: int, data: str = "") -> None:
    _check(
        _libc.mount(
            source.encode(),
            target.encode(),
            fstype.encode() if fstype else None,
            flags,
            data.encode() if data else None,
        ),
        f"mount({source!r}, {target!r}, {fstype or 'bind'}, flags={flags:#x}, {data!r})",
    )


def bind_mount(source: str, target: str, *, readonly: bool) -> None:
    mount(source, target, None, MS_BIND | MS_REC)
    if readonly:
        mount("none", target, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_REC)


def make_mounts_private() -> None:
    """Stop mounts made from now on in this mount namespace from propagating to the host."""
    mount("none", "/", None, MS_REC | MS_PRIVATE)


class NetnsSwitch:
    """Enter a network namespace and come back later: the pytest fixture joins the cluster's
    namespace so the test process (and kopf threads it starts) reach the API server and pod IPs.
    """

    def __init__(self, target: str | Path) -> None:
        self._target = str(target)
        self._home_fd: int | None = None

    def enter(self) -> None:
        self._home_fd = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        try:
            setns(self._target, CLONE_NEWNET)
        except BaseException:
            os.close(self._home_fd)
            self._home_fd = None
            raise

    def leave(self) -> None:
        if self._home_fd is None:
            return
        try:
            _check(_libc.setns(self._home_fd, CLONE_NEWNET), "setns(back home)")
        finally:
            os.close(self._home_fd)
            self._home_fd = None
