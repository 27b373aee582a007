#!/usr/bin/env bash
# Download the pinned sglang wheel (no dependencies; ~39 MB) into a cache, once, and print its path.
# The tests find it in the same place (serve_app/engines/sglang/pinned.py); override the cache
# folder with SPECSERVE_WHEEL_CACHE, the Python with PYTHON.
set -euo pipefail

version=0.5.23
sha256=00b3cd5b265ac76c64185fbb6b95424f324ddd9f428d0306b77bc9db9d859937
name="sglang-${version}-cp311-cp311-manylinux_2_34_x86_64.whl"
cache="${SPECSERVE_WHEEL_CACHE:-$HOME/.cache/specserve/wheels}"
wheel="$cache/$name"

if [ ! -f "$wheel" ]; then
  mkdir -p "$cache"
  tmp="$(mktemp -d "$cache/.download.XXXXXX")"
  trap 'rm -rf "$tmp"' EXIT
  # Pin the platform so the same wheel comes down on any CI host.
  "${PYTHON:-python3}" -m pip download --quiet --no-deps --only-binary=:all: \
    --platform manylinux_2_34_x86_64 --python-version 3.11 --implementation cp \
    "sglang==${version}" -d "$tmp" >&2
  echo "${sha256}  $tmp/$name" | sha256sum --check --quiet >&2
  mv "$tmp/$name" "$wheel"
fi
echo "$wheel"
