"""lora-router's faults on a real cluster: the chart installed once (3 inference pods, the
router's 2 replicas, the tiny model), generations sent through the router's Service while pods,
routers and adapters go away.

- an inference pod killed mid-generation: the client gets the answer of another pod (the
  connection broke before the answer started, so the router sent it once more) or a clear 5xx
  with a JSON error, within a bound;
- a router deleted, another killed: the Service keeps answering, and a restarted router is
  Ready only once it has polled the pods, so its first requests already follow residency;
- the pod an adapter with `replicas: 1` is placed on deleted: requests keep succeeding while the
  operator re-places it, and follow `status.placedPods` to the new pod;
- a pod whose `/v1/adapters` fails while it still generates: routed by its queue alone;
- an adapter deleted while requests for it run: 200 or 404, never a 500; afterwards the
  server's 404 comes back unchanged;
- a weighted rollout of a new revision: the pods' own counters split the requests at the step's
  weight, an abort sends them all back, the rollout survives an operator restart, and a promote
  ends it with the new revision under the adapter's name.

The test process is in the cluster's network namespace (the devcluster fixture) and kube-proxy's
rules apply there: it reaches the router through the Service's ClusterIP (not its DNS name,
which only the pods' resolver knows), and the pods and routers by their IPs (the routers'
metrics, a pod's own answer to compare with). On another cluster (LORA_E2E_KUBECONFIG) that
network is out of reach, so these tests run on the local cluster only.
"""

from __future__ import annotations

import collections
import contextlib
import http.client
import json
import os
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import pytest
from lora_demo import manifests, release
from lora_demo.manifests import INFERENCE_LABELS, RELEASE, SERVICE, AdapterSource
from lora_devcluster import pytest_plugin
from lora_devcluster.harness import ApiError, Harness
from prometheus_client.parser import text_string_to_metric_families

Obj = dict[str, Any]
PODS = 3
ROUTERS = 2  # the chart's default
ROUTER_LABELS = "app.kubernetes.io/component=router"
AFFINITY = ("gpu-resident", "cpu-resident")
SHORT: dict[str, Any] = {"size": 32, "steps": 2}  # generation_request's keywords
MUTE_LABEL = "lora.test/residency"  # the extra pod whose /v1/adapters fails carries it
MUTE_WORKLOAD = "inference-mute"  # its Deployment, one of the release's inference workloads


@dataclass
class Answer:
    """One HTTP exchange as a client saw it: a status, or no answer at all (`error`)."""

    status: int | None
    body: bytes
    headers: dict[str, str]  # names in lower case
    started: float
    ended: float
    error: str | None = None

    @property
    def route(self) -> tuple[str | None, str | None]:
        return self.headers.get("x-lora-pod"), self.headers.get("x-lora-route")

    def json(self) -> Any:
        return json.loads(self.body)


def post(url: str, body: Obj, timeout: float = 120) -> Answer:
    data = json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    started = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read()
            headers = {k.lower(): v for k, v in r.headers.items()}
            return Answer(r.status, raw, headers, started, time.monotonic())
    except urllib.error.HTTPError as e:
        headers = {k.lower(): v for k, v in e.headers.items()}
        return Answer(e.code, e.read(), headers, started, time.monotonic())
    except (urllib.error.URLError, http.client.HTTPException, OSError) as e:
        return Answer(None, b"", {}, started, time.monotonic(), error=repr(e))


def get_json(url: str, timeout: float = 10) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


