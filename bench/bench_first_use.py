"""An adapter's first use on the CPU: this tree's reader against an earlier one's, side by side on
the same files, and against reading and hashing the same bytes.

A first use is what a request for an adapter the server holds in no tier waits for before its
batch: the reader's path (read the file, hash it, check and convert it, pack it into the slot
layout: `DiffusionBackend.parse_adapter`, the "cpu" column), then a copy into a slot ("copy").
Each tree runs in a worker process of its own (this tree's, and `--baseline`, a git revision
exported to a temporary directory, its packages first on the path), around SD 1.5 at full width
with random weights in float32 (`bench_inference.py`'s representative model), on one torch
thread. This tree's worker writes rank-64 adapters for it: the attention layers of the UNet, and
of the UNet and the text encoder, as `bench_inference.py` writes them. The workers take turns,
one first use each, and between them this process reads and hashes the same file twice: the way
the server's reader does it (`weightsfile.read`: one pass, the hash beside the read) and plainly
(`hashlib.sha256(path.read_bytes())`), so the machine's load hits every figure alike. Medians
over the samples are printed, and in the last line the medians over both adapters, the ratios
taken per turn; with `--profile`, before it, where each tree's time went (cProfile of
`--profile-runs` first uses of the larger adapter, in each worker).

    .venv/bin/python bench/bench_first_use.py --baseline 0a24f55 --profile

The last line reads (ratio: after against read+hash, the server's one pass)
    first-use: before ms = X, after ms = Y, read+hash ms = Z, after/before = R.RR, ratio = Q.QQ
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from lora_inference import weightsfile

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("inference", "volume", "runtime", "podapi", "playground")

# One tree's reader around the representative model; commands and answers are JSON lines.
WORKER = r"""
import cProfile, io, json, pstats, sys, time
from pathlib import Path
import torch
from lora_inference.pipeline import DiffusionBackend
from lora_inference.tools.full_size import build_full_size_sd15
from lora_inference.tools.random_adapters import write_random_adapter

torch.set_num_threads(1)
pipe = build_full_size_sd15("cpu", torch.float32)
backend = DiffusionBackend(pipe, device="cpu", dtype=torch.float32, slots=1, max_rank=64)

def first_use(path):
    started = time.perf_counter()
    parsed = backend.parse_adapter(path, name="probe", max_rank=64)
    parsed_at = time.perf_counter()
    backend.place("probe", parsed)
    return parsed_at - started, time.perf_counter() - parsed_at

print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    command = json.loads(line)
    if command["do"] == "write":
        path = write_random_adapter(
            Path(command["out"]), pipe, base_model="sd15-full-width", seed=command["seed"],
            rank=64, text_encoder=command["text_encoder"], strength=0.02,
        )
        answer = {"path": str(path)}
    elif command["do"] == "first-use":
        cpu, copy = first_use(Path(command["path"]))
        answer = {"cpu_s": cpu, "copy_s": copy}
    elif command["do"] == "profile":
        profiler = cProfile.Profile()
        for _ in range(command["runs"]):
            profiler.runcall(first_use, Path(command["path"]))
        out = io.StringIO()
        stats = pstats.Stats(profiler, stream=out)
        stats.sort_stats("tottime").print_stats(command["lines"])
        answer = {"text": out.getvalue()}
    else:
        break
    print(json.dumps(answer), flush=True)
