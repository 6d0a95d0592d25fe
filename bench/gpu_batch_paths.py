"""What each way of running a batch costs against the base model, on a full-size SDXL on a GPU.

One random-weight SDXL base (fp16, built in code) holds four rank-64 adapters in its slots; one
pipeline call of 4 images (20 steps, 1024x1024, guidance 5) runs each way the server runs a batch:

  base                    no adapter (the limit)
  one adapter, unmerged   every image through one slot, its branch run from the slot buffers
  one adapter, merged     the same slot merged into every layer it targets
  mixed, 4 adapters       each image through its own slot (one gathered pass per layer)

and prints the best of two calls' wall-clock and CPU time for each, then the kernel launches of a
one-step call, mixed and base, from torch's profiler (those through the CUDA runtime,
cudaLaunchKernel; cuBLAS launches some through the driver, not counted). GPU only:

    PYTHONPATH=runtime:podapi:inference:volume:playground python3 bench/gpu_batch_paths.py
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch
from lora_inference.costs import MergePolicy
from lora_inference.pipeline import DiffusionBackend, ImageJob, resolve_dtype
from lora_inference.tools.full_size import build_full_size_sdxl
from lora_inference.tools.random_adapters import write_random_adapter

LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC")


def main() -> None:
    dtype = resolve_dtype("auto", "cuda")
    pipe = build_full_size_sdxl("cuda", dtype)
    pipe.set_progress_bar_config(disable=True)
    backend = DiffusionBackend(pipe, device="cuda", dtype=dtype, slots=4, max_rank=64)
    with tempfile.TemporaryDirectory() as scratch:
        for i in range(4):
            path = write_random_adapter(
                Path(scratch) / f"a{i}",
                pipe,
                base_model="sdxl",
                seed=i,
                rank=64,
                strength=0.02,
                dtype=dtype,
            )
            backend.place(f"s{i}", backend.parse_adapter(path, name=f"a{i}", max_rank=64))
    jobs = [ImageJob("a lighthouse", None, (i,)) for i in range(4)]
    scales = {f"s{i}": 1.0 for i in range(4)}
    # Each case's slots per image and the merge policy it runs under.
    cases: dict[str, tuple[list[str | None], MergePolicy]] = {
        "base": ([None] * 4, "never"),
        "one adapter, unmerged": (["s0"] * 4, "never"),
        "one adapter, merged": (["s0"] * 4, "always"),
        "mixed, 4 adapters": (["s0", "s1", "s2", "s3"], "never"),
    }

    def run(slots: list[str | None], steps: int, merge: MergePolicy) -> tuple[float, float, str]:
        torch.cuda.synchronize()
        wall, cpu = time.perf_counter(), time.process_time()
        outcome = backend.run_batch(
            jobs,
            slots,
            scales,
            width=1024,
            height=1024,
            steps=steps,
            guidance_scale=5.0,
            merge=merge,
        )
        torch.cuda.synchronize()
        return time.perf_counter() - wall, time.process_time() - cpu, outcome.path

    for name, (slots, merge) in cases.items():
        run(slots, 2, merge)  # warm-up
        rows = [run(slots, 20, merge) for _ in range(2)]
        print(
            f"{name:26} 4 images 20 steps 1024: wall {min(r[0] for r in rows):.2f} s, "
            f"cpu {min(r[1] for r in rows):.2f} s, path {rows[0][2]}",
            flush=True,
        )
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    for name in ("mixed, 4 adapters", "base"):
        with torch.profiler.profile(activities=activities) as prof:
            run(cases[name][0], 1, "never")
        launches = sum(e.count for e in prof.key_averages() if e.key in LAUNCHES)
        print(f"{name}, 1 step: cuda kernel launches {launches}")


if __name__ == "__main__":
    main()
