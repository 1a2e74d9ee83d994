"""How far each choice of MLX bits moves a 16-weight-group K-quant (Q6_K, Q3_K, Q2_K) from the file's weights.

llama.cpp quantizes a GGUF of Gaussian weights (the shape of real weight matrices' bulk); each K-quant tensor
is dequantized with gguf-py (the reference), requantized per 32 with mlxpipe's converter at several bit
widths, and the error is given relative to the weights' RMS, next to the file's own quantization error (file
vs the original floats) for scale. Needs the `bench` extra (llama-cpp-python).

    python bench/kquant_requant.py
"""

from __future__ import annotations

import ctypes
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

from gguf_factory import tiny_bpe, write_gguf  # noqa: E402

from mlxpipe.models.gguf import quants  # noqa: E402


def main() -> None:
    import gguf
    import llama_cpp

    ftypes = {"Q6_K": "Q6_K", "Q3_K": "Q3_K_M", "Q2_K": "Q2_K"}
    print("| GGUF type | file error | MLX bits | bits/weight (GGUF → MLX) | requantization error | total |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        shape = {"hidden": 1024, "ffn": 2048, "layers": 1, "heads": 8, "kv_heads": 8, "seed": 11}
        src = write_gguf(Path(tmp) / "f32.gguf", "llama", tiny_bpe(), **shape)
        originals = {t.name: np.array(t.data) for t in gguf.GGUFReader(str(src)).tensors}
        for name, ftype in ftypes.items():
            dst = Path(tmp) / f"{ftype}.gguf"
            params = llama_cpp.llama_model_quantize_default_params()
            params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
            llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
            qtype = getattr(gguf.GGMLQuantizationType, name)
            tensors = [t for t in gguf.GGUFReader(str(dst)).tensors if t.tensor_type == qtype]
            bpw = 8 * quants.BLOCKS[int(qtype)][1] / 256
            for bits in (3, 4, 5, 6, 8):
                if bits < {"Q6_K": 6, "Q3_K": 3, "Q2_K": 3}[name]:
                    continue
                num_file = num_req = num_tot = den = 0.0
                for t in tensors:
                    raw = np.array(t.data)
                    ref = gguf.quants.dequantize(raw, qtype)
                    a = quants.requantize(ref.astype(np.float32), bits)
                    s, b = (
                        a.scales.astype(np.float16).astype(np.float32),
                        a.biases.astype(np.float16).astype(np.float32),
                    )
                    ours = (a.q.reshape(*s.shape, 32) * s[..., None] + b[..., None]).reshape(ref.shape)
                    orig = originals[t.name].reshape(ref.shape)
                    num_file += float(((ref - orig) ** 2).sum())
                    num_req += float(((ours - ref) ** 2).sum())
                    num_tot += float(((ours - orig) ** 2).sum())
                    den += float((orig**2).sum())
                rel = [np.sqrt(x / den) for x in (num_file, num_req, num_tot)]
                errors = [f"{100 * x:.2f}%" for x in rel]
                cells = [
                    f"{name} ({len(tensors)} tensors)",
                    errors[0],
                    str(bits),
                    f"{bpw:.2f} → {bits + 1:.0f}",
                ]
                cells += errors[1:]
                print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
