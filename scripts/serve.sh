#!/usr/bin/env bash
# Install (if needed) and start Tandem on the embedded default model.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
exec .venv/bin/python -m engine.demo "$@"
