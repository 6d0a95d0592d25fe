"""`python -m lora_router`: run the router (see `--help` and docs/routing.md)."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from collections.abc import Sequence

import uvloop
from aiohttp import web
from lora_runtime import metrics as prometheus

from lora_router import server
from lora_router.app import create_app
from lora_router.config import RouterConfig, parse_args
from lora_router.metrics import Metrics
from lora_router.sources import kube_sources
from lora_router.state import STATE, Source

log = logging.getLogger("lora_router")


async def serve(
    config: RouterConfig, stop: asyncio.Event, sources: list[Source] | None = None
) -> None:
    """Serve until `stop` is set, then drain: answer for `shutdown_delay_s` more (not Ready),
    let the requests in flight finish, and close."""
    metrics = Metrics()
    app = create_app(
        config, sources=kube_sources(config) if sources is None else sources, metrics=metrics
    )
    runners = [
        # No access log: a line per request cost a fifth of the router's CPU per request; the
        # pods log every generation, and lora_router_requests_total counts each route and code.
        web.AppRunner(app, access_log=None),
        web.AppRunner(prometheus.app(metrics.registry), access_log=None),
    ]
    for runner in runners:
        await runner.setup()
    # Generations are read and answered by the router's own server, the rest by aiohttp's
    # (lora_router.server).
    await server.Site(runners[0], "0.0.0.0", config.port).start()
    # The metrics port through the same HTTP/1.1 reader: its head deadline and limits too.
    await server.Site(runners[1], "0.0.0.0", config.metrics_port).start()
    log.info(
        "listening on :%d (metrics :%d) for %s/%s, polling residency %s",
        config.port,
        config.metrics_port,
        config.namespace,
        ", ".join(s.name for s in config.services),
        f"with the client token in {config.client_token_file}"
        if config.client_token_file
        else "without a token",
    )
    try:
        await stop.wait()
        app[STATE].draining = True
        log.info("action=shutdown result=draining seconds=%s", config.shutdown_delay_s)
        await asyncio.sleep(config.shutdown_delay_s)
    finally:
        # In-flight requests finish (the sites' graceful shutdown) before the pool and the
        # session close.
        for runner in runners:
            await runner.cleanup()


def new_event_loop() -> asyncio.AbstractEventLoop:
    """The router's event loop: uvloop's, since the router's CPU per request is mostly the
    loop's and its sockets' (docs/benchmarks.md, "The router's own cost per request")."""
    return uvloop.new_event_loop()


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_args(argv)
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stdout,
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
    )

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await serve(config, stop)

    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        runner.run(run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
