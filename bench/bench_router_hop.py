"""The router's own cost per request: its CPU time per generation it forwards, this tree's router
against an earlier one's, side by side, on the same fake pods and the same requests.

Each router runs as a process of its own (`python -c RUNNER`, with PYTHONPATH pointing at the
router package of this tree or of `--baseline`, a git revision exported to a temporary
directory), in front of N fake pods served by this process: each answers `GET /v1/adapters`
with K adapters (a few in its GPU tier, more in its CPU tier, the rest on disk) and a
generation with a JSON answer of `--answer-bytes` (a small image's base64), at once. Clients in
this process send `--requests` generations for a Zipf(1.1) stream over the K adapters with
`--concurrency` in flight, a new connection per request (as clients behind a Service do). The
router process's CPU time (user + system, from /proc) over the requests, divided by their
number, is its cost per request; it includes its residency polls (each pod read every second)
at the rate the run sends, and the idle polling alone is reported too. The routers take turns,
`--rounds` times each, and the medians are printed.

    .venv/bin/python bench/bench_router_hop.py --baseline 5434a07
    .venv/bin/python bench/bench_router_hop.py --pods 16 --adapters 1000

The last line reads
    router hop: CPU ms per request before = X.XX, after = Y.YY, after/before = Z.ZZ
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import platform
import pstats
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
from aiohttp import ClientSession, ClientTimeout, TCPConnector, web

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_inference import zipf_stream  # noqa: E402

# A router on a fixed fleet: the pods given on the command line, every adapter without
# spec.replicas (on every pod), its residency polled as in a cluster.
RUNNER = """
import asyncio, json, logging, os, signal, sys
from lora_router.__main__ import serve
try:  # the event loop `python -m lora_router` runs on, where the tree chooses one
    from lora_router.__main__ import new_event_loop
except ImportError:
    new_event_loop = asyncio.new_event_loop
from lora_router.config import RouterConfig
from lora_router.fleet import AdapterPlacement, Endpoint

port, metrics_port = int(sys.argv[1]), int(sys.argv[2])
pods, adapters = json.loads(sys.argv[3]), json.loads(sys.argv[4])
logging.basicConfig(level=logging.INFO, stream=sys.stdout,
                    format="%(asctime)s %(levelname)s %(name)s %(message)s")

async def fixed(fleet, state):
    fleet.slices["bench"] = [Endpoint(pod, address, True) for pod, address in pods.items()]
    fleet.adapters.update({a: AdapterPlacement(a, None) for a in adapters})
    fleet.synced.update({"endpoints", "adapters"})
    state.endpoints_changed()
    await asyncio.Event().wait()

async def main():
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    config = RouterConfig(namespace="bench", port=port, metrics_port=metrics_port,
                          poll_interval_s=1.0, shutdown_delay_s=0)
    await serve(config, stop, sources=[fixed])

if os.environ.get("BENCH_PROFILE"):
    # On the CPU clock: a send on loopback that is preempted by the process it woke is not
    # the router's cost.
    import cProfile, time
    profiler = cProfile.Profile(time.process_time)
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        profiler.runcall(runner.run, main())
    profiler.dump_stats(os.environ["BENCH_PROFILE"])
else:
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        runner.run(main())
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def adapters_report(pod: int, names: list[str], slots: int, cpu: int) -> tuple[bytes, bytes]:
    """What a pod of a fleet answers to GET /v1/adapters, the full listing and the residency
    view (`?view=residency`): each pod holds its own share of the adapters in its GPU slots and
    CPU tier (as under a router), every adapter is registered."""
    mine = [n for i, n in enumerate(names) if i % max(1, pod + 1) == 0]
    gpu, cpu_tier = set(mine[:slots]), set(mine[slots : slots + cpu])
    data = [
        {
            "id": n,
            "path": f"/adapters/bench/{n}/current",
            "tier": "gpu" if n in gpu else "cpu" if n in cpu_tier else "disk",
            "pinned": False,
            "origin": "api",
            "hits": 0,
            "last_used": 0.0,
            "size_bytes": 186_000_000,
            "sha256": "0" * 64,
            "rank": 64,
        }
        for n in names
    ]
    fleet = {
        "model": "sdxl-base",
        "max_loras": slots,
        "max_cpu_loras": cpu,
        "num_requests_waiting": 0,
        "num_requests_running": 0,
    }
    tiers: dict[str, list[str]] = {"gpu": [], "cpu": [], "disk": []}
    for card in data:
        tiers[str(card["tier"])].append(str(card["id"]))
    full = json.dumps({"object": "list", "data": data, **fleet}).encode()
    return full, json.dumps({"object": "residency", **tiers, **fleet}).encode()


