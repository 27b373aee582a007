#!/usr/bin/env bash
# GPU smoke benchmark of the SGLang backend on one 8-GPU node; see infra/gpu/smoke.py.
#   infra/gpu/smoke.sh --model meta-llama/Llama-3.3-70B-Instruct --draft yuhuili/EAGLE3-LLaMA3.3-Instruct-70B
# Needs: pip install -r requirements/sglang-0.5.17.txt .  (or requirements/sglang-0.5.23.txt; the '.' installs the plugin's entry point)
set -euo pipefail
cd "$(dirname "$0")/../.."
gpus=$(nvidia-smi --list-gpus | wc -l)
echo "GPUs: $gpus" >&2
python -c 'import importlib.metadata as m; assert any(e.name == "specserve" for e in m.entry_points(group="sglang.srt.plugins")), "pip install . first (plugin entry point missing)"'
export SGLANG_PLUGINS=specserve
exec python infra/gpu/smoke.py "$@"
