"""Where a single stream's decode step goes, and its CPU levers side by side (issue 19).

    flock -x /tmp/mlxpipe-cpu.lock python bench/single_stream.py [--records 4] [--max-tokens 64] [--rounds 4]

Loads the embedded model once (``--dtype auto``: float32 with the quantized one-row kernels on an AVX-512 CPU)
and prints, in one process:

- the split: mlx operations in one decode step's graph (by kind); all of a step's one-row products computed
  alone from C, one after another (the output layer apart); one token through each layer of the loop
  (``_steps``, ``stream_generate``, ``Engine.generate``, ``mlxpipe.run``: what each adds a token);
- the levers, taking turns record by record (each record's rate beside the same record's under the first
  setting, so that this CPU's drift falls on both alike): main's set (no log-softmax skipped, no transposes
  kept, nothing fused, no product shared), then each lever added in turn. The paired ratios' median and
  quartiles, and whether the greedy texts are the same.
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a refrigerator works to a ten-year-old.",
    "Describe a walk through a busy market in the morning.",
    "Write a letter to a friend about learning to play the guitar.",
]
OLD = ["rms_norm", "rope", "swiglu", "eval_per_layer"]  # main's kinds before issue 19's single-stream work
# name: (layers kinds, greedy argmax, one-row products shared from this many weights; 0: none)
LEVERS: dict[str, tuple[list[str] | None, bool, int]] = {
    "main's": (OLD, False, 0),
    "+ argmax": (OLD, True, 0),
    "+ linear": ([*OLD, "linear"], True, 0),
    "+ output shared": ([*OLD, "linear"], True, 1 << 22),
    "+ fused": (None, True, 1 << 22),  # None: every kind (the fused ones multiply 2-d rows)
}


def op_counts(model: Any, tokens: list[int]) -> collections.Counter[str]:
    """The operations of one decode step's graph (no layer evaluated as built), by kind."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from mlxpipe.cpu import layers

    kinds = [k for k in layers.KINDS if k != "eval_per_layer"]
    layers.revert(model)
    layers.apply(model, kinds)
    try:
        cache = make_prompt_cache(model)
        mx.eval(model(mx.array([tokens]), cache=cache))
        logits = model(mx.array([tokens[-1:]]), cache=cache)
        with tempfile.NamedTemporaryFile(suffix=".dot") as f:
            mx.export_to_dot(f.name, logits)
            text = Path(f.name).read_text(encoding="utf-8")
    finally:
        layers.revert(model)
        layers.apply(model)
    return collections.Counter(re.findall(r'label ="(\w+)', text))


