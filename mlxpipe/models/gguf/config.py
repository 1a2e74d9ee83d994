"""GGUF metadata → the model's config.json for mlx-lm, per architecture, and each architecture's tensor names.

Supported: llama (Llama 2/3.x, Mistral), qwen2, qwen3, gemma2, gemma3 (text), phi3. Each maps to the mlx-lm
model class that implements it; the file's conventions are matched here (llama.cpp's permuted Q/K rows for
llama by traditional RoPE, gemma's stored ``1 + w`` norms in :func:`float_fix`).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from ...errors import ModelError

__all__ = ["ARCHITECTURES", "build_config", "float_fix", "mlx_name"]

ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma2", "gemma3", "phi3")
_MODEL_TYPES = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "gemma2": ("gemma2", "Gemma2ForCausalLM"),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM"),
    "phi3": ("phi3", "Phi3ForCausalLM"),
}
_LAYER = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_qkv": "self_attn.qkv_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Gemma's four norms per layer have their own names.
_GEMMA_LAYER = {
    **_LAYER,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# Tensors folded into the config instead of the weights.
_CONFIG_ONLY = {"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"}


def mlx_name(arch: str, name: str) -> str | None:
    """A GGUF tensor name → mlx-lm's parameter name; None for tensors the config carries instead."""
    if name in _CONFIG_ONLY:
        return None
    base, _, suffix = name.rpartition(".")
    if base in _GLOBAL:
        return f"{_GLOBAL[base]}.{suffix}"
    parts = base.split(".")
    table = _GEMMA_LAYER if arch in ("gemma2", "gemma3") else _LAYER
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in table:
        target = table[parts[2]]
        if arch == "phi3" and parts[2] == "ffn_up":
            target = "mlp.gate_up_proj"  # phi3 stores gate and up as one matrix, as mlx-lm's phi3 does
        return f"model.layers.{parts[1]}.{target}.{suffix}"
    return ""


def float_fix(arch: str, name: str, data: np.ndarray) -> np.ndarray:
    """Undo a file convention on a float tensor: gemma files store RMS norm weights as ``1 + w``."""
    if arch in ("gemma2", "gemma3") and name.endswith("norm.weight"):
        return (data.astype(np.float32) - 1.0).astype(data.dtype)
    return data


