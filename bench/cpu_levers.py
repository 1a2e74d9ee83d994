"""The CPU levers of issue 7 side by side: one decode step's time per configuration, ratio to the baseline.

    flock -x /tmp/mlxpipe-cpu.lock python bench/cpu_levers.py [--batch 1,16] [--steps 32]

Each configuration runs in its own process (the BLAS and its thread count are fixed when mlx is imported):

- baseline: the model as loaded (4-bit), mlx's bundled reference BLAS (``MLXPIPE_BLAS=off``);
- float32 + reference BLAS (``MLXPIPE_BLAS=off --dtype float32``);
- float32 + OpenBLAS with 1 and with 2 threads (``OPENBLAS_NUM_THREADS``), one-row products by OpenBLAS's
  sgemm (``MLXPIPE_GEMV=off``);
- float32 + OpenBLAS with 2 threads and mlxpipe's default forwarding of one-row products to sgemv.

A step is one forward pass of B new tokens with a KV cache plus the greedy pick, evaluated: what one decode
step of ``mlx_lm.stream_generate`` (B=1) or of ``--batch B`` costs the model. The minimum over the steps is
what the machine can do; the median shows how much other load on the CPU costs. Prompt processing
(prefill) is timed once per configuration. With ``--stream`` each configuration also runs
``mlx_lm.stream_generate`` (sampling and detokenizing included) for its decode rate.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

CONFIGS = {
    "4-bit, reference BLAS (baseline)": ("quantized", {"MLXPIPE_BLAS": "off"}),
    "float32, reference BLAS": ("float32", {"MLXPIPE_BLAS": "off"}),
    "float32, OpenBLAS 1 thread": ("float32", {"OPENBLAS_NUM_THREADS": "1", "MLXPIPE_GEMV": "off"}),
    "float32, OpenBLAS 2 threads": ("float32", {"OPENBLAS_NUM_THREADS": "2", "MLXPIPE_GEMV": "off"}),
    "float32, OpenBLAS 2 thr., sgemv fwd": ("float32", {"OPENBLAS_NUM_THREADS": "2", "MLXPIPE_GEMV": ""}),
}
PROMPT = "Write a long story about a dragon who learns to paint."


def measure(dtype: str, batch: int, steps: int, stream: bool) -> dict[str, float]:
    """In this process: load the embedded model in ``dtype`` and time decode steps of ``batch`` tokens."""
    from mlxpipe.cpu import blas

    blas.setup()  # before mlx is imported, as mlxpipe.engine does: mlx binds its BLAS on import
    import mlx.core as mx
    import mlx_lm
    from decode_steps import decode_steps

    from mlxpipe.engine import Engine

    engine = Engine.load(None, dtype=dtype)
    used = engine.info()["blas"]
    assert used["library"] or os.environ.get("MLXPIPE_BLAS") == "off", used  # measure what the row says
    forwarding = bool(used["library"]) and os.environ.get("MLXPIPE_GEMV") != "off"
    assert used.get("gemv", "").startswith("one-row") == forwarding, used
    model = engine.model
    tokens = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT}], add_generation_prompt=True
    )
    prompt = mx.array([tokens] * batch)

    decode_steps(model, prompt, 2)  # warm-up
    run = decode_steps(model, prompt, steps)
    prefill, times = run.prefill, run.times
    out = {
        "step_min_ms": min(times) * 1e3,
        "step_median_ms": statistics.median(times) * 1e3,
        "prefill_tps": len(tokens) * batch / prefill,
    }
    if stream and batch == 1:
        responses = list(mlx_lm.stream_generate(model, engine.tokenizer, tokens, max_tokens=steps))
        out["stream_tps"] = responses[-1].generation_tps
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", default="1,16", help="comma-separated batch sizes")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--stream", action="store_true", help="also time mlx_lm.stream_generate (B=1)")
    parser.add_argument("--configs", help="comma-separated row numbers to run (1 = baseline; default all)")
    parser.add_argument("--only", help="internal: measure one configuration in this process", nargs=2)
    args = parser.parse_args()
    if args.only:
        dtype, batch = args.only
        print(json.dumps(measure(dtype, int(batch), args.steps, args.stream)))
        return 0

    print(f"load average before: {os.getloadavg()[0]:.2f}", flush=True)
    for batch in [int(b) for b in args.batch.split(",")]:
        print(f"\nB={batch} (tokens per step)")
        head = f"{'step min':>10}{'median':>10}{'tok/s best':>12}{'x base':>8}{'prefill':>10}"
        print(f"{'configuration':<36}{head}")
        base = None
        rows = [int(n) for n in args.configs.split(",")] if args.configs else range(1, len(CONFIGS) + 1)
        for number, (name, (dtype, env)) in enumerate(CONFIGS.items(), 1):
            if number not in rows:
                continue
            cmd = [sys.executable, __file__, "--only", dtype, str(batch), "--steps", str(args.steps)]
            cmd += ["--stream"] if args.stream else []
            r = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True, check=False)
            if r.returncode != 0:
                print(f"{name:<36} failed: {r.stderr.strip().splitlines()[-1:]}")
                continue
            m = json.loads(r.stdout.strip().splitlines()[-1])
            tps = batch / m["step_min_ms"] * 1e3
            base = base or tps
            stream = f"   stream_generate {m['stream_tps']:.1f} tok/s" if "stream_tps" in m else ""
            print(
                f"{name:<36}{m['step_min_ms']:>8.1f}ms{m['step_median_ms']:>8.1f}ms{tps:>12.1f}"
                f"{tps / base:>7.2f}x{m['prefill_tps']:>7.0f}t/s{stream}",
                flush=True,
            )
    print(f"\nload average after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
