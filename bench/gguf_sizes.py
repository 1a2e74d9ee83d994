"""A converted GGUF's size on disk, the converter's peak memory, and the second run (issue 18's size goals).

Files: the embedded SmolLM2-135M's weights dequantized to an F32 GGUF by gguf-py, then quantized by llama.cpp
(``llama_cpp.llama_model_quantize``) to each type. Its rows are 576 wide, not a multiple of 256, so llama.cpp
falls back from the K-quants on most tensors (as in every SmolLM2-135M K-quant file); the second model,
``llama-1b-shape`` (random weights in Llama 3.2 1B's shapes, 6 layers instead of 16, the SmolLM2 vocabulary,
tied embeddings), gets K-quants on every matrix, as models from 1B up do. Sizes depend on the tensor types,
not on the values.

Each file is converted the way the command does it (``materialize`` into an empty cache) in a child process:
the child's peak RSS (``VmHWM``), and its peak before converting (interpreter and imports). A second child
materializes again with the converter replaced by a failure: it must find the cached folder. Per GGUF tensor
type: bytes in the file and in the converted folder. Needs the `bench` extra (llama-cpp-python).

    python bench/gguf_sizes.py [--types Q4_K_M,Q8_0,...] [--models smollm2,llama-1b-shape]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests"), str(REPO / "bench")]

from gguf_conformance import quantize, smollm_bpe  # noqa: E402
from gguf_factory import dequantized_copy, write_gguf  # noqa: E402

TYPES = ["Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0", "Q4_0", "Q3_K_M", "Q2_K"]

# VmHWM, not ru_maxrss: Linux carries the parent's ru_maxrss over fork and exec into the child's.
CHILD = r"""
import re, sys, time
import numpy, tokenizers
import mlxpipe.models.cache as cache
import mlxpipe.models.gguf.convert
from mlxpipe.models import materialize, resolve

def hwm():
    with open("/proc/self/status") as f:
        return int(re.search(r"VmHWM:\s+(\d+) kB", f.read()).group(1))

if sys.argv[2] == "again":
    def refuse(*args):
        raise SystemExit("converted again")
    cache.convert_gguf = refuse
before = hwm()
t0 = time.perf_counter()
folder = materialize(resolve(sys.argv[1]))
print(folder, before, hwm(), time.perf_counter() - t0)
"""


def source(model: str, folder: Path) -> Path:
    """The F32 GGUF that llama.cpp quantizes."""
    if model == "smollm2":
        from mlxpipe.models import resolve

        embedded = resolve(None).path
        assert embedded is not None
        return dequantized_copy(embedded, folder / "smollm2-F32.gguf")
    tok = smollm_bpe("smollm")
    return write_gguf(
        folder / f"{model}-F32.gguf", "llama", tok, hidden=2048, layers=6, heads=32, kv_heads=8, ffn=8192,
        seed=3,
    )  # fmt: skip


def child(path: Path, mode: str, cache: Path) -> tuple[Path, int, int, float]:
    """Materialize ``path`` in a child: (folder, peak RSS kB, peak RSS kB before converting, seconds)."""
    env = dict(os.environ, XDG_CACHE_HOME=str(cache), PYTHONPATH=str(REPO))
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(path), mode], env=env, stdout=subprocess.PIPE)
    assert proc.stdout is not None
    out = proc.stdout.read().decode()
    if proc.wait() != 0:
        raise RuntimeError(f"materialize {mode} of {path} failed ({proc.returncode}): {out}")
    folder, before, peak, seconds = out.split()
    return Path(folder), int(peak), int(before), float(seconds)


def by_type(path: Path, folder: Path) -> dict[str, list[int]]:
    """GGUF tensor type → [weights, bytes in the GGUF, bytes in the folder's safetensors]."""
    from mlxpipe.models.gguf import quants
    from mlxpipe.models.gguf.config import mlx_name
    from mlxpipe.models.gguf.reader import GGML_TYPES, read_header

    metadata, infos = read_header(path)
    with open(folder / "model.safetensors", "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    spans = {k: v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items() if k != "__metadata__"}
    table: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    for t in infos:
        target = mlx_name(metadata["general.architecture"], t.name)
        if not target:
            continue
        n = 1
        for d in t.shape:
            n *= d
        block, size = quants.BLOCKS[t.ggml_type]
        base = target.rpartition(".")[0]
        names = (
            [target]
            if t.ggml_type in quants.FLOAT_TYPES
            else [f"{base}.{s}" for s in ("weight", "scales", "biases")]
        )
        row = table[GGML_TYPES[t.ggml_type]]
        row[0] += n
        row[1] += n // block * size
        row[2] += sum(spans[k] for k in names)
    return dict(table)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", default=",".join(TYPES))
    ap.add_argument("--models", default="smollm2,llama-1b-shape")
    args = ap.parse_args()

    print(
        "| model | type | GGUF MB | folder MB | folder / GGUF | of it tokenizer.json MB "
        "| peak RSS MB (before converting) | peak / GGUF | convert s | second run |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    details = []
    for model in args.models.split(","):
        with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as tmp:
            src = source(model, Path(tmp))
            for qtype in args.types.split(","):
                path = quantize(src, qtype)
                cache = Path(tmp) / f"cache-{qtype}"
                folder, peak, before, seconds = child(path, "first", cache)
                again, _, _, again_s = child(path, "again", cache)
                gguf_mb = path.stat().st_size / 1e6
                files = {f.name: f.stat().st_size for f in folder.iterdir()}
                size = sum(files.values()) / 1e6
                second = f"cached, {again_s:.2f} s" if again == folder else "a different folder"
                print(
                    f"| {model} | {qtype} | {gguf_mb:.1f} | {size:.1f} | {size / gguf_mb:.3f} | "
                    f"{files['tokenizer.json'] / 1e6:.2f} | {peak / 1e3:.0f} ({before / 1e3:.0f}) | "
                    f"{peak / 1e3 / gguf_mb:.2f} | {seconds:.1f} | {second} |",
                    flush=True,
                )
                for name, (n, g, m) in sorted(by_type(path, folder).items()):
                    details.append(
                        f"| {model} | {qtype} | {name} | {n / 1e6:.1f} | {8 * g / n:.3f} | {8 * m / n:.3f} | "
                        f"{m / g:.3f} |"
                    )
                path.unlink()
    head = (
        "| model | file type | tensor type | weights (M) | GGUF bits/weight | MLX bits/weight | MLX / GGUF |"
    )
    print("\n" + head)
    print("|---|---|---|---|---|---|---|")
    print("\n".join(details))


if __name__ == "__main__":
    main()
