"""mlxpipe against llama.cpp on the same GGUF file, measured side by side in one run.

    python bench/vs_llamacpp.py [--threads 2] [--max-tokens 128] [--batch 16,64] [--rounds 3]
                                [--model SPEC] [--gguf FILE]

Both engines get the same prompt token ids (the embedded model's chat template, applied by mlxpipe) and greedy
decoding. llama.cpp gets ``--threads`` (n_threads/n_threads_batch, 2 = this machine's cores); mlxpipe runs
with its defaults (1 OpenBLAS thread for one stream, one per core with ``--batch``; mlx runs its own thread
beside), or with ``OPENBLAS_NUM_THREADS`` from the environment. Per record it takes the time to first token
and the decode rate after it ((tokens - 1) / (last - first)), timed from outside each engine in the same way.

Single stream: records one after another, ``--rounds`` times, the engines taking turns (mlxpipe's records,
then llama.cpp's, and again): the ratios are the median of the rounds' ratios, each taken under the same
conditions (this CPU's speed drifts from minute to minute). Batched: mlxpipe's ``--batch`` path
(``mlxpipe.run(batch=N)``) when this checkout has it, else mlx-lm's ``batch_generate`` on the same loaded
model (said in the output). llama.cpp batches too: its own batched decoding through llama-cpp-python's
low-level API (one ``llama_batch`` holding a token of each of the N sequences, one ``llama_decode`` a step,
greedy per sequence, prompts read first) gives the honest anchor for ``--batch``. For both, the decode
aggregate is the tokens after each record's first over the time after the last record's first (every prompt
read), the end-to-end aggregate all tokens over the whole time; they print side by side, the two engines
taking turns for ``--rounds``, and each is compared with its own kind. Installs nothing: llama.cpp is
measured only when ``llama_cpp`` imports
(``pip install -e '.[bench]'``).
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a refrigerator works to a ten-year-old.",
    "Describe a walk through a busy market in the morning.",
    "Write a letter to a friend about learning to play the guitar.",
    "Explain why the sky is blue, in detail.",
    "Write a poem about autumn leaves and the first frost.",
    "Describe the life cycle of a butterfly step by step.",
    "Give advice to someone starting their first job.",
]


@dataclass
class Run:
    """One record's timings: seconds to the first token, to the last, and tokens generated."""

    first: float
    last: float
    tokens: int
    text: str

    @property
    def decode_tps(self) -> float:
        span = self.last - self.first
        return (self.tokens - 1) / span if self.tokens > 1 and span > 0 else 0.0


def summarize(name: str, runs: list[Run]) -> dict[str, float]:
    """Median time to first token, decode rate over all tokens after the first, and end to end rate.

    End to end: all tokens over all the time from each record's start (prompt processing included), the
    same measure as the batched aggregate.
    """
    tokens = sum(r.tokens - 1 for r in runs)
    span = sum(r.last - r.first for r in runs)
    wall = sum(r.last for r in runs)
    out = {
        "ttft_ms": statistics.median(r.first for r in runs) * 1000,
        "decode_tps": tokens / span if span > 0 else 0.0,
        "end_to_end_tps": sum(r.tokens for r in runs) / wall if wall > 0 else 0.0,
        "tokens": float(sum(r.tokens for r in runs)),
    }
    print(
        f"{name:<34} ttft {out['ttft_ms']:8.1f} ms   decode {out['decode_tps']:7.1f} tok/s   "
        f"end to end {out['end_to_end_tps']:7.1f} tok/s   ({int(out['tokens'])} tokens, {len(runs)} records)",
        flush=True,
    )
    return out


Runner = Callable[[list[list[int]]], list[Run]]

# llama.cpp's "extra buffer types" (AMX, CPU repacking) are off unless LLAMACPP_EXTRA_BUFTS=1: a build with
# -march=native repacks Q4_1 for AMX, whose kernels die with SIGILL on this VM's worker threads.
EXTRA_BUFTS = os.environ.get("LLAMACPP_EXTRA_BUFTS", "0") == "1"


@contextlib.contextmanager
def _model_params() -> Iterator[None]:
    """llama.cpp's default model parameters with ``use_extra_bufts`` set to :data:`EXTRA_BUFTS` meanwhile."""
    import llama_cpp
    import llama_cpp.llama_cpp as low

    default = low.llama_model_default_params

    def params() -> Any:
        p = default()
        if hasattr(p, "use_extra_bufts"):
            p.use_extra_bufts = EXTRA_BUFTS
        return p

    llama_cpp.llama_model_default_params = low.llama_model_default_params = params
    try:
        yield
    finally:
        llama_cpp.llama_model_default_params = low.llama_model_default_params = default


