"""The operator scale bench's own arithmetic (bench/bench_operator.py --simulate;
lora_bench.operator.scaleplan): how adapters and pods are spread over the namespaces, the Zipf
head that autoscales, the calls per pod read from the operator's log, and the report's last
line."""

from __future__ import annotations

from collections import Counter
from types import ModuleType

import pytest

from tests.support import bench_module


@pytest.fixture(scope="module")
def plan() -> ModuleType:
    return bench_module("lora_bench.operator.scaleplan")


@pytest.mark.parametrize(("k", "n", "ns"), [(200, 6, 3), (1000, 10, 5), (10_000, 50, 25)])
def test_every_namespace_has_pods_enough_for_its_replicas(
    plan: ModuleType, k: int, n: int, ns: int
) -> None:
    layout = plan.Layout(k, n, ns)
    assert sum(layout.pods_in(i) for i in range(ns)) == n
    assert min(layout.pods_in(i) for i in range(ns)) >= plan.REPLICAS
    adapters = layout.adapters()
    assert len({(a, b) for a, b, _ in adapters}) == k
    per_ns = Counter(a for a, _, _ in adapters)
    assert set(per_ns) == set(layout.names())
    assert max(per_ns.values()) - min(per_ns.values()) <= 1


def test_more_namespaces_than_pods_can_serve_is_refused_with_the_reason(plan: ModuleType) -> None:
    with pytest.raises(ValueError, match="at most 25 namespaces"):
        plan.Layout(10_000, 50, 100)


def test_the_zipf_head_asks_for_half_the_requests(plan: ModuleType) -> None:
    for k in (200, 1000, 10_000):
        hot = plan.autoscaled(k)
        weights = [1 / (r + 1) for r in range(k)]
        assert sum(weights[:hot]) >= 0.5 * sum(weights) > sum(weights[: hot - 1])
    assert plan.autoscaled(10_000) < plan.autoscaled(1000) * 10  # a head, not a share of K


def test_documents_have_replicas_or_autoscale(plan: ModuleType) -> None:
    doc = plan.adapter_doc("team-000", "a-00001", "/v/a.safetensors", "m", autoscale=False)
    assert doc["metadata"] == {"name": "a-00001", "namespace": "team-000"}
    assert doc["spec"]["replicas"] == plan.REPLICAS and "autoscale" not in doc["spec"]
    doc = plan.adapter_doc("team-000", "a-00000", "/v/a.safetensors", "m", autoscale=True)
    assert doc["spec"]["autoscale"]["minReplicas"] == plan.REPLICAS
    assert "replicas" not in doc["spec"]


def test_calls_per_pod_are_read_from_the_operator_s_action_lines(plan: ModuleType) -> None:
    lines = [
        "action=load pod=team-000/inference-a adapter=a-00001 revision=ab result=ok seconds=0.1",
        "action=load-inplace pod=team-000/inference-a adapter=a-00001 revision=cd result=ok "
        "seconds=0.1",
        "action=load pod=team-001/inference-b adapter=a-00002 revision=ab result=transient "
        "message='x'",
        "action=unload pod=team-001/inference-b adapter=a-00002 result=ok",
        "action=phase adapter=team-000/a-00001 phase=Ready reason=Ready",
    ]
    calls = plan.calls_per_pod(lines)
    assert calls["load"] == Counter({"team-000/inference-a": 2})
    assert calls["unload"] == Counter({"team-001/inference-b": 1})


def test_the_last_line_has_the_issue_s_shape(plan: ModuleType) -> None:
    layout = plan.Layout(10_000, 50, 25)
    phases = [plan.Phase(name) for name in plan.PHASES]
    run = plan.Run(layout=layout, phases=phases, apply_s=200.0, bare_s=100.0)
    apply, restart = run.phase("apply"), run.phase("restart")
    apply.wall_s, apply.writes, apply.peak_rss_mib, apply.cpu_s = 412.4, 36_100, 240.2, 80.0
    apply.loads = Counter({f"p{i}": 400 for i in range(50)})
    restart.loads = Counter()
    line = plan.last_line(run)
    assert line == (
        "operator-scale: K=10000 N=50 ready s = 412, writes/adapter = 3.61, rss MiB = 240, "
        "restart loads = 0"
    )
    assert plan.ready_over_bare(run) == pytest.approx((412.4 - 200.0) / 100.0)
    assert plan.cpu_per_load_ms(run) == pytest.approx(80_000 / 20_000)
    assert len(plan.growth_table([run])) == 2
    table = plan.phase_table(run)
    assert table[0] == "K=10000 N=50 NS=25"
    # The rows printed as each phase ends are the table's rows.
    assert table[2:] == [plan.phase_row(run, p) for p in phases]
    assert table[2].startswith("apply") and "3.61" in table[2], table[2]


def test_the_machine_s_cpu_is_printed_by_kind_of_process(plan: ModuleType) -> None:
    phases = [plan.Phase(name) for name in plan.PHASES]
    run = plan.Run(layout=plan.Layout(1000, 10, 5), phases=phases)
    run.apply_cpu_by = {"operator": 134.5, "kube-apiserver": 80.25}
    assert plan.cpu_lines([run]) == ["K=1000 N=10: operator 134.5, kube-apiserver 80.2"]