@dataclass
class Fleet:
    h: Harness
    ns: str
    url: str  # the router's Service: http://<ClusterIP>:80
    sources: dict[str, AdapterSource] = field(default_factory=dict)

    def generation(self, model: str, **request: Any) -> Answer:
        body = manifests.generation_request(model, **{**SHORT, **request})
        return post(f"{self.url}/v1/images/generations", body)

    def pods(self, selector: str) -> list[Obj]:
        return [
            p
            for p in self.h.pods(self.ns, selector)
            if not p["metadata"].get("deletionTimestamp") and release.is_ready(p)
        ]

    def ip(self, pod: str) -> str:
        ip: str = self.h.get(f"/api/v1/namespaces/{self.ns}/pods/{pod}")["status"]["podIP"]
        return ip

    def placed(self, adapter: str) -> list[str]:
        return list(release.adapter_status(self.h, self.ns, adapter).get("placedPods") or ())

    def router_samples(self, pod: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """One router's metrics: (sample name, sorted labels) -> value."""
        with urllib.request.urlopen(f"http://{self.ip(pod)}:9090/metrics", timeout=10) as r:
            text = r.read().decode()
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }

    def routed(self, pods: list[str], reason: str) -> float:
        """Requests the routers `pods` answered for `reason`, every status together."""
        total = 0.0
        for pod in pods:
            for (name, labels), value in self.router_samples(pod).items():
                if name == "lora_router_requests_total" and ("reason", reason) in labels:
                    total += value
        return total

    def metric(self, pods: list[str], name: str, **labels: str) -> float:
        key = tuple(sorted(labels.items()))
        return sum(self.router_samples(p).get((name, key), 0.0) for p in pods)

    def idle(self, routers: list[str]) -> None:
        """Until the routers `routers` count no request on any pod: a request sent right after
        a load stops would otherwise meet the queues their last polls saw, and may overflow."""
        self.h.wait_for(
            "the routers to see the pods idle",
            lambda: self.metric(routers, "lora_router_load") == 0,
            timeout=30,
        )

    def healthy(self) -> None:
        """Every inference pod, both routers and the adapters as the fixture left them."""
        release.ready_inference_pods(self.h, self.ns, PODS, timeout=240)
        self.h.wait_for(
            f"{ROUTERS} ready routers", lambda: len(self.pods(ROUTER_LABELS)) == ROUTERS, 120
        )
        release.wait_adapter_ready(self.h, self.ns, "every", f"{PODS}/{PODS}", timeout=180)
        release.wait_adapter_ready(self.h, self.ns, "one", "1/1", timeout=180)


def adapter(source: AdapterSource, **spec: Any) -> Obj:
    obj = manifests.adapter(source)
    obj["spec"].update(spec)
    return obj