def build_config(
    gguf_path: Path, arch: str, md: dict[str, Any], names: set[str], rope_freqs: np.ndarray | None
) -> dict[str, Any]:
    """config.json for ``arch`` from the file's metadata; ``rope_freqs`` is the file's tensor of that name."""

    def get(key: str, default: Any = None) -> Any:
        value = md.get(f"{arch}.{key}", default)
        if value is None:
            raise ModelError(f"GGUF file {gguf_path} lacks metadata {arch}.{key}")
        return value

    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    kv = get("attention.head_count_kv", heads)
    if isinstance(kv, list) and len(set(kv)) > 1:
        raise _gap(gguf_path, arch, "KV heads that differ per layer")
    kv = int(kv[0] if isinstance(kv, list) else kv)
    head_dim = int(md.get(f"{arch}.attention.key_length") or hidden // heads)
    if int(md.get(f"{arch}.attention.value_length") or head_dim) != head_dim:
        raise _gap(gguf_path, arch, "values of another head size than keys")
    rot = int(md.get(f"{arch}.rope.dimension_count") or head_dim)
    if rot != head_dim and arch != "phi3":
        raise _gap(gguf_path, arch, f"RoPE over {rot} of each head's {head_dim} dimensions")
    layers = int(get("block_count"))
    ffn = get("feed_forward_length")
    vocab = md.get(f"{arch}.vocab_size") or len(md.get("tokenizer.ggml.tokens", [])) or None
    if vocab is None:
        raise ModelError(f"GGUF file {gguf_path} lacks metadata {arch}.vocab_size")
    model_type, class_name = _MODEL_TYPES[arch]
    config: dict[str, Any] = {
        "architectures": [class_name],
        "model_type": model_type,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": int(ffn[0] if isinstance(ffn, list) else ffn),
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": head_dim,
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "vocab_size": int(vocab),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(get("context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in names,
    }
    if arch == "llama":
        # llama.cpp permutes Q/K rows for its rotary layout; traditional RoPE matches it without un-permuting.
        config["rope_traditional"] = True
        if head_dim == hidden // heads:
            del config["head_dim"]
    scaling = md.get(f"{arch}.rope.scaling.type")
    if rope_freqs is not None:
        config["rope_scaling"] = _llama3_scaling(gguf_path, md, arch, head_dim, rope_freqs)
    elif scaling == "linear" and md.get(f"{arch}.rope.scaling.factor"):
        config["rope_scaling"] = {"type": "linear", "factor": float(md[f"{arch}.rope.scaling.factor"])}
    elif scaling not in (None, "none"):
        raise ModelError(f"unsupported GGUF RoPE scaling {scaling!r} in {gguf_path}")
    if arch == "gemma2" and "rope_scaling" in config:
        raise _gap(gguf_path, arch, "RoPE scaling")
    if arch in ("gemma2", "gemma3"):
        # llama.cpp scales queries by 1/sqrt(hidden/heads) for the 27B models, else 1/sqrt(head_dim).
        big = (arch == "gemma2" and layers == 46) or (arch == "gemma3" and layers == 62)
        config["query_pre_attn_scalar"] = hidden // heads if big else head_dim
        config["sliding_window"] = int(get("attention.sliding_window", 4096))
    if arch == "gemma2":
        config["attn_logit_softcapping"] = float(get("attn_logit_softcapping", 50.0))
        config["final_logit_softcapping"] = float(get("final_logit_softcapping", 30.0))
    if arch == "gemma3":
        config["sliding_window_pattern"] = 6  # what llama.cpp uses for every gemma3 file
        config["rope_local_base_freq"] = 10000.0
    if arch == "phi3":
        config["original_max_position_embeddings"] = int(get("rope.scaling.original_context_length", 4096))
        config["partial_rotary_factor"] = rot / head_dim
        if "rope_factors_long.weight" in names:
            raise ModelError(f"unsupported GGUF feature in {gguf_path}: phi3 LongRoPE factors (128k models)")
    return config


def _gap(gguf_path: Path, arch: str, what: str) -> ModelError:
    """The refusal of a file that specifies something mlx-lm's model for ``arch`` would leave out (issue 40):
    run anyway, it would answer otherwise than llama.cpp, in silence."""
    return ModelError(f"unsupported GGUF feature in {gguf_path}: {what} (mlx-lm's {arch} model has none)")


def _llama3_scaling(
    gguf_path: Path, md: dict[str, Any], arch: str, head_dim: int, factors: np.ndarray
) -> dict[str, Any]:
    """The llama3 rope_scaling keys whose per-frequency divisors equal the file's ``rope_freqs`` tensor."""
    base = float(md.get(f"{arch}.rope.freq_base", 10000.0))
    old = float(md.get(f"{arch}.rope.scaling.original_context_length") or 8192)
    f = factors.astype(np.float64).reshape(-1)
    dims = int(md.get(f"{arch}.rope.dimension_count") or head_dim)
    if f.size != dims // 2 or not np.all(np.isfinite(f)) or f.min() <= 0:
        raise ModelError(f"unsupported GGUF rope_freqs in {gguf_path}: {f.size} factors for {dims} dims")
    factor = float(f.max())
    scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": int(old)}  # fmt: skip
    if factor > 1.0:
        wavelens = 2 * math.pi * base ** (np.arange(0, dims, 2) / dims)
        smooth = (1.0 / f - 1.0 / factor) / (1.0 - 1.0 / factor)
        mid = (f > 1.0 + 1e-6) & (f < factor - 1e-6)
        ratio = old / wavelens[mid]
        # ratio = low + smooth * (high - low): one point gives high (low = 1, as in Llama 3.x), two give both.
        if mid.sum() >= 2:
            a = np.stack([1.0 - smooth[mid], smooth[mid]], axis=1)
            low, high = np.linalg.lstsq(a, ratio, rcond=None)[0]
            scaling["low_freq_factor"], scaling["high_freq_factor"] = float(low), float(high)
        elif mid.sum() == 1:
            scaling["high_freq_factor"] = float(1.0 + (ratio[0] - 1.0) / smooth[mid][0])
    if not np.allclose(llama3_factors(scaling, base, dims), f, rtol=1e-3):
        raise ModelError(f"unsupported GGUF rope_freqs in {gguf_path}: not llama3 RoPE scaling")
    return scaling


def llama3_factors(scaling: dict[str, Any], base: float, dims: int) -> np.ndarray:
    """The per-frequency divisors mlx-lm's llama3 RoPE applies (rope_utils.Llama3RoPE), in float64."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    wavelens = 2 * math.pi * base ** (np.arange(0, dims, 2) / dims)
    smooth = (old / wavelens - low) / (high - low)
    out = np.where(wavelens > old / low, factor, 1.0)
    medium = (wavelens > old / high) & (wavelens < old / low)
    result: np.ndarray = np.where(medium, 1.0 / ((1 - smooth) / factor + smooth), out)
    return result
