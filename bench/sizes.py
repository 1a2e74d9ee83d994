"""mlxpipe against llama.cpp on models of real sizes (issue 38): the same files, measured side by side.

    python bench/sizes.py [--shapes 1b,8b] [--types Q4_K_M,Q8_0,Q6_K] [--mlx4] [--dir DIR] [--rounds 3]

Writes random-weight GGUFs in the shapes of Llama-3.2-1B and Llama-3.1-8B (the embedded SmolLM2's byte-level
BPE vocabulary, tied embeddings; one set of layer matrices repeated in every layer, which changes no speed)
at F16 with gguf-py, and has llama.cpp itself quantize them (``llama_model_quantize``). ``--mlx4`` adds the
seed's own form: mlxpipe's conversion of the F16 file turned into a 4-bit, group-64 MLX folder by
``mlx_lm.convert``, against llama.cpp on a Q4_0 file of the same weights. Files are kept in ``--dir`` for
the next run (the 8B F16 file is 15 GB).

Per file, each measure in a child process, the engines taking turns:
- first run: mlxpipe's conversion into an empty cache (``materialize``), seconds and the child's peak RSS,
  then its first answer (the kernels built, the weights packed and their copies kept);
- warm start to the first token: a new process answering one short prompt with 1 token (the file converted
  already), from the process's start to its first output, and the peak RSS of a 64-token answer;
- decode: ``bench/vs_llamacpp.py --model FILE`` (single stream, then ``--batch`` 16 and 64, rounds taking
  turns), whose ratios it prints.
Needs the `bench` extra (llama-cpp-python). Take ``flock -x /tmp/mlxpipe-cpu.lock`` around it.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests"), str(REPO / "bench")]

from gguf_conformance import quantize, smollm_bpe  # noqa: E402

# hidden, layers, heads, KV heads, FFN: Llama-3.2-1B's and Llama-3.1-8B's
SHAPES = {"1b": (2048, 16, 32, 8, 8192), "8b": (4096, 32, 32, 8, 14336)}
PROMPT = "Write a short story about a lighthouse keeper."

# A child that converts a GGUF into the cache it is given, as the command's first run does.
CONVERT = r"""
import re, sys, time
from mlxpipe.models import materialize, resolve
t0 = time.perf_counter()
materialize(resolve(sys.argv[1]))
print(time.perf_counter() - t0, re.search(r"VmHWM:\s+(\d+)", open("/proc/self/status").read()).group(1))
"""

# llama.cpp's start: load, read the prompt, the first token; then 64 tokens for the peak RSS.
LLAMA = r"""
import re, sys, time
t0 = time.perf_counter()
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_ctx=512, n_threads=2, n_threads_batch=2, verbose=False)
tokens = llm.tokenize(sys.argv[2].encode())
for i, tok in enumerate(llm.generate(tokens, temp=0.0, top_k=1, repeat_penalty=1.0)):
    if i == 0:
        first = time.perf_counter() - t0
    if i == int(sys.argv[3]) - 1:
        break
print(first, re.search(r"VmHWM:\s+(\d+)", open("/proc/self/status").read()).group(1))
"""


def write_f16(path: Path, shape: str) -> Path:
    """A random-weight llama GGUF of ``shape`` at F16 (weights ~N(0, 1/fan_in), embeddings N(0, 1))."""
    import gguf

    if path.exists():
        return path
    hidden, layers, heads, kv_heads, ffn = SHAPES[shape]
    tok = smollm_bpe("smollm")
    rng = np.random.default_rng(0)
    head = hidden // heads
    w = gguf.GGUFWriter(str(path) + ".part", "llama")
    w.add_context_length(8192)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(500000.0)
    w.add_vocab_size(len(tok["tokens"]))
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    w.add_tokenizer_model(tok["model"])
    w.add_tokenizer_pre(tok["pre"])
    w.add_token_list(tok["tokens"])
    w.add_token_types(tok["types"])
    w.add_token_merges(tok["merges"])
    w.add_bos_token_id(tok["bos"])
    w.add_eos_token_id(tok["eos"])
    w.add_add_bos_token(tok["add_bos"])
    w.add_chat_template(tok["template"])

    def mat(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols), dtype=np.float32) / np.sqrt(cols)).astype(np.float16)

    ones = np.ones(hidden, dtype=np.float32)
    w.add_tensor(
        "token_embd.weight",
        rng.standard_normal((len(tok["tokens"]), hidden), dtype=np.float32).astype(np.float16),
    )
    w.add_tensor("output_norm.weight", ones)
    layer = {
        "attn_q": mat(heads * head, hidden), "attn_k": mat(kv_heads * head, hidden),
        "attn_v": mat(kv_heads * head, hidden), "attn_output": mat(hidden, heads * head),
        "ffn_gate": mat(ffn, hidden), "ffn_up": mat(ffn, hidden), "ffn_down": mat(hidden, ffn),
    }  # fmt: skip
    for i in range(layers):
        w.add_tensor(f"blk.{i}.attn_norm.weight", ones)
        w.add_tensor(f"blk.{i}.ffn_norm.weight", ones)
        for name, data in layer.items():
            w.add_tensor(f"blk.{i}.{name}.weight", data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(str(path) + ".part", path)
    return path


def mlx4_folder(f16: Path) -> Path:
    """The seed's form of ``f16``'s weights: mlxpipe's conversion, then ``mlx_lm.convert -q`` (4 bits, 64)."""
    out = f16.with_name(f16.stem.replace("-F16", "") + "-mlx4g64")
    if out.exists():
        return out
    from mlx_lm import convert

    from mlxpipe.models import convert_gguf

    with tempfile.TemporaryDirectory(dir=f16.parent) as tmp:
        plain = Path(tmp) / "f16"
        convert_gguf(f16, plain)
        convert(str(plain), str(out), quantize=True, q_group_size=64, q_bits=4)
    return out


