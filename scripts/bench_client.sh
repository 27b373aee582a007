#!/usr/bin/env bash
# SGLang's benchmark client, unmodified, against a running specserve app (default: the local app
# of scripts/run_local.sh on http://127.0.0.1:8000). It streams chat completions of the benchmark's
# chat prompts (serve_app/tools/bench/prompts.py, as a ShareGPT-format file) and reports TTFT,
# TPOT, ITL and throughput. Arguments go to the client, e.g.
#
#     scripts/bench_client.sh --num-prompts 64 --max-concurrency 8 --sharegpt-output-len 96
#
# BASE_URL overrides the server, MODEL the served model's name. The client installs into .venv-bench-client on first use
# (requirements/bench-client.txt); `python -m sglang.bench_serving --help` lists its options.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
venv=.venv-bench-client
if [ ! -x "$venv/bin/python" ] || ! cmp -s requirements/bench-client.txt "$venv/.installed"; then
  rm -rf "$venv"
  "${PYTHON:-python3}" -m venv "$venv"
  "$venv/bin/python" -m pip install --quiet -r requirements/bench-client.txt 2>&1 | grep -v "is ignored: it is neither" >&2 || true
  "$venv/bin/python" -c "import sglang.bench_serving" && cp requirements/bench-client.txt "$venv/.installed"
fi
data=tmp/bench-client
mkdir -p "$data"
model_dir=$(.venv/bin/python - "$data/chat.sharegpt.json" <<'PY'
import json, sys
from serve_app.engines.embedded.weights import DEFAULT_MODEL, resolve_model_dir
from serve_app.tools.bench.prompts import CHAT_PROMPTS, sharegpt
with open(sys.argv[1], "w") as f:
    json.dump(sharegpt(CHAT_PROMPTS), f)
print(resolve_model_dir(DEFAULT_MODEL))
PY
)
# vllm-chat: the client's plain OpenAI chat backend (its sglang backends also query SGLang's own
# /get_server_info route). Greedy (the client's temperature 0), streamed; ignore_eos makes each
# request run to its output length, as the client does on its completions backends.
exec "$venv/bin/python" -m sglang.bench_serving --backend vllm-chat --base-url "${BASE_URL:-http://127.0.0.1:8000}" \
  --model "${MODEL:-smollm2-135m-instruct}" --tokenizer "$model_dir" \
  --dataset-name sharegpt --dataset-path "$data/chat.sharegpt.json" --extra-request-body '{"ignore_eos": true}' "$@"
