"""``--model-info``: a materialized model folder described from its JSON and safetensors headers only."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

from ..errors import ModelError
from .source import ModelSource

__all__ = ["context_length", "describe"]


_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length")


def _first(config: dict[str, Any], keys: tuple[str, ...]) -> Any:
    """The first of ``keys`` set in ``config`` or its ``text_config``."""
    text_config: dict[str, Any] = config["text_config"] if isinstance(config.get("text_config"), dict) else {}
    for key in keys:
        for cfg in (config, text_config):
            if cfg.get(key) is not None:
                return cfg[key]
    return None


def context_length(folder: str) -> int:
    """The model's context in tokens as :func:`describe` gives it (0 when unknown), from config.json alone."""
    config = _read_json(Path(folder) / "config.json")
    if config is None:
        raise ModelError(f"cannot read model config: {Path(folder) / 'config.json'}")
    return int(_first(config, _CONTEXT_KEYS) or 0)


def describe(source: ModelSource, folder: str) -> dict[str, Any]:
    """Summarize a materialized model folder for --model-info, from its JSON and safetensors headers only.

    Keys: source, spec, path, folder, architecture, parameters, quantization, context_length, eos_token_ids,
    has_chat_template. Raises ModelError if the folder has no readable config.json.
    """
    root = Path(folder)
    config = _read_json(root / "config.json")
    if config is None:
        raise ModelError(f"cannot read model config: {root / 'config.json'}")
    tok_config = _read_json(root / "tokenizer_config.json") or {}

    def first(*keys: str) -> Any:
        return _first(config, keys)

    quant = config.get("quantization") or config.get("quantization_config")
    quantization = None
    if isinstance(quant, dict) and ("bits" in quant or "group_size" in quant):
        quantization = {"bits": quant.get("bits"), "group_size": quant.get("group_size")}
        if quant.get("mode"):
            quantization["mode"] = quant["mode"]
        overrides = {k: v.get("bits") for k, v in quant.items() if isinstance(v, dict)}
        if overrides:
            quantization["overrides"] = overrides

    has_template = bool(tok_config.get("chat_template")) or any(
        (root / name).is_file() for name in ("chat_template.jinja", "chat_template.json")
    )
    return {
        "source": source.kind,
        "spec": source.spec,
        "path": str(source.path) if source.path is not None else None,
        "folder": str(root),
        "architecture": config.get("model_type"),
        "parameters": _count_parameters(root, config),
        "quantization": quantization,
        "context_length": first(*_CONTEXT_KEYS),
        "eos_token_ids": _eos_ids(root, config, tok_config),
        "has_chat_template": has_template,
    }


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _count_parameters(root: Path, config: dict[str, Any]) -> int | None:
    """Count parameters from safetensors headers; a quantized weight counts its unpacked size."""
    shapes: dict[str, list[int]] = {}
    for file in sorted(root.glob("*.safetensors")):
        try:
            with open(file, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(n))
        except (OSError, ValueError, struct.error):
            return _count_parameters_from_config(config)
        shapes.update({k: v["shape"] for k, v in header.items() if k != "__metadata__"})
    if not shapes:
        return _count_parameters_from_config(config)
    quant = config.get("quantization") or {}
    total = 0
    for name, shape in shapes.items():
        prefix, _, suffix = name.rpartition(".")
        quantized = f"{prefix}.scales" in shapes
        if quantized and suffix in ("scales", "biases"):
            continue
        count = 1
        for d in shape:
            count *= int(d)
        if quantized and suffix == "weight":
            layer = quant.get(prefix) if isinstance(quant.get(prefix), dict) else quant
            group_size = int(layer.get("group_size") or 64) if isinstance(layer, dict) else 64
            count = count // shape[-1] * shapes[f"{prefix}.scales"][-1] * group_size
        total += count
    return total


def _count_parameters_from_config(config: dict[str, Any]) -> int | None:
    try:
        vocab, hidden = int(config["vocab_size"]), int(config["hidden_size"])
        layers, ffn = int(config["num_hidden_layers"]), int(config["intermediate_size"])
        heads = int(config["num_attention_heads"])
        kv = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or hidden // heads)
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return None
    per_layer = 2 * hidden * heads * head_dim + 2 * hidden * kv * head_dim + 3 * hidden * ffn + 2 * hidden
    embeddings = vocab * hidden * (1 if config.get("tie_word_embeddings", True) else 2)
    return embeddings + layers * per_layer + hidden


def _eos_ids(root: Path, config: dict[str, Any], tok_config: dict[str, Any]) -> list[int]:
    ids: list[int] = []

    def add(value: Any) -> None:
        for v in value if isinstance(value, list) else [value]:
            if isinstance(v, int) and v not in ids:
                ids.append(v)

    add(config.get("eos_token_id"))
    add((_read_json(root / "generation_config.json") or {}).get("eos_token_id"))
    eos = tok_config.get("eos_token")
    eos_text = eos.get("content") if isinstance(eos, dict) else eos
    if isinstance(eos_text, str):
        tok = _read_json(root / "tokenizer.json") or {}
        for added in tok.get("added_tokens") or []:
            if isinstance(added, dict) and added.get("content") == eos_text:
                add(added.get("id"))
        vocab = (tok.get("model") or {}).get("vocab")
        if isinstance(vocab, dict):
            add(vocab.get(eos_text))
    return ids
