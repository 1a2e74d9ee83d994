"""A batched decode step's weight products (mlxpipe/cpu/gemv.c) from two builds of the shim, side by side.

    MLXPIPE_KERNELS=off PYTHONPATH=. flock -x /tmp/mlxpipe-cpu.lock python bench/qgemm_ab.py [--before main]
        [--batch 16,64] [--rounds 4] [--threads 1]

(``MLXPIPE_KERNELS=off``: the float32 path, whose matrices are attached to the shim; ``--dtype auto``
computes a quantized model through ``cpu/kernels`` instead, and nothing would be attached.)

Compiles ``gemv.c`` as it is at ``--before`` (a git revision) and as it is in this checkout, loads both as
libraries of their own (each with its own table of matrices and helper thread), attaches the embedded
model's 211 quantized matrices to both, and times the step's products (every matrix by B random rows, as
``bench/batch_steps.py``'s "products"), alternating the builds round by round so that other load on the CPU
falls on both alike. Reports wall and CPU time per build, per kind of matrix too, and the largest difference
between the builds' results and from float64 (relative to the largest value).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from mlxpipe import Engine  # the BLAS first, then mlx
from mlxpipe.cpu import blas, gemv

REPO = Path(__file__).resolve().parent.parent


def build(source: bytes, folder: str, name: str) -> Any:
    """``source`` compiled as gemv.py compiles it, loaded as a library of its own in front of the BLAS."""
    c, so = Path(folder) / f"{name}.c", Path(folder) / f"{name}.so"
    c.write_bytes(source)
    subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-o", str(so), str(c)], check=True)
    shim = ctypes.CDLL(str(so), mode=ctypes.RTLD_LOCAL)
    openblas = ctypes.CDLL(blas._candidates()[0][1], mode=ctypes.RTLD_LOCAL)
    p = ctypes.c_void_p
    assert shim.mlxpipe_gemv_init(ctypes.cast(openblas.cblas_sgemm, p), ctypes.cast(openblas.cblas_sgemv, p))
    shim.mlxpipe_qgemm_max_rows(gemv.MAX_ROWS)
    shim.mlxpipe_qgemm_amx(gemv.AMX_ROWS)
    return shim


def ms(times: list[float]) -> str:
    return f"{min(times) * 1e3:.1f} / {statistics.median(times) * 1e3:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", default="main", help="git revision of the build to compare against")
    parser.add_argument("--batch", default="16,64")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--reps", type=int, default=3, help="steps timed per build and round")
    parser.add_argument("--threads", type=int, default=1, help="the shim's threads (1: no helper)")
    args = parser.parse_args()

    before = subprocess.run(
        ["git", "show", f"{args.before}:mlxpipe/cpu/gemv.c"], cwd=REPO, capture_output=True, check=True
    ).stdout
    after = (REPO / "mlxpipe/cpu/gemv.c").read_bytes()
    engine = Engine.load()  # kept: its matrices stay attached while it lives
    entries = [
        (np.asarray(w), np.asarray(q), np.asarray(s), np.asarray(b), bits, g)
        for w, q, s, b, bits, g in gemv._attached.values()
    ]
    with tempfile.TemporaryDirectory() as folder:
        shims = {"before": build(before, folder, "before"), "after": build(after, folder, "after")}
        p, f = ctypes.c_void_p, ctypes.c_float
        for shim in shims.values():
            shim.mlxpipe_qgemm_threads(args.threads)
            for w, q, s, b, bits, g in entries:
                addresses = (p(q.ctypes.data), p(s.ctypes.data), p(b.ctypes.data))
                assert shim.mlxpipe_qgemv_register(p(w.ctypes.data), *w.shape, bits, g, *addresses)
        load = os.getloadavg()[0]
        print(f"load average before: {load:.2f}; {len(entries)} matrices; threads {args.threads}")
        print("| B | build | wall ms min / median | CPU ms min / median | CPU ms by kind (min) |")
        print("|---|---|---|---|---|")
        for b in [int(x) for x in args.batch.split(",")]:
            rng = np.random.default_rng(b)
            xs = {k: rng.standard_normal((b, k), np.float32) for k in {w.shape[1] for w, *_ in entries}}
            out = {name: [np.zeros((b, w.shape[0]), np.float32) for w, *_ in entries] for name in shims}
            wall: dict[str, list[float]] = {name: [] for name in shims}
            cpu: dict[str, list[float]] = {name: [] for name in shims}
            kinds: dict[str, dict[str, float]] = {name: {} for name in shims}
            for _ in range(args.rounds):
                for name, shim in shims.items():
                    for _ in range(args.reps):
                        per: dict[str, float] = {}
                        w0, c0 = time.perf_counter(), time.thread_time()
                        for (w, _q, _s, _b, bits, _g), c in zip(entries, out[name], strict=True):
                            t = time.thread_time()
                            n, k = w.shape
                            shim.cblas_sgemm(
                                101, 111, 112, b, n, k, f(1.0), p(xs[k].ctypes.data), k, p(w.ctypes.data), k,
                                f(0.0), p(c.ctypes.data), n,
                            )  # fmt: skip
                            kind = f"{n}x{k}/{bits}"
                            per[kind] = per.get(kind, 0.0) + time.thread_time() - t
                        wall[name].append(time.perf_counter() - w0)
                        cpu[name].append(time.thread_time() - c0)
                        for kind, t in per.items():
                            kinds[name][kind] = min(kinds[name].get(kind, 1e9), t)
            for name in shims:
                by_kind = ", ".join(f"{kind} {t * 1e3:.1f}" for kind, t in kinds[name].items())
                print(f"| {b} | {name} | {ms(wall[name])} | {ms(cpu[name])} | {by_kind} |", flush=True)
            diff = err_before = err_after = 0.0
            for (w, *_), c0, c1 in zip(entries, out["before"], out["after"], strict=True):
                want = xs[w.shape[1]].astype(np.float64) @ w.T.astype(np.float64)
                top = float(np.abs(want).max())
                diff = max(diff, float(np.abs(c1 - c0).max()) / top)
                err_before = max(err_before, float(np.abs(c0 - want).max()) / top)
                err_after = max(err_after, float(np.abs(c1 - want).max()) / top)
            print(
                f"| {b} | largest difference, of the largest value: between builds {diff:.1e}, "
                f"from float64: before {err_before:.1e}, after {err_after:.1e} ||||"
            )
        print(f"load average after: {os.getloadavg()[0]:.2f}; {engine.quantized_rows} attached")


if __name__ == "__main__":
    sys.exit(main())