def products_alone(rounds: int = 20) -> tuple[float, float, int]:
    """(ms of all attached matrices' one-row products one after another, ms of the largest alone, count)."""
    import numpy as np

    from mlxpipe.cpu import gemv

    shim = gemv._shim
    mats = [(int(w.shape[0]), int(w.shape[1]), gemv._address(w)) for w, *_ in gemv._attached.values()]
    x, y = np.ones(8192, np.float32), np.zeros(1 << 16, np.float32)
    p, f = ctypes.c_void_p, ctypes.c_float

    def once(chosen: list[tuple[int, int, int]]) -> float:
        start = time.perf_counter()
        for n, k, w in chosen:  # row-major c (1 x n) = x (1 x k) W^T
            shim.cblas_sgemm(
                101, 111, 112, 1, n, k, f(1), p(x.ctypes.data), k, p(w), k, f(0), p(y.ctypes.data), n
            )
        return (time.perf_counter() - start) * 1e3

    largest = max(mats, key=lambda m: m[0] * m[1])
    # a step's own: a fused matrix stands for its parts (views of its rows, inside its memory)
    step = [m for m in mats if not any(o[0] > m[0] and o[2] <= m[2] < o[2] + 4 * o[0] * o[1] for o in mats)]
    return min(once(step) for _ in range(rounds)), min(once([largest]) for _ in range(rounds)), len(step)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()

    from mlxpipe.cpu import blas

    blas.setup()  # before mlx is imported, as mlxpipe.engine does
    import mlx.core as mx

    from mlxpipe import records_from_objects, run
    from mlxpipe.cpu import gemv, layers
    from mlxpipe.engine import Engine, generate
    from mlxpipe.events import Chunk, Done
    from mlxpipe.records import Settings

    engine = Engine.load(None)
    model = engine.model
    settings = Settings(max_tokens=args.max_tokens, temperature=0.0)
    records = list(records_from_objects([PROMPTS[i % len(PROMPTS)] for i in range(args.records)], settings))
    tokens = [engine.encode(r) for r in records]
    print(f"load average before: {os.getloadavg()[0]:.2f}; fast paths {engine.cpu_fast_paths}", flush=True)
    print(f"attached matrices: {engine.quantized_rows}")

    ops = op_counts(model, tokens[0])
    print(f"\none decode step's graph: {sum(ops.values())} operations; {dict(ops.most_common(8))}")
    blas.use_threads(1)
    if engine.quantized_rows:
        step_ms, head_ms, count = products_alone()
        print(
            f"its {count} one-row products alone, one thread: {step_ms:.2f} ms (output layer {head_ms:.2f})"
        )

    def rate(stamps: list[float]) -> float:  # tokens after the first over their time
        return (len(stamps) - 2) / (stamps[-1] - stamps[1])

    def steps(i: int) -> float:
        sampler = engine.sampler_for(records[i])
        loop = generate._steps(
            mx.array(tokens[i]), model, max_tokens=args.max_tokens, sampler=sampler, logits_processors=[],
            prompt_cache=None, prefill_step_size=engine.prefill_step,
        )  # fmt: skip
        return rate([time.perf_counter() for _ in loop])

    def stream(i: int) -> float:
        sampler = engine.sampler_for(records[i])
        loop = generate.stream_generate(
            model,
            engine.tokenizer,
            tokens[i],
            max_tokens=args.max_tokens,
            sampler=sampler,
            logits_processors=[],
        )
        return rate([time.perf_counter() for _ in loop])

    loops = {
        "_steps (token ids)": steps,
        "stream_generate": stream,
        "Engine.generate": lambda i: rate([time.perf_counter() for _ in engine.generate(records[i])]),
        "mlxpipe.run": lambda i: rate([time.perf_counter() for _ in run([records[i]], engine)]),
    }
    rates: dict[str, list[float]] = {name: [] for name in loops}
    for f in loops.values():
        f(0)  # warm-up
    for _ in range(2):
        for i in range(len(records)):
            for name, f in loops.items():
                rates[name].append(f(i))
    first = rates["_steps (token ids)"]
    print("\none token through each layer of the loop (ms a token; paired ratio of rates to _steps):")
    for name, r in rates.items():
        ratio = statistics.median(a / b for a, b in zip(r, first, strict=True))
        print(f"  {name:<20} {1e3 / statistics.median(r):6.2f} ms   {ratio:.3f}")

    def use(kinds: list[str] | None, greedy: bool, shared: int) -> None:
        layers.revert(model)
        layers.apply(model, layers.KINDS if kinds is None else kinds)
        generate.GREEDY_ARGMAX = greedy
        gemv.share_one_rows(shared)

    def one(record: Any) -> tuple[float, str]:
        first = 0.0
        for event in run([record], engine):
            now = time.perf_counter()
            if isinstance(event, Chunk) and not first:
                first = now
            elif isinstance(event, Done):
                return (event.tokens - 1) / (now - first), event.text
        raise AssertionError("no done event")

    got: dict[str, list[float]] = {name: [] for name in LEVERS}
    texts: dict[str, list[str]] = {name: [] for name in LEVERS}
    for lever in LEVERS.values():
        use(*lever)
        one(records[0])  # warm-up (a new shape traces the compiled layers)
    for n in range(args.rounds):
        for record in records:
            for name, lever in LEVERS.items():
                use(*lever)
                tps, text = one(record)
                got[name].append(tps)
                texts[name].append(text)
        line = "  ".join(f"{k} {statistics.median(v[-len(records) :]):.1f}" for k, v in got.items())
        print(
            f"round {n + 1} (tok/s, median of its records): {line}   load {os.getloadavg()[0]:.2f}",
            flush=True,
        )
    use(None, True, gemv.ONE_ROW_SHARED)
    base = got["main's"]
    print(f"\n{'levers':<18}{'tok/s':>8}{'paired x':>10}{'q1':>7}{'q3':>7}  greedy texts")
    for name, r in got.items():
        q1, med, q3 = statistics.quantiles([a / b for a, b in zip(r, base, strict=True)], n=4)
        same = "same" if texts[name] == texts["main's"] else "DIFFER"
        print(f"{name:<18}{statistics.median(r):8.1f}{med:10.3f}{q1:7.3f}{q3:7.3f}  {same}")
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
