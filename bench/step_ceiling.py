"""How far a batched decode step is from the CPU's ceiling: a real-shape model's B-row step, its products
alone, and the integer multiply-adds those products do against what this CPU's ``vpdpbusd`` can do.

    flock -x /tmp/mlxpipe-cpu.lock python bench/step_ceiling.py GGUF_OR_FOLDER [--batch 1,16,64]

For each B: the products of every matrix the kernels compute (B random rows each, all threads mlxpipe uses),
one bare forward step of B tokens with a KV cache (``decode_steps``), the share of the step the products
take, and their rate in 8-bit multiply-adds (weights x B x the activation's 8-bit parts) against a loop of
independent ``vpdpbusd`` on as many threads (compiled here with ``cc``; AVX-512 VNNI CPUs only). The
ceiling line: the step if the products ran at that peak, the rest as measured.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mlxpipe import Engine  # the BLAS first, then mlx

sys.path.insert(0, os.path.dirname(__file__))
from decode_steps import decode_steps

PEAK = r"""
#include <immintrin.h>
#include <pthread.h>
#include <stdio.h>
#include <time.h>
#define IT 200000000L
__attribute__((target("avx512f,avx512bw,avx512vnni"))) static void *run(void *unused) {
    __m512i s[12], w = _mm512_set1_epi8(3), x = _mm512_set1_epi8(5);
    for (int i = 0; i < 12; i++) s[i] = _mm512_set1_epi32(i);
    for (long n = 0; n < IT / 12; n++) {
        _Pragma("GCC unroll 12") for (int i = 0; i < 12; i++) s[i] = _mm512_dpbusd_epi32(s[i], w, x);
        __asm__ volatile("" : "+v"(w));
    }
    for (int i = 1; i < 12; i++) s[0] = _mm512_add_epi32(s[0], s[i]);
    return (void *)(long)_mm_cvtsi128_si32(_mm512_castsi512_si128(s[0]));
}
int main(int argc, char **argv) {
    int threads = argc > 1 ? argv[1][0] - '0' : 1;
    pthread_t th[8];
    struct timespec a, b;
    clock_gettime(CLOCK_MONOTONIC, &a);
    for (int i = 0; i < threads; i++) pthread_create(&th[i], 0, run, 0);
    for (int i = 0; i < threads; i++) pthread_join(th[i], 0);
    clock_gettime(CLOCK_MONOTONIC, &b);
    printf("%f\n", threads * IT * 64.0 / ((b.tv_sec - a.tv_sec) + (b.tv_nsec - a.tv_nsec) * 1e-9));
}
"""


def peak_macs(threads: int) -> float | None:
    """8-bit multiply-adds a second of independent ``vpdpbusd`` on ``threads`` threads; None where it
    cannot be built or run (no cc, no AVX-512 VNNI)."""
    with tempfile.TemporaryDirectory() as d:
        source, binary = Path(d) / "peak.c", Path(d) / "peak"
        source.write_text(PEAK)
        built = subprocess.run(["cc", "-O2", "-pthread", "-o", str(binary), str(source)], capture_output=True)
        if built.returncode != 0:
            return None
        done = subprocess.run([str(binary), str(threads)], capture_output=True, text=True)
        return float(done.stdout) if done.returncode == 0 else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--batch", default="1,16,64")
    args = ap.parse_args()
    import mlx.core as mx

    from mlxpipe.cpu import blas, gemv, kernels

    engine = Engine.load(args.model)
    blas.use_threads(16)  # the threads a batch gets (the kernels' helper too)
    found: dict[int, kernels.Matrix] = {}
    for _, module in engine.model.named_modules():
        for value in module.__dict__.values():
            matrix = value.whole if isinstance(value, kernels.Part) else value
            if isinstance(matrix, kernels.Matrix):
                found[id(matrix)] = matrix
    matrices = list(found.values())
    weights = sum(m.n * m.k for m in matrices)
    parts = gemv.int8_activations()
    threads = 2 if (os.cpu_count() or 1) >= 2 else 1
    peak = peak_macs(threads)
    print(f"{args.model}: {len(matrices)} matrices, {weights / 1e9:.3f} G weights; 8-bit parts {parts}")
    print(f"vpdpbusd peak, {threads} threads: " + (f"{peak / 1e9:.0f} G multiply-adds/s" if peak else "n/a"))
    for b in [int(x) for x in args.batch.split(",")]:
        rows = {m.k: mx.random.normal((b, m.k)) for m in matrices}
        mx.eval(list(rows.values()))
        times = []
        for _ in range(5):
            start = time.perf_counter()
            mx.eval([kernels.product(rows[m.k], m) for m in matrices])
            times.append(time.perf_counter() - start)
        products = min(times)
        step = statistics.median(decode_steps(engine.model, mx.array([list(range(1, 9))] * b), 12).times[2:])
        macs = weights * b * max(parts, 1)
        line = (
            f"B={b}: step {step * 1e3:.1f} ms ({b / step:.0f} tok/s), products alone {products * 1e3:.1f} ms "
            f"({products / step:.0%} of it), {macs / products / 1e9:.0f} G multiply-adds/s"
        )
        if peak and parts:
            floor = macs / peak + max(step - products, 0)
            line += f" = {macs / products / peak:.0%} of peak; ceiling {b / floor:.0f} tok/s"
        print(line, flush=True)


if __name__ == "__main__":
    main()
