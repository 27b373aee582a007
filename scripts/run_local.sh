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
# Serve's HTTP proxy reaches the ingress over gRPC (serve_app.serving.config.RAY_ENV).
export SPECSERVE_ADMIN_TOKEN RAY_USAGE_STATS_ENABLED=0 RAY_SERVE_PROXY_USE_GRPC="${RAY_SERVE_PROXY_USE_GRPC:-1}" \
  RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH="${RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH:-268435456}"
export PATH="$PWD/.venv/bin:$PATH"
exec serve run "${@:-configs/local.yaml}"
