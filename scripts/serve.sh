#!/usr/bin/env bash
# Install (if needed) and start Tandem's OpenAI server on http://127.0.0.1:8000 (embedded default model).
# Extra arguments replace the default target, e.g. `scripts/serve.sh configs/autoscaling.yaml`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
# Ray 2.60 turns token auth on by default; a local single-user server does not need it.
export RAY_AUTH_MODE="${RAY_AUTH_MODE:-disabled}"
# serve_app.builder.CLUSTER_ENV, which build_app also applies when `serve run` starts the cluster from an import
# path (a config file needs it here): Serve's proxy talks gRPC to the ingress and routes on its own loop, and
# Serve's controller loops every 0.5 s.
export RAY_SERVE_PROXY_USE_GRPC="${RAY_SERVE_PROXY_USE_GRPC:-1}"
export RAY_SERVE_CONTROL_LOOP_INTERVAL_S="${RAY_SERVE_CONTROL_LOOP_INTERVAL_S:-0.5}"
export RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP="${RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP:-0}"
if [ "$#" -eq 0 ]; then set -- serve_app:app; fi
exec .venv/bin/serve run "$@"
