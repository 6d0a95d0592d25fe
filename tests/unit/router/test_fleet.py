"""What the router reads: EndpointSlices, LoRAAdapters, residency reports (pure parsing)."""

from __future__ import annotations

from typing import Any

import pytest
from lora_router.fleet import (
    AdapterPlacement,
    Endpoint,
    Fleet,
    Report,
    Split,
    estimated_load,
    parse_adapter,
    parse_endpoint_slice,
    parse_report,
    parse_split,
)
from lora_router.routing import Residency


def endpoint(name: str, ip: str, **conditions: bool) -> dict[str, Any]:
    return {
        "addresses": [ip],
        "conditions": conditions,
        "targetRef": {"kind": "Pod", "name": name, "namespace": "ns"},
    }


def test_endpoint_slices_give_pods_their_readiness_and_named_port() -> None:
    obj = {
        "ports": [{"name": "metrics", "port": 9090}, {"name": "http", "port": 8000}],
        "endpoints": [
            endpoint("a", "10.0.0.1", ready=True),
            endpoint("b", "10.0.0.2", ready=False),
            endpoint("c", "10.0.0.3"),  # ready unset: ready (the API's rule)
            endpoint("d", "10.0.0.4", ready=True, terminating=True),
            endpoint("e", "fd00::5", ready=True),
            {"addresses": ["10.0.0.6"], "targetRef": {"kind": "Node", "name": "n"}},
            {"addresses": [], "targetRef": {"kind": "Pod", "name": "f"}},
        ],
    }
    assert parse_endpoint_slice(obj, "http") == [
        Endpoint("a", "10.0.0.1:8000", True),
        Endpoint("b", "10.0.0.2:8000", False),
        Endpoint("c", "10.0.0.3:8000", True),
        Endpoint("d", "10.0.0.4:8000", False),
        Endpoint("e", "[fd00::5]:8000", True),
    ]


@pytest.mark.parametrize(
    ("ports", "expected"),
    [
        ([{"port": 8000}], ["10.0.0.1:8000"]),  # a single unnamed port is the port
        ([{"name": "other", "port": 1}, {"name": "x", "port": 2}], []),
        ([], []),
        (None, []),
    ],
    ids=["only-port", "no-such-name", "no-ports", "null-ports"],
)
def test_endpoint_slice_ports(ports: Any, expected: list[str]) -> None:
    obj = {"ports": ports, "endpoints": [endpoint("a", "10.0.0.1", ready=True)]}
    assert [e.address for e in parse_endpoint_slice(obj, "http")] == expected


@pytest.mark.parametrize(
    ("spec", "status", "pods"),
    [
        ({}, {}, None),
        ({}, {"placedPods": ["a"]}, None),  # no replicas: on every pod, whatever the status
        ({"replicas": 2}, {"placedPods": ["a", "b"]}, frozenset({"a", "b"})),
        ({"replicas": 2}, {}, frozenset()),  # not placed yet
        ({"autoscale": {"minReplicas": 1, "maxReplicas": 3}}, {"placedPods": ["c"]}, {"c"}),
    ],
    ids=["every-pod", "every-pod-status", "replicas", "not-yet-placed", "autoscale"],
)
def test_adapter_placement(spec: Any, status: Any, pods: Any) -> None:
    obj = {"metadata": {"name": "x"}, "spec": spec, "status": status}
    assert parse_adapter(obj) == AdapterPlacement("x", pods)


def test_reports_read_tiers_slots_queue_and_model() -> None:
    payload = {
        "object": "list",
        "model": "tiny",
        "max_loras": 2,
        "num_requests_waiting": 3,
        "num_requests_running": 1,
        "data": [{"id": "a", "tier": "gpu"}, {"id": "b", "tier": "cpu"}, {"id": "c"}],
    }
    report = parse_report(payload, at=5.0)
    residency = Residency(frozenset("a"), frozenset("b"), True, disk=frozenset("c"))
    assert report == Report(residency, 4, "tiny", 5.0, slots=2, polled=4)
    # A server that says nothing of slots or queue: no free slot known, queue unknown.
    old = parse_report({"data": [{"id": "a", "tier": "gpu"}]}, at=1.0)
    assert old.residency.free_slot is False and old.queue is None and old.base_model is None
    assert old.slots is None
    # The residency view says the same in names by tier, and keeps the answer's version.
    compact = {k: v for k, v in payload.items() if k not in ("object", "data")}
    view = {"object": "residency", "gpu": ["a"], "cpu": ["b"], "disk": ["c"], **compact}
    assert parse_report(view, at=5.0, etag='"v1"') == Report(
        residency, 4, "tiny", 5.0, slots=2, etag='"v1"', polled=4
    )
    with pytest.raises(ValueError, match="cpu names"):
        parse_report({**view, "cpu": "b"}, at=5.0)


