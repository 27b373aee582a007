#!/usr/bin/env bash
# Install what specserve needs (first run only), then serve the embedded default:
# 2 CPU replicas of SmolLM2-135M-Instruct on http://127.0.0.1:8000 (serve run configs/local.yaml).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
if [ -z "${SPECSERVE_ADMIN_TOKEN:-}" ]; then
  SPECSERVE_ADMIN_TOKEN="$(.venv/bin/python -c 'import secrets; print(secrets.token_hex(16))')"
  echo "specserve: operator token for PUT /v1/speculation: $SPECSERVE_ADMIN_TOKEN" >&2
fi
export SPECSERVE_ADMIN_TOKEN RAY_USAGE_STATS_ENABLED=0
# The environment the Ray that serves the app starts with, where unset (serve_app.serving.config.RAY_ENV).
eval "$(.venv/bin/python -c 'from serve_app.serving.config import RAY_ENV
for k, v in RAY_ENV.items(): print(f"export {k}=\"${{{k}:-{v}}}\"")')"
export PATH="$PWD/.venv/bin:$PATH"
exec serve run "${@:-configs/local.yaml}"
