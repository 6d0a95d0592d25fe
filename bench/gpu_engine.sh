#!/usr/bin/env bash
# Every GPU figure of the inference engine in one run, on one NVIDIA GPU: the full-size SDXL
# stream of bench_inference.py (a/c, a call of four adapters against a base call, a slot fill's
# bandwidth, kernels per step; its last line `serving-gpu: ...`), then each batch path against
# the base model (gpu_batch_paths.py). Writes each output under $OUT (default gpu-out/).
#
# The GPU machine brings its own Python and torch; diffusers, peft and transformers at the
# versions pyproject.toml pins travel as wheels in .whl/ (docs/benchmarks.md says how to fetch
# them), installed here into /tmp/site.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-out}
mkdir -p "$out"
site=""
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl
  site=/tmp/site:
fi
export PYTHONPATH="${site}inference:volume:playground:bench" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
python3 -c 'import sys, torch, diffusers, peft, transformers; print(sys.version.split()[0], "torch", torch.__version__, "diffusers", diffusers.__version__, "peft", peft.__version__, "transformers", transformers.__version__)' | tee "$out/versions.txt"
python3 bench/bench_inference.py --full-size --modes full-size --device cuda --size 1024 \
  --rank 64 --steps 20 --requests 48 --threads 0 2>&1 | tee "$out/full-size.txt"
python3 bench/gpu_batch_paths.py 2>&1 | tee "$out/batch-paths.txt"
