#!/usr/bin/env bash
# On a machine with a CUDA GPU: run the GPU tests and the GPU benchmarks, collect the results.
#
#   scripts/gpu_check.sh [all|full|tests|fused|bench|photon|graphs|mixed|throughput|bs1|kernels] [bench_gpu.py args]
#
#   all (default) the check sized for one device call of under 8 minutes (GPU_CHECK_BUDGET seconds, default 470;
#               each part is cut off at its share and a part that no longer fits is skipped, said so in the log):
#               1. fused: the fused forward's Triton kernels against the eager path on CUDA, its fp32 greedy
#                  against HF with and without graphs, its CUDA kernels per decoder layer from torch.profiler
#                  (printed; tests/test_fused_kernels.py, test_fused_forward.py -m gpu);
#               2. graphs: step times (with and without the profiler), kernel time, kernels per step and the
#                  heaviest kernels at 1, 8 and 32 streams for Qwen2.5-0.5B and Llama-3.2-1B with the fused
#                  forward, graphs on (GRAPHS_FORWARD="fused layers" adds the eager layers, as the last run did);
#               2b. mixed: a step with a prompt chunk beside decodes, eager against its mixed-step graph (host
#                  and device time, logits compared), both models (new: not run on a GPU yet);
#               3. bs1: one sequence's time per token against the weight-bandwidth floor, with transformers'
#                  generate on the same weights as the peer (128 of its tokens timed);
#               4. photon: pipelined against blocking at 1 and 32 streams, the GPU's idle per step, now that the
#                  fused forward leaves the host half the time it had;
#               5. kernels: the fused gate/up GEMM's tiles swept at both models' shapes and 1/8/32 rows, against
#                  cuBLAS + act_mul and the weights' floor (the largest kernel of a fused step on the last run);
#               6. tests: the runtime's GPU tests (below).
#   tests       pytest: Triton kernels vs the PyTorch reference on CUDA (fp32, bf16), the kernels compiled for
#               sm_90, graph replay vs eager, pipelined vs blocking, fp32 greedy vs HF, no host sync in the
#               loop, offload dependency ordering (tests/test_attention_kernels.py, test_gpu_runtime.py,
#               test_runtime_paths.py), and the -m gpu tests of the KV offload side stream, the step records and
#               the fused-MoE kernels
#   fused       part 1 of all
#   photon|graphs|mixed|throughput|bs1|kernels   one benchmark (bench/bench_gpu.py), all three models unless --models
#   bench       the six benchmarks;  full: tests, fused, then the six benchmarks (several device calls)
#
# Needs torch with CUDA, triton, transformers, tokenizers, safetensors, numpy, pytest; no ray or fastapi. engine/
# also imports pyahocorasick and xgrammar (with pydantic): where the machine lacks them and reaches no package
# index, run scripts/gpu_wheels.sh on a machine that does and bring the .whl folder along with the checkout;
# this script installs .whl/*.whl into a scratch folder on PYTHONPATH. Nothing is downloaded: the benchmark
# models are random weights with the real configs. Results (JSON, markdown, PNG) are written to bench/results/;
# when $OUT is set (the device tool's output folder) they are also packed into $OUT/gpu_results.tgz, with
# $OUT/summary.md (every table of this run) and the logs next to it.
# How long each part took on a GPU is in docs/gpu.md (the GPU runs). Keep each call under the device tool's
# 10-minute limit.
set -uo pipefail
cd "$(dirname "$0")/.."
what=${1:-all}
shift || true
py=${PYTHON:-python3}
results=bench/results
logs=${OUT:-$results}
mkdir -p "$results" "$logs"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
if compgen -G ".whl/*.whl" > /dev/null; then  # packages the machine lacks (scripts/gpu_wheels.sh)
  site=$(mktemp -d)
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" .whl/*.whl \
    || { echo "installing .whl/*.whl failed"; exit 2; }
  export PYTHONPATH="$site:$PYTHONPATH"
fi
stamp=$(mktemp)
status=0

"$py" - <<'EOF' || { echo "no usable CUDA device, or engine/ does not import"; exit 2; }
import torch, triton, transformers
assert torch.cuda.is_available(), "torch sees no CUDA device"
import engine  # every package engine/ imports is here (else: scripts/gpu_wheels.sh, and carry .whl)
print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | triton {triton.__version__} | "
      f"transformers {transformers.__version__}")
EOF
nvidia-smi --query-gpu=name,memory.total,memory.used,clocks.sm,temperature.gpu --format=csv 2>/dev/null || true

run_tests() {
  "$py" -m pytest -q -p no:cacheprovider -rs tests/test_attention_kernels.py tests/test_gpu_runtime.py \
    tests/test_runtime_paths.py 2>&1 | tee -a "$logs/gpu_tests.log"
  local first=${PIPESTATUS[0]}
  # The CUDA tests of the KV offload side stream, the per-step CUDA-event timings and the fused-MoE kernels.
  "$py" -m pytest -q -p no:cacheprovider -rs -m gpu tests/test_kv_offload.py tests/test_step_records.py \
    tests/test_moe.py 2>&1 | tee -a "$logs/gpu_tests.log"
  local second=${PIPESTATUS[0]}
  (( first != 0 )) && return "$first"
  return "$second"
}

run_fused_tests() {
  # The fused forward (-s: its profiler counts of kernels per layer are printed into the log).
  "$py" -m pytest -q -s -p no:cacheprovider -rs -m gpu tests/test_fused_kernels.py tests/test_fused_forward.py 2>&1 \
    | tee -a "$logs/gpu_fused_tests.log"
  local rc=${PIPESTATUS[0]}
  grep "CUDA kernels per layer" "$logs/gpu_fused_tests.log" || true
  return "$rc"
}

run_bench() {
  local name=$1
  shift
  "$py" bench/bench_gpu.py "$name" --device cuda --out "$results" "$@" 2>&1 | tee "$logs/bench_$name.log"
  return "${PIPESTATUS[0]}"
}

export -f run_tests run_fused_tests run_bench
export py logs results
budget=${GPU_CHECK_BUDGET:-470}
# part NAME CAP CMD...: run CMD cut off at CAP seconds or at what is left of the budget; skip it under 30 s left.
part() {
  local name=$1 cap=$2
  shift 2
  local left=$(( budget - SECONDS ))
  (( left < cap )) && cap=$left
  if (( cap < 30 )); then
    echo "== $name: skipped, ${left}s of the ${budget}s budget left"
    status=3
    return
  fi
  echo "== $name (at ${SECONDS}s, up to ${cap}s)"
  timeout -k 10 "$cap" bash -c '"$@"' "$name" "$@"
  local rc=$?
  (( rc == 124 || rc == 137 )) && echo "== $name: cut off at ${cap}s"
  (( rc != 0 )) && status=$rc
  echo "== $name: exit $rc at ${SECONDS}s"
}

case "$what" in
  all)
    part fused 150 run_fused_tests
    part graphs 120 run_bench graphs --models qwen2.5-0.5b llama-3.2-1b --forward ${GRAPHS_FORWARD:-fused} \
      --no-eager "$@"
    part mixed 60 run_bench mixed --models qwen2.5-0.5b llama-3.2-1b "$@"
    part bs1 90 run_bench bs1 --models qwen2.5-0.5b llama-3.2-1b --hf-tokens 128 "$@"
    part photon 100 run_bench photon --models qwen2.5-0.5b llama-3.2-1b --streams 1 32 "$@"
    part kernels 130 run_bench kernels --models qwen2.5-0.5b llama-3.2-1b "$@"
    part tests "$budget" run_tests ;;  # what is left of the budget (docs/gpu.md: each part's time)
  tests) run_tests || status=$? ;;
  fused) run_fused_tests || status=$? ;;
  photon|graphs|mixed|throughput|bs1|kernels) run_bench "$what" "$@" || status=$? ;;
  bench|full)
    if [ "$what" = full ]; then run_tests || status=$?; run_fused_tests || status=$?; fi
    for b in photon graphs mixed throughput bs1 kernels; do run_bench "$b" "$@" || status=$?; done ;;
  *) echo "unknown part: $what (all|full|tests|fused|bench|photon|graphs|mixed|throughput|bs1|kernels)"; exit 2 ;;
esac

# This run's tables in one file, and everything packed for the trip back.
find "$results" -name '*_cuda*.md' -newer "$stamp" -print0 | sort -z | xargs -0 -r cat > "$logs/summary.md"
if [ -n "${OUT:-}" ]; then
  tar czf "$OUT/gpu_results.tgz" -C bench results
fi
rm -f "$stamp"
echo "gpu_check $what: exit status $status; results in $results${OUT:+ and \$OUT}"
exit "$status"
