"""The router's view of the API: the EndpointSlices of the inference pods' Services (one per base
model in a release that serves several: each slice's pods serve its Service's models) and the
LoRAAdapters of the namespace, mirrored into the `Fleet` by list-then-watch (kube.mirror)."""

from __future__ import annotations

from collections.abc import Callable

from lora_runtime.login import Login

from lora_router import fleet as fleet_mod
from lora_router import kube
from lora_router.config import RouterConfig
from lora_router.fleet import Fleet
from lora_router.state import ProxyState, Source

GROUP_VERSION = "lora.dev/v1alpha1"
SERVICE_NAME_LABEL = "kubernetes.io/service-name"  # an EndpointSlice's Service


def kube_sources(
    config: RouterConfig, *, connect: Callable[[], Login] = kube.login
) -> list[Source]:
    ns = config.namespace
    slices_path = f"/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices"
    models = {s.name: s.models for s in config.services}
    names = ",".join(sorted(models))
    slices_params = {"labelSelector": f"kubernetes.io/service-name in ({names})"}
    adapters_path = f"/apis/{GROUP_VERSION}/namespaces/{ns}/loraadapters"

    async def endpoints(fleet: Fleet, state: ProxyState) -> None:
        def parse(obj: kube.Obj) -> list[fleet_mod.Endpoint]:
            labels = (obj.get("metadata") or {}).get("labels") or {}
            served = models.get(str(labels.get(SERVICE_NAME_LABEL, "")), frozenset())
            return fleet_mod.parse_endpoint_slice(obj, config.port_name, served)

        def replace(items: list[kube.Obj]) -> None:
            fleet.slices = {_name(o): parse(o) for o in items}
            fleet.synced.add("endpoints")
            state.endpoints_changed()

        def on_event(kind: str, obj: kube.Obj) -> None:
            if kind == "DELETED":
                fleet.slices.pop(_name(obj), None)
            else:
                fleet.slices[_name(obj)] = parse(obj)
            state.endpoints_changed()

        await kube.mirror(slices_path, slices_params, replace, on_event, connect=connect)

    async def adapters(fleet: Fleet, state: ProxyState) -> None:
        def replace(items: list[kube.Obj]) -> None:
            parsed = [fleet_mod.parse_adapter(o) for o in items]
            fleet.adapters = {a.name: a for a in parsed}
            fleet.synced.add("adapters")

        def on_event(kind: str, obj: kube.Obj) -> None:
            placed = fleet_mod.parse_adapter(obj)
            if kind == "DELETED":
                fleet.adapters.pop(placed.name, None)
            else:
                fleet.adapters[placed.name] = placed

        await kube.mirror(adapters_path, {}, replace, on_event, connect=connect)

    return [endpoints, adapters]


def _name(obj: kube.Obj) -> str:
    return str((obj.get("metadata") or {}).get("name", ""))
