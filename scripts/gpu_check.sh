#!/usr/bin/env bash
# make gpu-check: the CUDA path on a GPU. Never run where this project is developed (no
# GPU there): on a machine without CUDA it says so and fails.
#
# Usage: gpu_check.sh [PYTHON] [OUT]. For a lent machine's short lease: GPU_PARTS picks
# parts (some of: tests bench sync profile planning gil workers heavy example ws2; all by
# default),
# GPU_BENCH_ARGS adds arguments to benchmarks/gpu.py, GPU_PART_TIMEOUT (seconds) bounds
# each part. Every part runs even when one before it failed; the last lines are one table
# of what passed, and the exit status is non-zero if anything failed.
set -uo pipefail
py=${1:-.venv/bin/python}
out=${2:-results/gpu_check}
if ! "$py" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu-check: no CUDA device here (torch.cuda.is_available() is False); it needs a GPU" >&2
  exit 1
fi
mkdir -p "$out"
export PYTHONUNBUFFERED=1
"$py" -c "import torch, fbgemm_gpu, torchrec
print('gpu-check:', torch.cuda.get_device_name(0), '| torch', torch.__version__,
      '| fbgemm_gpu', fbgemm_gpu.__version__, '| torchrec', torchrec.__version__)" \
  2>&1 | grep '^gpu-check:' | tee "$out/versions.txt"
declare -a table=()
wanted() { [[ " ${GPU_PARTS:-tests bench sync profile planning gil workers heavy example ws2} " == *" $1 "* ]]; }
part() {  # part NAME LOG COMMAND...: runs one part, logs it, records its outcome
  local name=$1 log=$2
  shift 2
  local start=$SECONDS
  timeout "${GPU_PART_TIMEOUT:-0}" "$@" >"$log" 2>&1
  local rc=$?
  [ $rc = 124 ] && echo "gpu-check: $name stopped after ${GPU_PART_TIMEOUT}s" >>"$log"
  tail -n 25 "$log"
  table+=("$(printf '%-36s %-6s %4ss' "$name" "$([ $rc = 0 ] && echo pass || echo FAIL)" $((SECONDS - start)))")
  return 0
}
# The CUDA-marked tests: the unsharded cache under torch's CUDA sanitizer (it reports
# kernels racing on memory across streams: the side stream, the stage, the trainer),
# the benchmark, then the DLRM example (DMP over NCCL, four runs of it). The example
# goes without the sanitizer: its loader's forked workers run torch operators, and the
# sanitizer's hook then initialises CUDA in a forked child, which CUDA refuses.
pytest=("$py" -m pytest -v -m cuda -p no:cacheprovider tests/test_gpu.py)
wanted tests && part "cuda tests: the cache (sanitizer)" "$out/tests.txt" \
  env TORCH_CUDA_SANITIZER=1 "${pytest[@]}" -k "not dlrm_example"
# shellcheck disable=SC2086
wanted bench && part "benchmarks/gpu.py" "$out/bench.txt" "$py" benchmarks/gpu.py --out "$out" ${GPU_BENCH_ARGS:-}
# The first two leases' measure (the device synchronised around each step) beside the
# bench part's (CUDA events, no synchronisation between steps), at one fraction.
wanted sync && part "benchmarks/gpu.py (synchronised)" "$out/sync.txt" \
  "$py" benchmarks/gpu.py --out "$out/sync" --settings fused lookahead lookahead-device \
  --cache-fractions 0.05 --steps 50 --warmup 15 --repeats 2 --sync-each-step
# Where a step's time goes at gpu.py's shape (5% caches): torch.profiler's table for five
# steps of fused and of lookahead with either planner, after 40 timed ones.
wanted profile && part "benchmarks/gpu.py (profile)" "$out/profile.txt" \
  "$py" benchmarks/gpu.py --out "$out/profile" --settings fused lookahead lookahead-device \
  --cache-fractions 0.05 --steps 40 --warmup 20 --profile-steps 5
# The host planner's planning per batch on this host's CPU (no GPU in it), one thread,
# two and four: what the trainer waits for when planning is slower than a step.
wanted planning && part "benchmarks/planning.py" "$out/planning.txt" \
  "$py" benchmarks/planning.py --out "$out/planning" --batch-sizes 8192 32768 \
  --fractions 0.05 --workers 1 2 4 --repeats 2
# What each planner's thread costs the trainer's launches through the GIL, with the
# trainer's ops and the device oracle on the GPU (a real batch's ids: 8,192 samples).
wanted gil && part "benchmarks/gil.py" "$out/gil.txt" \
  "$py" benchmarks/gil.py --out "$out/gil" --device cuda --device-ids 212992
# Whether the host planner's planning, split over four threads (numba, nogil), keeps up
# with the fused step at gpu.py's shape (one thread: about 9-13 ms of CPU a batch there).
wanted workers && part "benchmarks/gpu.py (4 workers)" "$out/workers.txt" \
  "$py" benchmarks/gpu.py --out "$out/workers" --settings fused lookahead --planning-workers 4 \
  --steps 60 --warmup 20 --repeats 2
# Issue 40's miss-heavy regime (docs/results.md, "Bytes over the host link"): full-size
# tables, dim 128, 1% caches, 32,768 samples, each setting twice in alternation, with the
# bytes lookahead's cache moved per step. GPU_HEAVY_ARGS replaces these arguments.
heavy=(--scale 1.0 --dim 128 --zipf 1.05 --batch-size 32768 --cache-fractions 0.01
       --steps 40 --warmup 10 --repeats 2)
# shellcheck disable=SC2086
wanted heavy && part "benchmarks/gpu.py (miss-heavy)" "$out/heavy.txt" \
  "$py" benchmarks/gpu.py --out "$out/heavy" ${GPU_HEAVY_ARGS:-${heavy[*]}}
wanted example && part "cuda tests: the example" "$out/example.txt" "${pytest[@]}" -k dlrm_example
# Two ranks over NCCL: hot rows with table-wise tables, then with row-wise tables, each
# against plain TorchRec on the same plan. NCCL refuses two ranks on one GPU.
gpus=$("$py" -c "import torch; print(torch.cuda.device_count())")
tiny=(--scale 0.001 --synthetic_samples_per_day 8192 --batch_size 256 --limit_train_batches 40
      --limit_val_batches 2 --limit_test_batches 2 --baseline --adagrad
      --data_cache "$out/data")
jobs=("hot:--hot_rows" "row_wise:--hot_rows --sharding_type row_wise")
wanted ws2 || jobs=()
for job in "${jobs[@]}"; do
  name=${job%%:*}
  if [ "$gpus" -lt 2 ]; then
    table+=("$(printf '%-36s %-6s %s' "two ranks over NCCL ($name)" "not run" "needs 2 GPUs, $gpus here")")
    continue
  fi
  # shellcheck disable=SC2086
  part "two ranks over NCCL ($name)" "$out/ws2_$name.txt" \
    "$py" -m torch.distributed.run --standalone --nproc_per_node 2 examples/dlrm/dlrm_main.py \
    "${tiny[@]}" ${job#*:} --out "$out/ws2_$name"
  grep -q "bitwise equal\|within 1e-05" "$out/ws2_$name.txt" \
    || table+=("two ranks over NCCL ($name): did not agree with plain TorchRec")
done
printf '%s\n' "gpu-check summary" "${table[@]}" | tee "$out/summary.txt"
! grep -q "FAIL\|did not agree" "$out/summary.txt"
