#!/usr/bin/env bash
# Install (if needed) and run the test suite (listing its 25 slowest tests at the end: the suite is to stay near
# 20 minutes on a 2-core machine). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
export RAY_AUTH_MODE="${RAY_AUTH_MODE:-disabled}"  # tests start their own loopback Ray clusters
exec .venv/bin/python -m pytest -q -p no:cacheprovider --durations=25 tests "$@"
