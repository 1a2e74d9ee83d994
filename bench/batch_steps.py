"""Where a batched decode step goes, at B records: matrix products, the rest of the model, mlx-lm's
BatchGenerator, mlxpipe's own per-token work; setting by setting, side by side.

    PYTHONPATH=. flock -x /tmp/mlxpipe-cpu.lock python bench/batch_steps.py [--batch 2,16,64] [--rounds 2]
        [--settings sdpa,amx]

Settings: ``blas``: the products by OpenBLAS on the float32 weights with its default threads, as before
issue 19; ``blas1``: the same with one OpenBLAS thread; ``qgemm``: products of several rows from the
quantized bytes with the AVX-512 float32 kernels, mlx-lm's own decode step (the first issue-19 session);
``argmax``: the same with greedy steps that skip mlx-lm's log-softmax; ``amx``: that, with products of 16
rows or more on AMX tiles (the default where the CPU has AMX); ``sdpa``: ``amx`` with mx.fast's attention
in place of mlxpipe.cpu.layers' (before it); ``pairs``: ``amx`` with a decode step's attention one (record, KV
head) pair a call, as mlx makes a batched product (before ``attention_cached``). Per B and setting, minimum
and median over the steps of:

- ``products``: the step's 211 weight products alone (the attached matrices, B random rows, through the
  same ``cblas_sgemm`` mlx calls);
- ``model``: one bare forward step of B tokens with a KV cache, then argmax (``decode_steps``);
- ``step``: one ``Batch.step()`` of ``mlxpipe.run``'s batched path with B records in flight (prefill steps
  left out), split into mlx-lm's ``next_generated`` (graph, evaluation, sampling and bookkeeping) and
  mlxpipe's own part (detokenizing, stop strings, events).

The rounds alternate the settings. Greedy tokens of the bare steps are compared with the first setting's.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import time
from typing import Any

from mlxpipe import Engine, records_from_objects, run  # the BLAS first, then mlx
from mlxpipe.cpu import blas, gemv, layers
from mlxpipe.records import Settings

sys.path.insert(0, os.path.dirname(__file__))
from decode_steps import decode_steps


def use(setting: str, b: int, model: Any = None) -> None:
    """Products, threads, decode step and attention as ``setting`` says (see the module's docstring)."""
    from mlxpipe.engine import batch as batch_module

    for layer in getattr(model, "layers", []):
        attention = layer.self_attn
        plain = type(attention).__dict__.get("_plain", type(attention))
        fused = layers.FUSED in attention.__dict__
        cpu_attention = gemv.attention_available()
        fast = layers._fast_attention(plain, fused, cpu_attention)
        attention.__class__ = plain if setting == "sdpa" else fast
    layers.CACHED_ATTENTION = setting != "pairs"
    setting = "amx" if setting in ("sdpa", "pairs") else setting

    gemv._shim.mlxpipe_qgemm_max_rows(0 if setting.startswith("blas") else gemv.MAX_ROWS)
    gemv.use_amx(gemv.AMX_ROWS if setting == "amx" else 0)
    batch_module.GREEDY_ARGMAX = setting in ("argmax", "amx")
    blas.use_threads(b)
    if setting.startswith("blas"):
        blas._library.openblas_set_num_threads(blas._library_threads if setting == "blas" else 1)


def products(b: int, n: int) -> list[float]:
    """Seconds of all attached matrices' products by b random rows, n times."""
    import numpy as np

    weights = [entry[0] for entry in gemv._attached.values()]
    xs = {w.shape[1]: np.random.default_rng(0).standard_normal((b, w.shape[1]), np.float32) for w in weights}
    out = {id(w): np.zeros((b, w.shape[0]), np.float32) for w in weights}
    p, f = ctypes.c_void_p, ctypes.c_float
    times = []
    for _ in range(n):
        start = time.perf_counter()
        for w in weights:
            k, x, c = w.shape[1], xs[w.shape[1]], out[id(w)]
            gemv._shim.cblas_sgemm(
                101, 111, 112, b, w.shape[0], k, f(1.0), p(x.ctypes.data), k, p(gemv._address(w)), k, f(0.0),
                p(c.ctypes.data), w.shape[0],
            )  # fmt: skip
        times.append(time.perf_counter() - start)
    return times


def batch_steps(engine: Any, b: int, n: int) -> tuple[list[float], list[float]]:
    """(seconds of each Batch.step, of its next_generated part) with b records decoding n tokens."""
    from mlxpipe.engine import batch as batch_module

    steps: list[float] = []
    inner: list[float] = []
    original_step = batch_module.Batch.step

    def timed_step(self: Any) -> Any:
        gen = self._gen
        if not hasattr(gen, "_mlxpipe_timed"):
            plain = gen.next_generated

            def next_generated() -> Any:
                start = time.perf_counter()
                out = plain()
                inner.append(time.perf_counter() - start)
                return out

            gen.next_generated = next_generated
            gen._mlxpipe_timed = True
        start = time.perf_counter()
        events = original_step(self)
        steps.append(time.perf_counter() - start)
        return events

    batch_module.Batch.step = timed_step  # type: ignore[method-assign]
    try:
        prompts = [f"Write a long story about topic number {i}." for i in range(b)]
        records = records_from_objects(prompts, Settings(max_tokens=n + 8, temperature=0.0))
        for _ in run(records, engine, batch=b, ordered=False):
            pass
    finally:
        batch_module.Batch.step = original_step  # type: ignore[method-assign]
    # The first steps read the prompts, the last ones have fewer records: keep the full decode steps.
    return steps[4 : 4 + n], inner[4 : 4 + n]


def ms(times: list[float]) -> str:
    return f"{min(times) * 1e3:7.1f} / {statistics.median(times) * 1e3:7.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", default="2,16,64")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--settings", default="sdpa,amx", help="of blas, blas1, qgemm, argmax, amx, sdpa, pairs"
    )
    args = parser.parse_args()
    import mlx.core as mx

    settings = args.settings.split(",")
    engine = Engine.load()
    print(f"load average before: {os.getloadavg()[0]:.2f}; BLAS {blas.setup().info().get('config')}")
    print(f"attached matrices: {engine.quantized_rows}; times in ms, min / median")
    print("| B | setting | products | model step | Batch.step | of it next_generated | mlxpipe's | tok/s |")
    print("|---|---|---|---|---|---|---|---|")
    for b in [int(x) for x in args.batch.split(",")]:
        prompt = mx.array([engine.tokenizer.encode(f"Tell me about the number {i}.")[:8] for i in range(b)])
        picked: dict[str, list[int]] = {}
        for _ in range(args.rounds):
            for setting in settings:
                use(setting, b, engine.model)
                prod = products(b, args.steps)
                model = decode_steps(engine.model, prompt, args.steps)
                picked[setting] = model.picked
                step, inner = batch_steps(engine, b, args.steps)
                own = [s - i for s, i in zip(step, inner, strict=True)]
                cells = " | ".join(ms(t) for t in (prod, model.times, step, inner, own))
                print(
                    f"| {b} | {setting} | {cells} | {b / statistics.median(step):.0f} |",
                    flush=True,
                )
        same = all(picked[s] == picked[settings[0]] for s in settings)
        print(f"| {b} | greedy tokens of the bare steps equal in every setting: {same} |||||||")
    use("amx", 1, engine.model)
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
