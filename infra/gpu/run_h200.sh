#!/usr/bin/env bash
# Run specserve's SGLang backend for real on one GPU node without network (one H200):
#   infra/gpu/run_h200.sh prepare PIECES_DIR   # join and unpack the bundle (infra/gpu/unpack.sh), export the models
#   infra/gpu/run_h200.sh engine  OUT_DIR      # infra/gpu/engine_study.py: lossless greedy output, speed per step count
#   infra/gpu/run_h200.sh serve   OUT_DIR      # infra/gpu/serve_study.py: serve run configs/gpu-h200.yaml, the ramp, the table
# Each step writes its log and JSON under OUT_DIR; `serve` merges `engine`'s JSON (kept in
# $SPECSERVE_GPU/engine.json) into OUT_DIR/gpu_sglang_h200.json. SPECSERVE_GPU (default
# /tmp/specserve-gpu) holds the unpacked bundle, its env.sh, the GGUF and the exported models.
set -euo pipefail
cd "$(dirname "$0")/../.."
step="${1:?usage: run_h200.sh prepare|engine|serve DIR}"
dir="${2:?usage: run_h200.sh prepare|engine|serve DIR}"
gpu="${SPECSERVE_GPU:-/tmp/specserve-gpu}"
export PYTHONUNBUFFERED=1

case "$step" in
  prepare)
    infra/gpu/unpack.sh "$dir" "$gpu"
    # shellcheck disable=SC1091
    source "$gpu/env.sh"
    gguf="$(ls "$gpu"/model/*.gguf | head -1)"
    python3 serve_app/engines/sglang/export.py --out "$gpu/hf" --gguf "$gguf"
    python3 - <<'EOF'
import importlib.metadata as m
import ray, sglang
from ray import serve
from serve_app.engines.sglang import compat
print("sglang", sglang.__version__, "ray", ray.__version__, "release", compat.installed())
print("plugin entry point:", [e.value for e in m.entry_points(group="sglang.srt.plugins")])
EOF
    ;;
  engine)
    # shellcheck disable=SC1091
    source "$gpu/env.sh"
    mkdir -p "$dir"
    python3 infra/gpu/engine_study.py all --model "$gpu/hf/target" --draft "$gpu/hf/draft" \
      --out "$dir/engine.json" --deadline-s "${DEADLINE_S:-480}" 2>&1 | tee "$dir/engine.log"
    cp "$dir/engine.json" "$gpu/engine.json"
    ;;
  serve)
    # shellcheck disable=SC1091
    source "$gpu/env.sh"
    mkdir -p "$dir"
    python3 infra/gpu/serve_study.py --config configs/gpu-h200.yaml --model "$gpu/hf/target" \
      --engine-json "$gpu/engine.json" --out "$dir/gpu_sglang_h200.json" --logs "$dir/logs" 2>&1 | tee "$dir/serve.log"
    ;;
  *)
    echo "unknown step $step: prepare, engine or serve" >&2
    exit 2
    ;;
esac