@pytest.fixture(scope="module")
def fleet(devcluster: Harness, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    if os.environ.get("LORA_E2E_KUBECONFIG"):
        pytest.skip("the router's faults need the cluster's network: the local cluster only")
    h = devcluster
    ns = f"router-faults-{uuid.uuid4().hex[:6]}"
    h.create(
        "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}}
    )
    folder = f"{ns}/sources"
    sources = {
        name: AdapterSource(name, seed=i + 1, folder=folder)
        for i, name in enumerate(
            ("every", "one", "quiet", "doomed", "rolled-v1", "rolled-v2", "rolled-v3")
        )
    }
    try:
        release.prepare_model(h, ns)
        release.install_crd(h)
        values = manifests.local_values(ns, replicas=PODS)
        # The extra Deployment a test adds is one of the release's inference workloads.
        values["operator"]["inferencePods"] = {"workloads": [MUTE_WORKLOAD]}
        release.install_chart(h, ns, values, tmp_path_factory.mktemp("values"))
        release.prepare_adapters(h, ns, tuple(sources.values()), "prepare-sources")
        release.ready_inference_pods(h, ns, PODS)
        h.apply([adapter(sources["every"]), adapter(sources["one"], replicas=1)], ns)
        service = h.get(f"/api/v1/namespaces/{ns}/services/{SERVICE}")
        fleet = Fleet(h, ns, f"http://{service['spec']['clusterIP']}:80", sources)
        fleet.healthy()
        yield fleet
    finally:
        h.run(["helm", "uninstall", RELEASE, "-n", ns, "--ignore-not-found"], check=False)
        with contextlib.suppress(ApiError):
            h.delete(f"/api/v1/namespaces/{ns}")


@pytest.fixture(autouse=True)
def report_logs(fleet: Fleet, request: pytest.FixtureRequest) -> None:
    """A failing test's report gets the namespace's pods and container logs (the devcluster
    plugin adds them for the namespaces it knows)."""
    request.node.stash[pytest_plugin._NAMESPACE_KEY] = fleet.ns
    request.node.stash[pytest_plugin._HARNESS_KEY] = fleet.h


class Load:
    """Clients sending generations one after another until stopped; every answer kept."""

    def __init__(
        self, fleet: Fleet, model: str, clients: int = 2, pause: float = 0.2, **request: Any
    ) -> None:
        self.answers: list[Answer] = []
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(clients)
        self._futures = [
            self._pool.submit(self._run, fleet, model, pause, request) for _ in range(clients)
        ]

    def _run(self, fleet: Fleet, model: str, pause: float, request: Obj) -> None:
        while not self._stop.is_set():
            self.answers.append(fleet.generation(model, **request))
            time.sleep(pause)

    def stop(self) -> list[Answer]:
        self._stop.set()
        for f in self._futures:
            f.result(timeout=180)
        self._pool.shutdown()
        return sorted(self.answers, key=lambda a: a.started)


def summary(answers: list[Answer], since: float = 0.0) -> list[tuple[float, float, Any, Any, Any]]:
    """For failure messages: (seconds since `since`, seconds taken, status or error, pod, why)."""
    return [
        (round(a.started - since, 1), round(a.ended - a.started, 1), a.status or a.error, *a.route)
        for a in answers
    ]


# ---- a router deleted, another killed


def test_the_service_answers_while_routers_go_and_a_new_one_is_ready_with_residency(
    fleet: Fleet,
) -> None:
    h, ns = fleet.h, fleet.ns
    fleet.healthy()
    routers = [p["metadata"]["name"] for p in fleet.pods(ROUTER_LABELS)]

    # Deleted (a rollout, a drain): the other replica answers, and no request fails.
    load = Load(fleet, "every")
    time.sleep(2)
    deleted_at = time.monotonic()
    h.kubectl("delete", "pod", "-n", ns, routers[0], "--wait=false")

    def replaced() -> list[str] | None:
        now = [p["metadata"]["name"] for p in fleet.pods(ROUTER_LABELS)]
        return now if len(now) == ROUTERS and routers[0] not in now else None

    current = h.wait_for("a replacement router to be Ready", replaced, timeout=120)
    ready_after = time.monotonic() - deleted_at
    time.sleep(2)
    answers = load.stop()
    assert answers and all(a.status == 200 for a in answers), summary(answers, deleted_at)
    (new,) = set(current) - set(routers)
    fleet.idle([new])

    # Ready means it has listed the pods and polled each once: its very first request, sent
    # to it directly, follows residency.
    first = post(
        f"http://{fleet.ip(new)}:8000/v1/images/generations",
        manifests.generation_request("one", **SHORT),
    )
    assert first.status == 200 and first.route[1] in AFFINITY, (first.status, first.route)
    assert first.route[0] in fleet.placed("one")
    assert fleet.metric([new], "lora_router_pods", state="reporting") == PODS
    assert fleet.metric([new], "lora_router_affinity_hits_total") >= 1

    # Killed (a crash): its clients' connections break, and new connections may be refused
    # until the kubelet has seen it die and kube-proxy has dropped it; never an HTTP error,
    # never a hang. It restarts in place and is Ready once it knows residency again.
    victim = next(p for p in current if p != new)
    load = Load(fleet, "every")
    time.sleep(2)
    killed_at = time.monotonic()
    h.kill_container(ns, victim, "router")

    def restarted() -> bool:
        pod = h.get(f"/api/v1/namespaces/{ns}/pods/{victim}")
        statuses = pod["status"].get("containerStatuses") or [{}]
        return release.is_ready(pod) and statuses[0].get("restartCount", 0) >= 1

    h.wait_for("the killed router to restart and be Ready", restarted, timeout=120)
    restart_ready_after = time.monotonic() - killed_at
    time.sleep(2)
    answers = load.stop()
    failed = [a for a in answers if a.status != 200]
    assert all(a.status is None for a in failed), summary(answers, killed_at)
    assert all(a.ended - a.started < 30 for a in answers), summary(answers, killed_at)
    assert all(a.started - killed_at < 15 for a in failed), summary(answers, killed_at)
    assert [a.status for a in answers[-4:]] == [200] * 4, summary(answers, killed_at)
    fleet.idle([victim])
    first = post(
        f"http://{fleet.ip(victim)}:8000/v1/images/generations",
        manifests.generation_request("one", **SHORT),
    )
    assert first.status == 200 and first.route[1] in AFFINITY, (first.status, first.route)
    print(
        f"router deleted: replacement Ready after {ready_after:.1f} s, {len(answers)} answers; "
        f"router killed: Ready again after {restart_ready_after:.1f} s, "
        f"{len(failed)} of {len(answers)} requests without an answer: "
        f"{summary(failed, killed_at)}"
    )


# ---- a pod whose residency reports fail


# The extra pod's front: everything passes to the server on 8001, except GET /v1/adapters.
MUTE_PROXY = """
import aiohttp
from aiohttp import web

UPSTREAM = "http://127.0.0.1:8001"
HOP = {"host", "content-length", "transfer-encoding", "connection"}


async def handle(request):
    if request.path == "/v1/adapters":
        error = {"message": "residency withheld", "type": "X", "param": None, "code": 503}
        return web.json_response({"error": error}, status=503)
    headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP}
    try:
        async with request.app["session"].request(
            request.method, UPSTREAM + str(request.rel_url), data=await request.read(),
            headers=headers,
        ) as r:
            body = await r.read()
            kept = {k: v for k, v in r.headers.items() if k.lower() not in HOP}
            return web.Response(status=r.status, body=body, headers=kept)
    except aiohttp.ClientConnectionError as e:
        return web.json_response({"error": {"message": str(e)}}, status=503)


async def session(app):
    app["session"] = aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=600), auto_decompress=False
    )
    yield
    await app["session"].close()


app = web.Application(client_max_size=64 * 1024**2)
app.cleanup_ctx.append(session)
app.router.add_route("*", "/{tail:.*}", handle)
web.run_app(app, port=8000, access_log=None)
"""


def mute_deployment(deployment: Obj, image: str, name: str) -> Obj:
    """A Deployment of one inference pod like the chart's (its template: labels, annotations,
    volumes, the server's arguments) whose server listens on 8001 behind a front on the `http`
    port that answers GET /v1/adapters with a 503. The release names it among its inference
    workloads (`operator.inferencePods.workloads`), so the operator counts its pod among the
    release's inference pods."""
    template = json.loads(json.dumps(deployment["spec"]["template"]))
    spec = template["spec"]
    (server,) = spec["containers"]
    server["args"] = [a for a in server["args"] if not a.startswith("--port=")] + ["--port=8001"]
    server["ports"] = [{"name": "server", "containerPort": 8001, "protocol": "TCP"}]
    front_probe = server["readinessProbe"]
    for probe in ("readinessProbe", "startupProbe", "livenessProbe"):
        if probe in server:
            server[probe] = {**server[probe], "httpGet": {**server[probe]["httpGet"], "port": 8001}}
    spec["containers"].append(
        {
            "name": "front",
            "image": image,
            "imagePullPolicy": "IfNotPresent",
            "command": ["python", "-c", MUTE_PROXY],
            "ports": [{"name": "http", "containerPort": 8000, "protocol": "TCP"}],
            "readinessProbe": front_probe,
            "securityContext": manifests.NON_ROOT,
        }
    )
    labels = {**template["metadata"]["labels"], MUTE_LABEL: "withheld"}
    pod = {"labels": labels, "annotations": template["metadata"]["annotations"]}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": {MUTE_LABEL: "withheld"}},
            "template": {"metadata": pod, "spec": spec},
        },
    }


