"""The cluster's supervisor: `python -m lora_devcluster.supervisor --dir DIR --bin-dir BIN`.

Runs as PID 1 of the cluster's own PID, network and mount namespaces (`cluster.up` starts it
under `unshare`), so when it exits, however it exits, the kernel kills every process of the
cluster. Owns: the pod bridge, the control plane's start and orderly stop, the kubelet, and
the `ready` file that `up` waits for. SIGUSR1 restarts the API server (tests use it to show
that clients recover their watches); any other control-plane exit stops the cluster.
Must not: be started directly on the host (it would configure the host's network).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
from pathlib import Path

from lora_devcluster import (
    apiclient,
    controlplane,
    kubelet,
    kubeletserver,
    mountpoints,
    podlogic,
    processes,
)


async def setup_network() -> None:
    run = processes.run_checked
    await run(["ip", "link", "set", "lo", "up"])
    await run(["ip", "link", "add", kubelet.BRIDGE, "type", "bridge"])
    await run(["ip", "addr", "add", f"{controlplane.HOST_IP}/24", "dev", kubelet.BRIDGE])
    await run(["ip", "link", "set", kubelet.BRIDGE, "up"])


async def serve(root: Path, bin_dir: Path, image_map: list[podlogic.ImageEntry]) -> None:
    layout = controlplane.Layout(root)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    restart = asyncio.Event()
    loop.add_signal_handler(signal.SIGUSR1, restart.set)
    await setup_network()
    pki, started = await controlplane.start(bin_dir, layout)
    try:
        config = kubelet.KubeletConfig(
            root=layout.pods,
            cluster_dir=root,
            host_ip=controlplane.HOST_IP,
            pod_prefix=controlplane.HOST_IP.rsplit(".", 1)[0] + ".",
            bridge=kubelet.BRIDGE,
            image_map=image_map,
            base_env={
                "PATH": f"{Path(sys.executable).parent}:{bin_dir}:/usr/local/bin:/usr/bin:/bin",
                "LANG": "C.UTF-8",
                "HOME": "/root" if os.getuid() == 0 else os.environ.get("HOME", "/tmp"),
            },
            mountpoints_file=mountpoints.REGISTRY,
            api_port=controlplane.API_PORT,
            ca_cert=pki.ca_cert,
        )
        async with apiclient.ApiClient(
            f"https://127.0.0.1:{controlplane.API_PORT}", pki.ca_cert, pki.admin_cert, pki.admin_key
        ) as api:
            kl = kubelet.Kubelet(api, config)
            # The API server's serving certificate also names the node address (10.244.0.1).
            server = await kubeletserver.start(
                kl, controlplane.HOST_IP, pki.server_cert, pki.server_key
            )
            await kl.register_node()
            layout.ready.write_text(json.dumps({"supervisor_pid_in_namespace": os.getpid()}))
            logging.info("cluster ready")
            run = asyncio.create_task(kl.run())
            waiter = asyncio.create_task(stop.wait())
            while True:
                exits = [asyncio.create_task(p.process.wait()) for p in started]
                restarter = asyncio.create_task(restart.wait())
                done, _ = await asyncio.wait(
                    {run, waiter, restarter, *exits}, return_when=asyncio.FIRST_COMPLETED
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
            if run in done and run.exception() is not None:
                logging.error("kubelet failed", exc_info=run.exception())
            run.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await run
            logging.info("stopping pods")
            await server.cleanup()
            await kl.shutdown()
    finally:
        logging.info("stopping the control plane")
        await controlplane.stop(started)
        logging.info("stopped")


def main() -> None:
    parser = argparse.ArgumentParser(prog="lora_devcluster.supervisor")
    parser.add_argument("--dir", type=Path, required=True)
    parser.add_argument("--bin-dir", type=Path, required=True)
    parser.add_argument("--image-map", default="{}", help="JSON image map")
    args = parser.parse_args()
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    if os.getpid() != 1:
        sys.exit("lora_devcluster.supervisor must run as PID 1 of its own namespaces (use `up`)")
    image_map = podlogic.parse_image_map(json.loads(args.image_map))
    asyncio.run(serve(args.dir, args.bin_dir, image_map))


if __name__ == "__main__":
    main()
