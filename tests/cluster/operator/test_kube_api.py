"""The operator's own API calls against the real kube-apiserver (the calls kopf does not make
for it)."""

from __future__ import annotations

from typing import Any

from lora_devcluster.harness import Harness
from lora_operator.edges import kube
from lora_runtime import login


def adapter(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "lora.dev/v1alpha1",
        "kind": "LoRAAdapter",
        "metadata": {"name": name},
        "spec": {"baseModel": "sd15", "source": {"uri": "hf://acme/pixel-art"}},
    }


async def test_every_adapter_is_listed_a_page_at_a_time(
    crd: Harness, devcluster_namespace: str
) -> None:
    """What a starting operator waits for: every LoRAAdapter, of one namespace or of all,
    read through the API's continue tokens (pages of 2 here, of 500 in the operator)."""
    ns = devcluster_namespace
    names = [f"a{i}" for i in range(5)]
    for name in names:
        crd.create(f"/apis/lora.dev/v1alpha1/namespaces/{ns}/loraadapters", adapter(name))
    credentials = login.from_kubeconfig(crd.cluster.env()["KUBECONFIG"])
    assert credentials is not None
    api = kube.KubeApi(credentials)
    try:
        assert sorted(await api.list_adapters(ns, page_size=2)) == [(ns, n) for n in names]
        everywhere = await api.list_adapters(None, page_size=2)
        assert {(ns, n) for n in names} <= set(everywhere)
        assert len(everywhere) == len(set(everywhere))  # no page read twice
    finally:
        await api.close()
