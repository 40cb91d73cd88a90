#!/usr/bin/env bash
# Wheels that a GPU machine without internet needs for `python -m bench session / gpu / w4 / w5` and the GPU
# test-suite, downloaded here into .whl/ (ignored by git) for Python 3.12 on x86-64 Linux. The GPU image this
# project is measured on has torch 2.11, triton 3.6 and transformers 5.17 (below the trainers' floor, 5.18) but not
# TRL, Liger, datasets, dill or multiprocess. Carry `.whl` with the command: bench/gpu_session.sh installs it there
# (and fastrl itself, editable, since fastrl.kernels is the kernels/ folder).
# Last, .whl/COMMIT.json: the commit, whether the tree is clean, and a digest of the tracked files
# (bench/provenance.py), so the results name the fastrl they measured: run this right before the GPU call, after
# the last commit (it downloads nothing already in .whl/).
# Versions are the ones this repository's CPU tests run with; override one with e.g. TRANSFORMERS=5.18.0.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST="${1:-.whl}"
mkdir -p "$DEST"
PKGS=(
    "trl==${TRL:-1.16.0}"
    "liger-kernel==${LIGER:-0.8.5}"
    "transformers==${TRANSFORMERS:-5.23.0}"
    "datasets==${DATASETS:-5.2.0}"
    "dill==0.4.1"
    "multiprocess==0.70.19"
)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$DEST" "${PKGS[@]}"
python3 -m bench.provenance stamp "$DEST/COMMIT.json"
ls -1 "$DEST"
du -sh "$DEST"  # the device tool carries at most 64 MiB with the working tree