def env(cache: Path) -> dict[str, str]:
    return dict(os.environ, XDG_CACHE_HOME=str(cache), PYTHONPATH=str(REPO))


def first_output(cmd: list[str], environ: dict[str, str]) -> tuple[float, str]:
    """Seconds from starting ``cmd`` to its first byte on stdout, and all it wrote."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=environ, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None
    first = proc.stdout.read(1)
    seconds = time.perf_counter() - start
    rest = first + proc.stdout.read()
    if proc.wait() != 0:
        raise RuntimeError(f"{cmd} failed: {proc.stderr.read().decode() if proc.stderr else ''}")
    return seconds, rest.decode(errors="replace")


def peak_rss_mb(cmd: list[str], environ: dict[str, str]) -> float:
    """The peak RSS of ``cmd`` (GNU time's maximum resident set)."""
    done = subprocess.run(["/usr/bin/time", "-f", "%M", *cmd], env=environ, capture_output=True, check=True)
    return int(done.stderr.decode().strip().splitlines()[-1]) / 1e3


def measure(spec: Path, gguf_file: Path, cache: Path, rounds: int, batches: str) -> None:
    """The table rows of one model: mlxpipe on ``spec`` against llama.cpp on ``gguf_file``."""
    python = sys.executable
    if spec.suffix == ".gguf":
        t, hwm = subprocess.run(
            [python, "-c", CONVERT, str(spec)], env=env(cache), capture_output=True, check=True, text=True
        ).stdout.split()
        print(f"first run, conversion: {float(t):.1f} s, peak RSS {int(hwm) / 1e3:.0f} MB", flush=True)
    ours = [python, "-m", "mlxpipe", "-m", str(spec), "--batch", "1", "-p", PROMPT]
    first_s, _ = first_output([*ours, "-n", "1"], env(cache))  # builds the kernels, packs, keeps the copies
    print(f"first answer after the conversion: {first_s:.2f} s (kernels built, weights packed and kept)")
    for i in range(rounds):
        start_s, _ = first_output([*ours, "-n", "1"], env(cache))
        base_s, base_out = first_output([python, "-c", LLAMA, str(gguf_file), PROMPT, "1"], env(cache))
        print(
            f"round {i + 1}: warm start to first token: mlxpipe {start_s:.2f} s (from process start), "
            f"llama.cpp {float(base_out.split()[0]):.2f} s (in process), {base_s:.2f} s (from process start)",
            flush=True,
        )
    rss = peak_rss_mb([*ours, "-n", "64"], env(cache))
    base = peak_rss_mb([python, "-c", LLAMA, str(gguf_file), PROMPT, "64"], env(cache))
    print(
        f"peak RSS, 64-token answer: mlxpipe {rss:.0f} MB, llama.cpp {base:.0f} MB ({rss / base:.2f}x)",
        flush=True,
    )
    subprocess.run(
        [python, str(REPO / "bench" / "vs_llamacpp.py"), "--model", str(spec), "--gguf", str(gguf_file),
         "--max-tokens", "64", "--records", "2", "--batch", batches, "--rounds", str(rounds)],
        env=env(cache), check=True,
    )  # fmt: skip


def main() -> None:
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[attr-defined]  # beside the children's lines
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="1b")
    ap.add_argument("--types", default="Q4_K_M,Q8_0,Q6_K")
    ap.add_argument("--mlx4", action="store_true", help="also the seed's MLX 4-bit group-64 form")
    ap.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()) / "mlxpipe-sizes")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", default="16,64")
    args = ap.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    print(f"load average before: {os.getloadavg()[0]:.2f}; {os.cpu_count()} cores")
    for shape in args.shapes.split(","):
        f16 = write_f16(args.dir / f"llama-{shape}-F16.gguf", shape)
        for qtype in [t for t in args.types.split(",") if t]:
            path = f16.with_name(re.sub("-F16", f"-{qtype}", f16.name))
            if not path.exists():
                quantize(f16, qtype)
            print(f"\n## {shape} {qtype}: {path.stat().st_size / 1e6:.0f} MB", flush=True)
            with tempfile.TemporaryDirectory(dir=args.dir) as cache:
                measure(path, path, Path(cache), args.rounds, args.batch)
        if args.mlx4:
            folder = mlx4_folder(f16)
            q4_0 = f16.with_name(f16.name.replace("-F16", "-Q4_0"))
            if not q4_0.exists():
                quantize(f16, "Q4_0")
            size = sum(f.stat().st_size for f in folder.iterdir()) / 1e6
            q4_0_mb = q4_0.stat().st_size / 1e6
            print(f"\n## {shape} MLX 4-bit g64 folder ({size:.0f} MB) vs llama.cpp Q4_0 ({q4_0_mb:.0f} MB)")
            with tempfile.TemporaryDirectory(dir=args.dir) as cache:
                measure(folder, q4_0, Path(cache), args.rounds, args.batch)
    print(f"\nload average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
