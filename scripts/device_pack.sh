#!/usr/bin/env bash
# Packs, on this machine, what `make gpu-check` needs on a lent GPU machine into .gpu/.
#
# The lent machine's image has torch 2.11 (CUDA 13) and no package registry, and no
# FBGEMM or TorchRec; the release train that loads beside its torch is fbgemm-gpu 1.6
# and torchrec 1.6.1 (shared/notes/gpu-device.md). FBGEMM's CUDA wheel is 465 MB and a
# device call carries 64 MiB, so its unpacked files travel as one xz stream (168 MiB,
# against the wheel's 465 MB) cut into pieces, one folder per piece:
# .gpu/p00 ... .gpu/pNN, the small wheels in .gpu/whl. Each device call carries one
# piece (`carry: [".gpu/p03"]`); scripts/device_check.sh joins and runs them there.
# .gitignore keeps .gpu/ out of git and out of what a device call copies unasked.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
dest=$here/.gpu
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
rm -rf "$dest" && mkdir -p "$dest/whl"
get=(python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12
     --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
     --platform manylinux2014_x86_64)
"${get[@]}" -d "$work" fbgemm-gpu==1.6.0
"${get[@]}" -d "$dest/whl" torchrec==1.6.1 tensordict==0.12.1 pyvers==0.2.3 orjson==3.13.0 \
  importlib_metadata==10.2.0 zipp==4.1.2
python3 -m pip wheel --quiet --no-deps -w "$dest/whl" iopath==0.1.10  # an sdist only
mkdir "$work/site"
python3 -m zipfile -e "$work"/fbgemm_gpu-1.6.0-*.whl "$work/site"
tar -C "$work/site" -cf - . | xz -T0 -6 | split -b 60M -d -a 2 - "$work/piece-"
for piece in "$work"/piece-*; do
  n=${piece##*-}
  mkdir "$dest/p$n" && mv "$piece" "$dest/p$n/"
done
du -sh "$dest"/* | tr '\t' ' '
