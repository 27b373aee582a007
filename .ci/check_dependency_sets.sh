#!/usr/bin/env bash
# Resolve every dependency set (requirements.txt on CPython 3.11 and 3.12, and each
# requirements/sglang-*.txt on CPython 3.12, all for Linux x86_64) with pip's dry run, and fail
# on any conflict. The logic and what it prints: .ci/check_dependency_sets.py.
# It runs with a pinned pip in its own venv (cached; SPECSERVE_DEPCHECK_VENV overrides where),
# made with PYTHON (default python3).
set -euo pipefail
cd "$(dirname "$0")/.."
pip_pin="pip==26.3"
packaging_pin="packaging==26.4"
venv="${SPECSERVE_DEPCHECK_VENV:-$HOME/.cache/specserve/depcheck-venv}"
stamp="$venv/.installed"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$pip_pin $packaging_pin" ]; then
  rm -rf "$venv"
  "${PYTHON:-python3}" -m venv "$venv"
  PIP_CONSTRAINT=/dev/null "$venv/bin/python" -m pip install --quiet --disable-pip-version-check \
    "$pip_pin" "$packaging_pin" 2>&1 | grep -v "is ignored: it is neither" >&2 || true
  "$venv/bin/python" -c "import packaging" && echo "$pip_pin $packaging_pin" > "$stamp"
fi
exec "$venv/bin/python" .ci/check_dependency_sets.py "$@"
