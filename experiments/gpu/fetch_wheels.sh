#!/usr/bin/env bash
# Wheels the GPU check needs beside the machine's own torch 2.11 (Python 3.12, no network
# there): torchtitan 0.2.2 and what it and the planner import that the image lacks (about
# 3 MB; the image brings numpy, numba, pyarrow, tensorboard, tokenizers, safetensors,
# huggingface_hub and fsspec). Versions are constraints/torch2.11.txt's, the set CI's smoke
# job tests on torch 2.11.
set -euo pipefail
cd "$(dirname "$0")/../.."
NEEDED="torchtitan highspy tomli tyro docstring_parser typeguard torchdata datasets dill multiprocess einops"
pins=()
for name in $NEEDED; do
  pin=$(grep -iE "^${name//_/[-_]}==" constraints/torch2.11.txt) || { echo "error: $name is not in constraints/torch2.11.txt" >&2; exit 2; }
  pins+=("$pin")
done
mkdir -p .whl
"${PYTHON:-.venv/bin/python}" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "${pins[@]}"
du -sh .whl
