"""The fleet bench's own arithmetic (bench/bench_fleet.py; lora_bench.fleet.figures): what it counts
as a round's steady state, and the machine's CPU share over a round."""

from __future__ import annotations

from collections import namedtuple
from types import ModuleType
from typing import Any

import pytest

from tests.support import bench_module


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return bench_module("lora_bench.fleet.figures")


def closed_loop_round(pods: int, in_flight: int, requests: int, call_s: float) -> dict[str, Any]:
    """A closed loop on `pods` pods that each run one call at a time, `in_flight` requests
    spread evenly: each answer sends the next request to the pod that answered."""
    queues = [[0.0] * (in_flight // pods) for _ in range(pods)]  # per pod: the sent times
    free_at = [0.0] * pods
    sent = [0.0] * in_flight
    done: list[float] = []
    while len(done) < requests:
        pod = min(range(pods), key=lambda p: free_at[p] if queues[p] else float("inf"))
        queues[pod].pop(0)
        free_at[pod] += call_s
        done.append(free_at[pod])
        if len(sent) < requests:
            sent.append(free_at[pod])
            queues[pod].append(free_at[pod])
    return {"done": done, "last_sent": max(sent), "requests": requests, "wall": max(done)}


@pytest.mark.parametrize("requests", [200, 190, 137])
def test_a_rounds_steady_rate_leaves_out_its_fill_and_its_drain(
    bench: ModuleType, requests: int
) -> None:
    # 16 pods at 0.5 s a call, 2 requests each in flight: 32 images/s while the load is on. The
    # pods started together answer in waves of 16; wherever the round's last request falls in a
    # wave, the rate is the pods'.
    result = closed_loop_round(pods=16, in_flight=32, requests=requests, call_s=0.5)
    steady = bench.steady_window(result["done"], result["last_sent"])
    assert steady is not None
    rate, seconds = steady
    assert rate == pytest.approx(32.0, rel=0.03)
    assert seconds == pytest.approx(result["last_sent"] - 0.5)
    assert bench.steady_rate(result) == rate


def test_the_steady_rates_of_rounds_are_weighted_by_their_windows(bench: ModuleType) -> None:
    tally = bench.Tally("router")
    for call_s, requests in ((0.5, 200), (1.0, 200)):  # 32 and 16 images/s
        result = closed_loop_round(pods=16, in_flight=32, requests=requests, call_s=call_s)
        tally.add_answers({**result, "latencies": result["done"], "routes": {}})
    # The slower round's window is twice as long: (32 x 1 + 16 x 2) / 3.
    assert tally.steady_throughput == pytest.approx(64 / 3, rel=0.03)


def test_a_round_too_short_for_a_steady_window_is_rated_whole(bench: ModuleType) -> None:
    # Every request sent at once: the last one goes before any answer.
    result = {"done": [0.5, 0.5, 1.0], "last_sent": 0.0, "requests": 3, "wall": 1.0}
    assert bench.steady_window(result["done"], result["last_sent"]) is None
    assert bench.steady_rate(result) == pytest.approx(3.0)
    assert bench.steady_window([], 1.0) is None


def test_the_machines_cpu_share_leaves_out_idle_and_counts_guest_time_once(
    bench: ModuleType,
) -> None:
    times = namedtuple("times", "user nice system idle iowait irq softirq steal guest guest_nice")
    before = times(10, 0, 5, 100, 1, 0, 0, 0, 2, 0)
    after = times(13, 0, 6, 105, 2, 0, 0, 0, 3, 0)  # 4 s busy (1 s of it guest, in user), 6 idle
    tally = bench.Tally("router")
    tally.add_host(before, after)
    assert (tally.host_busy_s, tally.host_s) == (4, 10)
