#!/usr/bin/env bash
# Start Debian's Prometheus (apt-get install prometheus) against a local specserve run:
#   serve run configs/local.yaml      # in another shell; Ray writes the scrape target file
#   scripts/prometheus.sh             # then http://localhost:9090
# Scrapes every Ray node listed in /tmp/ray/prom_metrics_service_discovery.json (written by
# Ray's dashboard process, so the Ray cluster must run with its dashboard). Extra arguments
# go to prometheus, e.g. --web.listen-address=:9091. Data lives in ${PROMETHEUS_DATA:-/tmp/specserve-prometheus}.
set -euo pipefail
cd "$(dirname "$0")/.."
bin="${PROMETHEUS:-$(command -v prometheus || echo /usr/bin/prometheus)}"
[ -x "$bin" ] || { echo "prometheus not found: apt-get install -y prometheus" >&2; exit 1; }
[ -e /tmp/ray/prom_metrics_service_discovery.json ] ||
  echo "note: /tmp/ray/prom_metrics_service_discovery.json is not there yet; Prometheus picks it up once Ray writes it" >&2
exec "$bin" --config.file=infra/prometheus/prometheus.yml \
  --storage.tsdb.path="${PROMETHEUS_DATA:-/tmp/specserve-prometheus}" \
  --web.listen-address="${PROMETHEUS_LISTEN:-127.0.0.1:9090}" "$@"
