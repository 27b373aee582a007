"""Resolve every dependency set with pip (dry run) and fail on any conflict.

Run by .ci/check_dependency_sets.sh, which provides a pinned pip (with `packaging`). The sets:

- requirements.txt + specserve, for CPython 3.11 and 3.12 (the CPU/embedded set);
- requirements/sglang-*.txt + specserve, each for CPython 3.12 (one set per SGLang release);
- requirements/bench-client.txt alone, for CPython 3.11 (SGLang's benchmark client).

All are resolved for Linux x86_64 (manylinux_2_5 .. manylinux_2_34: sglang's own wheels need
glibc 2.34) with wheels only. pip gets each wheel's metadata with HTTP range requests
(`fast-deps`), since the index serves no PEP 658 metadata files; no large wheel is downloaded.

A pinned NVIDIA build (`nvidia-*==V`, required by a dependency such as torch) that the
package index lacks for the target would make pip fail for that reason alone. The check then
confirms that the build is missing on its own (`pip install --no-deps nvidia-x==V` fails too),
stands in for it with an empty wheel of that name and version, resolves again, and names it
under "could not check". Every other failure, including every ResolutionImpossible, fails the
check.

Further checks on a resolved set:
- every requirement in the set's files is an exact `==` pin;
- a sglang set lists every exact pin of that sglang release's own metadata (markers evaluated
  for the target), at the same version.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
MANYLINUX_MAX = 34
PLATFORMS = [f"manylinux_2_{minor}_x86_64" for minor in range(MANYLINUX_MAX, 4, -1)] + [
    "manylinux2014_x86_64",
    "manylinux2010_x86_64",
    "manylinux1_x86_64",
]
MAX_STAND_INS = 8
SHOWN = ("sglang", "torch", "transformers", "tokenizers", "openai", "numpy", "ray", "fastapi", "pydantic")


@dataclass
class DepSet:
    name: str
    files: list[Path]
    python: str
    sglang: str | None = None  # the release whose own exact pins the files must list
    with_project: bool = True  # installed together with specserve itself
    ok: bool = False
    problems: list[str] = field(default_factory=list)
    not_checked: list[str] = field(default_factory=list)
    resolved: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0
    log: str = ""


def shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def dep_sets() -> list[DepSet]:
    sets = [DepSet(f"cpu (py{py})", [ROOT / "requirements.txt"], py) for py in ("3.11", "3.12")]
    for path in sorted((ROOT / "requirements").glob("sglang-*.txt")):
        version = path.stem.removeprefix("sglang-")
        sets.append(DepSet(f"sglang {version} (py3.12)", [path], "3.12", sglang=version))
    # SGLang's benchmark client, in a venv of its own (scripts/bench_client.sh).
    sets.append(DepSet("bench client (py3.11)", [ROOT / "requirements" / "bench-client.txt"], "3.11",
                       with_project=False))
    return sets


def pip_env() -> dict[str, str]:
    env = dict(os.environ)
    # The machine's pip config may carry a constraints file (local install caps): it is no
    # part of our sets, so it must not change what they resolve to. Indexes stay as configured.
    env["PIP_CONSTRAINT"] = os.devnull
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    env["PIP_NO_INPUT"] = "1"
    return env


def target_args(python: str) -> list[str]:
    args = ["--only-binary=:all:", "--python-version", python, "--implementation", "cp"]
    for platform in PLATFORMS:
        args += ["--platform", platform]
    return args


def pip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pip", *args],
        capture_output=True,
        text=True,
        env=pip_env(),
        cwd=ROOT,
    )


def dry_run(python: str, reqs: list[str], report: Path | None, find_links: Path | None, no_deps: bool = False):
    args = ["install", "--dry-run", "--ignore-installed", "--use-feature=fast-deps", *target_args(python)]
    if report is not None:
        args += ["--report", str(report)]
    if find_links is not None:
        args += ["--find-links", str(find_links)]
    if no_deps:
        args.append("--no-deps")
    return pip(*args, *reqs)


def pinned_in(files: list[Path]) -> tuple[dict[str, Requirement], list[str]]:
    """The requirements of the files, by name, and the lines that are not exact pins."""
    reqs: dict[str, Requirement] = {}
    loose: list[str] = []
    for path in files:
        for number, raw in enumerate(path.read_text().splitlines(), 1):
            line = raw.split(" #", 1)[0].strip()
            if not line or line.startswith("#"):
                continue
            where = f"{shown(path)}:{number}"
            if line.startswith("-"):
                loose.append(f"{where}: option lines are not allowed here: {line}")
                continue
            try:
                req = Requirement(line)
            except InvalidRequirement as exc:
                loose.append(f"{where}: {exc}")
                continue
            specs = list(req.specifier)
            if req.url or len(specs) != 1 or specs[0].operator != "==" or "*" in specs[0].version:
                loose.append(f"{where}: not an exact == pin: {line}")
            reqs[canonicalize_name(req.name)] = req
    return reqs, loose


def marker_env(python: str) -> dict[str, str]:
    return {
        "python_version": python,
        "python_full_version": f"{python}.0",
        "implementation_name": "cpython",
        "platform_python_implementation": "CPython",
        "sys_platform": "linux",
        "platform_system": "Linux",
        "platform_machine": "x86_64",
        "os_name": "posix",
        "extra": "",
    }


def sglang_pins(requires_dist: list[str], python: str) -> dict[str, Requirement]:
    """sglang's exact (==) pins that apply on the target, without extras."""
    env = marker_env(python)
    pins: dict[str, Requirement] = {}
    for text in requires_dist:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate(env):
            continue
        if any(spec.operator == "==" for spec in req.specifier):
            pins[canonicalize_name(req.name)] = req
    return pins


