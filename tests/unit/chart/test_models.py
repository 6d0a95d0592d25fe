"""Several base models in one release (`inference.models`) and autoscaling: each model's
Deployment, Service, PodDisruptionBudget, NetworkPolicy and HPA, the router's entry per model,
the operator's trust in each model's Deployment, and the replica count left to an autoscaler;
a single-model release renders what it always did."""

from __future__ import annotations

import json

import pytest

from tests.support.chart import (
    FULLNAME,
    Obj,
    container,
    of_kind,
    one,
    operator_args,
    refused,
    render,
)

INFERENCE = f"{FULLNAME}-inference"
SDXL, SD15 = f"{INFERENCE}-sdxl-base", f"{INFERENCE}-sd15"
TWO_MODELS = [
    {
        "name": "sdxl-base",
        "model": {"path": "/models/sdxl"},
        "autoscaling": {
            "enabled": True,
            "maxReplicas": 3,
            "behavior": {"scaleDown": {"stabilizationWindowSeconds": 30}},
        },
    },
    {
        "name": "sd15",
        "model": {"path": "/models/sd15"},
        "replicas": 2,
        "gpu": {"count": 2},
        "maxLoras": 8,
        "nodeSelector": {"gpu": "l4"},
        "resources": {"limits": {"memory": "8Gi"}},
    },
]


def _models(helm: str, models: object) -> list[Obj]:
    return render(helm, "--set-json", f"inference.models={json.dumps(models)}")


def _arg(c: Obj, flag: str) -> str:
    (value,) = [str(a).split("=", 1)[1] for a in c["args"] if str(a).startswith(f"{flag}=")]
    return value


def test_each_model_has_its_deployment_with_its_settings_over_the_shared_ones(helm: str) -> None:
    docs = _models(helm, TWO_MODELS)
    deployments = {d["metadata"]["name"] for d in of_kind(docs, "Deployment")}
    assert {SDXL, SD15} <= deployments and INFERENCE not in deployments
    sdxl, sd15 = one(docs, "Deployment", SDXL), one(docs, "Deployment", SD15)
    for deployment, name in ((sdxl, "sdxl-base"), (sd15, "sd15")):
        labels = deployment["spec"]["selector"]["matchLabels"]
        assert labels["lora.dev/model"] == name
        assert deployment["spec"]["template"]["metadata"]["labels"]["lora.dev/model"] == name
        assert _arg(container(deployment), "--served-model-name") == name
    # sd15's own keys; what it leaves out comes from inference (a map key by key).
    c = container(sd15)
    assert _arg(c, "--model") == "/models/sd15" and _arg(c, "--max-loras") == "8"
    assert _arg(container(sdxl), "--max-loras") == "4"
    assert c["resources"]["limits"] == {"memory": "8Gi", "nvidia.com/gpu": 2}
    assert container(sdxl)["resources"]["limits"] == {"nvidia.com/gpu": 1}
    assert sd15["spec"]["template"]["spec"]["nodeSelector"] == {"gpu": "l4"}
    assert "nodeSelector" not in sdxl["spec"]["template"]["spec"]
    assert sd15["spec"]["replicas"] == 2
    assert "replicas" not in sdxl["spec"], "the HPA owns sdxl-base's count"


def test_each_model_has_its_service_disruption_budget_and_network_policy(helm: str) -> None:
    docs = _models(helm, TWO_MODELS)
    for name, model in ((SDXL, "sdxl-base"), (SD15, "sd15")):
        service = one(docs, "Service", name)
        assert service["spec"]["selector"]["lora.dev/model"] == model
        pdb = one(docs, "PodDisruptionBudget", name)
        assert pdb["spec"]["selector"]["matchLabels"]["lora.dev/model"] == model
        assert pdb["spec"]["maxUnavailable"] == 1
        policy = one(docs, "NetworkPolicy", name)
        assert policy["spec"]["podSelector"]["matchLabels"]["lora.dev/model"] == model
    # Clients still call one Service: the router's, which routes by model.
    front = one(docs, "Service", INFERENCE)
    assert front["spec"]["selector"]["app.kubernetes.io/component"] == "router"


