#!/usr/bin/env bash
# Download, on a machine with network, the wheels that scripts/gpu_check.sh installs on a CUDA machine that
# has PyTorch, Triton and transformers but not the rest of engine/'s imports (pyahocorasick for stop strings,
# xgrammar and its pydantic for structured output), and cannot reach a package index.
#
#   scripts/gpu_wheels.sh [DIR]      # default .whl; versions: those installed in .venv; CPython 3.12, x86-64
#
# gpu_check.sh installs DIR/*.whl into a scratch folder on its PYTHONPATH when DIR exists. Seen needed on the
# first GPU run (an H200 image with torch 2.11, triton 3.6, transformers 5.17, Python 3.12, no pyahocorasick,
# xgrammar or pydantic); msgspec (request and output structs) and pyzmq (the engine core process) since.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-.whl}
py=${PYTHON:-.venv/bin/python}
pyver=${GPU_PYTHON_VERSION:-3.12}
mkdir -p "$dir"
for name in pyahocorasick msgspec pyzmq xgrammar apache-tvm-ffi pydantic pydantic-core annotated-types typing-inspection \
            typing-extensions; do
  version=$("$py" -c "import importlib.metadata as m; print(m.version('$name'))")
  "$py" -m pip download -q --no-deps --only-binary=:all: --python-version "$pyver" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$dir" "$name==$version"
done
ls "$dir"
