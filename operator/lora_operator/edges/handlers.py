"""kopf's handlers: thin, each hands one kind of event to the controller.

    inference pod event  ->  the index of pods, then the controller
    LoRAAdapter event    ->  the controller (which stages a new spec, with its own retries, and
                             wakes the pods; holds the adapter with its finalizer, and on
                             deletion unpublishes, unloads everywhere, collects and releases it)

Inference pods are held in a kopf index keyed by namespace (`inference_pods`), complete
before the first event handler runs; only pods with the `lora.dev/inference` label are watched
at all; those `trust.static_refusal` refuses are never indexed, and the others are reconciled
once the controller's identity prover has read their owner chain and trusts them. LoRAAdapters
are in no kopf index: kopf makes every object of an indexed kind a readiness flag of its own,
and every flag raised or lowered wakes every handler waiting on them, a startup that grew as
the square of the adapters (minutes at 10,000). The controller's records are their index, and
it acts once they hold every adapter the API lists (`Controller.set_active`). kopf writes
nothing to an adapter: no finalizer (the controller's finalizer actor adds and removes its own:
a kopf delete handler would be held, with its stack and the object, by every deletion until the
pods unload it), no diff-base annotation, no handler progress, no Events.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import kopf
from lora_runtime import metrics

from lora_operator.controller import Controller
from lora_operator.edges import kube
from lora_operator.edges.config import OperatorConfig
from lora_operator.rules import trust
from lora_operator.rules.model import (
    GROUP,
    INFERENCE_LABEL,
    PLURAL,
    VERSION,
    PodInfo,
    pod_info,
)

ANNOTATION_PREFIX = "lora.dev"


def build_registry(controller: Controller) -> kopf.OperatorRegistry:
    registry = kopf.OperatorRegistry()
    adapters = {"group": GROUP, "version": VERSION, "plural": PLURAL, "registry": registry}
    pods = {
        "group": "",
        "version": "v1",
        "plural": "pods",
        "labels": {INFERENCE_LABEL: kopf.PRESENT},
        "registry": registry,
    }

    @kopf.on.login(id="login", registry=registry)
    async def login(**kwargs: Any) -> kopf.ConnectionInfo | None:  # async: in the operator's loop
        info = kube.in_cluster_login() or kopf.login_with_kubeconfig(**kwargs)
        if info is not None:
            controller.use_credentials(info)
        return info

    @kopf.on.startup(id="startup", registry=registry)
    async def startup(settings: kopf.OperatorSettings, **kwargs: Any) -> None:
        configure(settings, controller.config)
        # kopf hands its (still empty, then live) index to every handler, this one included.
        controller.start(kwargs["inference_pods"])
        registry, port = controller.metrics.registry, controller.config.metrics_port
        runner = await metrics.serve(registry, "0.0.0.0", port)
        controller.on_stop(runner.cleanup)

    @kopf.on.cleanup(id="cleanup", registry=registry)
    async def cleanup(**_: Any) -> None:
        await controller.stop()

    @kopf.index(id="inference_pods", **pods)  # type: ignore[arg-type]
    async def inference_pods(body: kopf.Body, **_: Any) -> dict[str, PodInfo]:
        info = pod_info(body)
        if trust.static_refusal(info, controller.prover.policy) is not None:
            return {}  # a look-alike: never placed on, never targeted
        return {info.namespace: info}

    @kopf.on.event(id="pod_event", **pods)  # type: ignore[arg-type]
    async def pod_event(body: kopf.Body, type: str | None, **_: Any) -> None:
        controller.pod_changed(pod_info(body), deleted=type == "DELETED")

    # Sync handlers would run in threads: every handler here is async, in the operator's loop.
    @kopf.on.event(id="adapter_event", **adapters)  # type: ignore[arg-type]
    async def adapter_event(body: kopf.Body, type: str | None, **_: Any) -> None:
        controller.adapter_changed(body, deleted=type == "DELETED")

    return registry


class NoDiffBase(kopf.AnnotationsDiffBaseStorage):
    """No diff-base: the operator has no create, update or delete handlers (the controller
    compares generations itself), so storing the last spec would cost a write per change for
    nothing, and building it a deep copy of every event's body."""

    def build(
        self, *, body: kopf.Body, extra_fields: Iterable[Any] | None = None
    ) -> kopf.BodyEssence:
        return kopf.BodyEssence()

    def fetch(self, *, body: kopf.Body) -> kopf.BodyEssence | None:
        return None

    def store(self, *, body: kopf.Body, patch: kopf.Patch, essence: kopf.BodyEssence) -> None:
        return None


def configure(settings: kopf.OperatorSettings, config: OperatorConfig) -> None:
    """kopf keeps no records of its own on the objects; it watches, and reconnects quickly."""
    settings.persistence.diffbase_storage = NoDiffBase(
        prefix=ANNOTATION_PREFIX, key="last-handled-configuration"
    )
    settings.peering.lifetime = config.peering_lifetime_s
    # The controller posts its own Events, one per transition, with reasons users can grep.
    settings.posting.enabled = False
    # Reconnect watches quickly after the API server restarts or a connection silently dies.
    settings.watching.server_timeout = 60
    settings.watching.client_timeout = 90
    settings.watching.connect_timeout = 10
    settings.networking.request_timeout = 30
    settings.batching.error_delays = (1, 2, 5, 10, 20)
