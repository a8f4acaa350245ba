#!/usr/bin/env bash
# Creates a virtual environment with the pinned dependency set for this
# machine (CUDA if an NVIDIA driver answers, else CPU) and installs the
# project into it in editable mode.
set -euo pipefail
venv=${1:-.venv}
python=${PYTHON:-python3}
here=$(cd "$(dirname "$0")/.." && pwd)

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  flavour=cuda
else
  flavour=cpu
fi
echo "install: $flavour dependency set into $venv"

[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check)
"${pip[@]}" install --quiet --upgrade pip
"${pip[@]}" install --quiet -r "$here/requirements/$flavour.txt" -r "$here/requirements/dev.txt"
"${pip[@]}" install --quiet --no-deps torchrec==1.8.0
"${pip[@]}" install --quiet --no-deps --no-build-isolation -e "$here"
"$venv/bin/python" -c "import torch, fbgemm_gpu, torchrec, torchrec_lookahead, planners; print('install: torch', torch.__version__, '| torchrec', torchrec.__version__)"
