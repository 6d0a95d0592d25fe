"""The router hop bench's own arithmetic (bench/bench_router_hop.py): a profile's time split by
where its functions live."""

from __future__ import annotations

import cProfile
from pathlib import Path

from lora_router import http1

from tests.support import bench_module

HEAD = b"POST /v1/images/generations HTTP/1.1\r\nHost: h\r\nContent-Length: 2"


def test_a_profile_is_split_by_where_its_functions_live(tmp_path: Path) -> None:
    bench = bench_module("bench_router_hop")
    profiler = cProfile.Profile()
    profiler.runcall(lambda: [http1.parse_request(HEAD) for _ in range(2000)])
    path = tmp_path / "hop.prof"
    profiler.dump_stats(path)
    parts = bench.profile_parts(path)
    assert list(parts) == [name for name, _ in bench.PARTS]
    own = parts["the router's HTTP/1.1 reading and writing (`http1`)"]
    assert own > 0 and own >= 0.3 * sum(parts.values())
    assert parts["aiohttp's server on the client side"] == 0
