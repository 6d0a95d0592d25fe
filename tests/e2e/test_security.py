"""Attacks on the chart's trust boundaries, on a real cluster: one test per attack, each against
the same release (installed once for the module), each checking what the attacker got.

The attacker may create pods, ReplicaSets, Secrets and LoRAAdapters in the release's namespace
(and in one more of their own), and call the router. docs/security.md lists each boundary,
what enforces it and the test here that tries it. A recorder pod (the operator image's Python)
plays the attacker's server: it carries the inference label and answers like an inference
server on its HTTP port, and counts every connection to a second port that a source URL may
point at; its log is the evidence of what reached it.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shlex
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from lora_demo import manifests, release
from lora_demo.manifests import MODEL_NAME, RELEASE, AdapterSource
from lora_demo.release import CHART, INFERENCE_PORT, ROOT
from lora_devcluster import images, netpolicy
from lora_devcluster.harness import Harness

from tests.support.docs import commands, parse_blocks

Obj = dict[str, Any]

# On the local cluster the tests name the `devcluster` fixture, so the session keeps the cluster
# until they are done (it stops it after the last test that names it); on another cluster
# (LORA_E2E_KUBECONFIG) they must not, or the suite's conftest would skip them.
pytestmark = (
    [] if os.environ.get("LORA_E2E_KUBECONFIG") else [pytest.mark.usefixtures("devcluster")]
)

RECORDER = "lookalike"
OPERATOR_PODS = f"app.kubernetes.io/instance={RELEASE},app.kubernetes.io/component=operator"
SOURCE_PORT = 8443
RECORDER_SCRIPT = f"""
import http.server, json, socket, threading

def note(**what):
    print(json.dumps(what), flush=True)

class Handler(http.server.BaseHTTPRequestHandler):
    def answer(self, body, kind="application/json"):
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.path == "/ready":
            return self.answer(b"ok", "text/plain")
        note(method="GET", path=self.path, auth=self.headers.get("Authorization"))
        card = {{"id": "{MODEL_NAME}", "object": "model", "root": "{MODEL_NAME}", "parent": None}}
        self.answer(json.dumps({{"object": "list", "data": [card]}}).encode())

    def do_POST(self):
        length = int(self.headers.get("Content-Length") or 0)
        note(method="POST", path=self.path, auth=self.headers.get("Authorization"),
             body=self.rfile.read(length).decode(errors="replace"))
        self.answer(b"Success: LoRA adapter added successfully.", "text/plain")

    def log_message(self, *args):
        pass

def sources():
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("", {SOURCE_PORT}))
    s.listen()
    while True:
        conn, peer = s.accept()
        conn.settimeout(2)
        try:
            data = conn.recv(4096)
        except OSError:
            data = b""
        note(connection={SOURCE_PORT}, peer=peer[0], data=data[:300].decode("latin-1"))
        conn.close()

threading.Thread(target=sources, daemon=True).start()
http.server.ThreadingHTTPServer(("", 8000), Handler).serve_forever()
"""


class Release:
    def __init__(self, h: Harness, ns: str) -> None:
        self.h, self.ns = h, ns

    def pods(self, component: str) -> list[str]:
        selector = f"app.kubernetes.io/instance={RELEASE},app.kubernetes.io/component={component}"
        return [p["metadata"]["name"] for p in self.h.pods(self.ns, selector)]

    def recorded(self) -> list[Obj]:
        """What reached the recorder: one entry per request or connection."""
        log = self.h.kubectl("logs", "-n", self.ns, RECORDER, check=False)
        return [json.loads(line) for line in log.splitlines() if line.startswith("{")]

    def events(self, reason: str) -> list[Obj]:
        items = self.h.get(f"/apis/events.k8s.io/v1/namespaces/{self.ns}/events")["items"]
        return [e for e in items if e.get("reason") == reason]

    def condition(self, adapter: str, kind: str) -> Obj:
        status = release.adapter_status(self.h, self.ns, adapter)
        return next((c for c in status.get("conditions") or () if c["type"] == kind), {})

    def wait_failed(self, adapter: str, reason: str, timeout: float = 120) -> Obj:
        def failed() -> Obj | None:
            status = release.adapter_status(self.h, self.ns, adapter)
            staged = self.condition(adapter, "Staged")
            return status if status.get("phase") == "Failed" and staged else None

        status = self.h.wait_for(f"{adapter} to fail", failed, timeout=timeout)
        staged = self.condition(adapter, "Staged")
        assert staged.get("reason") == reason, json.dumps(status)
        return status


def recorder_pod(image: str) -> Obj:
    """A labelled look-alike of an inference pod: the label, the annotations, the port, Ready;
    but the default ServiceAccount and no owner."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": RECORDER,
            "labels": {"lora.dev/inference": "true"},
            "annotations": {
                "lora.dev/port": "8000",
                "lora.dev/adapter-root": str(manifests.VOLUME_ROOT),
            },
        },
        "spec": {
            "automountServiceAccountToken": False,
            "containers": [
                {
                    "name": "recorder",
                    "image": image,
                    "imagePullPolicy": "IfNotPresent",
                    "command": ["python", "-u", "-c", RECORDER_SCRIPT],
                    "ports": [{"name": "http", "containerPort": 8000}],
                    "readinessProbe": {"httpGet": {"path": "/ready", "port": 8000}},
                    "securityContext": manifests.NON_ROOT,
                }
            ],
        },
    }


