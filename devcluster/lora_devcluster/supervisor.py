"""The cluster's supervisor: `python -m lora_devcluster.supervisor --dir DIR --bin-dir BIN ...`.

Runs as PID 1 of the cluster's own PID, mount and network namespaces (`cluster.up` starts it
under `unshare`), so when it exits, however it exits, the kernel kills every process of the
cluster, containers included. Owns: the order of things: the sandbox's mounts and network, the
control plane, the node, the `ready` file that `up` waits for, and the orderly stop. SIGUSR1
restarts the API server (tests use it to show that clients recover their watches); any other
exit of a component stops the cluster.
Must not: be started directly on the host (it would mount over the host's /run).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path

from lora_devcluster import controlplane, node, processes, sandbox
from lora_devcluster.layout import Layout


async def serve(
    root: Path,
    bin_dir: Path,
    images: dict[Path, str],
    helper_image: str,
    with_registry: bool = False,
) -> None:
    layout = Layout(root)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    restart = asyncio.Event()
    loop.add_signal_handler(signal.SIGUSR1, restart.set)
    t0 = time.monotonic()
    sandbox.apply_mounts(layout)
    sandbox.apply_network()
    pki, started = await controlplane.start(bin_dir, layout)
    logging.info("control plane up in %.1f s", time.monotonic() - t0)
    try:
        started += await node.start(
            bin_dir, layout, pki, images, helper_image, logging.info, with_registry
        )
        logging.info("node ready in %.1f s", time.monotonic() - t0)
        layout.ready.write_text(json.dumps({"seconds": round(time.monotonic() - t0, 1)}))
        waiter = asyncio.create_task(stop.wait())
        while True:
            exits = [asyncio.create_task(p.process.wait()) for p in started]
            restarter = asyncio.create_task(restart.wait())
            done, _ = await asyncio.wait(
                {waiter, restarter, *exits}, return_when=asyncio.FIRST_COMPLETED
            )
            for task in (*exits, restarter):
                task.cancel()
            if done != {restarter}:
                break
            restart.clear()
            logging.info("restarting the API server (SIGUSR1)")
            await controlplane.restart_apiserver(bin_dir, layout, pki, started)
            logging.info("API server restarted")
        for p in started:
            if not p.running:
                logging.error(
                    "%s exited with %s; last lines:\n%s",
                    p.name,
                    p.process.returncode,
                    processes.tail(p.log),
                )
    finally:
        logging.info("stopping the node and the control plane")
        # Containers need no goodbye: they die with this PID namespace when we exit.
        await processes.stop_all(started)
        logging.info("stopped")


def main() -> None:
    parser = argparse.ArgumentParser(prog="lora_devcluster.supervisor")
    parser.add_argument("--dir", type=Path, required=True)
    parser.add_argument("--bin-dir", type=Path, required=True)
    parser.add_argument("--image", action="append", default=[], help="REF=ARCHIVE")
    parser.add_argument("--helper-image", required=True)
    parser.add_argument("--registry", action="store_true", help="start the OCI registry")
    args = parser.parse_args()
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    if os.getpid() != 1:
        sys.exit("lora_devcluster.supervisor must run as PID 1 of its own namespaces (use `up`)")
    images = {Path(a): ref for ref, _, a in (i.partition("=") for i in args.image)}
    asyncio.run(serve(args.dir, args.bin_dir, images, args.helper_image, args.registry))


if __name__ == "__main__":
    main()
