"""A GGUF file → an MLX model folder (config.json, model.safetensors, tokenizer files)."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path
from typing import Any

from ...errors import ModelError
from .config import llama_config
from .reader import GGML_TYPES, SUPPORTED_TYPES, read_header
from .tokenizer import tokenizer_files

__all__ = ["convert_gguf"]

_LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_NAME = re.compile(r"^blk\.(\d+)\.(\w+)$")


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Convert a llama-architecture GGUF file into an MLX model folder at ``out_dir`` (created if needed).

    Supports tensor types F32, F16, Q4_0, Q4_1 and Q8_0; quantized tensors stay quantized, each layer keeping
    its own bit width. Raises ModelError naming what is unsupported, or if the file is truncated or corrupt.
    """
    gguf_path = Path(gguf_path)
    out_dir = Path(out_dir)
    metadata, infos = read_header(gguf_path)

    arch = metadata.get("general.architecture")
    if arch != "llama":
        raise ModelError(f"unsupported GGUF architecture {arch!r} in {gguf_path} (only 'llama' is supported)")
    bad = sorted(
        {
            GGML_TYPES.get(t.ggml_type, f"type {t.ggml_type}")
            for t in infos
            if t.ggml_type not in SUPPORTED_TYPES
        }
    )
    if bad:
        raise ModelError(
            f"unsupported GGUF tensor type {', '.join(bad)} in {gguf_path} "
            "(supported: F32, F16, Q4_0, Q4_1, Q8_0)"
        )
    names = {t.name for t in infos}
    if "rope_freqs.weight" in names:
        raise ModelError(f"unsupported GGUF feature in {gguf_path}: rope_freqs (Llama 3.1 RoPE scaling)")

    config = llama_config(gguf_path, metadata, names)
    tokenizer, tokenizer_config, eos_ids = tokenizer_files(gguf_path, metadata)
    config["eos_token_id"] = eos_ids

    # mlx is needed only here, so importing this module stays cheap; the BLAS goes in before mlx does.
    from ...cpu import mlx_core

    mx = mlx_core()

    try:
        raw = mx.load(str(gguf_path), format="gguf")
    except (RuntimeError, ValueError, OSError) as e:
        raise ModelError(f"cannot read GGUF file {gguf_path}: {e}") from None
    assert isinstance(raw, dict)

    weights: dict[str, Any] = {}
    for key, array in raw.items():
        base, _, suffix = key.rpartition(".")
        weights[f"{_mlx_name(gguf_path, base)}.{suffix}"] = array

    quantization = _quantization(weights)
    if quantization is not None:
        config["quantization"] = quantization

    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        mx.save_safetensors(str(out_dir / "model.safetensors"), weights, metadata={"format": "mlx"})
    except (RuntimeError, ValueError) as e:
        raise ModelError(f"cannot write converted model to {out_dir}: {e}") from None
    _write_json(out_dir / "config.json", config)
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config)
    tokenizer.save(str(out_dir / "tokenizer.json"))


def _mlx_name(gguf_path: Path, base: str) -> str:
    if base in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[base]
    m = _LAYER_NAME.match(base)
    if m and m.group(2) in _LAYER_TENSORS:
        return f"model.layers.{m.group(1)}.{_LAYER_TENSORS[m.group(2)]}"
    raise ModelError(f"unsupported GGUF tensor {base!r} in {gguf_path} for a llama model")


def _quantization(weights: dict[str, Any]) -> dict[str, Any] | None:
    """MLX quantization config: the commonest (bits, group size) as default, others as per-layer overrides."""
    layers: dict[str, tuple[int, int]] = {}
    for key, scales in weights.items():
        if not key.endswith(".scales"):
            continue
        prefix = key[: -len(".scales")]
        # GGUF quant blocks are 32 wide: in_features = scales columns * 32, bits = weight / scales columns.
        group_size = 32
        bits = weights[prefix + ".weight"].shape[-1] // scales.shape[-1]
        layers[prefix] = (bits, group_size)
    if not layers:
        return None
    (bits, group_size), _ = Counter(layers.values()).most_common(1)[0]
    quant: dict[str, Any] = {"group_size": group_size, "bits": bits}
    for prefix, (b, g) in sorted(layers.items()):
        if (b, g) != (bits, group_size):
            quant[prefix] = {"group_size": g, "bits": b}
    return quant


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