@pytest.fixture(scope="module")
def secured(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Release]:
    """One release for every attack: one inference pod, an adapter Ready on it, a source
    placed by hand in the namespace's folder, and the recorder pod Ready beside them."""
    kubeconfig = os.environ.get("LORA_E2E_KUBECONFIG")
    ns = f"sec-{uuid.uuid4().hex[:6]}"
    if kubeconfig:
        refs = {i.role: i.ref for i in images.built(("operator", "inference"))}
        node_shell = shlex.split(os.environ.get("LORA_E2E_NODE_SHELL", ""))
        h = Harness.external(Path(kubeconfig), refs, node_shell)
    else:
        h = request.getfixturevalue("devcluster")
    h.kubectl("create", "namespace", ns)
    h.wait_for(
        "the namespace's default ServiceAccount",
        lambda: h.get_or_none(f"/api/v1/namespaces/{ns}/serviceaccounts/default"),
        timeout=60,
    )
    published = AdapterSource("pixel-art", seed=1, folder=f"{ns}/sources")
    by_hand = AdapterSource("by-hand", seed=2, folder=ns)  # in the pods' adapter root itself
    try:
        release.prepare_model(h, ns)
        release.install_crd(h)
        release.install_chart(
            h, ns, manifests.local_values(ns, replicas=1), tmp_path_factory.mktemp("values")
        )
        release.prepare_adapters(h, ns, (published, by_hand), "prepare-sources")
        release.ready_inference_pods(h, ns, 1)
        h.apply(manifests.adapter(published), ns)
        release.wait_adapter_ready(h, ns, "pixel-art", "1/1")
        h.apply(recorder_pod(h.image("operator")), ns)
        h.wait_for(
            "the recorder pod to be Ready",
            lambda: release.is_ready(h.get(f"/api/v1/namespaces/{ns}/pods/{RECORDER}")),
            timeout=120,
        )
        yield Release(h, ns)
    finally:
        # The adapters first, while the operator runs to release their finalizers.
        h.kubectl("delete", "loraadapters", "--all", "-n", ns, "--timeout=90s", check=False)
        h.run(["helm", "uninstall", RELEASE, "-n", ns, "--ignore-not-found"], check=False)
        h.kubectl("delete", "namespace", ns, "--wait=false", check=False)


def test_a_labelled_lookalike_pod_gets_no_token_and_no_call(secured: Release) -> None:
    h, ns = secured.h, secured.ns
    events = h.wait_for(
        "an Event saying why the look-alike is not the release's",
        lambda: [
            e for e in secured.events("UntrustedInferencePod") if e["regarding"]["name"] == RECORDER
        ],
        timeout=60,
    )
    assert "ServiceAccount 'default'" in events[0]["note"], events[0]["note"]
    # Several resync periods (5 s with these values) later: not one call, so no token.
    h.wait_for(
        "the adapter to be written again (a resync has passed)",
        lambda: release.adapter_status(h, ns, "pixel-art").get("ready") == "1/1",
        timeout=30,
    )
    time.sleep(15)
    calls = [r for r in secured.recorded() if "path" in r]
    assert calls == [], calls
    status = release.adapter_status(h, ns, "pixel-art")
    assert status["ready"] == "1/1"
    assert RECORDER not in {p["name"] for p in status.get("pods") or ()}


def test_an_empty_token_refuses_to_start_naming_the_secret(secured: Release) -> None:
    h, ns = secured.h, secured.ns
    h.apply(
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": "empty-token"},
            "stringData": {"token": ""},
        },
        ns,
    )
    named = f"Secret {ns}/empty-token, key token"
    mount = [{"name": "token", "mountPath": "/var/run/lora/token", "readOnly": True}]

    def container(name: str, image: str, command: list[str], env: str) -> Obj:
        return {
            "name": name,
            "image": h.image(image),
            "imagePullPolicy": "IfNotPresent",
            "command": command,
            "env": [{"name": env, "value": named}, {"name": "HOME", "value": "/tmp"}],
            "volumeMounts": [*mount, {"name": "tmp", "mountPath": "/tmp"}],
            "securityContext": manifests.NON_ROOT,
        }

    token = "/var/run/lora/token/token"
    h.apply(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "empty-token"},
            "spec": {
                "restartPolicy": "Never",
                "automountServiceAccountToken": False,
                "volumes": [
                    {"name": "token", "secret": {"secretName": "empty-token"}},
                    {"name": "tmp", "emptyDir": {}},
                ],
                "containers": [
                    container(
                        "server",
                        "inference",
                        [
                            "lora-inference",
                            "serve",
                            "--model=/tmp/none",
                            "--device=cpu",
                            f"--admin-token-file={token}",
                        ],
                        "LORA_ADMIN_TOKEN_SECRET",
                    ),
                    container(
                        "operator",
                        "operator",
                        [
                            "python",
                            "-m",
                            "lora_operator",
                            "--standalone",
                            f"--admin-token-file={token}",
                        ],
                        "LORA_ADMIN_TOKEN_SECRET",
                    ),
                    container(
                        "router",
                        "operator",
                        [
                            "python",
                            "-m",
                            "lora_router",
                            f"--namespace={ns}",
                            f"--client-token-file={token}",
                        ],
                        "LORA_CLIENT_TOKEN_SECRET",
                    ),
                ],
            },
        },
        ns,
    )

    def ended() -> list[Obj] | None:
        pod = h.get(f"/api/v1/namespaces/{ns}/pods/empty-token")
        statuses = (pod.get("status") or {}).get("containerStatuses") or []
        done = [s for s in statuses if "terminated" in (s.get("state") or {})]
        return done if len(done) == 3 else None

    for status in h.wait_for("all three programs to exit", ended, timeout=240):
        name = status["name"]
        log = h.kubectl("logs", "-n", ns, "empty-token", "-c", name, check=False)
        assert status["state"]["terminated"]["exitCode"] == 2, (name, log)
        assert named in log and "empty" in log, (name, log)


