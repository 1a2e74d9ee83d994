"""Timed greedy decode steps on a loaded model: what the CPU benchmarks measure a step by.

Imported by bench/batch_steps.py, bench/cpu_layers.py and bench/quantized_rows.py (a script's own folder is on
``sys.path``), after they have set up the BLAS and imported mlx.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Steps:
    """Seconds the prompt took, seconds each decode step took, and the token each step picked (row 0)."""

    prefill: float
    times: list[float] = field(default_factory=list)
    picked: list[int] = field(default_factory=list)


def decode_steps(model: Any, prompt: Any, n: int) -> Steps:
    """Run ``prompt`` (an ``mx.array`` of B rows of token ids) through ``model`` with a fresh KV cache,
    then ``n`` greedy steps of B new tokens, each evaluated and timed on its own."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    start = time.perf_counter()
    logits = model(prompt, cache=cache)
    nxt = mx.argmax(logits[:, -1, :], axis=-1)[:, None]
    mx.eval(nxt)
    out = Steps(time.perf_counter() - start)
    for _ in range(n):
        start = time.perf_counter()
        logits = model(nxt, cache=cache)
        nxt = mx.argmax(logits[:, -1, :], axis=-1)[:, None]
        mx.eval(nxt)
        out.times.append(time.perf_counter() - start)
        out.picked.append(int(nxt[0, 0].item()))
    return out
