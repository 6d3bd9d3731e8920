#!/usr/bin/env bash
# Wheels the GPU check needs beside the machine's own PyTorch (Python 3.12, no network
# there): torchtitan and what it and the planner import that the image lacks.
# Versions are pyproject.toml's or what torchtitan 0.3.0 resolved to in .venv.
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .whl
"${PYTHON:-.venv/bin/python}" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl \
  torchtitan==0.3.0 spmd_types==0.2.3 highspy==1.15.1 tomli==2.5.0 tyro==1.0.17 docstring_parser==0.18.0 \
  typeguard==4.6.1 torchdata==0.11.0 torch_checkpointing==0.1.1 datasets==4.7.0 dill==0.4.0 multiprocess==0.70.18
du -sh .whl
