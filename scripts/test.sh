#!/usr/bin/env bash
# Install (if needed) and run the test suite (listing its 25 slowest tests at the end: the suite is to stay near
# 20 minutes on a 2-core machine). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
export RAY_AUTH_MODE="${RAY_AUTH_MODE:-disabled}"  # tests start their own loopback Ray clusters
# Two test files at a time where there are 2 CPUs or more (pytest-xdist, each file's tests on one worker, so a
# module's Ray cluster starts once): run alone, the suite keeps about one CPU busy (it waits on Ray, sockets and
# model loads much of the time). TANDEM_TEST_WORKERS=0 runs it in this one process.
workers="${TANDEM_TEST_WORKERS:-$(( $(nproc) < 2 ? $(nproc) : 2 ))}"
exec .venv/bin/python -m pytest -q -p no:cacheprovider --durations=25 -n "$workers" --dist loadfile tests "$@"
