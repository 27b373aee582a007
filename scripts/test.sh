#!/usr/bin/env bash
# Install what the tests need, then run the tests: the fast ones by default, all of them with
# --full (what CI runs). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
export SPECSERVE_WHEEL_CACHE="$(PYTHON=.venv/bin/python .ci/fetch_sglang_wheel.sh)"  # every supported sglang release, for the drift guard
exec .venv/bin/python -m pytest "$@"