def etag(body: bytes) -> str:
    return f'"{hashlib.blake2b(body, digest_size=12).hexdigest()}"'


async def start_pods(
    args: argparse.Namespace, names: list[str]
) -> tuple[dict[str, str], list[web.AppRunner]]:
    answer = json.dumps(
        {"created": 0, "data": [{"b64_json": "A" * args.answer_bytes, "seed": 1}]}
    ).encode()
    runners, pods = [], {}
    for i in range(args.pods):
        full, view = adapters_report(i, names, args.slots, args.cpu_slots)

        async def adapters(
            request: web.Request, full: bytes = full, view: bytes = view
        ) -> web.Response:
            # As the server answers: the view asked for, a 304 when the poller holds it.
            body = view if request.query.get("view") == "residency" else full
            tag = etag(body)
            if request.headers.get("If-None-Match") == tag:
                return web.Response(status=304, headers={"ETag": tag})
            return web.Response(body=body, content_type="application/json", headers={"ETag": tag})

        async def generate(request: web.Request) -> web.Response:
            await request.read()
            headers = {"x-lora-model": "adapter", "x-lora-revision": "0" * 64}
            return web.Response(body=answer, content_type="application/json", headers=headers)

        app = web.Application()
        app.router.add_get("/v1/adapters", adapters)
        app.router.add_post("/v1/images/generations", generate)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        runners.append(runner)
        pods[f"pod-{i:02d}"] = f"127.0.0.1:{port}"
    return pods, runners


# What a router imports of this tree besides its own package (lora_runtime, lora_podapi; a
# baseline's operator package, when it has one, comes first: see `export`).
PACKAGE_DIRS = ("runtime", "podapi", "operator", "volume", "playground")


class Router:
    """One router process (this tree's, or a baseline's)."""

    def __init__(
        self,
        label: str,
        router_dir: Path,
        pods: dict[str, str],
        names: list[str],
        env: dict[str, str],
    ):
        self.label, self.port = label, free_port()
        # A baseline's own operator package (export) comes before this tree's.
        own = [router_dir.parent / "operator"] if router_dir.parent != ROOT else []
        path = os.pathsep.join(
            str(p) for p in [router_dir, *own, *(ROOT / p for p in PACKAGE_DIRS)]
        )
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-c",
                RUNNER,
                str(self.port),
                str(free_port()),
                json.dumps(pods),
                json.dumps(names),
            ],
            env={**os.environ, **env, "PYTHONPATH": path},
            stdout=subprocess.DEVNULL,  # the access log, as a container's stdout takes it
        )
        self.ps = psutil.Process(self.proc.pid)

    def cpu_s(self) -> float:
        t = self.ps.cpu_times()
        return float(t.user + t.system)

    def system_s(self) -> float:
        return float(self.ps.cpu_times().system)

    async def wait_ready(self, session: ClientSession) -> None:
        for _ in range(600):
            if self.proc.poll() is not None:
                raise RuntimeError(f"the {self.label} router exited with {self.proc.returncode}")
            try:
                async with session.get(f"http://127.0.0.1:{self.port}/ready") as resp:
                    if resp.status == 200:
                        return
            except OSError:
                pass
            await asyncio.sleep(0.1)
        raise RuntimeError(f"the {self.label} router did not become Ready")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