NO_MATCH = re.compile(r"No matching distribution found for (\S+)")


def missing_nvidia_build(log: str, ours: dict[str, Requirement]) -> str | None:
    """`nvidia-x==V` when pip's one failure is that no distribution matches that pin."""
    if "ResolutionImpossible" in log:
        return None
    found = [text.split(";", 1)[0] for text in NO_MATCH.findall(log)]
    if len(set(found)) != 1:
        return None
    try:
        req = Requirement(found[0])
    except InvalidRequirement:
        return None
    name = canonicalize_name(req.name)
    specs = list(req.specifier)
    if not name.startswith("nvidia-") or name in ours or len(specs) != 1 or specs[0].operator != "==":
        return None
    return f"{name}=={specs[0].version}"


def stand_in_wheel(folder: Path, pin: str) -> None:
    """An empty wheel named and versioned as `pin`, with no dependencies."""
    name, version = pin.split("==")
    dist = f"{name.replace('-', '_')}-{version}"
    with zipfile.ZipFile(folder / f"{dist}-py3-none-any.whl", "w") as whl:
        info = f"{dist}.dist-info"
        whl.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        whl.writestr(
            f"{info}/WHEEL",
            "Wheel-Version: 1.0\nGenerator: specserve-check\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        )
        whl.writestr(f"{info}/RECORD", "")


def check(dep: DepSet, project_wheel: Path, work: Path) -> DepSet:
    start = time.monotonic()
    ours, loose = pinned_in(dep.files)
    dep.problems += loose
    reqs = [arg for path in dep.files for arg in ("-r", str(path))]
    if dep.with_project:
        reqs.append(str(project_wheel))
    folder = work / re.sub(r"\W+", "_", dep.name)
    folder.mkdir()
    stand_ins = folder / "stand-ins"
    stand_ins.mkdir()
    report = folder / "report.json"
    logs = []
    resolved = False
    for _ in range(MAX_STAND_INS + 1):
        proc = dry_run(dep.python, reqs, report, stand_ins)
        logs.append(proc.stdout + proc.stderr)
        resolved = proc.returncode == 0
        if resolved:
            break
        pin = missing_nvidia_build(logs[-1], ours)
        if pin is None:
            dep.problems.append("pip could not resolve the set (its output follows)")
            break
        alone = dry_run(dep.python, [pin], None, None, no_deps=True)
        if alone.returncode == 0:
            dep.problems.append(f"{pin} installs on its own, yet the set did not resolve (output follows)")
            break
        stand_in_wheel(stand_ins, pin)
        dep.not_checked.append(
            f"{pin}: not on this machine's package index for cp{dep.python.replace('.', '')} manylinux x86_64; "
            "resolved with an empty stand-in of that version, so its own dependencies are unchecked"
        )
    else:
        dep.problems.append(f"more than {MAX_STAND_INS} NVIDIA builds missing; gave up")
    dep.log = "\n".join(logs)
    if resolved:
        installed = json.loads(report.read_text())["install"]
        dep.resolved = {canonicalize_name(i["metadata"]["name"]): i["metadata"]["version"] for i in installed}
        if dep.sglang is not None:
            meta = next(
                (i["metadata"] for i in installed if canonicalize_name(i["metadata"]["name"]) == "sglang"), None
            )
            if meta is None or meta["version"] != dep.sglang:
                dep.problems.append(f"resolved sglang {meta and meta['version']}, expected {dep.sglang}")
            else:
                for name, req in sglang_pins(meta.get("requires_dist", []), dep.python).items():
                    mine = ours.get(name)
                    if mine is None or mine.specifier != req.specifier:
                        dep.problems.append(
                            f"sglang {dep.sglang} pins {req.name}{req.specifier}; "
                            f"{shown(dep.files[0])} must list it at that version"
                        )
    dep.ok = not dep.problems and bool(dep.resolved)
    dep.seconds = time.monotonic() - start
    return dep


def build_project_wheel(work: Path) -> Path:
    """specserve's wheel, built from a copy so that no build output lands in the work tree."""
    src, out = work / "project-src", work / "project"
    src.mkdir()
    shutil.copy2(ROOT / "pyproject.toml", src)
    shutil.copytree(ROOT / "serve_app", src / "serve_app", ignore=shutil.ignore_patterns("__pycache__"))
    proc = pip("wheel", "--no-deps", "--quiet", "--wheel-dir", str(out), str(src))
    if proc.returncode != 0:
        print(proc.stdout + proc.stderr)
        sys.exit("check_dependency_sets: specserve itself does not build")
    return next(out.glob("specserve-*.whl"))


def main() -> int:
    start = time.monotonic()
    pip_version = pip("--version").stdout.split()[1]
    print(
        f"Dependency sets: pip {pip_version} dry runs, wheels only, Linux x86_64 "
        f"(manylinux_2_5 .. manylinux_2_{MANYLINUX_MAX}), metadata by HTTP range requests"
    )
    with tempfile.TemporaryDirectory(prefix="specserve-depcheck-") as tmp:
        work = Path(tmp)
        wheel = build_project_wheel(work)
        sets = dep_sets()
        with ThreadPoolExecutor(max_workers=len(sets)) as pool:
            done = list(pool.map(lambda dep: check(dep, wheel, work), sets))
    cpu = done[0].resolved
    cpu_pins = pinned_in([ROOT / "requirements.txt"])[0]
    for dep in done:
        files = " + ".join(shown(p) for p in dep.files)
        verdict = "OK" if dep.ok else "FAILED"
        print(
            f"\n[{verdict}] {dep.name}: {files}{' + specserve' if dep.with_project else ''}, "
            f"cp{dep.python.replace('.', '')}, "
            f"{len(dep.resolved)} packages, {dep.seconds:.0f} s"
        )
        if dep.resolved:
            print("  " + ", ".join(f"{n} {dep.resolved[n]}" for n in SHOWN if n in dep.resolved))
        if dep.sglang is not None and dep.resolved:
            differs = [
                f"{n} {cpu[n]} -> {v}"
                for n, v in sorted(dep.resolved.items())
                if n in cpu_pins and n in cpu and cpu[n] != v
            ]
            if differs:
                print("  differs from the CPU set's pins: " + ", ".join(differs))
        for line in dep.not_checked:
            print(f"  COULD NOT CHECK {line}")
        for line in dep.problems:
            print(f"  PROBLEM {line}")
        if not dep.ok and dep.log:
            print(
                "  pip's last output:\n"
                + "\n".join("    " + x for x in dep.log.splitlines()[-40:] if "is ignored: it is neither" not in x)
            )
    unchecked = [line for dep in done for line in dep.not_checked]
    failed = [dep.name for dep in done if not dep.ok]
    print(
        f"\nDependency sets: {len(done) - len(failed)}/{len(done)} resolve; "
        f"could not check: {'; '.join(unchecked) if unchecked else 'nothing'}; "
        f"{time.monotonic() - start:.0f} s"
    )
    if failed:
        print("FAILED: " + ", ".join(failed))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