def llamacpp_runner(path: str, max_tokens: int, threads: int, warmup: list[int]) -> Runner | None:
    """Load llama.cpp once and warm it up (None when ``llama_cpp`` does not import); the function that runs
    prompts on it."""
    try:
        from llama_cpp import Llama
    except ImportError:
        print("llama.cpp: llama_cpp is not importable (pip install -e '.[bench]'); skipped", flush=True)
        return None
    with _model_params():
        llm = Llama(
            model_path=path, n_ctx=2048, n_threads=threads, n_threads_batch=threads, verbose=False, seed=0
        )
    eos = llm.token_eos()

    def one(tokens: list[int]) -> Run:
        llm.reset()  # no reuse of the previous prompt's KV cache: each prompt is processed in full
        start = time.perf_counter()
        first = last = 0.0
        out: list[int] = []
        for tok in llm.generate(tokens, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0):
            now = time.perf_counter() - start
            if tok == eos:
                break
            out.append(tok)
            first = first or now
            last = now
            if len(out) >= max_tokens:
                break
        return Run(first, last, len(out), llm.detokenize(out).decode(errors="replace"))

    one(warmup)
    return lambda prompts: [one(p) for p in prompts]


def llamacpp_batched(
    path: str, threads: int
) -> Callable[[list[list[int]], int], tuple[float, float, int]] | None:
    """llama.cpp's own batched greedy decoding (None when ``llama_cpp`` does not import): a function of the
    prompts and max tokens giving (decode aggregate tok/s, end-to-end aggregate tok/s, tokens)."""
    try:
        import llama_cpp as lc
        import numpy as np
    except ImportError:
        return None
    lc.llama_backend_init()
    with _model_params():
        model = lc.llama_model_load_from_file(path.encode(), lc.llama_model_default_params())
    vocab = lc.llama_model_get_vocab(model)
    n_vocab = lc.llama_vocab_n_tokens(vocab)

    def run(prompts: list[list[int]], max_tokens: int) -> tuple[float, float, int]:
        n = len(prompts)
        params = lc.llama_context_default_params()
        params.n_ctx = sum(len(p) + max_tokens for p in prompts) + 64
        params.n_batch = max(max(len(p) for p in prompts), n)
        params.n_ubatch = params.n_batch
        params.n_seq_max = n
        params.kv_unified = True  # one cache for all sequences, as many-record jobs have
        params.n_threads = params.n_threads_batch = threads
        ctx = lc.llama_init_from_model(model, params)
        batch = lc.llama_batch_init(params.n_batch, 0, 1)

        def decode(items: list[tuple[int, int, int, bool]]) -> None:  # (token, position, sequence, logits)
            batch.n_tokens = len(items)
            for i, (tok, pos, seq, logits) in enumerate(items):
                batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, pos, 1
                batch.seq_id[i][0], batch.logits[i] = seq, logits
            if lc.llama_decode(ctx, batch) != 0:
                raise RuntimeError("llama_decode failed")

        def greedy(i: int) -> int:
            return int(np.argmax(np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, i), shape=(n_vocab,))))

        start = time.perf_counter()
        nxt, pos, made = [0] * n, [len(p) for p in prompts], [0] * n
        for s, p in enumerate(prompts):  # prompts first, one sequence a call (as mlx-lm prefills)
            decode([(tok, j, s, j == len(p) - 1) for j, tok in enumerate(p)])
            nxt[s] = greedy(len(p) - 1)
        first = time.perf_counter()
        made = [0 if lc.llama_vocab_is_eog(vocab, t) else 1 for t in nxt]
        live = [s for s in range(n) if 0 < made[s] < max_tokens]
        while live:
            decode([(nxt[s], pos[s], s, True) for s in live])
            still = []
            for i, s in enumerate(live):
                pos[s] += 1
                nxt[s] = greedy(i)
                if made[s] < max_tokens and not lc.llama_vocab_is_eog(vocab, nxt[s]):
                    made[s] += 1
                    if made[s] < max_tokens:
                        still.append(s)
            live = still
        end = time.perf_counter()
        lc.llama_batch_free(batch)
        lc.llama_free(ctx)
        tokens = sum(made)
        return (tokens - n) / max(end - first, 1e-9), tokens / (end - start), tokens

    run([[1, 2, 3, 4]] * 2, 4)  # warm-up: the first decodes of a process start llama.cpp's threads
    return run