"""


class Worker:
    """One tree's reader in a process of its own."""

    def __init__(self, label: str, packages: Path) -> None:
        self.label = label
        path = os.pathsep.join(str(packages / p) for p in PACKAGES)
        env = {**os.environ, "PYTHONPATH": path + os.pathsep + os.environ.get("PYTHONPATH", "")}
        self.process = subprocess.Popen(
            [sys.executable, "-c", WORKER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            text=True,
        )
        self.ask({})  # nothing: waits for "ready"

    def ask(self, command: dict[str, Any]) -> dict[str, Any]:
        assert self.process.stdin is not None and self.process.stdout is not None
        if command:
            self.process.stdin.write(json.dumps(command) + "\n")
            self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the {self.label} worker ended (exit {self.process.wait()})")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def close(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps({"do": "quit"}) + "\n")
        self.process.stdin.close()
        self.process.wait(timeout=60)


def export(revision: str, into: Path) -> Path:
    """The Python packages of `revision`, written under `into`."""
    archive = subprocess.run(
        ["git", "archive", revision, *PACKAGES], cwd=ROOT, capture_output=True, check=True
    ).stdout
    into.mkdir(parents=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def read_and_hash(path: Path) -> tuple[float, float]:
    """Seconds to read and hash `path` once: the server's one pass, and the plain way."""
    started = time.perf_counter()
    weightsfile.read(path).sha256()
    one_pass = time.perf_counter() - started
    started = time.perf_counter()
    hashlib.sha256(path.read_bytes()).hexdigest()
    return one_pass, time.perf_counter() - started


def ms(values: list[float]) -> float:
    return statistics.median(values) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--baseline", default="0a24f55", help="git revision of the 'before'")
    parser.add_argument("--samples", type=int, default=10, help="first uses per adapter and tree")
    parser.add_argument("--profile", action="store_true", help="then profile each tree")
    parser.add_argument("--profile-runs", type=int, default=5)
    parser.add_argument("--profile-lines", type=int, default=14)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="lora-first-use-") as scratch:
        work = Path(scratch)
        started = time.perf_counter()
        before = Worker("before", export(args.baseline, work / "baseline"))
        after = Worker("after", ROOT)
        adapters = [
            Path(after.ask({"do": "write", "out": str(work / name), "seed": seed, **kind})["path"])
            for name, seed, kind in (
                ("unet", 2, {"text_encoder": False}),
                ("unet-text", 5, {"text_encoder": True}),
            )
        ]
        print(
            f"SD 1.5 at full width (random weights, float32, 1 torch thread), rank-64 adapters; "
            f"before = {args.baseline}, after = this tree; {platform.machine()}, "
            f"{os.cpu_count()} cores; workers ready in {time.perf_counter() - started:.0f} s"
        )
        print(f"{'adapter':28}{'MB':>6}{'cpu ms':>17}{'copy ms':>17}{'read+hash ms':>22}")
        columns = ("before", 9), ("after", 8), ("before", 9), ("after", 8), ("one pass", 11)
        print(" " * 34 + "".join(f"{name:>{width}}" for name, width in columns) + f"{'plain':>11}")
        totals: dict[str, list[float]] = {"before": [], "after": [], "one pass": []}
        for adapter in adapters:
            weights = adapter / "pytorch_lora_weights.safetensors"
            for worker in (before, after):  # the first use of a process imports and warms up
                worker.ask({"do": "first-use", "path": str(adapter)})
            figures: dict[str, list[float]] = {}
            for i in range(args.samples):
                order = (before, after) if i % 2 == 0 else (after, before)
                for worker in order:
                    answer = worker.ask({"do": "first-use", "path": str(adapter)})
                    figures.setdefault(f"cpu {worker.label}", []).append(answer["cpu_s"])
                    figures.setdefault(f"copy {worker.label}", []).append(answer["copy_s"])
                one_pass, plain = read_and_hash(weights)
                figures.setdefault("one pass", []).append(one_pass)
                figures.setdefault("plain", []).append(plain)
            print(
                f"{adapter.name:28}{weights.stat().st_size / 1e6:6.0f}"
                f"{ms(figures['cpu before']):9.1f}{ms(figures['cpu after']):8.1f}"
                f"{ms(figures['copy before']):9.1f}{ms(figures['copy after']):8.1f}"
                f"{ms(figures['one pass']):11.1f}{ms(figures['plain']):11.1f}"
            )
            for key in totals:
                totals[key] += figures["cpu " + key] if key != "one pass" else figures[key]
        if args.profile:
            for worker in (before, after):
                text = worker.ask(
                    {
                        "do": "profile",
                        "path": str(adapters[-1]),
                        "runs": args.profile_runs,
                        "lines": args.profile_lines,
                    }
                )["text"]
                print(f"\n{worker.label}: {args.profile_runs} first uses of {adapters[-1].name}")
                print("\n".join(line for line in text.splitlines() if line.strip()))
        for worker in (before, after):
            worker.close()
    # Ratios per turn (the same file, the same moment), then their median.
    before, after, one_pass = totals["before"], totals["after"], totals["one pass"]
    speedup = statistics.median(a / b for a, b in zip(after, before, strict=True))
    ratio = statistics.median(a / r for a, r in zip(after, one_pass, strict=True))
    print(
        f"first-use: before ms = {ms(before):.0f}, after ms = {ms(after):.0f}, "
        f"read+hash ms = {ms(one_pass):.0f}, after/before = {speedup:.2f}, ratio = {ratio:.2f}"
    )


if __name__ == "__main__":
    main()