def test_a_pod_that_stops_reporting_residency_is_routed_by_its_queue(fleet: Fleet) -> None:
    h, ns = fleet.h, fleet.ns
    fleet.healthy()
    deployment = h.get(f"/apis/apps/v1/namespaces/{ns}/deployments/{RELEASE}-inference")
    h.apply(mute_deployment(deployment, h.image("operator"), MUTE_WORKLOAD), ns)
    try:
        (pod,) = release.ready_pods(h, ns, f"{MUTE_LABEL}=withheld", 1, timeout=240)
        name = pod["metadata"]["name"]
        # It generates (its own server, through its front), but reports nothing.
        ip = fleet.ip(name)
        with pytest.raises(urllib.error.HTTPError) as refused:
            get_json(f"http://{ip}:8000/v1/adapters")
        assert refused.value.code == 503
        # An adapter placed on it alone: the operator loads it through the front (it reads
        # /v1/models, which passes), and the router has no report to rank it by.
        selector = {"matchLabels": {MUTE_LABEL: "withheld"}}
        h.apply(adapter(fleet.sources["quiet"], replicas=1, selector=selector), ns)
        release.wait_adapter_ready(h, ns, "quiet", "1/1", timeout=180)
        assert fleet.placed("quiet") == [name]
        routers = [p["metadata"]["name"] for p in fleet.pods(ROUTER_LABELS)]
        h.wait_for(
            "both routers to route to the extra pod",
            lambda: fleet.metric(routers, "lora_router_pods", state="ready") == ROUTERS * 4,
            timeout=30,
        )
        before = fleet.routed(routers, "no-residency")
        failures_before = fleet.metric(routers, "lora_router_report_failures_total")
        answers = [fleet.generation("quiet") for _ in range(6)]
        assert [(a.status, *a.route) for a in answers] == [(200, name, "no-residency")] * 6
        # The other adapters still follow residency on the pods that report it.
        every = fleet.generation("every")
        assert every.status == 200 and every.route[0] != name, every.route
        assert fleet.routed(routers, "no-residency") - before == 6
        assert fleet.metric(routers, "lora_router_pods", state="reporting") == ROUTERS * PODS
        # Its polls keep failing (counted), while its Ready endpoint keeps it routable.
        h.wait_for(
            "the routers to count failed polls of the extra pod",
            lambda: fleet.metric(routers, "lora_router_report_failures_total") > failures_before,
            timeout=30,
        )
        failed_polls = fleet.metric(routers, "lora_router_report_failures_total") - failures_before
        print(
            f"pod {name} withholds residency: 6 of 6 requests for 'quiet' 200 by no-residency, "
            f"'every' {every.route}; routers report {PODS} of {PODS + 1} pods, "
            f"{failed_polls:.0f} failed polls meanwhile"
        )
    finally:
        h.kubectl("delete", "loraadapter", "quiet", "-n", ns, "--ignore-not-found",
                  "--timeout=90s", check=False)  # fmt: skip
        h.kubectl("delete", "deployment", MUTE_WORKLOAD, "-n", ns, "--ignore-not-found",
                  "--wait=true", "--timeout=60s", check=False)  # fmt: skip
        h.wait_for("the extra pod to be gone", lambda: not h.pods(ns, f"{MUTE_LABEL}=withheld"), 90)