def test_an_unpublished_file_requested_by_name_is_404(secured: Release) -> None:
    h, ns = secured.h, secured.ns
    (pod,) = secured.pods("inference")
    for model, expected in (("by-hand", 404), ("pixel-art", 200)):
        request = manifests.generation_request(model, size=32, steps=2)
        status, body = h.proxy(ns, release.pod_target(pod), "/v1/images/generations", request)
        assert status == expected, (model, status, body[:300])


def test_router_paths_outside_the_allowlist_are_404(secured: Release) -> None:
    h, ns = secured.h, secured.ns
    service = release.service_target()
    for path in ("/metrics", "/v1/adapters"):
        status, body = h.proxy(ns, service, path, timeout=30)
        assert status == 404, (path, status, body[:300])
        assert b"not served by the router" in body, body[:300]
    status, body = h.proxy(
        ns, service, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/etc"}, timeout=30
    )
    assert status == 404, body[:300]
    request = manifests.generation_request("pixel-art", size=32, steps=2)
    status, _ = h.proxy(ns, service, "/v1/images/generations", request)
    assert status == 200


ALLOWED_CLIENT = "lora.dev/security-test-client"
CLIENT_PORT = 8080
# Opens a TCP connection to each HOST:PORT; "open", or why not (a policy's REJECT is a
# ConnectionRefusedError; a DROP would be a TimeoutError).
CONNECT_SCRIPT = """
import json, socket, sys
seen = {}
for target in sys.argv[1:]:
    host, port = target.rsplit(":", 1)
    s = socket.socket()
    s.settimeout(3)
    try:
        s.connect((host, int(port)))
        seen[target] = "open"
    except OSError as e:
        seen[target] = f"{type(e).__name__}: {e}"
    finally:
        s.close()
print(json.dumps(seen))
"""


def client_pod(name: str, image: str, labels: dict[str, str]) -> Obj:
    """A pod of the attacker's (or, labelled as allowFrom names, a client's) that listens on
    CLIENT_PORT, so a connection to it shows whether a pod may open one."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "automountServiceAccountToken": False,
            "terminationGracePeriodSeconds": 1,
            "containers": [
                {
                    "name": "client",
                    "image": image,
                    "imagePullPolicy": "IfNotPresent",
                    "command": ["python", "-m", "http.server", str(CLIENT_PORT)],
                    "workingDir": "/tmp",
                    "securityContext": manifests.NON_ROOT,
                }
            ],
        },
    }


def connect(h: Harness, ns: str, pod: str, container: str, targets: list[str]) -> dict[str, str]:
    """What `pod` gets when it connects to each target: "open" or the error."""
    out = h.kubectl(
        "exec", "-n", ns, pod, "-c", container, "--", "python", "-c", CONNECT_SCRIPT, *targets
    )
    seen: dict[str, str] = json.loads(out.strip().splitlines()[-1])
    return seen


def test_a_pod_outside_allow_from_cannot_reach_the_router_or_the_inference_pods(
    secured: Release,
) -> None:
    """The chart's NetworkPolicies (on by default), on the cluster's enforcer (kube-router's
    firewall on the local cluster): a pod that allowFrom does not name is refused on the router's
    ports, the clients' Service and the inference pods' port, while a pod it names connects; and
    the inference pods open no connection themselves but to the API server. Turned off with
    `helm upgrade`, the same pod connects to all of them (the attack works), so the refusals are
    the policies' doing. The release is returned to its defaults afterwards."""
    h, ns = secured.h, secured.ns
    if h.is_local:
        problem = netpolicy.enforcement_problem()
        assert problem is None, problem
    image = h.image("operator")
    h.apply(
        [
            client_pod("outsider", image, {}),
            client_pod("insider", image, {ALLOWED_CLIENT: "true"}),
        ],
        ns,
    )
    for name in ("outsider", "insider"):

        def pod_ready(name: str = name) -> bool:
            return release.is_ready(h.get(f"/api/v1/namespaces/{ns}/pods/{name}"))

        h.wait_for(f"the {name} pod to be Ready", pod_ready, timeout=120)

    def ip(pod: str) -> str:
        return pod_ip(h, ns, pod)

    (inference,) = secured.pods("inference")
    service = h.get(f"/api/v1/namespaces/{ns}/services/{manifests.SERVICE}")["spec"]
    closed = [
        f"{ip(inference)}:{INFERENCE_PORT}",  # the inference pod: generation, load, /metrics
        f"{service['clusterIP']}:{service['ports'][0]['port']}",  # the clients' Service
    ]
    for router in secured.pods("router"):
        closed += [f"{ip(router)}:8000", f"{ip(router)}:9090"]  # its http and metrics ports
    egress = [f"{ip('insider')}:{CLIENT_PORT}"]  # the inference pods open no connection
    upgrade = ["helm", "upgrade", RELEASE, str(CHART), "-n", ns, "--reuse-values"]
    h.run([*upgrade, "--set", "networkPolicy.enabled=false"])
    try:
        # The attack without the policies: every port is open to the outsider.
        def all_open() -> dict[str, str] | None:
            seen = connect(h, ns, "outsider", "client", closed)
            seen |= connect(h, ns, inference, "inference", egress)
            return seen if set(seen.values()) == {"open"} else None

        h.wait_for("every port open without the policies", all_open, timeout=60, interval=2)
        allow_from = [{"podSelector": {"matchLabels": {ALLOWED_CLIENT: "true"}}}]
        policies = ["--set", "networkPolicy.enabled=true"]
        policies += ["--set-json", f"networkPolicy.allowFrom={json.dumps(allow_from)}"]
        h.run([*upgrade, *policies])
        seen: dict[str, dict[str, str]] = {}

        def enforced() -> bool:
            seen["outsider"] = connect(h, ns, "outsider", "client", closed)
            seen["insider"] = connect(h, ns, "insider", "client", closed)
            seen["inference"] = connect(h, ns, inference, "inference", egress)
            refused = [*seen["outsider"].values(), *seen["inference"].values()]
            return all(r.startswith("ConnectionRefusedError") for r in refused)

        try:
            h.wait_for("the policies to refuse the outsider", enforced, timeout=60, interval=2)
        except AssertionError as e:
            raise AssertionError(f"{e}; what the pods got: {json.dumps(seen)}") from e
        assert set(seen["insider"].values()) == {"open"}, seen
    finally:
        defaults = ["--set", "networkPolicy.enabled=true"]
        defaults += ["--set-json", 'networkPolicy.allowFrom=[{"podSelector": {}}]']
        h.run([*upgrade, *defaults], check=False)
        h.kubectl("delete", "pod", "-n", ns, "outsider", "insider", "--wait=false", check=False)


