"""What the operator knows about pods and adapters, read from Kubernetes objects (pure).

Inference pods are found by one well-known label; two annotations say how to reach them:

    labels["lora.dev/inference"]           any value: the pod runs an inference server
    annotations["lora.dev/port"]           its HTTP port (default 8000)
    annotations["lora.dev/adapter-root"]   where the adapter volume is mounted inside the pod
                                           (default /var/lib/lora/adapters); the pod's
                                           `--adapter-root` is that plus its namespace

`PodInfo` (the value kopf's index of pods holds) and `AdapterInfo` are small, frozen and
comparable, so the controller can tell whether an event changed anything it acts on.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any

# Label selectors are shared with the inference server, which checks the same selectors against
# its own labels before it resolves an adapter from the volume.
from lora_volume import stacks, targeting

from lora_operator.rules.rollout import COMMAND_ANNOTATION, Plan, parse_plan

INFERENCE_LABEL = "lora.dev/inference"
PORT_ANNOTATION = "lora.dev/port"
ADAPTER_ROOT_ANNOTATION = "lora.dev/adapter-root"
DEFAULT_PORT = 8000
DEFAULT_POD_VOLUME_ROOT = "/var/lib/lora/adapters"

GROUP = "lora.dev"
VERSION = "v1alpha1"
PLURAL = "loraadapters"
KIND = "LoRAAdapter"


# A container as trust compares it: (name, image, command, args).
Container = tuple[str, str, tuple[str, ...], tuple[str, ...]]


def containers_of(spec: Mapping[str, Any]) -> tuple[Container, ...]:
    """The (name, image, command, args) of a pod spec's or template's containers (pure)."""
    return tuple(
        (
            str(c.get("name", "")),
            str(c.get("image", "")),
            tuple(str(a) for a in c.get("command") or ()),
            tuple(str(a) for a in c.get("args") or ()),
        )
        for c in spec.get("containers") or ()
        if isinstance(c, Mapping)
    )


@dataclass(frozen=True)
class PodInfo:
    namespace: str
    name: str
    uid: str
    ip: str | None
    ready: bool
    restarts: int  # the sum of the containers' restart counts: a restart empties the server
    port: int
    volume_root: PurePosixPath  # where the adapter volume is mounted inside the pod
    deleting: bool
    labels: tuple[tuple[str, str], ...] = field(default=())
    # Who the pod is (trust.refusal decides whether it is one of the release's inference pods):
    # its ServiceAccount, and its controlling owner as (kind, name, uid), None for a bare pod.
    service_account: str = "default"
    owner: tuple[str, str, str] | None = None
    # What it runs: (name, image, command, args) per container (trust compares them with its
    # owner's template).
    containers: tuple[Container, ...] = ()
    # `labels` as a mapping, built once: every adapter's selector reads it at every pass.
    label_map: Mapping[str, str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "label_map", dict(self.labels))

    @property
    def key(self) -> tuple[str, str]:
        return (self.namespace, self.name)

    @property
    def adapter_root(self) -> PurePosixPath:
        """The pod's `--adapter-root`: its namespace's folder on the volume."""
        return self.volume_root / self.namespace

    @property
    def reachable(self) -> bool:
        return self.ready and self.ip is not None and not self.deleting

    def url(self, path: str) -> str:
        return f"http://{self.ip}:{self.port}{path}"


def pod_info(body: Mapping[str, Any]) -> PodInfo:
    meta = body.get("metadata") or {}
    status = body.get("status") or {}
    annotations = meta.get("annotations") or {}
    conditions = status.get("conditions") or ()
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
    restarts = sum(int(c.get("restartCount") or 0) for c in status.get("containerStatuses") or ())
    try:
        port = int(annotations.get(PORT_ANNOTATION, DEFAULT_PORT))
    except ValueError:
        port = DEFAULT_PORT
    return PodInfo(
        namespace=str(meta.get("namespace", "")),
        name=str(meta.get("name", "")),
        uid=str(meta.get("uid", "")),
        ip=status.get("podIP") or None,
        ready=ready,
        restarts=restarts,
        port=port,
        volume_root=PurePosixPath(
            annotations.get(ADAPTER_ROOT_ANNOTATION, DEFAULT_POD_VOLUME_ROOT)
        ),
        deleting=meta.get("deletionTimestamp") is not None,
        labels=tuple(sorted((meta.get("labels") or {}).items())),
        service_account=str((body.get("spec") or {}).get("serviceAccountName") or "default"),
        containers=containers_of(body.get("spec") or {}),
        owner=next(
            (
                (str(o.get("kind", "")), str(o.get("name", "")), str(o.get("uid", "")))
                for o in meta.get("ownerReferences") or ()
                if isinstance(o, Mapping) and o.get("controller")
            ),
            None,
        ),
    )


@dataclass(frozen=True)
class StagedRef:
    """The revision `status.staged` records: what pods should load."""

    sha256: str
    size: int


@dataclass(frozen=True)
class SourceSpec:
    """`spec.source`: what to stage."""

    uri: str
    revision: str | None = None
    sha256: str | None = None
    secret: str | None = None  # the name of the Secret with credentials (source.secretRef)


@dataclass(frozen=True)
class ComposeMember:
    """One entry of `spec.compose`: another LoRAAdapter of the namespace, at a scale, varied per
    block group by `blocks` (empty: the scale on every layer)."""

    name: str
    scale: float = 1.0
    blocks: stacks.Blocks = ()


@dataclass(frozen=True)
class AutoscaleSpec:
    """`spec.autoscale`: the range the operator chooses `replicas` from, by request rate."""

    min_replicas: int
    max_replicas: int
    target_rps: float = 0.5
    scale_down_delay_s: float = 120.0


@dataclass(frozen=True)
class Command:
    """The rollout annotation's value (`promote`, `abort`), on the object's version it was read
    from: removing it from that version only is what makes it act once."""

    action: str
    resource_version: str


@dataclass(frozen=True)
class AdapterInfo:
    namespace: str
    name: str
    uid: str
    generation: int
    base_model: str
    selector: targeting.Selector
    scale: float
    pinned: bool
    deleting: bool
    staged: StagedRef | None  # from status: what the operator published last
    source: SourceSpec = SourceSpec("")
    replicas: int | None = None  # spec.replicas; None with autoscale, or on every matching pod
    autoscale: AutoscaleSpec | None = None
    created: str = ""  # metadata.creationTimestamp
    # spec.compose: the adapters this one stacks, instead of a source (empty: it has a source).
    compose: tuple[ComposeMember, ...] = ()
    # spec.rollout: a new revision is rolled out in weighted steps (None: it replaces the old
    # one at once); `command` is the rollout annotation's value (promote, abort), if set.
    rollout: Plan | None = None
    command: Command | None = None

    @property
    def placed(self) -> bool:
        """Whether the adapter is on some of its matching pods (a placement decides which),
        rather than on every one of them."""
        return self.replicas is not None or self.autoscale is not None

    @property
    def key(self) -> tuple[str, str]:
        return (self.namespace, self.name)

    @property
    def target(self) -> targeting.Target:
        """What the operator publishes next to the staged adapter for the pods' resolvers."""
        return targeting.Target(base_model=self.base_model, selector=self.selector)

    def targets(self, pod: PodInfo, pod_base_model: str | None) -> bool:
        """Whether this adapter belongs on `pod` (a Ready pod whose base model is known)."""
        return (
            pod.namespace == self.namespace
            and pod_base_model == self.base_model
            and self.selector.matches(pod.label_map)
        )


