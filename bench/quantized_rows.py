"""One-row products from the quantized weights (mlxpipe/gemv.c) on and off, side by side in one process.

    MLXPIPE_KERNELS=off flock -x /tmp/mlxpipe-cpu.lock python bench/quantized_rows.py [--steps 32]
        [--rounds 4]

Loads the embedded model once (``--dtype auto`` with ``MLXPIPE_KERNELS=off``: float32 on a CPU, its matrices
attached to their 4- and 8-bit forms where the CPU has AVX-512 or AVX2) and times, alternating round by round
so that other load on the CPU falls on both alike:

- a decode step: one forward pass of one new token over a KV cache of ~64 tokens plus the greedy pick,
  evaluated (min and median over ``--steps`` steps per round, over all rounds);
- ``mlx_lm.stream_generate`` of ``--steps`` tokens, its decode rate (median and best of the rounds).

Settings: float32 (every one-row product by OpenBLAS's ``sgemv`` on the float32 weights) and quantized
(the same products computed from the quantized bytes); each one's speed-up, and whether the greedy tokens
are the same.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

PROMPT = "Write a long story about a dragon who learns to paint, in the style of a fairy tale for children."


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()

    from mlxpipe.cpu import blas

    blas.setup()  # before mlx is imported, as mlxpipe.engine does: mlx binds its BLAS on import
    import mlx.core as mx
    import mlx_lm
    from decode_steps import decode_steps

    from mlxpipe.cpu import gemv
    from mlxpipe.engine import Engine

    engine = Engine.load(None)
    if not engine.quantized_rows:
        print("no quantized one-row products on this machine (they need a CPU with AVX-512)")
        return 1
    model, tok = engine.model, engine.tokenizer
    entries = list(gemv._attached.values())  # (weight, q, scales, biases, bits, group size), as attached
    print(
        f"load average before: {os.getloadavg()[0]:.2f}; {engine.quantized_rows} matrices attached",
        flush=True,
    )
    tokens = tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True)
    tokens = (tokens * 4)[:64]

    times: dict[str, list[float]] = {"float32": [], "quantized": []}
    rates: dict[str, list[float]] = {"float32": [], "quantized": []}
    picks: dict[str, list[int]] = {}
    for _ in range(args.rounds):
        for name in times:
            if name == "float32":
                gemv.detach([e[0] for e in entries])
            else:
                for entry in entries:
                    gemv.attach(*entry)
            decode_steps(model, mx.array([tokens]), 2)  # warm-up
            run = decode_steps(model, mx.array([tokens]), args.steps)
            times[name].extend(run.times)
            picks[name] = run.picked
            responses = list(mlx_lm.stream_generate(model, tok, tokens, max_tokens=args.steps))
            rates[name].append(float(responses[-1].generation_tps))

    base = min(times["float32"])
    header = f"{'one-row products':<18}{'step min':>10}{'median':>11}{'x':>7}{'stream median':>16}{'best':>8}"
    print(f"\n{header}  greedy")
    for name in times:
        t = times[name]
        same = "equal" if picks[name] == picks["float32"] else "DIFFER"
        print(
            f"{name:<18}{min(t) * 1e3:>7.1f} ms{statistics.median(t) * 1e3:>8.1f} ms{base / min(t):>6.2f}x"
            f"{statistics.median(rates[name]):>10.1f} tok/s{max(rates[name]):>8.1f}  {same}"
        )
    print(f"\nload average after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
