"""The benchmark's inference pods: which are Ready, what each lists, and the bare load and unload
calls that are the limits the operator is measured against."""

from __future__ import annotations

import asyncio
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from typing import Any

import psutil
from aiohttp import ClientSession, ClientTimeout
from lora_demo import release
from lora_devcluster.harness import Harness

from tests.support import cluster
from tests.support.cluster import TOKEN

NS = "bench"
SELECTOR = "app=inference"


def pods(h: Harness, n: int, timeout: float = 900) -> list[dict[str, Any]]:
    return release.ready_pods(h, NS, SELECTOR, n, timeout=timeout, all_ready=False)


def names_on(ip: str) -> set[str]:
    try:
        return set(cluster.models(ip))
    except (OSError, AssertionError):
        return set()


def gone(pid: int) -> bool:
    try:
        return bool(psutil.Process(pid).status() == psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return True


def http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return bool(r.status == 200)
    except (OSError, urllib.error.HTTPError):
        return False


async def bare_calls(
    names_by_ip: dict[str, list[str]], root: str | Mapping[str, str]
) -> tuple[float, list[float], float]:
    """The limits: POST /v1/load_lora_adapter for each pod's adapters (every adapter, or its
    placed ones), one call at a time per pod, the pods in parallel (as the operator calls them),
    then the same for /v1/unload_lora_adapter. `root`: the folder of the copies as the pods see
    it, or each pod's (by IP). Returns (load wall, per-pod load wall, unload wall)."""
    headers = {"Authorization": f"Bearer {TOKEN}"}

    async def one_pod(session: ClientSession, ip: str, verb: str) -> float:
        started = time.perf_counter()
        folder = root if isinstance(root, str) else root[ip]
        for name in names_by_ip[ip]:
            body = {"lora_name": f"bare-{name}", "lora_path": f"{folder}/{name}"}
            if verb == "unload":
                body = {"lora_name": f"bare-{name}"}
            async with session.post(
                f"http://{ip}:8000/v1/{verb}_lora_adapter", json=body, headers=headers
            ) as resp:
                if resp.status != 200:
                    raise RuntimeError(f"{ip}: {verb} {name}: {resp.status} {await resp.text()}")
        return time.perf_counter() - started

    async def all_pods(session: ClientSession, verb: str) -> tuple[float, list[float]]:
        started = time.perf_counter()
        per_pod = await asyncio.gather(*(one_pod(session, ip, verb) for ip in names_by_ip))
        return time.perf_counter() - started, list(per_pod)

    async with ClientSession(timeout=ClientTimeout(total=600)) as session:
        load_wall, per_pod = await all_pods(session, "load")
        unload_wall, _ = await all_pods(session, "unload")
    return load_wall, per_pod, unload_wall
