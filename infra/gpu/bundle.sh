#!/usr/bin/env bash
# Build the offline GPU bundle (SGLang 0.5.17 + Ray Serve 2.60 + the default model) on a machine
# with PyPI access, as pieces for a GPU machine without network; infra/gpu/README.md says what it
# holds and how to carry it over.
#   infra/gpu/bundle.sh                  # pieces of at most 40 MB under .gpu/payload/
#   infra/gpu/bundle.sh --piece-mb 60    # other options: --xz-level N, --force, --lock, --download-only
# Wheels are cached in ~/.cache/specserve/gpu-wheels (SPECSERVE_GPU_WHEELS overrides); a second run
# downloads nothing, and rebuilds the site only when the pinned list or bundle.py changed.
# Needs: python3 (3.9+) with pip, xz, strip and readelf (binutils), tar. PYTHON picks the python.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
py=${PYTHON:-python3}
fail() { echo "bundle.sh: $*" >&2; exit 1; }
command -v "$py" >/dev/null 2>&1 || fail "$py not found (set PYTHON=/path/to/python3)"
"$py" -c 'import sys; sys.exit(sys.version_info < (3, 9))' || fail "$py is older than Python 3.9"
"$py" -m pip --version >/dev/null 2>&1 || fail "$py has no pip ($py -m ensurepip, or set PYTHON)"
for tool in xz strip readelf tar; do
    command -v "$tool" >/dev/null 2>&1 || fail "$tool is not on PATH (Debian/Ubuntu: apt-get install xz-utils binutils tar)"
done
exec "$py" -u "$here/bundle.py" "$@"
