"""What the autoscaling tests put on a cluster and send to it: a HorizontalPodAutoscaler on a
per-pod custom metric (`hpa_manifest`), and a closed-loop load of generation requests that
records every answer (`Load`).

`hpa_manifest` stands in for the chart's own HPA until it renders one
(`inference.models[].autoscaling`): the chart must then leave the Deployment's `replicas` out,
or every upgrade would set the count back under the HPA.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

Obj = dict[str, Any]

QUEUE_METRIC = "vllm_num_requests_waiting"  # the metrics pipeline's name for the server's gauge


def hpa_manifest(
    deployment: str,
    *,
    metric: str = QUEUE_METRIC,
    average: str = "1",
    min_replicas: int = 1,
    max_replicas: int = 3,
    scale_up_window: int = 0,
    scale_down_window: int = 10,
) -> Obj:
    """An autoscaling/v2 HPA of `deployment` (named after it) on the per-pod `metric`, aiming
    at `average` per pod, between `min_replicas` and `max_replicas`. The behavior is a test's:
    add up to the maximum at once, and remove pods after `scale_down_window` seconds of a lower
    recommendation (the default waits 5 minutes), all of them at once."""
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": {"name": deployment},
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": deployment},
            "minReplicas": min_replicas,
            "maxReplicas": max_replicas,
            "metrics": [
                {
                    "type": "Pods",
                    "pods": {
                        "metric": {"name": metric},
                        "target": {"type": "AverageValue", "averageValue": average},
                    },
                }
            ],
            "behavior": {
                "scaleUp": {
                    "stabilizationWindowSeconds": scale_up_window,
                    "policies": [{"type": "Pods", "value": max_replicas, "periodSeconds": 1}],
                },
                "scaleDown": {
                    "stabilizationWindowSeconds": scale_down_window,
                    "policies": [{"type": "Percent", "value": 100, "periodSeconds": 1}],
                },
            },
        },
    }


@dataclass(frozen=True)
class Answer:
    """One request as the client saw it: the status (None: no answer at all, `error` says why),
    the pod and route the router named (`x-lora-pod`, `x-lora-route`), when it was sent and
    answered (time.monotonic)."""

    status: int | None
    pod: str | None
    route: str | None
    started: float
    ended: float
    error: str | None = None


def post(url: str, body: Obj, timeout: float = 120) -> Answer:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    started = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            r.read()
            status, headers = r.status, r.headers
    except urllib.error.HTTPError as e:
        e.read()
        status, headers = e.code, e.headers
    except (urllib.error.URLError, http.client.HTTPException, OSError) as e:
        return Answer(None, None, None, started, time.monotonic(), error=repr(e))
    return Answer(
        status, headers.get("x-lora-pod"), headers.get("x-lora-route"), started, time.monotonic()
    )


class Load:
    """`clients` closed-loop clients, each sending `body` to `url` again as soon as the last one
    is answered (a new connection each time, as different clients would), until `stop`."""

    def __init__(self, url: str, body: Obj, clients: int) -> None:
        self.url, self.body = url, body
        self.answers: list[Answer] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._client, name=f"load-{i}", daemon=True)
            for i in range(clients)
        ]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def stop(self) -> list[Answer]:
        """Stop sending, wait for the requests in flight; every answer, in the order received."""
        self._stop.set()
        for t in self._threads:
            if t.ident is not None:  # started
                t.join(timeout=180)
        return self.snapshot()

    def snapshot(self) -> list[Answer]:
        with self._lock:
            return list(self.answers)

    def _client(self) -> None:
        while not self._stop.is_set():
            answer = post(self.url, self.body)
            with self._lock:
                self.answers.append(answer)
