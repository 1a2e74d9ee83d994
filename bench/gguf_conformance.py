"""mlxpipe's GGUF conversion against llama.cpp (the reference GGUF implementation), on the same files.

For every supported architecture a small random-weight GGUF is written with gguf-py (tests/gguf_factory.py:
the BPE ones with the embedded SmolLM2's vocabulary and merges, the SentencePiece ones with a vocabulary
trained here); ``smollm2`` is the embedded model's real weights, dequantized to F32. llama.cpp quantizes each
(llama_cpp.llama_model_quantize), and both engines read the same file:
prompt tokens, greedy continuations (16 tokens), and per-step logits along llama.cpp's greedy path (max abs
difference at the first step, top-1 agreement over all steps). The reference in float arithmetic too:
llama.cpp on the file's weights dequantized to F32 (gguf-py), whose greedy tokens both llama.cpp on the file
(its 8-bit quantized activations) and mlxpipe are compared with; where the greedy runs part, the parting step
is shown in both engines on both files, which tells llama.cpp's activation noise from a conversion error.
Last column: mlxpipe's batched path (every prompt at once, ``--batch``) against llama.cpp's greedy texts. One
prompt is longer than the factory's sliding window (64: gemma2, gemma3), so attention past the window counts.
Needs the `bench` extra (llama-cpp-python); not part of the tests.

    python bench/gguf_conformance.py [--types Q4_0,Q4_K_M,...] [--archs llama,qwen2,...] [--out table.md]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

from gguf_factory import ARCHS, CHATML, trained_spm, write_gguf  # noqa: E402

PROMPTS = [
    "The quick brown fox jumps over the lazy dog",
    "Numbers 12345 and 3.14159; emoji 🌸 and   spaces",
    "東京は晴れ、北京欢迎你 — Café naïve",
    "def f(x):\n    return x * 2  # it's done\n",
]
# A prompt longer than the factory's sliding window (64 positions: gemma2, gemma3): attention past the window.
PROMPTS.append(" ".join(["Each lighthouse keeper wrote the weather, the ships and the lamp's hours."] * 6))
TYPES = ["Q8_0", "Q6_K", "Q5_K_M", "Q4_K_M", "Q4_0", "Q3_K_M", "Q2_K", "Q4_1", "Q5_0", "Q5_1", "F16", "BF16"]
STEPS = 16
SCALE = (
    1.3  # larger makes the random network chaotic: llama.cpp's quantized activations then flip greedy picks
)


def smollm_bpe(pre: str) -> dict[str, Any]:
    """The embedded SmolLM2's byte-level BPE vocabulary, labelled with the pre-tokenizer ``pre``."""
    from mlxpipe.models import resolve
    from mlxpipe.models.gguf.reader import read_header

    path = resolve(None).path
    assert path is not None
    md, _ = read_header(path)
    return {
        "model": "gpt2", "pre": pre, "tokens": md["tokenizer.ggml.tokens"],
        "types": md["tokenizer.ggml.token_type"], "merges": md["tokenizer.ggml.merges"],
        "bos": 1, "eos": 2, "add_bos": False, "template": CHATML,
    }  # fmt: skip


def build(arch: str, folder: Path) -> Path:
    if arch == "smollm2":
        # Real weights: the embedded model's, dequantized to F32 for llama.cpp to quantize afresh.
        from gguf_factory import dequantized_copy

        from mlxpipe.models import resolve

        embedded = resolve(None).path
        assert embedded is not None
        return dequantized_copy(embedded, folder / "smollm2-F32.gguf")
    if arch in ("gemma2", "gemma3", "phi3"):
        tok = trained_spm(folder / f"{arch}-spm", vocab_size=1000, text=_spm_text())
        tok.pop("processor")
        tok["add_bos"] = True
    else:
        tok = smollm_bpe({"llama": "llama-bpe", "llama3": "llama-bpe"}.get(arch, "qwen2"))
    real = "llama" if arch == "llama3" else arch
    return write_gguf(
        folder / f"{arch}-F32.gguf", real, tok, hidden=256, layers=6 if real == "gemma3" else 4, heads=4,
        kv_heads=2, ffn=512, rope_freqs=arch == "llama3", scale=SCALE, tied=real != "phi3", seed=7,
        output_noise=SCALE / 2,  # phi3's untied output near its embedding: margins as clear as a tied one's
    )  # fmt: skip


