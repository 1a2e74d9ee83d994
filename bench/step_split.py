"""Where the non-product part of a batched decode step goes: one decode step of the bare model with
mlx-lm's ``BatchKVCache`` (left-padded prompts, the mask of the real batched path), with one part at a time
replaced by a near-free stand-in; the difference to the whole step is that part's cost. One variant puts
mx.fast's attention back in place of mlxpipe.cpu.layers' (the step before it), another has RoPE compute
each row's angles instead of gathering them from its table (before it).

    PYTHONPATH=. flock -x /tmp/mlxpipe-cpu.lock python bench/step_split.py [--batch 1,16,64] [--length 96]

Each timed step writes its keys and values at the same position and is then trimmed off the caches, so
every step sees ``--length`` positions. Variants alternate within each round; ms, min / median.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

from mlxpipe import Engine  # the BLAS first, then mlx


def batch_caches(model: Any, b: int, length: int) -> tuple[list[Any], Any]:
    """Caches of b left-padded prompts (lengths 8…length, as a batch's records differ) read in one pass;
    the token each row decodes next. One record: the single stream's plain KV cache, no mask."""
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache, make_prompt_cache

    if b == 1:
        caches = make_prompt_cache(model)
        logits = model(mx.array([[(7 * j) % 1000 + 100 for j in range(length)]]), cache=caches)
        nxt = mx.argmax(logits[:, -1, :], axis=-1)[:, None]
        mx.eval(nxt)
        return caches, nxt

    lengths = [8 + (i * 37) % (length - 7) for i in range(b)]
    lengths[0] = length
    pad = [length - n for n in lengths]
    rows = [
        [0] * p + [(7 * i + j) % 1000 + 100 for j in range(n)]
        for i, (p, n) in enumerate(zip(pad, lengths, strict=True))
    ]
    tokens = mx.array(rows)
    caches = [BatchKVCache(pad) for _ in model.layers]
    logits = model(tokens, cache=caches)
    nxt = mx.argmax(logits[:, -1, :], axis=-1)[:, None]
    mx.eval(nxt, [c.state for c in caches])
    return caches, nxt


def step(model: Any, caches: list[Any], nxt: Any) -> float:
    """Seconds of one decode step (forward, argmax, evaluation); the step is then trimmed off the caches."""
    import mlx.core as mx

    start = time.perf_counter()
    logits = model(nxt, cache=caches)
    out = mx.argmax(logits[:, -1, :], axis=-1)
    mx.eval(out)
    seconds = time.perf_counter() - start
    for c in caches:
        c.trim(1)
    return seconds


@contextmanager
def patched(obj: Any, name: str, value: Any) -> Iterator[None]:
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


def variants(model: Any, cache_class: type) -> dict[str, Callable[[], Any]]:
    """Name → a context manager replacing one part of the step by a near-free stand-in."""
    from mlx_lm.models import llama

    from mlxpipe.cpu import layers

    layer = model.layers[0]  # the swapped classes (mlxpipe.cpu.layers) where the engine swapped them
    rope_cls = type(layer.self_attn.rope)
    norm_cls = type(layer.input_layernorm)
    mlp_cls = type(layer.mlp)

    def no_update(self: Any, keys: Any, values: Any) -> Any:
        # The fetch without the write: the same slices of the same buffers.
        self.offset = self.offset + keys.shape[2]
        if hasattr(self, "_idx"):  # BatchKVCache
            self._idx += keys.shape[2]
            return self.keys_and_values()
        return self.keys[..., : self.offset, :], self.values[..., : self.offset, :]

    def no_attention() -> Any:  # mx.fast's or mlxpipe.cpu.layers': the queries instead
        stack = ExitStack()
        stack.enter_context(patched(llama, "scaled_dot_product_attention", lambda q, k, v, **kw: q))
        stack.enter_context(patched(layers, "attention", lambda q, k, v, scale, mask: q))
        return stack

    def sdpa() -> Any:  # mx.fast's attention in place of mlxpipe.cpu.layers' (as before it)
        fast = type(layer.self_attn)
        return patched(fast, "__call__", fast.__dict__.get("_plain", fast).__call__)

    def rope_computed() -> Any:  # FastRoPE computing each row's angles (before it gathered them)
        call = layers.FastRoPE.__call__
        return patched(
            layers.FastRoPE, "__call__", lambda self, x, offset=0, bound=None: call(self, x, offset)
        )

    def no_residuals(self: Any, x: Any, mask: Any = None, cache: Any = None) -> Any:
        return self.mlp(self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), mask, cache)))

    return {
        "whole": lambda: patched(llama, "__name__", llama.__name__),
        "mx.fast's attention": sdpa,
        "RoPE's angles per row": rope_computed,
        "no attention": no_attention,
        "no mask": lambda: patched(llama, "create_attention_mask", lambda *a, **kw: None),
        "no KV write": lambda: patched(cache_class, "update_and_fetch", no_update),
        "no RoPE": lambda: patched(rope_cls, "__call__", lambda self, x, offset=0, bound=None: x),
        "no norms": lambda: patched(norm_cls, "__call__", lambda self, x: x),
        "no SwiGLU": lambda: patched(
            mlp_cls, "__call__", lambda self, x: self.down_proj(self.gate_proj(x) + self.up_proj(x))
        ),
        "no residual adds": lambda: patched(llama.TransformerBlock, "__call__", no_residuals),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", default="1,16,64")
    parser.add_argument("--length", type=int, default=96)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()

    engine = Engine.load()
    model = engine.model
    print(f"load average before: {os.getloadavg()[0]:.2f}; fast paths {engine.cpu_fast_paths}")
    for b in [int(x) for x in args.batch.split(",")]:
        caches, nxt = batch_caches(model, b, args.length)
        times: dict[str, list[float]] = {}
        for _ in range(args.rounds):
            for name, make in variants(model, type(caches[0])).items():
                with make():
                    step(model, caches, nxt)  # warm-up (traces)
                    times.setdefault(name, []).extend(step(model, caches, nxt) for _ in range(args.steps))
        whole = statistics.median(times["whole"])
        print(f"\nB = {b}, {args.length} positions: ms min / median, and what the part costs (whole - it)")
        for name, t in times.items():
            med = statistics.median(t)
            print(f"  {name:28s} {min(t) * 1e3:7.1f} / {med * 1e3:7.1f}   {(whole - med) * 1e3:+7.1f}")
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
