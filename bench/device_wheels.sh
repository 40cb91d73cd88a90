#!/usr/bin/env bash
# Wheels a GPU machine without internet needs (TRL, Liger, transformers, datasets, dill, multiprocess; Python 3.12,
# x86-64 Linux) into .whl/ (ignored by git), then .whl/COMMIT.json naming the commit they measure: run it right
# before the GPU call, after the last commit (bench/README.md, "A GPU window, step by step"). Versions: those the CPU
# tests run with (the GPU image's transformers 5.17 is below the trainers' floor); override one: TRANSFORMERS=5.18.0.
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
