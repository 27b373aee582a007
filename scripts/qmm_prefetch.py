"""qmm.c with and without its weight prefetch, side by side: one thread's pass over the products
of SmolLM2-135M's 30 layers (Q4_1: fused q/k/v, o, fused gate/up, down) and its LM head (Q8_0),
at 1, 4 and 16 rows of activations (a plain decode step, a verify of 3 drafts, a batch).

    python scripts/qmm_prefetch.py --out bench/results/qmm_prefetch.json

Both builds compile the same qmm.c with the flags the engine uses, the second with
-DQMM_PF_BLOCKS=0; the weights are random codes packed once (the layout does not depend on the
prefetch), larger together than the last-level cache, as the model's are. Passes alternate
between the builds, in mirrored order, and every output of the two is checked to be the same
bits before any timing. Prints the median pass of each and their ratio and writes them as JSON.

``--against FILE`` times another version of qmm.c (e.g. ``git show REV:serve_app/engines/embedded/qmm.c
> /tmp/qmm_old.c``) in place of the build without prefetch. Each build packs the same codes into
its own layout, and since another version may sum in another order, the outputs are checked to
agree within float32 rounding (1e-4 of each product's largest output) instead of bit for bit.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import platform
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

from serve_app.engines.embedded import qmm
from serve_app.tools.bench.engine import cpu_model

D, INTER, Q_DIM, KV_DIM, LAYERS, VOCAB = 576, 1536, 576, 192, 30, 49152
SHAPES = [(Q_DIM + 2 * KV_DIM, D), (D, Q_DIM), (2 * INTER, D), (D, INTER)]  # (N, K) of each layer's products
I64 = ctypes.c_int64


def ptr(a: np.ndarray) -> ctypes.c_void_p:
    return a.ctypes.data_as(ctypes.c_void_p)


def pack(lib: ctypes.CDLL, rng: np.random.Generator, num_layers: int) -> tuple[list, tuple]:
    """The layers' packed Q4_1 matrices and the LM head's packed Q8_0 one."""
    layers = []
    for n, k in SHAPES * num_layers:
        codes = rng.integers(0, 16, size=(n, k), dtype=np.uint8)
        d = (rng.random((n, k // 32), dtype=np.float32) * 0.02).astype(np.float16).astype(np.float32)
        mn = (-rng.random((n, k // 32), dtype=np.float32) * 0.1).astype(np.float16).astype(np.float32)
        out = np.empty(lib.qmm_q4_1_packed_size(I64(n), I64(k)), dtype=np.uint8)
        lib.qmm_pack_q4_1(ptr(codes), ptr(d), ptr(mn), I64(n), I64(k), ptr(out))
        layers.append((n, k, out))
    codes = rng.integers(-127, 128, size=(VOCAB, D), dtype=np.int8)
    d = (rng.random((VOCAB, D // 32), dtype=np.float32) * 0.02).astype(np.float16).astype(np.float32)
    head = np.empty(lib.qmm_q8_0_packed_size(I64(VOCAB), I64(D)), dtype=np.uint8)
    lib.qmm_pack_q8_0(ptr(codes), ptr(d), I64(VOCAB), I64(D), ptr(head))
    return layers, (VOCAB, D, head)


def one_pass(lib: ctypes.CDLL, layers: list, head: tuple, xs: list[np.ndarray]) -> tuple[float, list[np.ndarray]]:
    """Seconds for every product once (``xs``: the layers' inputs, then the head's), and the outputs."""
    products = [(lib.qmm_linear_q4_1, *layer) for layer in layers] + [(lib.qmm_linear_q8_0, *head)]
    outs = []
    start = time.perf_counter()
    for (kernel, n, k, w), x in zip(products, xs, strict=True):
        y = np.empty((x.shape[0], n), dtype=np.float32)
        if kernel(ptr(x), None, ctypes.c_float(0), I64(x.shape[0]), I64(k), ptr(w), I64(n), ptr(y)):
            raise MemoryError(kernel.__name__)
        outs.append(y)
    return time.perf_counter() - start, outs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,4,16", help="comma list of activation rows (default 1,4,16)")
    p.add_argument("--repeats", type=int, default=40, help="timed passes of each build at each row count")
    p.add_argument("--layers", type=int, default=LAYERS, help=f"layers of products (default {LAYERS}, the model's)")
    p.add_argument("--against", help="another version of qmm.c to time in place of the build without prefetch")
    p.add_argument("--out", help="write the results as JSON")
    args = p.parse_args(argv)
    rows = [int(r) for r in args.rows.split(",")]
    if args.repeats < 2 or args.layers < 1 or any(r < 1 for r in rows):
        sys.exit("--repeats must be at least 2, --layers and every --rows entry at least 1")
    with tempfile.TemporaryDirectory() as tmp:
        this = qmm.load(qmm.compile_library(Path(tmp) / "this.so"))
        if args.against:
            baseline_name = Path(args.against).name
            baseline = qmm.load(qmm.compile_library(Path(tmp) / "against.so", source=Path(args.against)))
        else:
            baseline_name = "no prefetch"
            baseline = qmm.load(qmm.compile_library(Path(tmp) / "plain.so", ("-DQMM_PF_BLOCKS=0",)))
    builds = {"this": this, "baseline": baseline}
    path = this.qmm_path().decode()
    if path == "c" and not args.against:
        print("note: this CPU runs qmm.c's plain C path, which has no prefetch: the builds are the same")
    print("packing weights ...", flush=True)
    # the same codes in each build's layout (another version of qmm.c may pack another way)
    packed = {b: pack(lib, np.random.default_rng(0), args.layers) for b, lib in builds.items()}
    rng = np.random.default_rng(1)
    layers, head = packed["this"]
    # an input for every product: each layer's, then the LM head's
    xs = {m: [rng.standard_normal((m, k), dtype=np.float32) for _, k, _ in [*layers, head]] for m in rows}

    def one(b: str, m: int) -> tuple[float, list[np.ndarray]]:
        return one_pass(builds[b], *packed[b], xs[m])

    for m in rows:
        ref, got = one("baseline", m)[1], one("this", m)[1]
        same = (all(np.array_equal(a, b) for a, b in zip(ref, got, strict=True)) if not args.against else
                all(np.abs(a - b).max() <= 1e-4 * np.abs(a).max() for a, b in zip(ref, got, strict=True)))
        if not same:
            sys.exit(f"the builds' outputs differ at {m} rows")
    times: dict[tuple[str, int], list[float]] = {(b, m): [] for b in builds for m in rows}
    names = list(builds)
    for rep in range(args.repeats):
        for m in rows:
            for b in names if rep % 2 == 0 else names[::-1]:
                times[(b, m)].append(one(b, m)[0])
    results = []
    print(f"{'rows':>5} {baseline_name + ' ms':>15} {'this ms':>12} {'ratio':>7}")
    for m in rows:
        base = statistics.median(times[("baseline", m)]) * 1e3
        mine = statistics.median(times[("this", m)]) * 1e3
        results.append({"rows": m, "baseline_ms": round(base, 3), "this_ms": round(mine, 3),
                        "baseline_over_this": round(base / mine, 3)})
        print(f"{m:>5} {base:>15.2f} {mine:>12.2f} {base / mine:>6.2f}x")
    if args.out:
        meta = {"command": "python scripts/qmm_prefetch.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                "date": datetime.now(UTC).isoformat(timespec="seconds"), "host": platform.node(), "cpu_model": cpu_model(),
                "path": path, "baseline": baseline_name, "repeats": args.repeats, "layers": args.layers, "weights_mb": round(
                    (sum(w.nbytes for *_, w in layers) + head[2].nbytes) / 2**20, 1)}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"meta": meta, "rows": results}, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