# ---- the pod an adapter is placed on deleted


def test_requests_follow_an_adapter_to_its_new_pod_when_its_pod_is_deleted(
    fleet: Fleet,
) -> None:
    h, ns = fleet.h, fleet.ns
    fleet.healthy()
    (old,) = fleet.placed("one")
    load = Load(fleet, "one")
    time.sleep(2)
    deleted_at = time.monotonic()
    h.kubectl("delete", "pod", "-n", ns, old, "--wait=false")

    def following() -> str | None:
        placed = fleet.placed("one")
        if len(placed) != 1 or placed[0] == old:
            return None
        recent = [a for a in load.answers[-4:] if a.started > deleted_at]
        on_new = len(recent) == 4 and all(
            a.route[0] == placed[0] and a.route[1] in AFFINITY for a in recent
        )
        return placed[0] if on_new else None

    new = h.wait_for("requests to follow the adapter to its new pod", following, timeout=240)
    answers = load.stop()
    after = [a for a in answers if a.started > deleted_at]
    assert answers and all(a.status == 200 for a in answers), summary(answers, deleted_at)
    # Between the pod leaving and the new placement: any Ready pod (its server loads the
    # adapter from the volume). Overflow is the load bound at work, not a fallback.
    unplaced = [a for a in after if a.route[1] == "unplaced"]
    window = (unplaced[-1].ended - deleted_at) if unplaced else 0.0
    assert window < 150, summary(after, deleted_at)
    print(
        f"placed pod {old} deleted: re-placed on {new}; {len(after)} requests after, all 200; "
        f"{len(unplaced)} routed unplaced within {window:.1f} s; by reason: "
        f"{dict(collections.Counter(a.route[1] for a in after))}"
    )