def sourced(uris: dict[str, str]) -> list[Obj]:
    """A LoRAAdapter per name, each from its source URI."""
    return [
        {
            "apiVersion": "lora.dev/v1alpha1",
            "kind": "LoRAAdapter",
            "metadata": {"name": name},
            "spec": {"baseModel": MODEL_NAME, "source": {"uri": uri}},
        }
        for name, uri in uris.items()
    ]


def pod_ip(h: Harness, ns: str, pod: str) -> str:
    ip: str = h.get(f"/api/v1/namespaces/{ns}/pods/{pod}")["status"]["podIP"]
    return ip


def recorder_ip(secured: Release) -> str:
    return pod_ip(secured.h, secured.ns, RECORDER)


def test_an_adapter_naming_an_unlabelled_secret_fails_and_the_secret_is_never_sent(
    secured: Release,
) -> None:
    h, ns = secured.h, secured.ns
    canary = f"canary-{uuid.uuid4().hex}"
    h.apply(
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": "database-password"},
            "stringData": {"AUTHORIZATION": f"Bearer {canary}"},
        },
        ns,
    )
    url = f"https://{recorder_ip(secured)}:{SOURCE_PORT}/pixel.safetensors"
    h.apply(
        {
            "apiVersion": "lora.dev/v1alpha1",
            "kind": "LoRAAdapter",
            "metadata": {"name": "borrowed"},
            "spec": {
                "baseModel": MODEL_NAME,
                "source": {"uri": url, "secretRef": {"name": "database-password"}},
            },
        },
        ns,
    )
    status = secured.wait_failed("borrowed", "SecretNotConsented")
    assert "lora.dev/source-credentials" in secured.condition("borrowed", "Staged")["message"]
    # Not a byte went to the source: the value never left the operator.
    connections = [r for r in secured.recorded() if "connection" in r]
    assert connections == [], connections
    operator = secured.pods("operator")[0]
    logs = h.kubectl("logs", "-n", ns, operator, "-c", "operator", check=False)
    everything = json.dumps(status) + json.dumps(secured.events("Failed")) + logs
    assert canary not in everything


def test_sources_at_the_metadata_or_api_server_address_are_refused(secured: Release) -> None:
    h, ns = secured.h, secured.ns
    api = h.get("/api/v1/namespaces/default/services/kubernetes")["spec"]["clusterIP"]
    targets = {
        "metadata": "https://169.254.169.254/latest/meta-data/lora.safetensors",
        "api-server": f"https://{api}/api/v1/namespaces/{ns}/secrets/x.safetensors",
    }
    h.apply(sourced(targets), ns)
    for name, words in (("metadata", "link-local"), ("api-server", "API server")):
        secured.wait_failed(name, "HostRefused")
        assert words in secured.condition(name, "Staged")["message"]


CALL_SCRIPT = """
import json, sys, urllib.error, urllib.request
url, token = sys.argv[1], sys.argv[2]
request = urllib.request.Request(url, data=json.dumps({"lora_name": "no-such-adapter"}).encode())
if token:
    request.add_header("Authorization", "Bearer " + token)
try:
    status = urllib.request.urlopen(request, timeout=10).status
except urllib.error.HTTPError as e:
    status = e.code
print(status)
"""


def unload_as(secured: Release, token: str) -> int:
    """What an inference pod answers the recorder pod (a tenant's pod of the namespace) that
    calls its unload endpoint with `token`: 401 refused, 404 allowed (no such adapter)."""
    h, ns = secured.h, secured.ns
    (pod,) = secured.pods("inference")
    ip = h.get(f"/api/v1/namespaces/{ns}/pods/{pod}")["status"]["podIP"]
    url = f"http://{ip}:{INFERENCE_PORT}/v1/unload_lora_adapter"
    out = h.kubectl("exec", "-n", ns, RECORDER, "--", "python", "-c", CALL_SCRIPT, url, token)
    return int(out.strip().splitlines()[-1])


def token_of(h: Harness, ns: str, account: str, audience: str) -> str:
    """A token of `account`, bound to `audience`, from the TokenRequest API (as the cluster's
    admin: what the operator gets for itself, or a tenant for a ServiceAccount of theirs)."""
    body: Obj = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest"}
    body["spec"] = {"audiences": [audience], "expirationSeconds": 600}
    answer = h.create(f"/api/v1/namespaces/{ns}/serviceaccounts/{account}/token", body)
    token: str = answer["status"]["token"]
    return token


