"""What the autoscaling tests ask of the chart and send to the cluster: the chart's HPA on the
pods' queue metric with a test's quick behavior (`autoscaling_values`), and a closed-loop load
of generation requests that records every answer (`Load`)."""

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


def autoscaling_values(*, max_replicas: int, scale_down_window: int = 10) -> Obj:
    """The chart's `inference.autoscaling` for a test: an HPA on the pods' queue metric aiming
    at one waiting request a pod, between 1 and `max_replicas`; its behavior adds up to the
    maximum at once and removes pods after `scale_down_window` seconds of a lower
    recommendation (Kubernetes' default waits 5 minutes), all of them at once."""
    return {
        "enabled": True,
        "minReplicas": 1,
        "maxReplicas": max_replicas,
        "metric": QUEUE_METRIC,
        "targetAverageValue": "1",
        "behavior": {
            "scaleUp": {
                "stabilizationWindowSeconds": 0,
                "policies": [{"type": "Pods", "value": max_replicas, "periodSeconds": 1}],
            },
            "scaleDown": {
                "stabilizationWindowSeconds": scale_down_window,
                "policies": [{"type": "Percent", "value": 100, "periodSeconds": 1}],
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
