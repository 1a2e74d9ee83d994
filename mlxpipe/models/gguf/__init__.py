"""GGUF files: the header reader, the conversion to an MLX folder, the tokenizer, per-architecture config."""

from .convert import convert_gguf

__all__ = ["convert_gguf"]
