"""Time to first token of one long prompt, read in chunks of mlx-lm's default size and of mlxpipe's.

    python bench/prefill.py [--tokens 2048] [--steps 2048,512,256]

One process, one loaded engine (mlxpipe's defaults: on a CPU float32 with OpenBLAS),
``mlx_lm.stream_generate`` with one new token and ``prefill_step_size`` set to each value in turn; prints
seconds and the ratio to the first. mlx has no CPU attention kernel: its fallback scores every query-key pair
of a chunk, the masked ones too, with an exp that costs ~9 ns a value here, so the chunk size changes how
much of that work is wasted.
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--steps", default="2048,512,256", help="comma-separated prefill step sizes")
    args = parser.parse_args()
    from mlxpipe.cpu import blas

    blas.setup()  # before mlx is imported, as mlxpipe.engine does
    import mlx_lm

    from mlxpipe.engine import Engine

    engine = Engine.load(None)
    prompt = engine.tokenizer.encode("The history of the lighthouse keepers of the northern coast. " * 200)
    prompt = prompt[: args.tokens]
    print(
        f"load average before: {os.getloadavg()[0]:.2f}; prompt {len(prompt)} tokens; mlxpipe's step "
        f"{engine.prefill_step}",
        flush=True,
    )
    first = None
    for step in [int(s) for s in args.steps.split(",")]:
        start = time.perf_counter()
        for _ in mlx_lm.stream_generate(
            engine.model, engine.tokenizer, prompt, max_tokens=1, prefill_step_size=step
        ):
            pass
        seconds = time.perf_counter() - start
        first = first or seconds
        print(
            f"prefill step {step:5d}: {seconds:6.2f} s to the first token, "
            f"{len(prompt) / seconds:6.0f} tok/s, {first / seconds:.2f}x",
            flush=True,
        )
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