# ---- a pod killed mid-generation


def test_a_pod_killed_mid_generation_is_answered_by_another_or_with_a_clear_error(
    fleet: Fleet,
) -> None:
    h, ns = fleet.h, fleet.ns
    fleet.healthy()
    (victim,) = fleet.placed("one")
    ip = fleet.ip(victim)
    routers = [p["metadata"]["name"] for p in fleet.pods(ROUTER_LABELS)]
    retries = fleet.metric(routers, "lora_router_retries_total")
    long = {"size": 128, "steps": 200}
    with ThreadPoolExecutor(1) as pool:
        call: Future[Answer] = pool.submit(fleet.generation, "one", **long)

        def running() -> bool:
            report = get_json(f"http://{ip}:8000/v1/adapters")
            return bool(report.get("num_requests_running"))

        h.wait_for("the long generation to run on its pod", running, timeout=60, interval=0.1)
        time.sleep(1)
        killed_at = time.monotonic()
        h.kill_container(ns, victim, "inference")
        answer = call.result(timeout=300)
    took = answer.ended - killed_at
    print(
        f"pod {victim} killed {killed_at - answer.started:.1f} s into a generation: "
        f"{answer.status or answer.error} from {answer.route} {took:.1f} s later"
    )
    assert answer.status is not None, answer.error
    if answer.status == 200:
        # Sent once more, to another pod (its connection broke before any answer).
        assert answer.route[0] != victim
        assert fleet.metric(routers, "lora_router_retries_total") == retries + 1
    else:
        assert answer.status in (502, 503), answer.status
        assert answer.json()["error"]["code"] == answer.status
    assert took < 180


# ---- an adapter deleted while its requests run


