"""Throughput and time to first token on a GPU (made for an H200 with ``mlx[cuda13]``; runs anywhere).

For each model shape and weight type it measures, in one process and side by side:

- mlxpipe's own path (``Engine.load`` + ``pipeline.run``: what ``mlxpipe --batch B`` does) and raw mlx-lm
  on the same loaded weights (``stream_generate`` for one stream, ``BatchGenerator`` for a batch);
- one bare decode step of the model (B new tokens against a KV cache), which separates GPU time from the host
  work that a generation loop adds per step;
- the memory-bandwidth floor: bytes of weights read per decode step over the copy bandwidth measured with mlx
  in the same run (bytes read + bytes written by a large device copy). Each figure is printed with its ratio
  to that floor (1.0 = every weight read once per step at full copy speed; KV-cache reads are not counted).

Shapes: ``embedded`` (the embedded SmolLM2-135M-Instruct, as converted by mlxpipe) and random-weight 4-bit
Llama shapes built here (no downloads): ``1b`` (Llama 3.2 1B layers), ``8b`` (Llama 3.1 8B layers), ``tiny``
(for a quick check on a CPU). The random models use the embedded tokenizer, so their vocabulary is 49,152
instead of Llama's 128,256 (1.07B and 7.4B parameters): records decode to real text and the engine needs no
special case. Weight types: ``quantized`` (the 4-bit weights as loaded) and ``bfloat16`` (dequantized).

    python bench/cuda.py --shapes embedded,1b,8b --batches 1,8,32,128 --json results.json
    python bench/cuda.py --shapes tiny --batches 1,4 --max-tokens 8          # a CPU smoke test

Records are greedy, all of one length class ("Write a long story about …"), one wave of B records for batch B
(two records one after another for B=1). ``agg tok/s`` counts generated tokens over the wall time from the
first record's start to the last record's end; TTFT is the median time from a record's start to its first
token. A warm-up run with the same B (8 tokens) comes before each measured run, so that kernel compilation is
reported apart (``warm-up s``) and not inside the figures.
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from mlxpipe import models
from mlxpipe.engine import Engine
from mlxpipe.pipeline import run
from mlxpipe.reader import records_from_objects
from mlxpipe.records import Settings

# isort: split
# After mlxpipe.engine, which on a Linux CPU loads an optimized BLAS before mlx.
import mlx.core as mx
import mlx.nn as nn
import mlx_lm
from mlx.utils import tree_flatten
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_sampler

# Llama layer shapes (hidden, layers, MLP, heads, KV heads, head dim, tied embeddings).
_KEYS = ("hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads",
         "num_key_value_heads", "head_dim", "tie_word_embeddings")  # fmt: skip
SHAPES: dict[str, dict[str, Any]] = {
    "tiny": dict(zip(_KEYS, (128, 2, 256, 4, 2, 32, True), strict=True)),
    "1b": dict(zip(_KEYS, (2048, 16, 8192, 32, 8, 64, True), strict=True)),
    "8b": dict(zip(_KEYS, (4096, 32, 14336, 32, 8, 128, False), strict=True)),
}

TOPICS = [
    f"{a} {b}"
    for a in ("a brave", "a lonely", "a clever", "an old", "a tiny", "a curious", "a grumpy", "a kind")
    for b in (
        "dragon", "robot", "sailor", "baker", "wizard", "fox", "astronaut", "gardener",
        "painter", "detective", "owl", "miner", "queen", "tailor", "whale", "clockmaker",
    )
]  # fmt: skip


def say(*parts: Any) -> None:
    print(*parts, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# Ceilings


def copy_bandwidth(nbytes: int) -> float:
    """Bytes per second moved by a device copy (read + write), median of 10 after warm-up."""
    n = nbytes // 4
    bufs = [mx.random.uniform(shape=(n,)) for _ in range(2)]  # float32: no emulated 16-bit types on a CPU
    mx.eval(bufs)
    times = []
    for i in range(13):
        t = time.perf_counter()
        out = bufs[i % 2] * 1.5  # elementwise: reads n values, writes n values
        mx.eval(out)
        mx.synchronize()
        times.append(time.perf_counter() - t)
        del out
    return 2 * n * 4 / statistics.median(times[3:])


def weight_bytes(model: Any) -> int:
    """Bytes of weights one decode step reads: every parameter once, except an untied input embedding
    (only the rows of the step's tokens are gathered from it)."""
    params = dict(tree_flatten(model.parameters()))
    total = sum(v.nbytes for v in params.values())
    tied = "lm_head.weight" not in params and not any(k.startswith("lm_head.") for k in params)
    if not tied:
        total -= sum(v.nbytes for k, v in params.items() if ".embed_tokens." in f".{k}")
    return total


def parameter_count(model: Any) -> int:
    """Logical parameters (a quantized layer counts the values it packs)."""
    total = 0
    for _, m in model.named_modules():
        if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            total += m.scales.size * m.group_size + (m["bias"].size if "bias" in m else 0)
        else:  # the module's own arrays; its children are visited on their own
            total += sum(v.size for v in m.values() if isinstance(v, mx.array))
    return total


# ---------------------------------------------------------------------------------------------
# Models


def embedded_folder() -> str:
    return models.materialize(models.resolve(None))


def build_random(shape: str, dst: Path, tokenizer_folder: str, bits: int = 4, group_size: int = 64) -> str:
    """Write a random-weight ``bits``-bit Llama model folder of ``shape`` with the embedded tokenizer."""
    from mlx_lm.models import llama
    from mlx_lm.utils import save_model

    src = json.loads((Path(tokenizer_folder) / "config.json").read_text())
    config: dict[str, Any] = dict(
        model_type="llama",
        vocab_size=src["vocab_size"],
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        max_position_embeddings=8192,
        **SHAPES[shape],
    )
    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    # Layer by layer, so an 8B model never holds all its float32 weights at once.
    for part in [model.model.embed_tokens, *model.model.layers, model.model.norm, *model.children().values()]:
        if isinstance(part, nn.Module):
            part.set_dtype(mx.bfloat16)
            mx.eval(part.parameters())
    nn.quantize(model, group_size=group_size, bits=bits)
    for layer in model.model.layers:
        mx.eval(layer.parameters())
    mx.eval(model.parameters())
    dst.mkdir(parents=True, exist_ok=True)
    save_model(dst, model)
    config["quantization"] = {"group_size": group_size, "bits": bits}
    config["torch_dtype"] = "bfloat16"
    config["eos_token_id"] = src.get("eos_token_id")
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        if (Path(tokenizer_folder) / name).exists():
            (dst / name).write_bytes((Path(tokenizer_folder) / name).read_bytes())
    del model
    gc.collect()
    mx.clear_cache()
    return str(dst)


def load_engine(folder: str, dtype: str) -> Engine:
    """``mlxpipe --dtype dtype -m folder``'s engine. An mlxpipe without --dtype gets the same weights here."""
    if "dtype" in inspect.signature(Engine.load).parameters:
        return Engine.load(folder, dtype=dtype)
    engine = Engine.load(folder)
    if dtype != "quantized":
        from mlx_lm.utils import dequantize_model

        engine.model = dequantize_model(engine.model)
        engine.model.set_dtype(getattr(mx, dtype))
        mx.eval(engine.model.parameters())
    return engine


def has_batch() -> bool:
    """Whether this mlxpipe's pipeline has --batch."""
    return "batch" in inspect.signature(run).parameters


def auto_choice(engine: Engine, batch: int) -> str | None:
    """What ``--dtype auto`` picks for ``--batch batch`` on this machine, if this mlxpipe can say."""
    from mlxpipe.engine import dtype as engine_module

    choose = getattr(engine_module, "choose_dtype", None)
    if choose is None:
        return None
    kwargs = {"batch": batch} if "batch" in inspect.signature(choose).parameters else {}
    return str(choose(engine.model, "auto", **kwargs)[0])


# ---------------------------------------------------------------------------------------------
# Runs


def prompts(n: int) -> list[str]:
    return [f"Write a long story about {TOPICS[i % len(TOPICS)]}." for i in range(n)]


def run_ours(engine: Engine, batch: int, max_tokens: int, n: int) -> dict[str, Any]:
    """mlxpipe's pipeline: ``n`` records at ``--batch batch``; events as produced (``--unordered``)."""
    settings = Settings(max_tokens=max_tokens)
    records = list(records_from_objects(prompts(n), settings))
    kwargs: dict[str, Any] = {"batch": batch, "ordered": False} if batch > 1 else {}
    first: dict[int, float] = {}
    done: dict[int, float] = {}
    tokens = 0
    t0 = time.perf_counter()
    for event in run(records, engine, **kwargs):
        now = time.perf_counter()
        first.setdefault(event.index, now)
        if type(event).__name__ == "Done":
            done[event.index] = now
            tokens += event.tokens  # type: ignore[attr-defined]
        elif type(event).__name__ == "Error":
            raise RuntimeError(f"record {event.index} failed: {event.error}")  # type: ignore[attr-defined]
    end = time.perf_counter()
    if batch > 1:
        ttft = [first[i] - t0 for i in sorted(first)]
    else:  # one after another: each record starts when the one before it ends
        starts = [t0, *[done[i] for i in sorted(done)][:-1]]
        ttft = [first[i] - s for i, s in zip(sorted(first), starts, strict=True)]
    return {"tokens": tokens, "wall": end - t0, "ttft": statistics.median(ttft)}


def run_raw(
    engine: Engine, batch: int, max_tokens: int, n: int, own_samplers: bool = False
) -> dict[str, Any]:
    """Raw mlx-lm on the same weights and prompt tokens: stream_generate, or one BatchGenerator.

    ``own_samplers``: give every record its own (greedy) sampler object, as a pipe with per-record settings
    must; BatchGenerator then samples row by row instead of once for the batch.
    """
    model, tokenizer = engine.model, engine.tokenizer
    settings = Settings(max_tokens=max_tokens)
    token_lists = [engine.encode(r) for r in records_from_objects(prompts(n), settings)]  # type: ignore[arg-type]
    tokens = 0
    ttft: list[float] = []
    t0 = time.perf_counter()
    if batch == 1:
        for toks in token_lists:
            start = time.perf_counter()
            for r in mlx_lm.stream_generate(model, tokenizer, toks, max_tokens=max_tokens):
                if r.generation_tokens == 1:
                    ttft.append(time.perf_counter() - start)
                if r.finish_reason is not None:
                    tokens += r.generation_tokens
    else:
        gen = BatchGenerator(
            model,
            stop_tokens=[[t] for t in sorted(tokenizer.eos_token_ids)],
            completion_batch_size=batch,
            prefill_batch_size=batch,
        )
        samplers = [make_sampler(0.0) for _ in range(n)] if own_samplers else None
        uids = gen.insert(token_lists, max_tokens=[max_tokens] * n, samplers=samplers)
        live = set(uids)
        seen: set[int] = set()
        while live:
            for r in gen.next_generated():
                tokens += 1
                if r.uid not in seen:
                    seen.add(r.uid)
                    ttft.append(time.perf_counter() - t0)
                if r.finish_reason is not None:
                    live.discard(r.uid)
        gen.close()
    return {"tokens": tokens, "wall": time.perf_counter() - t0, "ttft": statistics.median(ttft)}


def profile(engine: Engine, batch: int, max_tokens: int, n: int, name: str, json_path: str | None) -> None:
    """Where the host's time goes in one mlxpipe run: the top functions by own time, on stderr."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    ours = run_ours(engine, batch, max_tokens, n)
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(25)
    text = (
        f"== profile {name}: {ours['tokens'] / ours['wall']:.0f} tok/s under the profiler\n{out.getvalue()}"
    )
    say(text)
    if json_path:
        Path(json_path).with_name(f"profile-{name}.txt").write_text(text)


def step_time(model: Any, batch: int, context: int = 64, repeats: int = 12) -> float:
    """Seconds for one bare decode step of ``batch`` tokens against a KV cache of ``context`` tokens."""
    cache = make_prompt_cache(model)
    vocab = model.args.vocab_size
    prompt = mx.random.randint(0, vocab, (batch, context))
    mx.eval(model(prompt, cache=cache))
    tok = mx.random.randint(0, vocab, (batch, 1))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        logits = model(tok, cache=cache)
        tok = mx.argmax(logits[:, -1:, :], axis=-1)
        mx.eval(tok)
        times.append(time.perf_counter() - t)
    return statistics.median(times[2:])


# ---------------------------------------------------------------------------------------------


def bench_engine(
    engine: Engine, label: str, dtype: str, args: argparse.Namespace, bandwidth: float, rows: list[dict]
) -> None:
    wbytes = weight_bytes(engine.model)
    params = parameter_count(engine.model)
    say(f"== {label} {dtype}: {params / 1e9:.3f}B parameters, {wbytes / 1e9:.3f} GB read per step")
    previous: tuple[int, float] | None = None  # (batch, aggregate tok/s) of the last measured size
    for batch in args.batches:
        row: dict[str, Any] = {"shape": label, "dtype": dtype, "batch": batch, "params": params}
        row["weight_bytes"] = wbytes
        floor = batch * bandwidth / wbytes  # tok/s if each step only read the weights at copy speed
        row["floor_tps"] = floor
        row["auto"] = auto_choice(engine, batch)
        if previous is not None:
            predicted = batch * args.max_tokens / previous[1]  # as if throughput did not grow with B
            if predicted > args.max_run_seconds:
                row["skipped"] = f"predicted {predicted:.0f} s > --max-run-seconds"
                say(f"   b{batch}: skipped ({row['skipped']})")
                rows.append(row)
                continue
        n = 2 if batch == 1 else batch
        t = time.perf_counter()
        if batch == 1 or has_batch():  # warm-up: compiles this batch size's kernels
            run_ours(engine, batch, 8, n)
        else:
            run_raw(engine, batch, 8, n)
        row["warmup_s"] = time.perf_counter() - t
        row["step_s"] = step_time(engine.model, batch)
        if batch == 1 or has_batch():
            ours = run_ours(engine, batch, args.max_tokens, n)
            row.update({f"ours_{k}": v for k, v in ours.items()})
            row["ours_tps"] = ours["tokens"] / ours["wall"]
        if batch in args.profile and dtype == args.profile_dtype and has_batch():
            profile(engine, batch, args.max_tokens, n, f"{label}-{dtype}-b{batch}", args.json)
        if args.raw:
            raw = run_raw(engine, batch, args.max_tokens, n)
            row.update({f"raw_{k}": v for k, v in raw.items()})
            row["raw_tps"] = raw["tokens"] / raw["wall"]
            if batch > 1 and args.own_samplers:
                raw = run_raw(engine, batch, args.max_tokens, n, own_samplers=True)
                row["raw_own_samplers_tps"] = raw["tokens"] / raw["wall"]
        speed = row.get("ours_tps") or row.get("raw_tps") or batch / row["step_s"]
        previous = (batch, speed)
        say(
            f"   b{batch}: ours {row.get('ours_tps', 0):.0f} tok/s"
            f" (ttft {row.get('ours_ttft', 0) * 1e3:.0f} ms)"
            + (f", raw {row['raw_tps']:.0f} tok/s (ttft {row['raw_ttft'] * 1e3:.0f} ms)" if args.raw else "")
            + (
                f", raw own samplers {row['raw_own_samplers_tps']:.0f}"
                if "raw_own_samplers_tps" in row
                else ""
            )
            + f", bare step {row['step_s'] * 1e3:.2f} ms = {batch / row['step_s']:.0f} tok/s,"
            f" floor {floor:.0f}, warm-up {row['warmup_s']:.1f} s"
        )
        rows.append(row)
        if args.json:
            Path(args.json).write_text(json.dumps({"meta": META, "rows": rows}, indent=1))


def table(rows: list[dict]) -> str:
    """The markdown table: each throughput with its ratio to the floor in parentheses."""
    head = (
        "| shape | weights | auto | B | mlxpipe tok/s | raw mlx-lm tok/s | mlxpipe/raw "
        "| TTFT ms mlxpipe / raw | bare step ms (tok/s) | floor tok/s | warm-up s |"
    )
    out = [head, "|" + "---|" * (head.count("|") - 1)]

    def tps(r: dict, key: str) -> str:
        return f"{r[key]:.0f} ({r[key] / r['floor_tps']:.2f})" if key in r else "—"

    def ms(r: dict, key: str) -> str:
        return f"{r[key] * 1e3:.0f}" if key in r else "—"

    for r in rows:
        auto = "auto" if r.get("auto") == r["dtype"] else ""
        if "skipped" in r:
            out.append(f"| {r['shape']} | {r['dtype']} | {auto} | {r['batch']} | {r['skipped']} ||||||")
            continue
        raw = tps(r, "raw_tps")
        if "raw_own_samplers_tps" in r:
            raw += f"; own samplers {r['raw_own_samplers_tps']:.0f}"
        vs = f"{r['ours_tps'] / r['raw_tps']:.2f}" if "ours_tps" in r and "raw_tps" in r else "—"
        step = r["batch"] / r["step_s"]
        out.append(
            f"| {r['shape']} | {r['dtype']} | {auto} | {r['batch']} | {tps(r, 'ours_tps')} | {raw} | {vs} "
            f"| {ms(r, 'ours_ttft')} / {ms(r, 'raw_ttft')} | {r['step_s'] * 1e3:.2f} ({step:.0f}, "
            f"{step / r['floor_tps']:.2f}) | {r['floor_tps']:.0f} | {r['warmup_s']:.1f} |"
        )
    return "\n".join(out)


META: dict[str, Any] = {}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="embedded,1b,8b", help="comma list: embedded, tiny, 1b, 8b")
    p.add_argument("--batches", default="1,8,32,128", help="comma list of --batch sizes")
    p.add_argument("--dtypes", default="quantized,bfloat16", help="comma list of --dtype values")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens per record (default 128)")
    p.add_argument("--max-run-seconds", type=float, default=40.0, help="skip a size predicted to run longer")
    p.add_argument("--no-raw", dest="raw", action="store_false", help="skip the raw mlx-lm baseline")
    p.add_argument(
        "--own-samplers", action="store_true", help="also time raw mlx-lm with a sampler per record"
    )
    p.add_argument("--profile", default="", help="comma list of batch sizes to profile (host time)")
    p.add_argument("--profile-dtype", default="bfloat16", help="the weights to profile with")
    p.add_argument("--bandwidth-mb", type=int, default=2048, help="buffer size for the copy bandwidth")
    p.add_argument("--work", default=None, help="folder for the random models (default: a temp folder)")
    p.add_argument("--json", default=None, help="also write every figure to this JSON file")
    args = p.parse_args()
    args.batches = [int(b) for b in args.batches.split(",")]
    args.profile = [int(b) for b in args.profile.split(",") if b]
    bandwidth = copy_bandwidth(args.bandwidth_mb << 20)
    META.update(
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        device=str(mx.default_device()),
        device_info={k: str(v) for k, v in mx.device_info().items()},
        mlx=mx.__version__,
        mlx_lm=mlx_lm.__version__,
        copy_bandwidth=bandwidth,
        command=" ".join([sys.executable, *sys.argv]),
        env={k: v for k, v in os.environ.items() if k.startswith("MLX")},
    )
    name = META["device_info"].get("device_name", "")
    say(f"device {META['device']} {name}; copy {bandwidth / 1e9:.0f} GB/s")
    tokenizer_folder = embedded_folder()
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(dir=args.work) as work:
        for shape in args.shapes.split(","):
            if shape == "embedded":
                folder = tokenizer_folder
            else:
                t = time.perf_counter()
                folder = build_random(shape, Path(work) / shape, tokenizer_folder)
                say(f"built {shape} in {time.perf_counter() - t:.1f} s")
            for dtype in args.dtypes.split(","):
                engine = load_engine(folder, dtype)
                bench_engine(engine, shape, dtype, args, bandwidth, rows)
                del engine
                gc.collect()
                mx.clear_cache()
    print(
        f"\n{META['date']}, {META['device']} ({name}), mlx {META['mlx']}, mlx-lm {META['mlx_lm']},"
        f" copy bandwidth {bandwidth / 1e9:.0f} GB/s, {args.max_tokens} tokens a record"
    )
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": META, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