def test_the_router_knows_each_models_pods_by_their_service(helm: str) -> None:
    router = container(one(_models(helm, TWO_MODELS), "Deployment", f"{FULLNAME}-router"))
    services = [a for a in router["args"] if a.startswith("--service=")]
    assert services == [f"--service=sdxl-base={SDXL}", f"--service=sd15={SD15}"]


def test_the_operator_trusts_each_models_deployment(helm: str) -> None:
    args = operator_args(_models(helm, TWO_MODELS))
    workloads = [a for a in args if a.startswith("--inference-workload=")]
    assert workloads == [f"--inference-workload={SDXL}", f"--inference-workload={SD15}"]


def test_an_autoscaled_model_has_an_hpa_on_its_pods_queue(helm: str) -> None:
    docs = _models(helm, TWO_MODELS)
    (hpa,) = of_kind(docs, "HorizontalPodAutoscaler")
    assert hpa["metadata"]["name"] == SDXL
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": SDXL,
    }
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (1, 3)
    assert hpa["spec"]["metrics"] == [
        {
            "type": "Pods",
            "pods": {
                "metric": {"name": "vllm_num_requests_waiting"},
                "target": {"type": "AverageValue", "averageValue": "2"},
            },
        }
    ]
    assert hpa["spec"]["behavior"] == {"scaleDown": {"stabilizationWindowSeconds": 30}}


def test_a_single_model_release_keeps_its_names_and_selector(helm: str) -> None:
    docs = render(helm)
    deployment = one(docs, "Deployment", INFERENCE)
    assert "lora.dev/model" not in deployment["spec"]["selector"]["matchLabels"]
    assert deployment["spec"]["replicas"] == 1
    assert not of_kind(docs, "HorizontalPodAutoscaler")
    router = container(one(docs, "Deployment", f"{FULLNAME}-router"))
    assert f"--service={FULLNAME}-inference-pods" in router["args"]
    for kind in ("PodDisruptionBudget", "NetworkPolicy"):
        assert one(docs, kind, INFERENCE)


@pytest.mark.parametrize(
    ("flags", "count"),
    [
        (["--set", "inference.autoscaling.enabled=true"], None),
        (["--set", "inference.replicas=null"], None),
        (["--set", "inference.replicas=0"], 0),
    ],
    ids=["autoscaled", "left-to-an-autoscaler", "zero"],
)
def test_the_replica_count_is_left_out_when_something_else_owns_it(
    helm: str, flags: list[str], count: int | None
) -> None:
    docs = render(helm, *flags)
    spec = one(docs, "Deployment", INFERENCE)["spec"]
    assert spec.get("replicas") == count
    assert ("replicas" in spec) == (count is not None)


@pytest.mark.parametrize(
    ("models", "reason"),
    [
        ([{"name": "SDXL"}], "'/inference/models/0/name': 'SDXL' does not match pattern"),
        ([{"name": "a"}, {"name": "a"}], '"a" is listed twice'),
        (
            [{"name": "a", "clientToken": {"existingSecret": "t"}}],
            "'/inference/models/0': additional properties 'clientToken' not allowed",
        ),
        ([{"model": {"path": "/models/a"}}], "'/inference/models/0': missing property 'name'"),
        ([{"name": "a" * 60}], "longer than the 63 characters"),
        (
            [{"name": "a", "model": {"existingClaim": "m", "path": "/data/a"}}],
            "inference.models[a].model.path must be under /models/",
        ),
        (
            [{"name": "a", "autoscaling": {"enabled": True, "minReplicas": 5, "maxReplicas": 2}}],
            "inference.models[a].autoscaling.minReplicas (5) is above",
        ),
    ],
    ids=[
        "upper-case",
        "twice",
        "shared-key",
        "no-name",
        "too-long",
        "claim-path",
        "min-above-max",
    ],
)
def test_models_that_cannot_be_rendered_are_refused_with_what_to_change(
    helm: str, models: object, reason: str
) -> None:
    message = refused(helm, "--set-json", f"inference.models={json.dumps(models)}")
    assert reason in message
