#!/usr/bin/env bash
# Download the sglang wheels of every supported release (no dependencies; 22-39 MB each) into a
# cache, once, check their sha256, and print the cache folder. The releases and sums are in
# .ci/sglang_wheels.txt; the tests find the wheels in the same folder
# (serve_app/tools/sglang_pins.py). Override the folder with SPECSERVE_WHEEL_CACHE, the
# Python with PYTHON.
set -euo pipefail
list="$(dirname "$0")/sglang_wheels.txt"
cache="${SPECSERVE_WHEEL_CACHE:-$HOME/.cache/specserve/wheels}"
mkdir -p "$cache"
tmp="$(mktemp -d "$cache/.download.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT
grep -v '^#' "$list" | while read -r version name sha256; do
  [ -n "$version" ] || continue
  if [ ! -f "$cache/$name" ]; then
    echo "fetching sglang $version" >&2
    # The platform and Python are pinned so the same wheel comes down on any CI host.
    "${PYTHON:-python3}" -m pip download --quiet --no-deps --only-binary=:all: \
      --platform manylinux_2_34_x86_64 --python-version 3.12 --implementation cp \
      "sglang==${version}" -d "$tmp" 2>&1 | grep -v "is ignored: it is neither" >&2 || true
    echo "${sha256}  $tmp/$name" | sha256sum --check --quiet >&2
    mv "$tmp/$name" "$cache/$name"
  fi
done
echo "$cache"