def adapter_info(body: Mapping[str, Any]) -> AdapterInfo:
    meta = body.get("metadata") or {}
    spec = body.get("spec") or {}
    staged = (body.get("status") or {}).get("staged") or {}
    sha = staged.get("sha256")
    source = spec.get("source") or {}
    replicas = spec.get("replicas")
    auto = spec.get("autoscale")
    return AdapterInfo(
        namespace=str(meta.get("namespace", "")),
        name=str(meta.get("name", "")),
        uid=str(meta.get("uid", "")),
        generation=int(meta.get("generation") or 0),
        base_model=str(spec.get("baseModel", "")),
        selector=targeting.parse_selector(spec.get("selector")),
        scale=float(spec.get("scale", 1.0)),
        pinned=bool(spec.get("pinned", False)),
        deleting=meta.get("deletionTimestamp") is not None,
        staged=StagedRef(sha256=str(sha), size=int(staged.get("sizeBytes") or 0)) if sha else None,
        source=SourceSpec(
            uri=str(source.get("uri", "")),
            revision=source.get("revision"),
            sha256=source.get("sha256"),
            secret=(source.get("secretRef") or {}).get("name") or None,
        ),
        replicas=int(replicas) if replicas is not None else None,
        created=str(meta.get("creationTimestamp") or ""),
        compose=tuple(
            ComposeMember(
                name=str(m.get("name", "")),
                scale=float(m.get("scale", 1.0)),
                # The CRD's schema admits only the groups and numbers in range.
                blocks=stacks.ordered_blocks(m.get("blocks") or {}),
            )
            for m in spec.get("compose") or ()
            if isinstance(m, Mapping)
        ),
        autoscale=AutoscaleSpec(
            min_replicas=int(auto.get("minReplicas", 1)),
            max_replicas=int(auto.get("maxReplicas", 1)),
            target_rps=float(auto.get("targetRequestsPerSecond", 0.5)),
            scale_down_delay_s=float(auto.get("scaleDownDelaySeconds", 120)),
        )
        if isinstance(auto, Mapping)
        else None,
        rollout=parse_plan(spec.get("rollout")),
        command=Command(str(action), str(meta.get("resourceVersion") or ""))
        if (action := (meta.get("annotations") or {}).get(COMMAND_ANNOTATION))
        else None,
    )


def object_ref(info: AdapterInfo) -> dict[str, str]:
    """The involvedObject/regarding reference of an Event about this adapter."""
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": KIND,
        "namespace": info.namespace,
        "name": info.name,
        "uid": info.uid,
    }
