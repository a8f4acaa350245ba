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
# Two ranks over NCCL: hot rows (on, every row that saves bytes) with table-wise tables,
# then with row-wise tables, each against plain TorchRec on the same plan. A rank per GPU
# where there are two; with one GPU both ranks share it (the example places rank r on
# GPU r mod count), which NCCL may refuse ("Duplicate GPU detected"): the log says so.
gpus=$("$py" -c "import torch; print(torch.cuda.device_count())")
tiny=(--scale 0.001 --synthetic_samples_per_day 8192 --batch_size 256 --limit_train_batches 40
      --limit_val_batches 2 --limit_test_batches 2 --baseline --adagrad
      --data_cache "$out/data")
for job in "hot:--hot_rows" "row_wise:--hot_rows --sharding_type row_wise"; do
  name=${job%%:*}
  echo "gpu-check: world size 2 over NCCL ($name, $gpus GPU(s))"
  # shellcheck disable=SC2086
  "$py" -m torch.distributed.run --standalone --nproc_per_node 2 examples/dlrm/dlrm_main.py \
    "${tiny[@]}" ${job#*:} --out "$out/ws2_$name" 2>&1 | tee "$out/ws2_$name.txt"
  grep -q "bitwise equal\|within 1e-05" "$out/ws2_$name.txt" \
    || { echo "gpu-check: ws2 $name did not agree with plain TorchRec" >&2; exit 1; }
done
"$py" benchmarks/gpu.py --out "$out"