def test_the_working_set_is_the_distinct_adapters_of_the_recent_requests() -> None:
    fleet = Fleet(window=4)
    for adapter in "aab":
        fleet.note_request(adapter)
    assert fleet.working_set() is None  # fewer requests than the window: not known yet
    for adapter in "cd":
        fleet.note_request(adapter)
    assert fleet.working_set() == 4  # the first "a" left the window, the second is in it
    fleet.note_request("d")
    assert fleet.working_set() == 3 and list(fleet.recent) == list("bcdd")


def test_the_fewest_slots_of_the_pods_reporting_now() -> None:
    fleet = Fleet(stale_after_s=5.0)
    assert fleet.fewest_slots(10.0) is None
    base: dict[str, Any] = {"data": []}
    fleet.reports["a"] = parse_report({**base, "max_loras": 4}, at=9.0)
    fleet.reports["b"] = parse_report({**base, "max_loras": 2}, at=1.0)  # stale at 10
    fleet.reports["c"] = parse_report(base, at=9.0)  # says nothing
    assert fleet.fewest_slots(10.0) == 4
    assert fleet.fewest_slots(6.0) == 2


@pytest.mark.parametrize(
    "payload", [[], {"data": None}, {"data": [{"tier": "gpu"}]}, {"data": ["a"]}], ids=str
)
def test_bad_reports_are_refused(payload: Any) -> None:
    with pytest.raises(ValueError):
        parse_report(payload, at=0.0)


def test_backends_are_ready_pods_with_fresh_reports_and_the_larger_load() -> None:
    fleet = Fleet(stale_after_s=5)
    fleet.slices = {
        "s1": [Endpoint("a", "1:1", True), Endpoint("b", "2:1", False)],
        # During a move a pod can appear in two slices; a ready entry wins.
        "s2": [Endpoint("b", "2:1", True), Endpoint("c", "3:1", True)],
    }
    residency = Residency(frozenset("x"), frozenset(), False)
    fleet.inflight = {"a": 1}
    fleet.take("a", Report(residency, 1, None, 10.0))  # the router's own request, alone there
    fleet.take("c", Report(residency, 7, None, 1.0))
    fleet.inflight = {"a": 3}
    backends = {b.name: b for b in fleet.backends(now=12.0)}
    assert set(backends) == {"a", "b", "c"}
    assert backends["a"].load == 3 and backends["a"].residency == residency
    assert backends["c"].residency is None and backends["c"].load == 0  # stale: ignored
    fleet.forget_reports(["a"])
    assert set(fleet.reports) == {"a"}


def test_a_pods_load_adds_what_other_routers_sent_there_to_the_routers_own() -> None:
    """Two router replicas share the pods: each knows its own requests at once, the other's
    only from the pod's queue at the last poll."""
    fleet = Fleet(stale_after_s=5)
    fleet.slices = {"s": [Endpoint("a", "1:1", True)]}
    residency = Residency(frozenset(), frozenset(), True)
    fleet.inflight = {"a": 1}
    fleet.take("a", Report(residency, 3, None, 10.0))  # 1 of ours, 2 of the other replica's
    fleet.inflight = {"a": 2}  # ours grew since; theirs are taken as unchanged
    assert [b.load for b in fleet.backends(now=11.0)] == [4]
    fleet.inflight = {"a": 0}
    assert [b.load for b in fleet.backends(now=11.0)] == [2]
    assert [b.load for b in fleet.backends(now=16.0)] == [0]  # stale: ours alone


