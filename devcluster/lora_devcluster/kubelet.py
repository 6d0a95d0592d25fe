"""The process kubelet: runs the pods bound to its Node as local processes.

Owns: the Node object, binding pending pods (there is no scheduler), one network namespace per
pod (a holder process, a veth pair on the cluster bridge, the pod IP), volumes on disk, starting
containers through `lora_devcluster.launch`, probes, restarts, graceful deletion, and patching
pod status. Every decision comes from `podlogic`; this module does the I/O.
Must not: run outside the supervisor's namespaces (it assumes its /proc shows its own children).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import json
import logging
import os
import shutil
import signal
import sys
import time
from collections.abc import Coroutine, Mapping
from pathlib import Path
from typing import Any

import aiohttp

from lora_devcluster import apiclient, mountpoints, podlogic, processes

log = logging.getLogger("lora_devcluster.kubelet")

Obj = dict[str, Any]
NODE_NAME = "lora-devcluster"
BRIDGE = "lorabr0"
POLL_S = 0.3
SERVICE_ACCOUNT_PATH = "/var/run/secrets/kubernetes.io/serviceaccount"


def now_rfc3339() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclasses.dataclass(frozen=True)
class KubeletConfig:
    root: Path  # where pod directories go
    cluster_dir: Path  # the state directory; containers carry it in their env so `down` can check
    host_ip: str
    pod_prefix: str  # "10.244.0."
    bridge: str
    image_map: list[podlogic.ImageEntry]
    base_env: Mapping[str, str]
    mountpoints_file: Path  # the machine-wide registry of mount points created on the host
    api_port: int
    ca_cert: Path  # written into each pod's service-account directory


class IPAllocator:
    """Round-robin pod IPs (.2 .. .254), so a replacement pod gets a new address."""

    def __init__(self, prefix: str) -> None:
        self._prefix = prefix
        self._used: set[int] = set()
        self._next = 2

    def allocate(self) -> str:
        for _ in range(253):
            n = self._next
            self._next = 2 if self._next >= 254 else self._next + 1
            if n not in self._used:
                self._used.add(n)
                return f"{self._prefix}{n}"
        raise RuntimeError("no free pod IP left on this node (253 pods)")

    def release(self, ip: str) -> None:
        self._used.discard(int(ip.rsplit(".", 1)[1]))


class Kubelet:
    def __init__(self, api: apiclient.ApiClient, config: KubeletConfig) -> None:
        self.api = api
        self.config = config
        self.ips = IPAllocator(config.pod_prefix)
        self.workers: dict[str, PodWorker] = {}  # by pod uid
        self._veth_seq = 0

    def next_veth(self) -> str:
        self._veth_seq += 1
        return f"lv{self._veth_seq}"

    async def record_mountpoint(self, path: Path) -> None:
        await asyncio.to_thread(mountpoints.record, path, self.config.mountpoints_file)

    async def register_node(self) -> None:
        node: Obj = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": NODE_NAME,
                "labels": {
                    "kubernetes.io/hostname": NODE_NAME,
                    "kubernetes.io/os": "linux",
                    "kubernetes.io/arch": "amd64",
                },
            },
            "spec": {"podCIDR": self.config.pod_prefix + "0/24"},
        }
        try:
            await self.api.create("/api/v1/nodes", node)
        except apiclient.ApiError as e:
            if e.status != 409:
                raise
        await self.update_node_status()

    async def update_node_status(self) -> None:
        now = now_rfc3339()
        resources = {"cpu": str(os.cpu_count() or 1), "memory": "16Gi", "pods": "250"}
        status = {
            "capacity": resources,
            "allocatable": resources,
            "addresses": [
                {"type": "InternalIP", "address": self.config.host_ip},
                {"type": "Hostname", "address": NODE_NAME},
            ],
            "conditions": [
                {
                    "type": "Ready",
                    "status": "True",
                    "reason": "KubeletReady",
                    "message": "lora-devcluster process kubelet is ready",
                    "lastHeartbeatTime": now,
                    "lastTransitionTime": now,
                }
            ],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": 10250}},
            "nodeInfo": {
                "kubeletVersion": "v1.37.2-process",
                "containerRuntimeVersion": "process://lora-devcluster",
                "operatingSystem": "linux",
                "architecture": "amd64",
                "osImage": "",
                "kernelVersion": os.uname().release,
                "kubeProxyVersion": "",
                "machineID": "",
                "systemUUID": "",
                "bootID": "",
            },
        }
        await self.api.merge_patch(f"/api/v1/nodes/{NODE_NAME}/status", {"status": status})

    async def run(self) -> None:
        await self.register_node()
        last_heartbeat = time.monotonic()
        while True:
            try:
                await self.sync_once()
                if time.monotonic() - last_heartbeat > 10:
                    await self.update_node_status()
                    last_heartbeat = time.monotonic()
            except (apiclient.ApiError, aiohttp.ClientError, TimeoutError) as e:
                log.warning("sync failed, retrying: %s", e)
            await asyncio.sleep(POLL_S)

    async def sync_once(self) -> None:
        pods = (await self.api.get("/api/v1/pods"))["items"]
        seen = set()
        for pod in pods:
            meta, spec = pod["metadata"], pod["spec"]
            uid = meta["uid"]
            node = spec.get("nodeName")
            if not node and not meta.get("deletionTimestamp"):
                await self.bind(pod)
                continue
            if node != NODE_NAME:
                continue
            seen.add(uid)
            worker = self.workers.get(uid)
            if worker is None:
                if meta.get("deletionTimestamp"):
                    # Deleted before it ever ran here: nothing to stop, confirm the deletion.
                    await self.finish_deletion(meta)
                    continue
                if self._finished(pod):
                    continue  # a finished pod from before; nothing to run
                worker = PodWorker(self, pod)
                self.workers[uid] = worker
                worker.start()
            else:
                worker.update(pod)
        for uid, worker in list(self.workers.items()):
            if uid not in seen:
                worker.vanished()
            if worker.done:
                del self.workers[uid]

    @staticmethod
    def _finished(pod: Obj) -> bool:
        return (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed")

    async def finish_deletion(self, meta: Obj) -> None:
        """The final delete a kubelet sends once a pod's processes are gone: grace period 0,
        guarded by the uid so a new pod with the same name is never deleted by mistake."""
        body = {
            "apiVersion": "v1",
            "kind": "DeleteOptions",
            "gracePeriodSeconds": 0,
            "preconditions": {"uid": meta["uid"]},
        }
        try:
            await self.api.delete(apiclient.pod_path(meta["namespace"], meta["name"]), body)
        except apiclient.ApiError as e:
            if e.status not in (404, 409):
                log.warning(
                    "pod %s/%s: final delete failed: %s", meta["namespace"], meta["name"], e
                )

    async def bind(self, pod: Obj) -> None:
        meta = pod["metadata"]
        body = {
            "apiVersion": "v1",
            "kind": "Binding",
            "metadata": {"name": meta["name"], "namespace": meta["namespace"]},
            "target": {"apiVersion": "v1", "kind": "Node", "name": NODE_NAME},
        }
        try:
            await self.api.create(
                apiclient.pod_path(meta["namespace"], meta["name"], "binding"), body
            )
        except apiclient.ApiError as e:
            if e.status not in (404, 409):
                raise

    async def shutdown(self) -> None:
        await asyncio.gather(*(w.close(grace=5) for w in self.workers.values()))


class ContainerRunner:
    """One container of a pod: start, watch, probe, restart."""

    def __init__(self, worker: PodWorker, spec: Obj, *, init: bool = False) -> None:
        self.worker = worker
        self.spec = spec
        self.init = init  # an init container: runs to completion before the others start
        self.name: str = spec["name"]
        self.proc: processes.Proc | None = None
        self.restart_count = 0
        self.running_since: str | None = None
        self.ready = False
        self.waiting_reason: str | None = "ContainerCreating"
        self.waiting_message: str | None = None
        self.terminated: Obj | None = None
        self.last_terminated: Obj | None = None
        self.stopping = False
        self.log = worker.dir / f"{self.name}.log"

    def view(self) -> podlogic.ContainerView:
        return podlogic.ContainerView(
            name=self.name,
            image=self.spec.get("image", ""),
            restart_count=self.restart_count,
            running_since=self.running_since,
            ready=self.ready,
            waiting_reason=None if self.running_since or self.terminated else self.waiting_reason,
            waiting_message=self.waiting_message,
            terminated=self.terminated,
            last_terminated=self.last_terminated,
            container_id=f"process://{self.proc.pid}" if self.proc and self.running_since else "",
        )

    async def run(self) -> None:
        policy = self.worker.pod["spec"].get("restartPolicy", "Always")
        if self.init:
            policy = podlogic.init_restart_policy(policy)
        while not self.stopping:
            try:
                spec = await self.worker.launch_spec(
                    self.spec, self.spec.get("command"), self.spec.get("args")
                )
            except podlogic.ContainerConfigError as e:
                self.waiting_reason, self.waiting_message = e.reason, e.message
                self.worker.changed()
                await asyncio.sleep(1)
                continue
            except (apiclient.ApiError, aiohttp.ClientError, OSError) as e:
                log.warning(
                    "container %s of %s: cannot start yet: %s", self.name, self.worker.name, e
                )
                self.waiting_reason, self.waiting_message = "ContainerCreating", str(e)
                await asyncio.sleep(1)
                continue
            with open(self.log, "a") as f:
                n = self.restart_count
                f.write(f"{podlogic.LOG_RUN_MARKER}{self.name} (restart {n}) ---\n")
            self.proc = await self.worker.spawn_launcher(self.name, spec, self.log)
            started = now_rfc3339()
            self.running_since = started
            self.terminated = None
            self.waiting_reason = self.waiting_message = None
            self.ready = False
            self.worker.changed()
            probes = asyncio.create_task(self.probe_loop(self.proc))
            code = await self.proc.process.wait()
            probes.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await probes
            # Reap whatever the container forked and left behind in its session.
            self.proc.signal_group(signal.SIGKILL)
            finished = now_rfc3339()
            exit_code = code if code >= 0 else 128 - code
            reason = "Completed" if exit_code == 0 else "Error"
            term = {
                "exitCode": exit_code,
                "reason": reason,
                "startedAt": started,
                "finishedAt": finished,
            }
            if code < 0 and -code == signal.SIGKILL and not self.stopping:
                term["reason"] = "Error"
            self.running_since = None
            self.ready = False
            if self.stopping or not podlogic.should_restart(policy, exit_code):
                self.terminated = term
                self.worker.changed()
                return
            self.last_terminated = term
            self.restart_count += 1
            self.waiting_reason = "CrashLoopBackOff"
            self.waiting_message = f"back-off restarting failed container {self.name}"
            self.worker.changed()
            await asyncio.sleep(podlogic.restart_backoff(self.restart_count, base=1.0))

    async def probe_loop(self, proc: processes.Proc) -> None:
        readiness = self.spec.get("readinessProbe")
        liveness = self.spec.get("livenessProbe")
        startup = self.spec.get("startupProbe")
        if startup and not await self._run_probe_until(startup, proc, want_success=True):
            await self._kill_for_probe(proc, "startup")
            return
        tasks = []
        if readiness:
            tasks.append(asyncio.create_task(self._readiness(readiness)))
        else:
            self.ready = True
            self.worker.changed()
        if liveness:
            tasks.append(asyncio.create_task(self._liveness(liveness, proc)))
        try:
            await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()

    async def _run_probe_until(self, probe: Obj, proc: processes.Proc, want_success: bool) -> bool:
        await asyncio.sleep(probe.get("initialDelaySeconds", 0))
        failures = 0
        threshold = probe.get("failureThreshold", 3)
        while proc.running:
            if await self.worker.probe(self.spec, probe):
                return True
            failures += 1
            if failures >= threshold:
                return False
            await asyncio.sleep(probe.get("periodSeconds", 10))
        return False

    async def _readiness(self, probe: Obj) -> None:
        await asyncio.sleep(probe.get("initialDelaySeconds", 0))
        ok = fail = 0
        while True:
            if await self.worker.probe(self.spec, probe):
                ok, fail = ok + 1, 0
                if not self.ready and ok >= probe.get("successThreshold", 1):
                    self.ready = True
                    self.worker.changed()
            else:
                ok, fail = 0, fail + 1
                if self.ready and fail >= probe.get("failureThreshold", 3):
                    self.ready = False
                    self.worker.changed()
            await asyncio.sleep(probe.get("periodSeconds", 10))

    async def _liveness(self, probe: Obj, proc: processes.Proc) -> None:
        await asyncio.sleep(probe.get("initialDelaySeconds", 0))
        fail = 0
        while proc.running:
            if await self.worker.probe(self.spec, probe):
                fail = 0
            else:
                fail += 1
                if fail >= probe.get("failureThreshold", 3):
                    await self._kill_for_probe(proc, "liveness")
                    return
            await asyncio.sleep(probe.get("periodSeconds", 10))

    async def _kill_for_probe(self, proc: processes.Proc, which: str) -> None:
        with open(self.log, "a") as f:
            f.write(f"--- lora-devcluster: {which} probe failed, killing {self.name} ---\n")
        grace = self.worker.pod["spec"].get("terminationGracePeriodSeconds", 30)
        await proc.stop(grace=min(grace, 5))

    async def stop(self, grace: float) -> None:
        self.stopping = True
        if self.proc is not None and self.proc.running:
            await self.proc.stop(grace)


class PodWorker:
    """One pod: its network namespace, volumes and containers, until it is deleted."""

    def __init__(self, kubelet: Kubelet, pod: Obj) -> None:
        self.kubelet = kubelet
        self.pod = pod
        meta = pod["metadata"]
        self.uid: str = meta["uid"]
        self.namespace: str = meta["namespace"]
        self.name: str = meta["name"]
        self.dir = kubelet.config.root / f"{self.namespace}_{self.name}_{self.uid}"
        self.ip = ""
        self.holder: processes.Proc | None = None
        self._host_if = ""
        self.runners = [ContainerRunner(self, c) for c in pod["spec"].get("containers", [])]
        self.init_runners = [
            ContainerRunner(self, c, init=True) for c in pod["spec"].get("initContainers") or []
        ]
        self.volume_paths: dict[str, str] = {}
        self.read_only_volumes: set[str] = set()
        self.service_account_dir: Path | None = None
        self.start_time = now_rfc3339()
        self.done = False
        self._changed = asyncio.Event()
        self._deleting = False
        self._task: asyncio.Task[None] | None = None
        self._last_status: Obj | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    # ---- lifecycle

    def start(self) -> None:
        self._task = asyncio.create_task(self._main())

    def update(self, pod: Obj) -> None:
        self.pod = pod
        if pod["metadata"].get("deletionTimestamp") and not self._deleting:
            self._deleting = True
            self._background(self._delete())

    def vanished(self) -> None:
        """The pod is gone from the API (force-deleted): stop everything at once."""
        if not self._deleting:
            self._deleting = True
            self._background(self._teardown(grace=0))

    def changed(self) -> None:
        self._changed.set()

    def _background(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)  # keep a reference until it finishes (asyncio holds weak ones)
        task.add_done_callback(self._tasks.discard)

    async def _main(self) -> None:
        status = asyncio.create_task(self._status_loop())
        self.dir.mkdir(parents=True, exist_ok=True)
        self.ip = self.kubelet.ips.allocate()
        log.info("pod %s/%s: setting up %s", self.namespace, self.name, self.ip)
        for attempt in range(1, 4):
            try:
                await self._setup_network()
                break
            except Exception as e:
                log.exception("pod %s/%s: network setup failed", self.namespace, self.name)
                self._waiting("ContainerCreating", f"pod network setup failed: {e}")
                await self._undo_network()
                if attempt == 3:
                    await status
                    return
                await asyncio.sleep(1)
        log.info("pod %s/%s: network ready", self.namespace, self.name)
        self.changed()
        while True:  # volumes wait for their ConfigMaps, Secrets, bound PVCs, service account
            try:
                await self._prepare_volumes()
                await self._prepare_service_account()
                break
            except podlogic.ContainerConfigError as e:
                self._waiting(e.reason, e.message)
            except (apiclient.ApiError, aiohttp.ClientError, TimeoutError, OSError) as e:
                log.warning("pod %s/%s: volume setup failed: %s", self.namespace, self.name, e)
                self._waiting("ContainerCreating", f"volume setup failed: {e}")
            await asyncio.sleep(1)
        log.info("pod %s/%s: volumes ready, starting containers", self.namespace, self.name)
        for init in self.init_runners:
            self._waiting("PodInitializing", "", init_too=False)
            await init.run()
            if init.terminated is None or init.terminated["exitCode"] != 0:
                self.changed()  # the pod failed (restartPolicy Never) or is being stopped
                await status
                return
        runners = [asyncio.create_task(r.run()) for r in self.runners]
        for result in await asyncio.gather(*runners, return_exceptions=True):
            if isinstance(result, Exception):
                # A bug here must not leave a pod silently stuck: say so in the log and status.
                log.error(
                    "pod %s/%s: container runner failed", self.namespace, self.name, exc_info=result
                )
                self._waiting("RunContainerError", f"kubelet error: {result!r}")
        self.changed()
        await status

    def _waiting(self, reason: str, message: str, *, init_too: bool = True) -> None:
        for r in self.runners + (self.init_runners if init_too else []):
            r.waiting_reason, r.waiting_message = reason, message
        self.changed()

    async def _status_loop(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), timeout=5)
            self._changed.clear()
            if self._deleting:
                return  # the final delete follows; nobody reads this status any more
            try:
                await self._patch_status()
            except apiclient.ApiError as e:
                if e.status == 404:
                    return
                log.warning("pod %s/%s: status patch failed: %s", self.namespace, self.name, e)
            except (aiohttp.ClientError, TimeoutError) as e:
                log.warning("pod %s/%s: status patch failed: %s", self.namespace, self.name, e)
            if self.runners and all(r.terminated is not None for r in self.runners):
                return
            if any(
                r.terminated is not None and r.terminated["exitCode"] != 0
                for r in self.init_runners
            ):
                return

    async def _patch_status(self) -> None:
        if not self.ip:
            return
        old = {"status": self._last_status or self.pod.get("status") or {}}
        status = podlogic.build_pod_status(
            {**self.pod, **old},
            [r.view() for r in self.runners],
            init_containers=[r.view() for r in self.init_runners],
            pod_ip=self.ip,
            host_ip=self.kubelet.config.host_ip,
            start_time=self.start_time,
            now=now_rfc3339(),
        )
        if self._last_status is not None and not podlogic.status_differs(self._last_status, status):
            return
        await self.kubelet.api.merge_patch(
            apiclient.pod_path(self.namespace, self.name, "status"), {"status": status}
        )
        self._last_status = status

    async def _delete(self) -> None:
        grace = self.pod["metadata"].get("deletionGracePeriodSeconds")
        if grace is None:
            grace = self.pod["spec"].get("terminationGracePeriodSeconds", 30)
        await self._teardown(grace=float(grace))
        await self.kubelet.finish_deletion(self.pod["metadata"])

    async def _teardown(self, grace: float) -> None:
        await self.stop_all(grace)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        # A runner may have spawned its process while we were stopping the others.
        await self.stop_all(0)
        if self.ip:
            self.kubelet.ips.release(self.ip)
        shutil.rmtree(self.dir / "volumes", ignore_errors=True)
        self.done = True

    async def close(self, grace: float) -> None:
        """Stop the pod's processes and its worker task (the supervisor is shutting down)."""
        self._deleting = True
        await self._teardown(grace)

    async def stop_all(self, grace: float) -> None:
        await asyncio.gather(*(r.stop(grace) for r in self.runners + self.init_runners))
        if self.holder is not None:
            await self.holder.stop(grace=0)

    # ---- network

    async def _setup_network(self) -> None:
        cfg = self.kubelet.config
        self.holder = await processes.start(
            "netns-holder",
            # Its own UTS namespace too, so the pod's hostname is the pod's name.
            [
                "unshare",
                "--net",
                "--uts",
                "--",
                "sh",
                "-c",
                'hostname "$0" && exec sleep infinity',
                self.name[:63],
            ],
            self.dir / "holder.log",
        )
        netns = f"/proc/{self.holder.pid}/ns/net"
        # unshare must have switched namespaces before the veth moves there, or the veth would
        # land in the cluster's namespace. On a loaded machine that can take seconds.
        deadline = time.monotonic() + 60
        while os.readlink(netns) == os.readlink("/proc/self/ns/net"):
            if not self.holder.running or time.monotonic() > deadline:
                raise RuntimeError(
                    f"the pod's namespace holder did not start: {processes.tail(self.holder.log)}"
                )
            await asyncio.sleep(0.01)
        host_if = self._host_if = self.kubelet.next_veth()
        run = processes.run_checked
        await run(
            [
                "ip",
                "link",
                "add",
                host_if,
                "type",
                "veth",
                "peer",
                "name",
                "eth0",
                "netns",
                str(self.holder.pid),
            ]
        )
        await run(["ip", "link", "set", host_if, "master", cfg.bridge, "up"])
        inside = ["nsenter", f"--net={netns}", "ip"]
        await run([*inside, "link", "set", "lo", "up"])
        await run([*inside, "addr", "add", f"{self.ip}/24", "dev", "eth0"])
        await run([*inside, "link", "set", "eth0", "up"])
        await run([*inside, "route", "add", "default", "via", cfg.host_ip])

    async def _undo_network(self) -> None:
        """Remove what a failed setup left, so the next attempt starts clean."""
        if self.holder is not None:
            await self.holder.stop(grace=0)
            self.holder = None
        if self._host_if:
            with contextlib.suppress(RuntimeError):
                # Deleting one end of a veth pair deletes both.
                await processes.run_checked(["ip", "link", "del", self._host_if])
            self._host_if = ""

    @property
    def netns(self) -> str:
        if self.holder is None:
            raise RuntimeError("pod network namespace not set up")
        return f"/proc/{self.holder.pid}/ns/net"

    # ---- volumes and launch

    async def _prepare_volumes(self) -> None:
        vol_root = self.dir / "volumes"
        for vol in self.pod["spec"].get("volumes") or []:
            name = vol["name"]
            target = vol_root / name
            if "emptyDir" in vol:
                target.mkdir(parents=True, exist_ok=True)
                self.volume_paths[name] = str(target)
            elif "hostPath" in vol:
                path = Path(vol["hostPath"]["path"])
                if vol["hostPath"].get("type") in ("DirectoryOrCreate", None, ""):
                    path.mkdir(parents=True, exist_ok=True)
                self.volume_paths[name] = str(path)
            elif "persistentVolumeClaim" in vol:
                self.volume_paths[name] = await self._pvc_path(vol["persistentVolumeClaim"])
                if vol["persistentVolumeClaim"].get("readOnly"):
                    self.read_only_volumes.add(name)
            elif "configMap" in vol or "secret" in vol:
                is_cm = "configMap" in vol
                src = vol["configMap"] if is_cm else vol["secret"]
                ref_name = src["name"] if is_cm else src["secretName"]
                kind = "configmaps" if is_cm else "secrets"
                obj = await self._wait_object(kind, ref_name, bool(src.get("optional")))
                data: Mapping[str, str | bytes]
                if obj is None:
                    data = {}
                elif is_cm:
                    data = {
                        **obj.get("data", {}),
                        **{
                            k: __import__("base64").b64decode(v)
                            for k, v in (obj.get("binaryData") or {}).items()
                        },
                    }
                else:
                    data = podlogic.decode_secret_data(obj)
                files = podlogic.build_projected_files(data, src.get("items"), f"{kind}/{ref_name}")
                target.mkdir(parents=True, exist_ok=True)
                mode = src.get("defaultMode", 0o644)
                for rel, content in files.items():
                    p = target / rel
                    p.parent.mkdir(parents=True, exist_ok=True)
                    p.write_bytes(content)
                    p.chmod(mode)
                self.volume_paths[name] = str(target)
                self.read_only_volumes.add(name)
            else:
                raise podlogic.ContainerConfigError(
                    "CreateContainerConfigError", f"volume {name!r}: unsupported volume type"
                )

    async def _prepare_service_account(self) -> None:
        """Like the kubelet's projected kube-api-access volume: a token from the TokenRequest
        API for the pod's service account (so in-cluster clients authenticate as it and its
        RBAC is exercised for real), the cluster CA and the namespace."""
        spec = self.pod["spec"]
        if spec.get("automountServiceAccountToken") is False:
            return
        sa = spec.get("serviceAccountName") or "default"
        # Not bound to the pod: with the ServiceAccount admission plugin off, the pod's
        # serviceAccountName may be empty, and the API server refuses to bind to such a pod.
        body = {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenRequest",
            "spec": {"expirationSeconds": 86400},
        }
        path = f"/api/v1/namespaces/{self.namespace}/serviceaccounts/{sa}/token"
        while True:
            try:
                token = (await self.kubelet.api.create(path, body))["status"]["token"]
                break
            except apiclient.ApiError as e:
                if e.status != 404:
                    raise
            self._waiting("ContainerCreating", f'serviceaccount "{sa}" not found')
            await asyncio.sleep(0.5)
        target = self.dir / "volumes" / "kube-api-access"
        target.mkdir(parents=True, exist_ok=True)
        (target / "token").write_text(token)
        (target / "ca.crt").write_bytes(self.kubelet.config.ca_cert.read_bytes())
        (target / "namespace").write_text(self.namespace)
        self.service_account_dir = target

    async def _wait_object(self, kind: str, name: str, optional: bool) -> Obj | None:
        path = f"/api/v1/namespaces/{self.namespace}/{kind}/{name}"
        while True:
            obj = await self.kubelet.api.get_or_none(path)
            if obj is not None or optional:
                return obj
            self._waiting("ContainerCreating", f"{kind} {name!r} not found")
            await asyncio.sleep(1)

    async def _pvc_path(self, ref: Obj) -> str:
        api = self.kubelet.api
        while True:
            pvc = await api.get_or_none(
                f"/api/v1/namespaces/{self.namespace}/persistentvolumeclaims/{ref['claimName']}"
            )
            pv_name = (pvc or {}).get("spec", {}).get("volumeName")
            if pvc is not None and pv_name and pvc.get("status", {}).get("phase") == "Bound":
                pv = await api.get(f"/api/v1/persistentvolumes/{pv_name}")
                host_path = pv["spec"].get("hostPath", {}).get("path")
                if not host_path:
                    raise podlogic.ContainerConfigError(
                        "CreateContainerConfigError",
                        f"PV {pv_name} is not a hostPath volume; this kubelet mounts only those",
                    )
                Path(host_path).mkdir(parents=True, exist_ok=True)
                return str(host_path)
            self._waiting("ContainerCreating", f"waiting for PVC {ref['claimName']!r} to be bound")
            await asyncio.sleep(0.5)

    async def _env_sources(self, container: Obj) -> podlogic.PodContext:
        cms: dict[str, Mapping[str, str]] = {}
        secrets: dict[str, Mapping[str, bytes]] = {}
        wanted: set[tuple[str, str]] = set()
        for src in container.get("envFrom") or []:
            if "configMapRef" in src:
                wanted.add(("configmaps", src["configMapRef"]["name"]))
            if "secretRef" in src:
                wanted.add(("secrets", src["secretRef"]["name"]))
        for var in container.get("env") or []:
            vf = var.get("valueFrom") or {}
            if "configMapKeyRef" in vf:
                wanted.add(("configmaps", vf["configMapKeyRef"]["name"]))
            if "secretKeyRef" in vf:
                wanted.add(("secrets", vf["secretKeyRef"]["name"]))
        for kind, name in wanted:
            obj = await self.kubelet.api.get_or_none(
                f"/api/v1/namespaces/{self.namespace}/{kind}/{name}"
            )
            if obj is None:
                continue
            if kind == "configmaps":
                cms[name] = obj.get("data") or {}
            else:
                secrets[name] = podlogic.decode_secret_data(obj)
        return podlogic.PodContext(self.pod, self.ip, self.kubelet.config.host_ip, cms, secrets)

    async def launch_spec(
        self, container: Obj, command: list[str] | None, args: list[str] | None
    ) -> Obj:
        cfg = self.kubelet.config
        ctx = await self._env_sources(container)
        base = dict(cfg.base_env)
        base.update(
            {
                "HOSTNAME": self.name,
                "KUBERNETES_SERVICE_HOST": cfg.host_ip,
                "KUBERNETES_SERVICE_PORT": str(cfg.api_port),
                # Lets the harness find a container's processes from outside (tests, `down`).
                "LORA_DEVCLUSTER_DIR": str(cfg.cluster_dir),
                "LORA_DEVCLUSTER_POD_UID": self.uid,
                "LORA_DEVCLUSTER_CONTAINER": container["name"],
            }
        )
        env = podlogic.build_env(container, ctx, base)
        argv = podlogic.build_argv(cfg.image_map, container.get("image", ""), command, args)
        argv = [podlogic.expand_vars(a, env) for a in argv]
        mounts = podlogic.build_mounts(container, self.volume_paths, self.read_only_volumes)
        if self.service_account_dir is not None and not any(
            m.target == SERVICE_ACCOUNT_PATH for m in mounts
        ):
            mounts.append(podlogic.Mount(str(self.service_account_dir), SERVICE_ACCOUNT_PATH, True))
        if not any(m.target == "/etc/hosts" for m in mounts):
            # Like the kubelet's managed /etc/hosts: the pod's hostname resolves (Python's
            # http.server looks it up at bind time and would wait ~10 s on DNS otherwise).
            hosts = self.dir / "etc-hosts"
            hosts.write_text(podlogic.build_etc_hosts(self.name, self.ip))
            mounts.insert(0, podlogic.Mount(str(hosts), "/etc/hosts", True))
        for m in mounts:
            await self._ensure_mountpoint(Path(m.source), Path(m.target))
        return {
            "netns": self.netns,
            "utsns": self.netns.replace("/ns/net", "/ns/uts"),
            "mounts": [dataclasses.asdict(m) for m in mounts],
            "argv": argv,
            "env": env,
            "workdir": container.get("workingDir"),
        }

    async def _ensure_mountpoint(self, source: Path, target: Path) -> None:
        if target.exists():
            return
        # Record every directory we create so `down` can remove them (deepest first).
        missing = []
        p = target if source.is_dir() else target.parent
        while not p.exists():
            missing.append(p)
            p = p.parent
        for d in reversed(missing):
            # Another pod may create the same directory at the same moment: fine either way,
            # and recording it twice is harmless.
            d.mkdir(exist_ok=True)
            await self.kubelet.record_mountpoint(d)
        if not source.is_dir():
            target.touch(exist_ok=True)
            await self.kubelet.record_mountpoint(target)

    async def spawn_launcher(self, name: str, spec: Obj, log_path: Path) -> processes.Proc:
        spec_path = self.dir / f"{name}.launch.json"
        spec_path.write_text(json.dumps(spec))
        return await processes.start(
            name, [sys.executable, "-m", "lora_devcluster.launch", str(spec_path)], log_path
        )

    async def probe(self, container: Obj, probe: Obj) -> bool:
        timeout = float(probe.get("timeoutSeconds", 1))
        try:
            if "httpGet" in probe:
                hg = probe["httpGet"]
                port = podlogic.resolve_port(container, hg["port"])
                scheme = hg.get("scheme", "HTTP").lower()
                url = f"{scheme}://{hg.get('host') or self.ip}:{port}{hg.get('path', '/')}"
                headers = {h["name"]: h["value"] for h in hg.get("httpHeaders") or []}
                async with (
                    aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as s,
                    s.get(url, headers=headers, ssl=False, allow_redirects=False) as r,
                ):
                    return 200 <= r.status < 400
            if "tcpSocket" in probe:
                port = podlogic.resolve_port(container, probe["tcpSocket"]["port"])
                _, writer = await asyncio.wait_for(asyncio.open_connection(self.ip, port), timeout)
                writer.close()
                return True
            if "exec" in probe:
                spec = await self.launch_spec(container, probe["exec"]["command"], [])
                proc = await self.spawn_launcher(
                    f"{container['name']}.probe", spec, self.dir / f"{container['name']}.probe.log"
                )
                try:
                    return await asyncio.wait_for(proc.process.wait(), timeout) == 0
                except TimeoutError:
                    await proc.stop(0)
                    return False
        except (
            OSError,
            aiohttp.ClientError,
            TimeoutError,
            ValueError,
            podlogic.ContainerConfigError,
        ):
            return False
        return False