def _spm_text() -> str:
    # Code and English that do not change with this script, so neither do the vocabulary and the table.
    import json.decoder

    words = Path(json.decoder.__file__).read_text(encoding="utf-8") + "\n".join(PROMPTS)
    return words * 3


def quantize(src: Path, qtype: str) -> Path:
    import llama_cpp

    if qtype == "F32":
        return src
    dst = src.with_name(src.name.replace("-F32", f"-{qtype}").replace("-F16", f"-{qtype}"))
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{qtype}")
    params.nthread = 2
    if llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params)) != 0:
        raise RuntimeError(f"llama.cpp could not quantize {src} to {qtype}")
    return dst


def llama_cpp_run(
    path: Path, prompt: str, follow: list[int] | None = None
) -> tuple[list[int], list[int], np.ndarray]:
    """llama.cpp: prompt tokens, greedy continuation, and the logits before each continuation token (along
    the tokens ``follow`` instead of its own picks where given)."""
    import llama_cpp

    llm = llama_cpp.Llama(str(path), n_ctx=256, n_threads=2, logits_all=True, verbose=False, n_batch=256)
    add_bos = llm.metadata.get("tokenizer.ggml.add_bos_token", "false") == "true"
    tokens = llm.tokenize(prompt.encode(), add_bos=add_bos, special=True)
    llm.eval(tokens)
    out: list[int] = []
    logits = []
    for _ in range(STEPS):
        row = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
        logits.append(row)
        out.append(int(row.argmax()))
        llm.eval([out[-1] if follow is None else follow[len(out) - 1]])
    llm.close()
    return tokens, out, np.stack(logits)


def mlx_run(path: Path, prompt_tokens: list[int], path_tokens: list[int], prompt: str) -> tuple[Any, ...]:
    """mlxpipe's engine on the file (converted, loaded as the command loads it): prompt
    tokens, greedy continuation, and the logits along llama.cpp's greedy path."""
    import mlx.core as mx

    from mlxpipe.engine import Engine
    from mlxpipe.engine.generate import stream_generate

    engine = Engine.load(str(path))
    model, tokenizer = engine.model, engine.tokenizer
    ours = tokenizer.encode(prompt)
    seq = mx.array([prompt_tokens + path_tokens[:-1]])
    logits = np.array(model(seq)[0, len(prompt_tokens) - 1 :].astype(mx.float32))
    stream = stream_generate(
        model, tokenizer, prompt_tokens, max_tokens=STEPS, sampler=lambda x: mx.argmax(x, axis=-1),
        logits_processors=[],
    )  # fmt: skip
    greedy = [r.token for r in stream]
    return ours, greedy, logits


def mlx_batched(path: Path, prompts: list[str]) -> list[str]:
    """mlxpipe's batched path (``--batch`` with every prompt at once, no chat template): each greedy text."""
    from mlxpipe import records_from_objects, run
    from mlxpipe.engine import Engine
    from mlxpipe.events import Done
    from mlxpipe.records import Settings

    engine = Engine.load(str(path))
    settings = Settings(max_tokens=STEPS, temperature=0.0, raw=True)
    done = [
        e
        for e in run(records_from_objects(prompts, settings), engine, batch=len(prompts))
        if isinstance(e, Done)
    ]
    return [e.text for e in sorted(done, key=lambda e: e.index)]


def parting(
    path: Path, exact: Path, prompt: str, ptoks: list[int], ours: list[int], theirs: list[int]
) -> str:
    """Where two greedy runs part: each engine's two best tokens and their margin at that step (same prefix,
    llama.cpp's path), on the file and on ``exact``, its weights dequantized to F32 by gguf-py (the same
    weights with float activations: llama.cpp's quantized activations, and mlxpipe's requantized
    16-weight-group K-quants, out of the comparison)."""
    k = next(i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b)

    def top2(row: np.ndarray) -> str:
        a, b = np.argsort(row)[::-1][:2]
        return f"{a} > {b} by {row[a] - row[b]:.3f}"

    rows = {
        "llama.cpp": llama_cpp_run(path, prompt, theirs)[2],
        "mlxpipe": mlx_run(path, ptoks, theirs, prompt)[2],
        "llama.cpp F32": llama_cpp_run(exact, prompt, theirs)[2],
        "mlxpipe F32": mlx_run(exact, ptoks, theirs, prompt)[2],
    }
    return f"parted at step {k}: " + "; ".join(f"{name} {top2(r[k])}" for name, r in rows.items())