async def send(url: str, stream: list[str], concurrency: int) -> float:
    """Send the stream, `concurrency` in flight, a connection per request; the wall time."""
    bodies = iter(stream)
    failures: list[str] = []

    async def client(session: ClientSession) -> None:
        for model in bodies:
            body = {"model": model, "prompt": "a lighthouse", "size": "1024x1024", "seed": 1}
            async with session.post(url, json=body) as resp:
                await resp.read()
                if resp.status != 200:
                    failures.append(f"{model}: {resp.status}")

    started = time.perf_counter()
    connector = TCPConnector(force_close=True)
    async with ClientSession(connector=connector, timeout=ClientTimeout(total=120)) as session:
        await asyncio.gather(*(client(session) for _ in range(concurrency)))
    if failures:
        raise RuntimeError(f"{len(failures)} requests failed: {failures[:3]}")
    return time.perf_counter() - started


async def measure(
    args: argparse.Namespace, baseline_dir: Path
) -> dict[str, dict[str, list[float]]]:
    profiles: dict[str, dict[str, str]] = {"before": {}, "after": {}}
    if args.profile:
        path = Path(args.profile).resolve()
        profiles["after"]["BENCH_PROFILE"] = str(path)
        profiles["before"]["BENCH_PROFILE"] = str(baseline_profile(path))
    names = [f"adapter-{i:02d}" for i in range(args.adapters)]
    pods, runners = await start_pods(args, names)
    routers = [
        Router("before", baseline_dir, pods, names, profiles["before"]),
        Router("after", ROOT / "router", pods, names, profiles["after"]),
    ]
    results: dict[str, dict[str, list[float]]] = {
        r.label: {"req": [], "idle": [], "system": []} for r in routers
    }
    try:
        async with ClientSession() as session:
            for r in routers:
                await r.wait_ready(session)
        warm = zipf_stream(200, args.adapters, 1.1, seed=99)
        for r in routers:
            await send(f"http://127.0.0.1:{r.port}/v1/images/generations", warm, args.concurrency)
        for round_ in range(args.rounds):
            stream = zipf_stream(args.requests, args.adapters, 1.1, seed=round_)
            order = routers if round_ % 2 == 0 else routers[::-1]
            for r in order:
                before, system = r.cpu_s(), r.system_s()
                url = f"http://127.0.0.1:{r.port}/v1/images/generations"
                await send(url, stream, args.concurrency)
                results[r.label]["req"].append(1000 * (r.cpu_s() - before) / args.requests)
                results[r.label]["system"].append(1000 * (r.system_s() - system) / args.requests)
            for r in order:  # each router idle: its polling alone, CPU ms per second
                before = r.cpu_s()
                await asyncio.sleep(args.idle_s)
                results[r.label]["idle"].append(1000 * (r.cpu_s() - before) / args.idle_s)
            line = "; ".join(
                f"{label} {v['req'][-1]:.2f} ms/request" for label, v in results.items()
            )
            print(f"  round {round_ + 1}/{args.rounds}: {line}", flush=True)
    finally:
        for r in routers:
            r.stop()
        for runner in runners:
            await runner.cleanup()
    return results


# The parts of a router's profile (`--profile`): the first whose pattern matches where a
# function lives ("file:function"; builtins are "~:<method ...>").
PARTS = [
    ("the router's server on the client side (`server`)", r"lora_router/(server|handover)\.py:"),
    ("the router's HTTP/1.1 reading and writing (`http1`)", r"lora_router/http1\.py:"),
    ("the router's pool to the pods (`upstream`)", r"lora_router/upstream\.py:"),
    ("the router's own code (decisions, proxy, polls)", r"lora_router/"),
    ("aiohttp's client to the pods, and its streams", r"aiohttp/(client|connector|streams|trac)"),
    ("aiohttp's server on the client side", r"aiohttp/"),
    ("socket calls seen apart (asyncio's loop only)", r"^~:.*_socket\.socket"),
    (
        "the event loop (callbacks, tasks; uvloop's calls)",
        r"asyncio/|selectors|uvloop|^~:.*Context",
    ),
    ("prometheus, json, yarl, multidict, logging", r"prometheus|json/|yarl|multidict|logging/"),
    ("other (builtins: dicts, strings, bytes)", r""),
]