def test_an_adapter_deleted_under_requests_answers_200_or_the_servers_404(fleet: Fleet) -> None:
    h, ns = fleet.h, fleet.ns
    fleet.healthy()
    h.apply(adapter(fleet.sources["doomed"]), ns)
    release.wait_adapter_ready(h, ns, "doomed", f"{PODS}/{PODS}", timeout=180)
    # Generations long enough that some are queued or running when the pods unload it.
    load = Load(fleet, "doomed", clients=4, pause=0.05, size=64, steps=20)
    time.sleep(4)
    deleting_at = time.monotonic()
    h.kubectl("delete", "loraadapter", "doomed", "-n", ns, "--timeout=90s")
    deleted_at = time.monotonic()
    # The clients may all be inside generations that began before the delete: wait for answers
    # to requests sent after it rather than for a fixed time.
    h.wait_for(
        "answers to requests sent after the delete",
        lambda: sum(a.started > deleted_at for a in list(load.answers)) >= 4,
        timeout=120,
    )
    answers = load.stop()
    assert {a.status for a in answers} <= {200, 404}, summary(answers, deleting_at)
    later = [a.status for a in answers if a.started > deleted_at]
    assert later and later == [404] * len(later), summary(answers, deleting_at)
    across = [a for a in answers if a.started < deleting_at < a.ended]

    # Afterwards: the pod's own 404, byte for byte.
    through = fleet.generation("doomed")
    pod = fleet.pods(INFERENCE_LABELS)[0]["metadata"]["name"]
    direct = post(
        f"http://{fleet.ip(pod)}:8000/v1/images/generations",
        manifests.generation_request("doomed", **SHORT),
    )
    assert (through.status, direct.status) == (404, 404)
    assert through.body == direct.body
    assert through.headers["content-type"] == direct.headers["content-type"]
    assert "doomed" in through.json()["error"]["message"]
    assert through.route[1] == "unplaced"
    print(
        f"adapter deleted in {deleted_at - deleting_at:.1f} s under load: "
        f"{dict(collections.Counter(a.status for a in answers))}; in flight across the delete: "
        f"{summary(across, deleting_at)}; then {through.status} {through.json()}"
    )


# ---- a weighted rollout of a new revision

ROLLOUT = {"steps": [{"weight": 30}, {"weight": 100, "pauseSeconds": 5}]}
OPERATOR_LABELS = "app.kubernetes.io/component=operator"


def served_hits(fleet: Fleet) -> dict[tuple[str, str], int]:
    """(served name, revision) -> requests the inference pods counted, all pods together."""
    out: collections.Counter[tuple[str, str]] = collections.Counter()
    for pod in fleet.pods(INFERENCE_LABELS):
        for card in get_json(f"http://{fleet.ip(pod['metadata']['name'])}:8000/v1/adapters")[
            "data"
        ]:
            out[(card["id"], card["sha256"])] += card["hits"]
    return dict(out)


def send(fleet: Fleet, model: str, n: int) -> list[Answer]:
    with ThreadPoolExecutor(4) as pool:
        return list(pool.map(lambda _: fleet.generation(model), range(n)))


