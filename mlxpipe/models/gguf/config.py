"""GGUF metadata → the model's config.json for mlx-lm, per architecture."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ...errors import ModelError

__all__ = ["llama_config"]


def llama_config(gguf_path: Path, md: dict[str, Any], names: set[str]) -> dict[str, Any]:
    def get(key: str, default: Any = None) -> Any:
        value = md.get(f"llama.{key}", default)
        if value is None:
            raise ModelError(f"GGUF file {gguf_path} lacks metadata llama.{key}")
        return value

    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    vocab = md.get("llama.vocab_size") or len(md.get("tokenizer.ggml.tokens", [])) or None
    if vocab is None:
        raise ModelError(f"GGUF file {gguf_path} lacks metadata llama.vocab_size")
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": int(get("block_count")),
        "intermediate_size": int(get("feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        "vocab_size": int(vocab),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        # llama.cpp permutes Q/K rows for its rotary layout; traditional RoPE matches it without un-permuting.
        "rope_traditional": True,
        "max_position_embeddings": int(get("context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in names,
    }
    head_dim = md.get("llama.attention.key_length")
    if head_dim and int(head_dim) != hidden // heads:
        config["head_dim"] = int(head_dim)
    scaling_type = md.get("llama.rope.scaling.type")
    if scaling_type == "linear" and md.get("llama.rope.scaling.factor"):
        config["rope_scaling"] = {"type": "linear", "factor": float(md["llama.rope.scaling.factor"])}
    elif scaling_type not in (None, "none"):
        raise ModelError(f"unsupported GGUF RoPE scaling {scaling_type!r} in {gguf_path}")
    return config
