#!/usr/bin/env bash
# Creates a virtual environment with the compatibility dependency set
# (requirements/compat.txt: the newest TorchRec release and its torch /
# FBGEMM) and installs the project into it in editable mode. The tests run
# in it exactly as in .venv: `$venv/bin/python -m pytest`.
set -euo pipefail
venv=${1:-.venv-compat}
python=${PYTHON:-python3}
here=$(cd "$(dirname "$0")/.." && pwd)
torchrec=torchrec==1.9.2
echo "install-compat: $torchrec set into $venv"

[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
# Keep the venv out of git whatever its name (as Python 3.13's venv does).
[ -e "$venv/.gitignore" ] || echo '*' > "$venv/.gitignore"
pip=("$venv/bin/python" -m pip --disable-pip-version-check)
"${pip[@]}" install --quiet --upgrade pip
"${pip[@]}" install --quiet -r "$here/requirements/compat.txt" -r "$here/requirements/dev.txt"
"${pip[@]}" install --quiet --no-deps "$torchrec"
"${pip[@]}" install --quiet --no-deps --no-build-isolation -e "$here"
"$venv/bin/python" -c "import torch, fbgemm_gpu, torchrec, torchrec_lookahead, planners; print('install-compat: torch', torch.__version__, '| fbgemm_gpu', fbgemm_gpu.__version__, fbgemm_gpu.__variant__, '| torchrec', torchrec.__version__)"