def test_a_weighted_rollout_splits_aborts_survives_an_operator_restart_and_promotes(
    fleet: Fleet,
) -> None:
    h, ns, sources = fleet.h, fleet.ns, fleet.sources
    fleet.healthy()
    path = f"/apis/lora.dev/v1alpha1/namespaces/{ns}/loraadapters/rolled"
    obj = adapter(sources["rolled-v1"], rollout=ROLLOUT)
    obj["metadata"]["name"] = "rolled"
    h.apply([obj], ns)
    release.wait_adapter_ready(h, ns, "rolled", f"{PODS}/{PODS}", timeout=180)
    v1 = release.adapter_status(h, ns, "rolled")["staged"]["sha256"]
    routers = [p["metadata"]["name"] for p in fleet.pods(ROUTER_LABELS)]

    def rollout() -> Obj:
        return release.adapter_status(h, ns, "rolled").get("rollout") or {}

    def roll_out(source: AdapterSource) -> Obj:
        h.merge_patch(path, {"spec": {"source": {"uri": source.uri}}})
        progressing: Obj = h.wait_for(
            "the canary serving its first step",
            lambda: r if (r := rollout()).get("state") == "Progressing" else None,
            timeout=180,
        )
        return progressing

    def split(n: int) -> tuple[int, int]:
        """Send n requests for `rolled`; the (stable, canary) requests the pods counted."""
        before = served_hits(fleet)
        answers = send(fleet, "rolled", n)
        assert [a.status for a in answers] == [200] * n, summary(answers)
        after = served_hits(fleet)
        grew = {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}
        r = rollout()
        stable = grew.pop(("rolled", r["stable"]["revision"]), 0)
        canary = grew.pop((r["canary"]["servedAs"], r["canary"]["revision"]), 0)
        assert grew == {}, grew  # no request went anywhere else
        return stable, canary

    # The new revision next to the old: 30 % of the requests, as the pods count them.
    started = roll_out(sources["rolled-v2"])
    v2, alias = started["canary"]["revision"], started["canary"]["servedAs"]
    assert started["stable"] == {"revision": v1, "weight": 70, "readyPods": PODS}
    assert started["canary"]["weight"] == 30 and started["canary"]["readyPods"] == PODS
    wide = h.kubectl("get", "lora", "-n", ns, "rolled", "-o", "wide").splitlines()
    assert wide[0].split()[-2:] == ["CANARY", "FORMAT"], wide
    assert wide[1].split()[-2:] == ["30", "lora"], wide
    stable, canary = split(300)
    assert stable + canary == 300 and abs(canary - 90) <= 9, (stable, canary)
    # The routers counted the same requests per revision.
    counted = fleet.metric(
        routers,
        "lora_router_rollout_requests_total",
        adapter="rolled",
        revision=v2[:12],
        code="200",
    )
    assert counted == canary

    # Abort: everything back to the old revision, the canary unloaded, the annotation taken.
    h.kubectl("annotate", "loraadapter", "-n", ns, "rolled", "lora.dev/rollout=abort")
    h.wait_for("aborted", lambda: rollout().get("state") == "Aborted", timeout=60)
    assert rollout()["canary"]["weight"] == 0
    h.wait_for(
        "the canary unloaded everywhere",
        lambda: not any(name == alias for name, _ in served_hits(fleet)),
        timeout=60,
    )
    assert "lora.dev/rollout" not in (h.get(path)["metadata"].get("annotations") or {})
    assert split(30) == (30, 0)

    # Another revision; the operator restarted mid-rollout continues where it was.
    started = roll_out(sources["rolled-v3"])
    v3 = started["canary"]["revision"]
    old = [p["metadata"]["name"] for p in fleet.pods(OPERATOR_LABELS)]
    h.kubectl("delete", "pod", "-n", ns, "-l", OPERATOR_LABELS, "--wait=false")
    h.wait_for(
        "a new operator",
        lambda: [p for p in fleet.pods(OPERATOR_LABELS) if p["metadata"]["name"] not in old],
        timeout=180,
    )
    stable, canary = split(100)
    assert abs(canary - 30) <= 5, (stable, canary)
    after = rollout()
    assert (after["state"], after["step"], after["canary"]["revision"]) == ("Progressing", 1, v3)
    assert after["stepStartedAt"] == started["stepStartedAt"]

    # Promote: the last step (all to the canary, for its pause), then the name serves it.
    h.kubectl("annotate", "loraadapter", "-n", ns, "rolled", "lora.dev/rollout=promote")
    h.wait_for("step 2", lambda: rollout().get("step") == 2 or not rollout(), timeout=60)
    h.wait_for("promoted", lambda: not rollout(), timeout=120)
    release.wait_adapter_ready(h, ns, "rolled", f"{PODS}/{PODS}", timeout=120)
    assert release.adapter_status(h, ns, "rolled")["staged"]["sha256"] == v3
    h.wait_for(
        "only the new revision on the pods",
        lambda: {k for k in served_hits(fleet) if k[0].startswith("rolled")} == {("rolled", v3)},
        timeout=60,
    )
    answers = send(fleet, "rolled", 10)
    assert [a.status for a in answers] == [200] * 10, summary(answers)