def test_an_answers_queue_replaces_the_polled_one_until_the_next_poll() -> None:
    """Each pod answer counts its queue (`x-lora-queue`) as it leaves: the other replicas'
    requests are then known as of that answer, not as of the last poll."""
    fleet = Fleet(stale_after_s=5)
    fleet.slices = {"s": [Endpoint("a", "1:1", True)]}
    residency = Residency(frozenset(), frozenset(), True)
    fleet.inflight = {"a": 1}
    fleet.take("a", Report(residency, 1, None, 10.0, polled=1))  # only ours there
    fleet.inflight = {"a": 2}
    assert [b.load for b in fleet.backends(now=11.0)] == [2]
    # One of ours is answered while the pod holds 4: 1 more of ours, 3 of another replica's.
    fleet.take_queue("a", 4)
    assert fleet.reports["a"].queue == 4 and fleet.reports["a"].mine == 1
    fleet.inflight = {"a": 1}  # the answered one is no longer in flight
    assert [b.load for b in fleet.backends(now=11.0)] == [4]
    assert fleet.reports["a"].at == 10.0  # residency as old as it was
    # A 304 confirms the poll's version: the queue it read is the pod's again.
    fleet.take("a", fleet.reports["a"].unchanged(12.0))
    assert fleet.reports["a"].queue == 1 and fleet.reports["a"].at == 12.0
    assert [b.load for b in fleet.backends(now=12.0)] == [1]


def test_an_answer_for_a_pod_without_a_report_changes_nothing() -> None:
    fleet = Fleet()
    fleet.inflight = {"a": 1}
    fleet.take_queue("a", 3)
    assert fleet.reports == {}


@pytest.mark.parametrize(
    ("own", "queue", "mine_then", "load"),
    [
        (2, None, 0, 2),  # the pod does not report a queue
        (2, 3, 1, 4),
        (0, 3, 3, 0),  # everything the pod had was ours, and has been answered
        (1, 0, 4, 1),  # ours were answered before the pod was read
    ],
)
def test_estimated_load(own: int, queue: int | None, mine_then: int, load: int) -> None:
    assert estimated_load(own, queue, mine_then) == load


def test_a_rollout_in_the_status_the_operator_writes_is_a_split() -> None:
    from lora_operator.rules import rollout

    canary, stable = "c" * 64, "5" * 64
    plan = rollout.Plan((rollout.Step(20),))
    r = rollout.Rollout(stable, canary, rollout.State.PROGRESSING, 0, 1.0)
    status = {"rollout": rollout.render(r, plan, "x", stable_ready=1, canary_ready=1, pods=1)}
    placement = parse_adapter({"metadata": {"name": "x"}, "spec": {}, "status": status})
    assert placement.split == Split(
        alias=rollout.alias("x", canary), weight=20, canary=canary, stable=stable
    )
    assert parse_split({"canary": {"weight": "lots"}, "stable": {}}) is None


def test_each_slice_s_pods_serve_its_service_s_models() -> None:
    obj = {
        "ports": [{"name": "http", "port": 8000}],
        "endpoints": [{"addresses": ["10.0.0.1"], "targetRef": {"kind": "Pod", "name": "a"}}],
    }
    (listed,) = parse_endpoint_slice(obj, "http", frozenset({"sdxl-base", "sdxl"}))
    assert listed.serves("sdxl") and listed.serves(None) and not listed.serves("sd15")
    (unsaid,) = parse_endpoint_slice(obj, "http")
    assert unsaid.serves("sd15"), "a Service listed without models: its pods take any request"
    fleet = Fleet(slices={"s": [listed], "t": [Endpoint("b", "10.0.0.2:8000", True)]})
    assert [b.name for b in fleet.backends(0.0, "sd15")] == ["b"]
    assert [b.name for b in fleet.backends(0.0, "sdxl-base")] == ["a", "b"]
    assert fleet.base_models() == {"sdxl-base", "sdxl"}


def test_an_adapter_s_base_model_is_its_spec_s() -> None:
    placed = parse_adapter({"metadata": {"name": "x"}, "spec": {"baseModel": "sd15"}})
    assert placed.base_model == "sd15"
    assert parse_adapter({"metadata": {"name": "x"}, "spec": {}}).base_model is None