def mlxpipe_single(engine: Any, records: list[Any]) -> list[Run]:
    from mlxpipe import run
    from mlxpipe.events import Chunk, Done

    runs = []
    for record in records:
        start = time.perf_counter()
        first = 0.0
        for event in run([record], engine):
            now = time.perf_counter() - start
            if isinstance(event, Chunk) and not first:
                first = now
            elif isinstance(event, Done):
                runs.append(Run(first or now, now, event.tokens, event.text))
    return runs


def mlxpipe_batched(engine: Any, records: list[Any], size: int) -> tuple[str, float, float, int, float]:
    """(how, decode aggregate tok/s, end-to-end aggregate tok/s, tokens, median time to first token in s)
    for ``size`` records at once.

    Decode aggregate as llama.cpp's below: the tokens after each record's first over the time from the
    last record's first token (every prompt read) to the end.
    """
    from mlxpipe import run
    from mlxpipe.events import Chunk, Done

    if "batch" in inspect.signature(run).parameters:
        how = f"mlxpipe --batch {size} --unordered"
        start = time.perf_counter()
        firsts: dict[int, float] = {}
        tokens = 0
        # --unordered: each record's chunks as they come, so its first one is its time to first token
        # (in input order a record's chunks wait for the records before it; the throughput is the same).
        for event in run(iter(records), engine, batch=size, ordered=False):
            now = time.perf_counter() - start
            if isinstance(event, Chunk):
                firsts.setdefault(event.index, now)
            elif isinstance(event, Done):
                tokens += event.tokens
        wall = time.perf_counter() - start
        decoding = wall - max(firsts.values(), default=0.0)
        decode = (tokens - len(firsts)) / decoding if decoding > 0 else 0.0
        return how, decode, tokens / wall, tokens, statistics.median(firsts.values()) if firsts else 0.0
    # This checkout has no --batch yet: mlx-lm's own continuous batching on the same model and dtype.
    from mlx_lm import batch_generate

    how = f"mlx_lm.batch_generate x{size} (no --batch yet)"
    prompts = [engine.encode(r) for r in records]
    start = time.perf_counter()
    resp = batch_generate(
        engine.model,
        engine.tokenizer,
        prompts,
        max_tokens=records[0].settings.max_tokens,
        return_token_ids=True,
    )
    wall = time.perf_counter() - start
    tokens = sum(len(t) for t in resp.token_ids)
    return how, float("nan"), tokens / wall, tokens, float("nan")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--records", type=int, default=4, help="records for each single-stream run")
    parser.add_argument(
        "--batch", default="16", help="comma-separated records generated together, one run each (0: skip)"
    )
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--model", help="mlxpipe's model (default: the embedded one)")
    parser.add_argument("--gguf", help="llama.cpp's GGUF file (default: --model's, or the embedded one)")
    parser.add_argument(
        "--rounds", type=int, default=3, help="single-stream rounds, the two engines alternating (default 3)"
    )
    args = parser.parse_args()

    # mlxpipe runs with its own thread choice (1 OpenBLAS thread for one stream, one per core for --batch),
    # unless OPENBLAS_NUM_THREADS is set in the environment; it uses the machine's cores either way.
    from mlxpipe import models, records_from_objects
    from mlxpipe.engine import Engine
    from mlxpipe.records import Settings

    gguf = Path(args.gguf) if args.gguf else models.resolve(args.model).path
    assert gguf is not None
    settings = Settings(max_tokens=args.max_tokens, temperature=0.0)
    engine = Engine.load(args.model, dtype=args.dtype)
    info = engine.info()
    blas_threads = os.environ.get("OPENBLAS_NUM_THREADS", "mlxpipe's default")
    print(f"model: {gguf.name}   llama.cpp threads: {args.threads}   OpenBLAS threads: {blas_threads}")
    print(f"max tokens: {args.max_tokens}")
    print(f"load average before: {os.getloadavg()[0]:.2f} (other work on the CPU skews every figure)")
    print(
        f"mlxpipe: dtype {info['dtype']}, int8 activations {info.get('int8_activations')}, "
        f"device {info['device']}, BLAS {info['blas']}"
    )
    sizes = [int(b) for b in args.batch.split(",") if int(b) > 0]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(max([args.records, *sizes]))]
    records = list(records_from_objects(prompts, settings))
    tokens = [engine.encode(r) for r in records]

    mlxpipe_single(engine, records[:1])  # warm-up
    llamacpp = llamacpp_runner(str(gguf), args.max_tokens, args.threads, tokens[0][:8])
    # The engines take turns, round after round: this CPU's speed drifts from minute to minute, and the ratio
    # of each round compares the two under the same conditions.
    rounds: list[tuple[dict[str, float], dict[str, float] | None]] = []
    for i in range(args.rounds):
        print(f"round {i + 1}:")
        our_runs = mlxpipe_single(engine, records[: args.records])
        ours = summarize(f"mlxpipe single ({info['dtype']})", our_runs)
        base_runs = llamacpp(tokens[: args.records]) if llamacpp else None
        rounds.append((ours, summarize("llama.cpp single", base_runs) if base_runs else None))
    if base_runs:
        same = sum(a.text.strip() == b.text.strip() for a, b in zip(our_runs, base_runs, strict=True))
        print(f"greedy texts identical in both engines: {same} of {len(base_runs)}")
        for a, b in zip(our_runs, base_runs, strict=True):
            if a.text.strip() != b.text.strip():
                x, y = a.text.strip(), b.text.strip()
                pairs = enumerate(zip(x, y, strict=False))
                at = next((i for i, (p, q) in pairs if p != q), min(len(x), len(y)))
                print(f"  differ at character {at}: mlxpipe {x[at : at + 30]!r}")
                print(f"  {'':>{len(str(at)) + 21}}llama.cpp {y[at : at + 30]!r}")
    batched: dict[int, float] = {}
    anchor: dict[int, list[tuple[float, float]]] = {}
    llama_batch = llamacpp_batched(str(gguf), args.threads) if llamacpp else None
    for size in sizes:
        for _ in range(args.rounds if llama_batch else 1):  # taking turns, as the single streams do
            how, dec, tps, n, ttft = mlxpipe_batched(engine, records[:size], size)
            batched[size] = max(batched.get(size, 0.0), dec)
            print(
                f"{how:<34} decode {dec:7.1f} tok/s, end to end {tps:7.1f} tok/s ({n} tokens), "
                f"median ttft {ttft * 1000:.0f} ms"
            )
            if llama_batch:
                decode_tps, whole_tps, m = llama_batch(tokens[:size], args.max_tokens)
                anchor.setdefault(size, []).append((dec / decode_tps, tps / whole_tps))
                print(
                    f"{f'llama.cpp batched x{size}':<34} decode {decode_tps:7.1f} tok/s, end to end "
                    f"{whole_tps:7.1f} tok/s ({m} tokens)"
                )

    print()
    measured = [(ours, base) for ours, base in rounds if base]
    if measured:

        def ratios(key: str) -> str:
            each = [ours[key] / base[key] for ours, base in measured]
            return f"{statistics.median(each):.2f}x (median of {', '.join(f'{r:.2f}' for r in each)})"

        print(f"single stream decode: mlxpipe/llama.cpp = {ratios('decode_tps')} (goal >= 0.9)")
        print(f"time to first token: mlxpipe/llama.cpp = {ratios('ttft_ms')}")
        decode = statistics.median(base["decode_tps"] for _, base in measured)
        single = statistics.median(ours["decode_tps"] for ours, _ in measured)
        for size, tps in batched.items():
            print(
                f"--batch {size} decode aggregate (best round) / mlxpipe's single stream decode (median) = "
                f"{tps / single:.2f}x (goal >= 4 at 16, >= 8 at 64); / llama.cpp's single {tps / decode:.2f}x"
            )
        for size, pairs in anchor.items():
            dec = statistics.median(a for a, _ in pairs)
            whole = statistics.median(b for _, b in pairs)
            print(
                f"--batch {size} / llama.cpp batched x{size}: {dec:.2f}x its decode aggregate, "
                f"{whole:.2f}x its end to end, each against its own kind (median of {len(pairs)} rounds; "
                "goal >= 1.5)"
            )
    else:
        print("no llama.cpp baseline: ratios not computed")
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