def test_a_token_bound_to_one_namespace_opens_no_pod_of_another(secured: Release) -> None:
    """The operator calls pods with tokens of its own ServiceAccount bound to each pod's
    namespace, and the pods ask the API server (TokenReview). A token of the operator's bound to
    another namespace (what a pod there could have collected), a tenant pod's own token bound to
    this one, a made-up token and none at all are refused; only the right one passes."""
    h, ns = secured.h, secured.ns
    deployment = h.get(f"/apis/apps/v1/namespaces/{ns}/deployments/{RELEASE}-operator")
    operator = deployment["spec"]["template"]["spec"]["serviceAccountName"]
    own = token_of(h, ns, operator, f"lora.dev/inference/{ns}")
    elsewhere = token_of(h, ns, operator, "lora.dev/inference/another-namespace")
    api_audience = token_of(h, ns, operator, "https://kubernetes.default.svc")
    tenant = token_of(h, ns, "default", f"lora.dev/inference/{ns}")
    forged = own.rsplit(".", 1)[0] + ".c2lnbmF0dXJl"  # the claims kept, the signature not
    for token in (elsewhere, api_audience, tenant, forged, "not-a-token", ""):
        assert unload_as(secured, token) == 401, token[:40]
    assert unload_as(secured, own) == 404  # allowed: there is no such adapter to unload


def test_a_rotated_admin_token_is_taken_without_a_restart(secured: Release) -> None:
    """The platform team's static token for the release namespace's pods: the Secret changes,
    the pod reads its file again; the old token is refused, the new one taken, no restart."""
    h, ns = secured.h, secured.ns
    (pod,) = secured.pods("inference")
    deployment = h.get(f"/apis/apps/v1/namespaces/{ns}/deployments/{RELEASE}-inference")
    volumes = deployment["spec"]["template"]["spec"]["volumes"]
    secret = next(v["secret"]["secretName"] for v in volumes if v["name"] == "admin-token")
    old = base64.b64decode(h.get(f"/api/v1/namespaces/{ns}/secrets/{secret}")["data"]["token"])
    assert unload_as(secured, old.decode()) == 404
    rotated = f"rotated-{uuid.uuid4().hex}"
    encoded = base64.b64encode(rotated.encode()).decode()
    h.merge_patch(f"/api/v1/namespaces/{ns}/secrets/{secret}", {"data": {"token": encoded}})
    h.wait_for(
        "the pod to take the rotated token",
        lambda: unload_as(secured, rotated) == 404,
        timeout=180,
        interval=3,
    )
    assert unload_as(secured, old.decode()) == 401
    assert secured.pods("inference") == [pod]
    pod_status = h.get(f"/api/v1/namespaces/{ns}/pods/{pod}")["status"]
    assert all(c["restartCount"] == 0 for c in pod_status["containerStatuses"])


# ---- a tenant of the namespace, as the platform's threat model has them ---------------------


def lookalike(name: str, owner: Obj | None, account: str, image: str) -> Obj:
    """The recorder, as a pod of `name` that claims `owner` and runs as `account`."""
    pod = recorder_pod(image)
    pod["metadata"]["name"] = name
    if owner is not None:
        pod["metadata"]["ownerReferences"] = [owner]
    pod["spec"]["serviceAccountName"] = account
    return pod


def test_forged_owners_and_a_replicaset_of_ones_own_get_no_token_and_no_call(
    secured: Release,
) -> None:
    """A bare pod whose ownerReference names the real inference Deployment (UID included), and
    a ReplicaSet named like the release's that claims the real Deployment, each running the
    recorder as the release's inference ServiceAccount: the owner chain, read by UID, refuses
    both; not one request reaches them, and an Event says why."""
    h, ns = secured.h, secured.ns
    account = f"{RELEASE}-inference"
    deploy = h.get(f"/apis/apps/v1/namespaces/{ns}/deployments/{RELEASE}-inference")
    meta = deploy["metadata"]
    real = {"apiVersion": "apps/v1", "kind": "Deployment", "name": meta["name"]}
    real |= {"uid": meta["uid"], "controller": True}
    image = h.image("operator")
    forged = lookalike("forged-owner", real, account, image)
    forged["metadata"]["labels"]["app"] = "forged"
    template = lookalike("unused", None, account, image)
    template["metadata"] = {"labels": {"lora.dev/inference": "true", "app": "own-rs"}}
    template["metadata"]["annotations"] = recorder_pod(image)["metadata"]["annotations"]
    own_rs: Obj = {
        "apiVersion": "apps/v1",
        "kind": "ReplicaSet",
        "metadata": {"name": f"{RELEASE}-inference-x", "ownerReferences": [real]},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": {"app": "own-rs"}},
            "template": {"metadata": template["metadata"], "spec": template["spec"]},
        },
    }
    h.apply([forged, own_rs], ns)

    def refused() -> list[str] | None:
        notes = [
            f"{e['regarding']['kind']} {e['regarding']['name']}: {e['note']}"
            for e in secured.events("UntrustedInferencePod")
        ]
        direct = [n for n in notes if "Deployments own ReplicaSets" in n]
        copied = [n for n in notes if n.startswith(f"ReplicaSet {RELEASE}-inference-x")]
        return notes if direct and copied else None

    notes = h.wait_for("an Event for each forgery", refused, timeout=120)
    pods = [p["metadata"]["name"] for p in h.pods(ns, "app=own-rs")]
    assert pods, "the ReplicaSet of one's own made no pod"
    time.sleep(15)  # several resyncs
    for pod in ("forged-owner", *pods):
        log = h.kubectl("logs", "-n", ns, pod, check=False)
        calls = [line for line in log.splitlines() if '"path"' in line]
        assert calls == [], (pod, calls, notes)
    status = release.adapter_status(h, ns, "pixel-art")
    assert status["ready"] == "1/1", status
    h.kubectl("delete", "replicaset", "-n", ns, own_rs["metadata"]["name"], "--wait=false")
    h.kubectl("delete", "pod", "-n", ns, "forged-owner", "--wait=false")