def baseline_profile(path: Path) -> Path:
    """Where the baseline's profile goes, beside this tree's at `path`: NAME-before.prof."""
    return path.with_stem(f"{path.stem}-before")


def profile_parts(path: Path) -> dict[str, float]:
    """A cProfile's own time (seconds) by part (`PARTS`)."""
    parts = dict.fromkeys((name for name, _ in PARTS), 0.0)
    stats = pstats.Stats(str(path)).stats  # type: ignore[attr-defined]
    for (file, _, function), (_, _, own, _, _) in stats.items():
        where = f"{file}:{function}"
        parts[next(name for name, pattern in PARTS if re.search(pattern, where))] += own
    return parts


def print_profiles(before: Path, after: Path) -> None:
    """Each router's profile by part, in shares of the baseline's whole profiled time (the
    profiler slows Python code more than C: the shares, not the times, are what it says)."""
    b, a = profile_parts(before), profile_parts(after)
    total = sum(b.values())
    print(f"\nprofiled time by part, % of the baseline's ({before.name}, {after.name})")
    for name in b:
        print(f"  {name:<56}{100 * b[name] / total:>7.1f}%{100 * a[name] / total:>7.1f}%")
    print(f"  {'total':<56}{100.0:>7.1f}%{100 * sum(a.values()) / total:>7.1f}%")


def export(revision: str, into: Path) -> Path:
    """The router package at `revision`, written under `into`, with the operator package of the
    same revision beside it (a router before lora_runtime imported the operator's client, size
    parser and backoff: it runs against its own)."""
    archive = subprocess.run(
        ["git", "archive", revision, "router/lora_router", "operator/lora_operator"], cwd=ROOT,
        capture_output=True, check=True,
    ).stdout  # fmt: skip
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into / "router"


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--baseline", default="5434a07", help="git revision of the 'before'")
    parser.add_argument("--pods", type=int, default=4)
    parser.add_argument("--adapters", type=int, default=100)
    parser.add_argument("--slots", type=int, default=4, help="each fake pod's GPU slots")
    parser.add_argument("--cpu-slots", type=int, default=32, help="each fake pod's CPU tier")
    parser.add_argument("--requests", type=int, default=1000, help="per round and router")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--answer-bytes", type=int, default=12_000, help="a generation's answer")
    parser.add_argument(
        "--profile",
        help="write cProfile stats of this tree's router here, and the baseline's beside it "
        "(NAME-before.prof for NAME.prof)",
    )
    parser.add_argument("--idle-s", type=float, default=3.0, help="idle time measured per round")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="lora-bench-hop-") as scratch:
        baseline = export(args.baseline, Path(scratch))
        results = asyncio.run(measure(args, baseline))
    if args.profile:
        path = Path(args.profile).resolve()
        print_profiles(baseline_profile(path), path)
    before = statistics.median(results["before"]["req"])
    after = statistics.median(results["after"]["req"])
    print(
        f"\nlora-router hop: N={args.pods} fake pods, K={args.adapters} adapters, Zipf(1.1),"
        f" {args.rounds} rounds x {args.requests} requests per router, {args.concurrency} in"
        f" flight, a connection per request, {args.answer_bytes}-byte answers; before ="
        f" {args.baseline}, after = this tree; {platform.machine()}, {os.cpu_count()} cores"
    )
    print(f"{'':<36}{'before':>10}{'after':>10}{'after/before':>14}")
    for label, key in (
        ("CPU ms per request (median)", "req"),
        ("  of which in the kernel (sockets)", "system"),
        ("idle polling, CPU ms per second", "idle"),
    ):
        b, a = statistics.median(results["before"][key]), statistics.median(results["after"][key])
        print(f"{label:<36}{b:>10.2f}{a:>10.2f}{a / b if b else 0:>14.2f}")
    for label in ("before", "after"):
        each = " ".join(f"{x:.2f}" for x in results[label]["req"])
        print(f"  {label}: CPU ms per request by round: {each}")
    print(
        f"router hop: CPU ms per request before = {before:.2f}, after = {after:.2f},"
        f" after/before = {after / before:.2f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
