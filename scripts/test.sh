#!/usr/bin/env bash
# Install what the tests need, then run the tests: the fast ones by default, all of them with
# --full (what CI runs). Extra arguments go to pytest. Two pytest-xdist workers share the
# machine: the tests wait on servers and processes about as long as they compute, and most
# compute on one core. The modules that use the session's Ray run in one of them, the others
# module by module in either (tests/conftest.py); `-n 0` runs everything in one process.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
export SPECSERVE_WHEEL_CACHE="$(PYTHON=.venv/bin/python .ci/fetch_sglang_wheel.sh)"  # every supported sglang release, for the drift guard
exec .venv/bin/python -m pytest -n 2 --dist loadscope "$@"
