#!/usr/bin/env bash
# On a lent GPU machine (the `device` tool; shared/notes/gpu-device.md): installs the
# pieces scripts/device_pack.sh made beside the image's torch, then runs
# scripts/gpu_check.sh with its results in $OUT: its logs, and its reports and traces in
# $OUT/data.tar.gz (at most 8 files come back from a call: GPU_PARTS picks the parts a call
# runs, a log each).
#
# Pieces arrive one per call (carry .gpu/p00, then .gpu/p01, ...; the last call carries
# the last piece and .gpu/whl); a call before the last one can run `ls .gpu`. On the
# lease of 2026-11-28 (an H200, 900 s of device time): the first call held the machine
# 40 s, the second 6 s; the third installed in 3 s and ran GPU_PARTS="tests bench" in
# 265 s (bench: --steps 50 --repeats 2); "heavy example" took 297 s. So a lease's plan:
# the pieces, then GPU_PARTS="bench sync profile" (about 170 s), GPU_PARTS="planning gil
# workers heavy" (about 200 s), and, if time is left, GPU_PARTS="tests example" (about
# 300 s).
set -uo pipefail
out=${OUT:-results/device}
site=/tmp/site
mkdir -p "$out"
if [ ! -d "$site/fbgemm_gpu" ]; then
  start=$SECONDS
  mkdir -p "$site.part"
  cat .gpu/p*/piece-* | xz -d -T0 | tar -C "$site.part" -xf - || { echo "unpack failed" >&2; exit 1; }
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$site.part" .gpu/whl/*.whl \
    || exit 1
  mv "$site.part" "$site"
  echo "device-check: installed in $((SECONDS - start)) s"
fi
export PYTHONPATH=$site:$PWD
nvidia-smi -L
bash scripts/gpu_check.sh python3 "$out"  # its logs land in $OUT as they are written
rc=$?
# A call brings back 8 files: the parts' logs (the top-level *.txt) as they are, and the
# rest (reports, profiler traces) in one archive, data.tar.gz.
cd "$out" || exit 1
mapfile -t data < <(find . -type f ! -name data.tar.gz | grep -v '^\./[^/]*\.txt$')
if [ ${#data[@]} -gt 0 ]; then
  tar -czf data.tar.gz "${data[@]}" && rm -f "${data[@]}" && find . -mindepth 1 -type d -empty -delete
fi
exit $rc
