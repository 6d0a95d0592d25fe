"""The kubelet's HTTPS endpoint, so `kubectl logs` works: the API server proxies
`pods/log` to https://<node InternalIP>:10250/containerLogs/<ns>/<pod>/<container>.

Owns: serving container logs (tailLines, previous, follow) from the log files.
Must not: serve exec, attach or port-forward (not implemented: answered 501). It listens only
inside the cluster's network namespace, on the node address.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from pathlib import Path

from aiohttp import web

from lora_devcluster import kubelet, podlogic

PORT = 10250
KUBELET_KEY = web.AppKey("kubelet", kubelet.Kubelet)


def _find_container(
    kl: kubelet.Kubelet, namespace: str, pod: str, container: str
) -> kubelet.ContainerRunner | None:
    for worker in kl.workers.values():
        if worker.namespace == namespace and worker.name == pod:
            for runner in worker.init_runners + worker.runners:
                if runner.name == container:
                    return runner
    return None


async def container_logs(request: web.Request) -> web.StreamResponse:
    kl = request.app[KUBELET_KEY]
    ns, pod, container = (request.match_info[k] for k in ("namespace", "pod", "container"))
    runner = _find_container(kl, ns, pod, container)
    if runner is None or not runner.log.exists():
        raise web.HTTPNotFound(text=f"container {container!r} of pod {ns}/{pod} has no log here")
    query = request.query
    tail = int(query["tailLines"]) if "tailLines" in query else None
    previous = query.get("previous") == "true"
    log = runner.log
    text = log.read_text(errors="replace")
    selected = podlogic.select_log(text, previous=previous, tail_lines=tail)
    if selected is None:
        raise web.HTTPBadRequest(text=f"previous terminated container {container!r} not found")
    if query.get("follow") != "true" or previous:
        return web.Response(text=selected)
    response = web.StreamResponse(headers={"Content-Type": "text/plain"})
    await response.prepare(request)
    await response.write(selected.encode())
    offset = len(text.encode())
    marker = podlogic.LOG_RUN_MARKER.encode()
    # Like the kubelet: follow until this run of the container ends (or the client leaves,
    # which cancels this handler).
    while request.transport is not None and not request.transport.is_closing():
        running = runner.running_since is not None
        await asyncio.sleep(0.2)
        size = log.stat().st_size
        if size > offset:
            with open(log, "rb") as f:
                f.seek(offset)
                chunk = f.read(size - offset)
            offset = size
            if marker in chunk:  # the next run started: this one is over
                await response.write(chunk[: chunk.index(marker)])
                break
            await response.write(chunk)
        elif not running:
            break
    with contextlib.suppress(ConnectionError):
        await response.write_eof()
    return response


async def not_implemented(request: web.Request) -> web.Response:
    raise web.HTTPNotImplemented(
        text="lora-devcluster's process kubelet serves only container logs"
    )


async def start(kl: kubelet.Kubelet, host: str, cert: Path, key: Path) -> web.AppRunner:
    app = web.Application()
    app[KUBELET_KEY] = kl
    app.router.add_get("/containerLogs/{namespace}/{pod}/{container}", container_logs)
    app.router.add_route("*", "/{tail:.*}", not_implemented)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(str(cert), str(key))
    # A `kubectl logs -f` still streaming must not hold up the cluster's shutdown.
    await web.TCPSite(runner, host, PORT, ssl_context=context, shutdown_timeout=1).start()
    return runner
