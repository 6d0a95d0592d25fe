"""The pod settings a real cluster needs, on each of the chart's Deployments: more volumes and
their mounts, the RuntimeClass, topology spread, node selection, tolerations, affinity and
resources, each rendered and read back from the object."""

from __future__ import annotations

import json

import pytest

from tests.support.chart import FULLNAME, Obj, container, one, refused, render

COMPONENTS = ["operator", "inference", "router"]


def _pod(helm: str, component: str, *flags: str) -> Obj:
    deployment = one(render(helm, *flags), "Deployment", f"{FULLNAME}-{component}")
    pod: Obj = deployment["spec"]["template"]["spec"]
    return pod


def _json(key: str, value: object) -> tuple[str, str]:
    return "--set-json", f"{key}={json.dumps(value)}"


@pytest.mark.parametrize("component", COMPONENTS)
def test_extra_volumes_and_mounts_are_added_to_the_charts_own(helm: str, component: str) -> None:
    volume = {"name": "ca", "configMap": {"name": "mirror-ca"}}
    mount = {"name": "ca", "mountPath": "/etc/ssl/mirror", "readOnly": True}
    pod = _pod(
        helm,
        component,
        *_json(f"{component}.extraVolumes", [volume]),
        *_json(f"{component}.extraVolumeMounts", [mount]),
    )
    assert pod["volumes"][-1] == volume
    assert {"tmp"} <= {v["name"] for v in pod["volumes"][:-1]}  # the chart's own stay
    mounts = container({"spec": {"template": {"spec": pod}}})["volumeMounts"]
    assert mounts[-1] == mount
    assert "tmp" in {m["name"] for m in mounts[:-1]}
    # None by default.
    plain = _pod(helm, component)
    assert "ca" not in {v["name"] for v in plain["volumes"]}


def test_a_model_on_a_volume_you_add(helm: str) -> None:
    """What inference.model's comment promises: the model from a volume of one's own."""
    pod = _pod(
        helm,
        "inference",
        *_json("inference.extraVolumes", [{"name": "m", "nfs": {"server": "n", "path": "/x"}}]),
        *_json("inference.extraVolumeMounts", [{"name": "m", "mountPath": "/models"}]),
        "--set",
        "inference.model.path=/models/sdxl",
    )
    (c,) = pod["containers"]
    assert {"name": "m", "mountPath": "/models"} in c["volumeMounts"]
    assert "--model=/models/sdxl" in c["args"] or "/models/sdxl" in " ".join(c["args"])


@pytest.mark.parametrize("component", COMPONENTS)
@pytest.mark.parametrize("name", ["tmp", "adapters"])
def test_an_extra_volume_may_not_take_a_charts_volume_name(
    helm: str, component: str, name: str
) -> None:
    stderr = refused(helm, *_json(f"{component}.extraVolumes", [{"name": name}]))
    assert f'{component}.extraVolumes: "{name}" is the name of one of the chart\'s own' in stderr


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("inference.extraVolumeMounts", [{"mountPath": "/a"}], "name"),
        ("operator.extraVolumes", [{"emptyDir": {}}], "name"),
        ("router.topologySpreadConstraints", [{"maxSkew": 1}], "topologyKey"),
    ],
    ids=["mount-without-name", "volume-without-name", "spread-key"],
)
def test_the_schema_refuses_malformed_pod_settings(
    helm: str, key: str, value: object, message: str
) -> None:
    stderr = refused(helm, *_json(key, value))
    assert "values don't meet the specifications of the schema" in stderr
    assert message in stderr


def test_the_inference_runtime_class(helm: str) -> None:
    assert "runtimeClassName" not in _pod(helm, "inference")
    pod = _pod(helm, "inference", "--set", "inference.runtimeClassName=nvidia")
    assert pod["runtimeClassName"] == "nvidia"


@pytest.mark.parametrize("component", COMPONENTS)
def test_topology_spread_selects_the_components_pods_unless_told(helm: str, component: str) -> None:
    assert "topologySpreadConstraints" not in _pod(helm, component)
    zone = {"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone"}
    zone["whenUnsatisfiable"] = "ScheduleAnyway"
    own = {
        **zone,
        "topologyKey": "kubernetes.io/hostname",
        "labelSelector": {"matchLabels": {"a": "b"}},
    }
    pod = _pod(helm, component, *_json(f"{component}.topologySpreadConstraints", [zone, own]))
    first, second = pod["topologySpreadConstraints"]
    assert first == {
        **zone,
        "labelSelector": {
            "matchLabels": {
                "app.kubernetes.io/name": "lora-operator",
                "app.kubernetes.io/instance": "demo",
                "app.kubernetes.io/component": component,
            }
        },
    }
    assert second == own
    # The selector is the Deployment's own: the spread counts exactly its pods.
    deployment = one(render(helm), "Deployment", f"{FULLNAME}-{component}")
    assert first["labelSelector"]["matchLabels"] == deployment["spec"]["selector"]["matchLabels"]


@pytest.mark.parametrize("component", COMPONENTS)
def test_node_selector_tolerations_affinity_and_resources(helm: str, component: str) -> None:
    toleration = {"key": "pool", "operator": "Equal", "value": "lora", "effect": "NoSchedule"}
    affinity = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["lora"]}]}
                ]
            }
        }
    }
    resources = {"requests": {"cpu": "2", "memory": "3Gi"}, "limits": {"memory": "4Gi"}}
    pod = _pod(
        helm,
        component,
        *_json(f"{component}.nodeSelector", {"pool": "lora"}),
        *_json(f"{component}.tolerations", [toleration]),
        *_json(f"{component}.affinity", affinity),
        *_json(f"{component}.resources", resources),
        *("--set", "inference.gpu.enabled=false", "--set", "inference.device=cpu"),
    )
    assert pod["nodeSelector"] == {"pool": "lora"}
    assert pod["tolerations"] == [toleration]
    assert pod["affinity"] == affinity
    (c,) = pod["containers"]
    assert c["resources"] == resources