def test_a_secret_ref_that_is_a_path_is_refused_by_the_api_server(secured: Release) -> None:
    """`secretRef.name: ../../team-b/secrets/hub-creds` once read another namespace's Secret:
    the CRD takes DNS-1123 names only, so the object never exists."""
    h, ns = secured.h, secured.ns
    adapter = {
        "apiVersion": "lora.dev/v1alpha1",
        "kind": "LoRAAdapter",
        "metadata": {"name": "traversal"},
        "spec": {
            "baseModel": MODEL_NAME,
            "source": {
                "uri": "https://huggingface.co/x/y/resolve/main/a.safetensors",
                "secretRef": {"name": "../../team-b/secrets/hub-creds"},
            },
        },
    }
    with pytest.raises(AssertionError) as refused:
        h.apply(adapter, ns)
    assert "secretRef.name" in str(refused.value), refused.value
    assert h.get_or_none(f"/apis/lora.dev/v1alpha1/namespaces/{ns}/loraadapters/traversal") is None


def test_sources_at_pod_or_mapped_metadata_addresses_are_refused_before_any_connection(
    secured: Release,
) -> None:
    """With the chart's defaults (the Hub only, private ranges refused): a source at another
    pod's address, the metadata address written as IPv4-mapped IPv6, and a URL whose host two
    parsers read differently are refused; the recorder sees no connection."""
    h, ns = secured.h, secured.ns
    before = len([r for r in secured.recorded() if "connection" in r])
    targets = {
        "pod-address": f"https://{recorder_ip(secured)}:{SOURCE_PORT}/a.safetensors",
        "mapped-metadata": "https://[::ffff:169.254.169.254]/latest/a.safetensors",
        "two-readings": "https://evil.example\\.huggingface.co/a.safetensors",
    }
    h.apply(sourced(targets), ns)
    for name in targets:

        def failed(name: str = name) -> bool:
            return release.adapter_status(h, ns, name).get("phase") == "Failed"

        h.wait_for(f"{name} to fail", failed, timeout=120)
        status = release.adapter_status(h, ns, name)
        staged = secured.condition(name, "Staged")
        assert staged.get("reason") in ("HostRefused", "InvalidSource"), json.dumps(status)
    assert "link-local" in secured.condition("mapped-metadata", "Staged")["message"]
    after = len([r for r in secured.recorded() if "connection" in r])
    assert after == before


BOMBS_SCRIPT = """
import os, struct, sys
root = sys.argv[1]
os.makedirs(root, exist_ok=True)

def write(name, header):
    with open(os.path.join(root, name + ".safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)

# The list bomb as it crashed the operator: 64 MiB of [], (about 1.6 GB in json.loads).
size = 64 * 1024 * 1024
write("list-bomb", (b"[" + b"[]," * ((size - 4) // 3) + b"[]]").ljust(size, b" "))
write("nest-bomb", b"[" * 2_000_000 + b"]" * 2_000_000)
write("long-number", b'{"a": ' + b"9" * 5000 + b"}")
print("written")
"""


def test_header_bombs_fail_their_adapters_and_the_operator_stays_up(secured: Release) -> None:
    """Three files whose headers once OOMKilled the operator or killed its staging task: each
    adapter is Failed (`NotALora`, the bound named), the operator never restarts, and the
    namespace's other adapter keeps serving."""
    h, ns = secured.h, secured.ns
    folder = f"{manifests.VOLUME_ROOT}/{ns}/bombs"
    job = manifests.prepare_job("write-bombs", h.image("operator"), model=None)
    spec = job["spec"]["template"]["spec"]
    spec["containers"][0]["command"] = ["python", "-c", BOMBS_SCRIPT, folder]
    spec["containers"][0]["volumeMounts"] = [
        {"name": "adapters", "mountPath": str(manifests.VOLUME_ROOT)}
    ]
    spec["volumes"] = [
        {"name": "adapters", "persistentVolumeClaim": {"claimName": f"{RELEASE}-adapters"}}
    ]
    release.run_job(h, ns, job)
    names = ("list-bomb", "nest-bomb", "long-number")
    h.apply(sourced({name: f"{folder}/{name}.safetensors" for name in names}), ns)
    for name in names:
        secured.wait_failed(name, "NotALora")
    (operator,) = secured.pods("operator")
    statuses = h.get(f"/api/v1/namespaces/{ns}/pods/{operator}")["status"]["containerStatuses"]
    assert all(c["restartCount"] == 0 for c in statuses), statuses
    assert release.adapter_status(h, ns, "pixel-art")["ready"] == "1/1"


def test_models_cards_show_no_volume_path(secured: Release) -> None:
    h, ns = secured.h, secured.ns
    status, body = h.proxy(ns, release.service_target(), "/v1/models", timeout=30)
    assert status == 200, body[:300]
    cards = json.loads(body)["data"]
    assert "pixel-art" in {c["id"] for c in cards}
    text = json.dumps(cards)
    assert str(manifests.VOLUME_ROOT) not in text and "/revisions/" not in text, text
    sha = release.adapter_status(h, ns, "pixel-art")["staged"]["sha256"]
    (card,) = [c for c in cards if c["id"] == "pixel-art"]
    assert (card["root"], card["revision"]) == ("pixel-art", sha)


