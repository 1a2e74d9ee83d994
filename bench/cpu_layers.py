"""The CPU fast paths (mlxpipe/cpu/layers.py) on and off, side by side in one process: decode step and stream.

    flock -x /tmp/mlxpipe-cpu.lock python bench/cpu_layers.py [--batch 1,16] [--steps 32] [--rounds 3]

Loads the embedded model once (``--dtype auto``: float32 on a CPU) and times, alternating the swapped and the
plain layers round by round (the settings below) so that other load on the CPU falls on both alike:

- a decode step: one forward pass of B new tokens over a KV cache of ~64 tokens plus the greedy pick,
  evaluated (min and median over ``--steps`` steps per round, over all rounds);
- ``mlx_lm.stream_generate`` of ``--steps`` tokens (B=1), its decode rate (best of the rounds).

Settings: plain (mx.fast), each of ``layers.KINDS`` swapped alone, all of them; each one's speed-up over
plain, and whether its greedy tokens equal plain's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

PROMPT = "Write a long story about a dragon who learns to paint, in the style of a fairy tale for children."


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", default="1,16", help="comma-separated batch sizes")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    from mlxpipe.cpu import blas

    blas.setup()  # before mlx is imported, as mlxpipe.engine does: mlx binds its BLAS on import
    import mlx.core as mx
    import mlx_lm
    from decode_steps import decode_steps

    from mlxpipe.cpu import layers
    from mlxpipe.engine import Engine

    os.environ[layers.ENV] = "off"  # load plain; the rounds below swap the layers in and out
    engine = Engine.load(None)
    info = engine.info()
    model, tok = engine.model, engine.tokenizer
    print(
        f"load average before: {os.getloadavg()[0]:.2f}; device {info['device']}, dtype {info['dtype']}, "
        f"BLAS {info['blas']['source']}",
        flush=True,
    )
    tokens = tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True)
    tokens = (tokens * 4)[:64]  # a KV cache of 64 tokens before the timed steps

    def steps(batch: int, n: int) -> tuple[list[float], list[int]]:
        run = decode_steps(model, mx.array([tokens] * batch), n)
        return run.times, run.picked

    def stream() -> float:
        responses = list(mlx_lm.stream_generate(model, tok, tokens, max_tokens=args.steps))
        return float(responses[-1].generation_tps)

    settings = {"plain": (), **{kind: (kind,) for kind in layers.KINDS}, "all": layers.KINDS}
    batches = [int(b) for b in args.batch.split(",")]
    times: dict[tuple[str, int], list[float]] = {}
    picks: dict[tuple[str, int], list[int]] = {}
    rates: dict[str, list[float]] = {name: [] for name in settings}
    for _ in range(args.rounds):
        for name, kinds in settings.items():
            layers.revert(model)
            layers.apply(model, kinds)
            for batch in batches:
                steps(batch, 2)  # warm-up: compiles for this batch's shapes
                t, p = steps(batch, args.steps)
                times.setdefault((name, batch), []).extend(t)
                picks[name, batch] = p
            rates[name].append(stream())

    print(f"\n{'swapped':<16}{'B':>4}{'step min':>12}{'median':>12}{'tok/s':>9}{'x plain':>9}  greedy tokens")
    for batch in batches:
        base = min(times["plain", batch])
        for name in settings:
            t = times[name, batch]
            same = "equal" if picks[name, batch] == picks["plain", batch] else "DIFFER"
            print(
                f"{name:<16}{batch:>4}{min(t) * 1e3:>9.1f} ms{statistics.median(t) * 1e3:>9.1f} ms"
                f"{batch / min(t):>9.1f}{base / min(t):>8.2f}x  {same}"
            )
    for name in settings:
        best = max(rates[name])
        print(f"stream_generate {name:<16}{best:>7.1f} tok/s{best / max(rates['plain']):>7.2f}x")
    print(f"\nload average after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
