#!/usr/bin/env bash
# Every GPU figure of the inference engine in one run, on one NVIDIA GPU, within a deadline
# (GPU_DEADLINE_S, default 500 s): each batch path against the base model (gpu_batch_paths.py);
# a miss next to a generation, with 1- and 4-image generations at 20 and 4 steps
# (gpu_miss_costs.py: what the simulated GPU's profiles are made from); then, in the time left,
# the full-size SDXL stream of bench_inference.py (a/c, a call of four adapters against a base
# call, a slot fill's bandwidth, kernels per step; its last line `serving-gpu: ...`). Each step
# writes its output under $OUT (default gpu-out/) as it goes, and a step that fails or runs out
# of time does not stop the next.
#
# The GPU machine brings its own Python and torch; diffusers, peft and transformers at the
# versions pyproject.toml pins travel as wheels in .whl/ (docs/benchmarks.md says how to fetch
# them), installed here into /tmp/site.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-out}
deadline=$((SECONDS + ${GPU_DEADLINE_S:-500}))
requests=${GPU_REQUESTS:-48}
mkdir -p "$out"
site=""
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit
  site=/tmp/site:
fi
export PYTHONPATH="${site}runtime:podapi:inference:volume:playground:bench" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
python3 -c 'import sys, torch, diffusers, peft, transformers; print(sys.version.split()[0], "torch", torch.__version__, "diffusers", diffusers.__version__, "peft", peft.__version__, "transformers", transformers.__version__)' | tee "$out/versions.txt"

step() {  # step NAME COMMAND...: run it until the deadline, its output into $out/NAME.txt
  local name=$1 left=$((deadline - SECONDS))
  shift
  if ((left < 30)); then
    echo "[$name] skipped: the deadline has passed" | tee "$out/$name.txt"
    return
  fi
  echo "[$name] started, ${left} s left"
  timeout "$left" "$@" 2>&1 | tee "$out/$name.txt"
  echo "[$name] exit ${PIPESTATUS[0]} after $((SECONDS)) s"
}
step batch-paths python3 bench/gpu_batch_paths.py
step miss-costs python3 bench/gpu_miss_costs.py
step full-size python3 bench/bench_inference.py --full-size --modes full-size --device cuda \
  --size 1024 --rank 64 --steps 20 --requests "$requests" --threads 0