def test_a_pinned_hash_of_another_namespaces_adapter_is_not_served(secured: Release) -> None:
    """Another namespace watched by the same release pins pixel-art's sha256 with a source that
    lacks those bytes: once the store published any object with that hash; now the namespace
    gets only what its own source serves."""
    h, ns = secured.h, secured.ns
    other = f"{ns}-b"
    h.kubectl("create", "namespace", other)
    upgrade = ["helm", "upgrade", RELEASE, str(CHART), "-n", ns, "--reuse-values"]
    h.run([*upgrade, "--set", f"operator.watchNamespaces={{{ns},{other}}}"])
    try:
        release.ready_pods(h, ns, OPERATOR_PODS, 1)
        sha = release.adapter_status(h, ns, "pixel-art")["staged"]["sha256"]
        h.apply(
            {
                "apiVersion": "lora.dev/v1alpha1",
                "kind": "LoRAAdapter",
                "metadata": {"name": "borrowed-bytes"},
                "spec": {
                    "baseModel": MODEL_NAME,
                    "source": {
                        "uri": f"{manifests.VOLUME_ROOT}/{other}/nothing.safetensors",
                        "sha256": sha,
                    },
                },
            },
            other,
        )

        def failed() -> Obj | None:
            status = release.adapter_status(h, other, "borrowed-bytes")
            return status if status.get("phase") == "Failed" else None

        status = h.wait_for("the borrowed hash to fail", failed, timeout=120)
        assert not status.get("staged"), status
        assert release.adapter_status(h, ns, "pixel-art")["ready"] == "1/1"
    finally:
        h.kubectl("delete", "loraadapters", "--all", "-n", other, "--timeout=60s", check=False)
        h.run([*upgrade, "--set", f"operator.watchNamespaces={{{ns}}}"], check=False)
        h.kubectl("delete", "namespace", other, "--wait=false", check=False)
        release.ready_pods(h, ns, OPERATOR_PODS, 1)  # the next tests exec into it


WIRE_SCRIPT = """
import json, select, socket, sys
host, port = sys.argv[1], int(sys.argv[2])

# The status line answered to `data`, sent at once or a byte per `pause` seconds (an answer
# that comes before the last byte is read at once).
def exchange(data, pause=0.0):
    s = socket.create_connection((host, port), timeout=30)
    try:
        for chunk in ([data[i:i + 1] for i in range(len(data))] if pause else [data]):
            if pause and select.select([s], [], [], pause)[0]:
                break
            s.sendall(chunk)
        if not select.select([s], [], [], 30)[0]:
            return "no answer"
        return s.recv(4096).split(b"\\r\\n", 1)[0].decode()
    except OSError as e:
        return type(e).__name__
    finally:
        s.close()

body = b'{"model": "pixel-art", "prompt": "p", "size": "32x32", "num_inference_steps": 2}'
smuggled = b"POST /v1/load_lora_adapter HTTP/1.1\\r\\nHost: x\\r\\nContent-Length: 2\\r\\n\\r\\n{}"
seen = {
    "bare-lf": exchange(b"GET /v1/models HTTP/1.1\\nHost: x\\n\\n"),
    "no-host": exchange(b"GET /v1/models HTTP/1.1\\r\\n\\r\\n"),
    "two-hosts": exchange(b"GET /v1/models HTTP/1.1\\r\\nHost: a\\r\\nHost: b\\r\\n\\r\\n"),
    "tab-in-target": exchange(b"GET /v1/models\\t HTTP/1.1\\r\\nHost: x\\r\\n\\r\\n"),
    "cl-and-te": exchange(
        b"POST /v1/images/generations HTTP/1.1\\r\\nHost: x\\r\\nContent-Length: 4\\r\\n"
        b"Transfer-Encoding: chunked\\r\\n\\r\\n0\\r\\n\\r\\n" + smuggled
    ),
    "slow-head": exchange(b"GET /v1/models HTTP/1.1\\r\\nHost: x\\r\\nX-Slow: aaaa", 1.0),
}
print(json.dumps(seen))
"""


def test_the_routers_http_layer_refuses_what_it_cannot_read_one_way(secured: Release) -> None:
    """From a pod of the namespace, on the clients' Service: a bare LF, a missing or doubled
    Host, a tab in the target and a length beside a chunked coding (with a load request behind
    it) are a 400 at once; a head sent a byte a second is cut off (408) at the head deadline.
    The pods never see a load call from the router (the inference pod's access log is
    checked)."""
    h, ns = secured.h, secured.ns
    service = h.get(f"/api/v1/namespaces/{ns}/services/{manifests.SERVICE}")["spec"]
    port = str(service["ports"][0]["port"])
    out = h.kubectl(
        "exec", "-n", ns, RECORDER, "--", "python", "-c", WIRE_SCRIPT, service["clusterIP"], port
    )
    seen = json.loads(out.strip().splitlines()[-1])
    for case in ("bare-lf", "no-host", "two-hosts", "tab-in-target", "cl-and-te"):
        assert seen[case].startswith("HTTP/1.1 400"), seen
    assert seen["slow-head"].startswith("HTTP/1.1 408"), seen
    # The smuggled load request would reach the pod from a router: only the operator loads.
    (pod,) = secured.pods("inference")
    log = h.kubectl("logs", "-n", ns, pod, "-c", "inference", check=False)
    routers = [pod_ip(h, ns, r) for r in secured.pods("router")]
    loads = [line for line in log.splitlines() if "/v1/load_lora_adapter" in line]
    assert loads, "the operator's own loads are in the access log"
    assert not [line for line in loads for ip in routers if f": {ip} [" in line], loads


