"""A miss's cost next to a generation, on a full-size SDXL on a GPU.

One random-weight SDXL base (fp16, built in code) and five rank-64 adapters (half with
text-encoder layers); four 1024x1024 generations of one image at 20 steps, then of one and of
four images at 4 steps (the simulated 4-step profile's), then bench_inference's growth table
(first use: parse the file and copy it into a slot; swap: copy a parsed adapter into a slot;
activate: switch the layers before a batch) with 1 and 5 adapters resident. GPU only:

    PYTHONPATH=runtime:podapi:inference:volume:playground:bench python3 bench/gpu_miss_costs.py
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_inference import growth
from lora_inference.pipeline import DiffusionBackend, resolve_dtype
from lora_inference.tools.full_size import build_full_size_sdxl
from lora_inference.tools.random_adapters import write_random_adapter


def size_mb(path: Path) -> int:
    files = [f for f in path.rglob("*") if f.is_file()] if path.is_dir() else [path]
    return round(sum(f.stat().st_size for f in files) / 1e6)


def main() -> None:
    dtype = resolve_dtype("auto", "cuda")
    started = time.perf_counter()
    pipe = build_full_size_sdxl("cuda", dtype)
    print(f"built {time.perf_counter() - started:.1f}s", flush=True)
    with tempfile.TemporaryDirectory() as scratch:
        paths = [
            write_random_adapter(
                Path(scratch) / f"a{i}",
                pipe,
                base_model="sdxl",
                seed=i,
                rank=64,
                text_encoder=i % 2 == 1,
                strength=0.02,
                dtype=dtype,
            )
            for i in range(5)
        ]
        print("sizes MB", [size_mb(p) for p in paths], flush=True)
        backend = DiffusionBackend(pipe, device="cuda", dtype=dtype, slots=6, max_rank=64)
        for steps, batch in ((20, 1), (4, 1), (4, 4)):
            generations = []
            for _ in range(4):
                torch.cuda.synchronize()
                started = time.perf_counter()
                pipe(
                    prompt=["a lighthouse"] * batch,
                    num_inference_steps=steps,
                    height=1024,
                    width=1024,
                )
                torch.cuda.synchronize()
                generations.append(time.perf_counter() - started)
            print(
                f"generation {steps} steps 1024 batch {batch} s:",
                [round(g, 3) for g in generations],
                flush=True,
            )
        for resident, first, swap, activate, layers in growth(backend, paths, (1, 5), 3):
            print(
                f"resident {resident}: first use {first * 1e3:.1f} ms, swap {swap * 1e3:.1f} ms, "
                f"activate {activate * 1e3:.2f} ms, layers {layers}",
                flush=True,
            )


if __name__ == "__main__":
    main()