def _text(path: Path, tokens: list[int]) -> str:
    """``tokens`` as mlxpipe's tokenizer for ``path`` reads them, up to the first end token."""
    from mlxpipe.engine import Engine

    tokenizer = _text_engines.get(path) or _text_engines.setdefault(path, Engine.load(str(path)).tokenizer)
    ends = set(tokenizer.eos_token_ids)
    kept = tokens[: next((i for i, t in enumerate(tokens) if t in ends), len(tokens))]
    return str(tokenizer.decode(kept))


_text_engines: dict[Path, Any] = {}


def _same(a: list[int], b: list[int]) -> int:
    return sum(x == y for x, y in zip(a, b, strict=False))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", default=",".join(TYPES))
    ap.add_argument("--archs", default=",".join(["llama", "llama3", *ARCHS[1:], "smollm2"]))
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    from gguf_factory import dequantized_copy

    from mlxpipe.models import convert_gguf

    rows = [
        "| arch | type | GGUF MB | MLX MB | prompt tokens equal | greedy tokens equal (min/16) | "
        "top-1 agreement | first-step max abs diff (logit range) | on F32 weights, greedy equal (min/16): "
        "llama.cpp on the file | mlxpipe | `--batch` greedy texts equal |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    with tempfile.TemporaryDirectory() as tmp:
        for arch in args.archs.split(","):
            src = build(arch, Path(tmp))
            for qtype in args.types.split(","):
                path = quantize(src, qtype)
                folder = Path(tmp) / f"{path.stem}-mlx"
                t0 = time.time()
                convert_gguf(path, folder)
                convert_s = time.time() - t0
                os.environ["XDG_CACHE_HOME"] = str(Path(tmp) / f"cache-{path.stem}")
                exact = (
                    path
                    if qtype == "F32"
                    else dequantized_copy(path, path.with_name(f"{path.stem}-F32w.gguf"))
                )
                same_prompt, worst, agree, total, diff, spread = 0, STEPS, 0, 0, 0.0, 0.0
                self_worst, exact_worst = STEPS, STEPS
                wanted = []  # llama.cpp's greedy text of each prompt, up to an end token
                for prompt in PROMPTS:
                    ptoks, theirs, ref = llama_cpp_run(path, prompt)
                    wanted.append(_text(path, theirs))
                    ours_p, ours_g, logits = mlx_run(path, ptoks, theirs, prompt)
                    same_prompt += ours_p == ptoks
                    worst = min(worst, _same(ours_g, theirs))
                    agree += int((logits.argmax(axis=1) == ref.argmax(axis=1)).sum())
                    total += len(theirs)
                    diff = max(diff, float(np.abs(logits[0] - ref[0]).max()))
                    spread = max(spread, float(ref[0].max() - ref[0].min()))
                    if exact != path:
                        # The reference in float arithmetic: llama.cpp on the same weights, dequantized.
                        theirs_f32 = llama_cpp_run(exact, prompt)[1]
                        self_worst = min(self_worst, _same(theirs, theirs_f32))
                        exact_worst = min(exact_worst, _same(ours_g, theirs_f32))
                    if ours_g != theirs:
                        why = parting(path, exact, prompt, ptoks, ours_g, theirs)
                        print(f"  {arch} {qtype} {prompt[:20]!r}: {why}", flush=True)
                size = sum(f.stat().st_size for f in folder.iterdir()) / 1e6
                f32 = "— | —" if exact == path else f"{self_worst} | {exact_worst}"
                # (a text's leading space is the detokenizer's to drop: compared without it)
                batched = sum(
                    a.strip() == b.strip() for a, b in zip(mlx_batched(path, PROMPTS), wanted, strict=True)
                )
                f32 += f" | {batched}/{len(PROMPTS)}"
                row = (f"| {arch} | {qtype} | {path.stat().st_size / 1e6:.1f} | {size:.1f} | "
                       f"{same_prompt}/{len(PROMPTS)} | {worst} | {100 * agree / total:.1f}% | "
                       f"{diff:.3f} ({spread:.1f}) | {f32} |")  # fmt: skip
                print(row, f"(converted in {convert_s:.1f} s)", flush=True)
                rows.append(row)
                if exact != path:
                    exact.unlink()
    if args.out:
        args.out.write_text("\n".join(rows) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