def test_a_namespace_over_its_quota_degrades_and_another_still_stages(secured: Release) -> None:
    """The release's quota lowered to one and a half adapters: a second adapter of this
    namespace is Degraded (`QuotaExceeded`, its usage and the value to raise in the message),
    while another namespace of the release stages its own; this namespace's first adapter
    keeps serving."""
    h, ns = secured.h, secured.ns
    other = f"{ns}-q"
    size = int(release.adapter_status(h, ns, "pixel-art")["staged"]["sizeBytes"])
    shared = AdapterSource("quota-shared", seed=3)  # in _shared/: any namespace may copy it
    release.prepare_adapters(h, ns, (shared,), "prepare-quota")
    h.kubectl("create", "namespace", other)
    upgrade = ["helm", "upgrade", RELEASE, str(CHART), "-n", ns, "--reuse-values"]
    h.run(
        [
            *upgrade,
            "--set",
            f"operator.watchNamespaces={{{ns},{other}}}",
            "--set",
            f"operator.namespaceQuota={size * 3 // 2}",
        ]
    )
    try:
        release.ready_pods(h, ns, OPERATOR_PODS, 1)
        by_hand = str(manifests.VOLUME_ROOT / ns / "by-hand")  # another adapter, as large
        h.apply(sourced({"over-quota": by_hand}), ns)
        h.apply(sourced({"elsewhere": shared.uri}), other)

        def degraded() -> Obj | None:
            status = release.adapter_status(h, ns, "over-quota")
            return status if status.get("phase") == "Degraded" else None

        h.wait_for("the adapter over the quota to be Degraded", degraded, timeout=120)
        reason = secured.condition("over-quota", "Degraded")
        assert reason.get("reason") == "QuotaExceeded", reason
        assert "operator.namespaceQuota" in reason["message"] and ns in reason["message"]
        h.wait_for(
            "the other namespace's adapter to be staged",
            lambda: release.adapter_status(h, other, "elsewhere").get("staged"),
            timeout=120,
        )
        assert not release.adapter_status(h, ns, "over-quota").get("staged")
        assert release.adapter_status(h, ns, "pixel-art")["ready"] == "1/1"
    finally:
        h.kubectl("delete", "loraadapters", "over-quota", "-n", ns, "--timeout=60s", check=False)
        h.kubectl("delete", "loraadapters", "--all", "-n", other, "--timeout=60s", check=False)
        restore = [
            "--set",
            f"operator.watchNamespaces={{{ns}}}",
            "--set",
            "operator.namespaceQuota=20GiB",
        ]
        h.run([*upgrade, *restore], check=False)
        h.kubectl("delete", "namespace", other, "--wait=false", check=False)
        release.ready_pods(h, ns, OPERATOR_PODS, 1)


def test_the_operator_never_restarted(secured: Release) -> None:
    """After every attack above (the suite runs in file order): the operator's containers never
    restarted, and the namespace's adapter is still served."""
    h, ns = secured.h, secured.ns
    for operator in secured.pods("operator"):
        pod = h.get(f"/api/v1/namespaces/{ns}/pods/{operator}")
        assert all(c["restartCount"] == 0 for c in pod["status"]["containerStatuses"]), pod
    request = manifests.generation_request("pixel-art", size=32, steps=2)
    status, _ = h.proxy(ns, release.service_target(), "/v1/images/generations", request)
    assert status == 200


def test_the_backup_task_restores_adapters_without_downloading(
    secured: Release, tmp_path: Path
) -> None:
    """docs/tasks/back-up-the-adapter-volume.md as written (its namespace and the images this
    cluster has aside): back up, lose the release and its claim, restore, and the adapter is
    Ready again with nothing staged."""
    h, ns = secured.h, secured.ns
    doc = ROOT / "docs" / "tasks" / "back-up-the-adapter-volume.md"
    backup, restore = [
        b for b in parse_blocks(doc, doc.read_text()) if b.lang == "sh" and b.mode == "dry-run"
    ]
    # The block's relative paths, in a folder of the test's own: the chart, and the example with
    # this cluster's image and, on one node, a ReadWriteOnce claim (all its provisioner offers).
    (tmp_path / "charts").symlink_to(ROOT / "charts")
    example = (ROOT / "examples" / "volume-restore.yaml").read_text()
    example = re.sub(r"\S+/lora-operator/operator:\S+", h.image("operator"), example)
    (tmp_path / "examples").mkdir()
    (tmp_path / "examples" / "volume-restore.yaml").write_text(
        example.replace("[ReadWriteMany]", "[ReadWriteOnce]")
    )
    values = tmp_path / "values.yaml"
    values.write_text(json.dumps(manifests.local_values(ns, replicas=1)))
    sha = release.adapter_status(h, ns, "pixel-art")["staged"]["sha256"]

    def run(block: Any) -> None:
        for words in commands(block.text):
            # The words as the docs test reads them, redirections kept for the shell.
            line = " ".join(shlex.quote(w) if w not in ("<", ">") else w for w in words)
            line = line.replace("-n lora", f"-n {ns}")
            if words[:2] == ["helm", "install"]:
                line += f" -f {shlex.quote(str(values))}"
            done = subprocess.run(
                ["bash", "-c", line], cwd=tmp_path, env=h.env, capture_output=True, timeout=300
            )
            assert done.returncode == 0, (line, done.stderr.decode(errors="replace")[-2000:])

    run(backup)
    names = subprocess.run(
        ["tar", "-tf", str(tmp_path / "adapters.tar")], capture_output=True, text=True, check=True
    ).stdout
    assert f"adapters/{ns}/pixel-art/revisions/{sha}/" in names, names[:2000]
    # The release and its claim are lost.
    h.run(["helm", "uninstall", RELEASE, "-n", ns, "--wait", "--timeout", "120s"])
    h.kubectl("delete", "pvc", "-n", ns, f"{RELEASE}-adapters", "--timeout=120s")
    run(restore)
    # The LoRAAdapter kept its Ready status through the loss, so that says nothing yet: the
    # restored operator must be up, and the new inference pod must serve the adapter it loaded.
    operator_selector = f"app.kubernetes.io/instance={RELEASE},app.kubernetes.io/component=operator"
    (operator_pod,) = release.ready_pods(h, ns, operator_selector, 1)
    (pod,) = (p["metadata"]["name"] for p in release.ready_inference_pods(h, ns, 1))
    h.wait_for(
        "the restored release to load the adapter on the new pod",
        lambda: release.served_adapters(h, ns, pod).get("pixel-art", {}).get("revision") == sha,
        timeout=240,
    )
    release.wait_adapter_ready(h, ns, "pixel-art", "1/1", timeout=240, sha256=sha)
    log = h.kubectl("logs", "-n", ns, operator_pod["metadata"]["name"], "-c", "operator")
    assert "action=staged" not in log, log[-3000:]
