#!/usr/bin/env bash
# make gpu-check: the CUDA path on a GPU. Never run where this project is developed (no
# GPU there): on a machine without CUDA it says so and fails.
set -euo pipefail
py=${1:-.venv/bin/python}
out=${2:-results/gpu_check}
if ! "$py" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu-check: no CUDA device here (torch.cuda.is_available() is False); it needs a GPU" >&2
  exit 1
fi
mkdir -p "$out"
# The CUDA-marked tests, under torch's CUDA sanitizer (it reports kernels racing on
# memory across streams: the side stream, the stage, the trainer).
TORCH_CUDA_SANITIZER=1 "$py" -m pytest -q -m cuda -p no:cacheprovider tests/test_gpu.py \
  2>&1 | tee "$out/tests.txt"
"$py" benchmarks/gpu.py --out "$out"
