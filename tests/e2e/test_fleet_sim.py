"""A small simulated fleet on the local cluster, as `bench/bench_fleet.py --simulate` runs it:
the chart with three pods of `lora-inference serve --simulate h200-sdxl-4step`, the operator
loading 20 LoRAAdapters on them, the router, and a load generator sending a Zipf stream through
round-robin (the pods' Service), least-queued (straight to the pods) and the router, closed and
open loop. It checks that the pieces work together and the bench's figures add up, never how
fast anything is (that is the bench's to say)."""

from __future__ import annotations

import argparse
import contextlib
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from lora_demo import release
from lora_demo.manifests import RELEASE
from lora_devcluster.harness import ApiError, Harness
from lora_router.routing import Reason

from tests.support import bench_module

PODS, ADAPTERS, REQUESTS = 3, 20, 24


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    """The fleet bench's package: its parts are modules of `lora_bench.fleet` (objects, rounds,
    simulated, ...), each an attribute of the package once imported."""
    bench_module("lora_bench.fleet.cli")  # imports every part
    return bench_module("lora_bench.fleet")


@pytest.fixture
def namespace(
    devcluster: Harness, bench: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> Iterator[str]:
    ns = f"fleet-sim-{uuid.uuid4().hex[:6]}"
    # The bench's functions name the namespace through one global, objects.NS; put back after
    # the test.
    monkeypatch.setattr(bench.objects, "NS", ns)
    try:
        yield ns
    finally:
        devcluster.run(["helm", "uninstall", RELEASE, "-n", ns, "--ignore-not-found"], check=False)
        with contextlib.suppress(ApiError):
            devcluster.delete(f"/api/v1/namespaces/{ns}")


def test_a_small_simulated_fleet_runs_every_route(
    devcluster: Harness, bench: ModuleType, namespace: str, tmp_path: Path
) -> None:
    h = devcluster
    args = argparse.Namespace(
        simulate="h200-sdxl-4step",
        pods=PODS,
        adapters=ADAPTERS,
        replicas=None,
        rounds=1,
        requests=REQUESTS,
        settle=6,
        concurrency=2 * PODS,
        zipf=1.1,
        size=1024,
        steps=4,
        max_loras=4,
        max_cpu_loras=8,
        seed=0,
        timeout=600.0,
        streams=["zipf"],
        loops=["closed", "open"],
        load_fraction=0.5,
    )
    pods = bench.rounds.set_up(h, args, tmp_path)
    for pod in pods:  # simulated pods say so
        models: Any = release.call(h, namespace, release.pod_target(pod), "/v1/models")
        assert models["data"][0]["simulated"] == "h200-sdxl-4step"
        assert len(models["data"]) == ADAPTERS + 1
    cells = bench.simulated.measure_sim(h, pods, args)
    assert [(c.stream, c.loop) for c in cells] == [("zipf", "closed"), ("zipf", "open")]
    for cell in cells:
        assert set(cell.tallies) == {"round-robin", "least-queued", "router"}
        for label, tally in cell.tallies.items():
            # Every request answered (or refused with a full queue, open loop), one lookup each.
            assert tally.requests + cell.rejected[label] == REQUESTS, label
            assert round(tally.lookups) == tally.requests == tally.served, label
            assert 0 <= tally.hit_rate <= 1
            # The machine did something during the round, and no more than all of it.
            assert 0 < tally.host_busy_s <= tally.host_s, label
            # Every round was long enough to have a steady window (the load generator sent
            # its answers' times), so the throughput is the steady state's.
            assert tally.steady_s > 0, label
        # The router says why it chose each pod; the other routes pass no router.
        assert set(cell.tallies["router"].routes) <= {r.value for r in Reason}
        assert set(cell.tallies["round-robin"].routes) == {"none"}
        assert set(cell.tallies["least-queued"].routes) == {"none"}
    line = bench.simulated.sim_summary(cells)
    assert line.startswith("fleet-sim: throughput router/round-robin 4step = ")
    # The no-miss bound is the profile's: 3 pods, one image per 0.345 s x 1.01.
    assert cells[0].bound == pytest.approx(PODS / (0.345 * 1.01), rel=1e-3)
