"""GGUF tokenizer metadata → a ``tokenizers`` tokenizer, its tokenizer_config and the end-of-turn ids."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ...errors import ModelError

__all__ = ["tokenizer_files"]

# llama.cpp pre-tokenizer names grouped by the regex they use (see llama-vocab.cpp).
_PRE_GPT2 = {"default", "gpt2", "gpt-2"}
_PRE_DIGITS_GPT2 = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}
_PRE_LLAMA3 = {"llama-bpe", "llama3", "llama-v3", "smaug-bpe", "dbrx"}
_LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
# Turn-ending specials: the chat model emits these, so generation must stop on them as well as on eos.
_END_TOKENS = (
    "<|im_end|>",
    "<|eot_id|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<|eom_id|>",
)
_TOKEN_CONTROL, _TOKEN_USER_DEFINED = 3, 4


def tokenizer_files(
    gguf_path: Path, md: dict[str, Any], arch: str = "llama"
) -> tuple[Any, dict[str, Any], list[int]]:
    """Build a byte-level BPE tokenizer (tokenizers.Tokenizer), its tokenizer_config and the eos token ids."""
    model = md.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise ModelError(
            f"unsupported GGUF tokenizer model {model!r} in {gguf_path} "
            "(only byte-level BPE 'gpt2' is supported)"
        )
    pre = md.get("tokenizer.ggml.pre", "default")
    tokens: list[str] = md.get("tokenizer.ggml.tokens") or []
    merges: list[str] = md.get("tokenizer.ggml.merges") or []
    if not tokens or not merges:
        raise ModelError(f"GGUF file {gguf_path} lacks tokenizer tokens or merges")
    types: list[int] = md.get("tokenizer.ggml.token_type") or [1] * len(tokens)

    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _PRE_GPT2:
        pre_tokenizer: Any = byte_level
    elif pre in _PRE_DIGITS_GPT2:
        pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    elif pre in _PRE_LLAMA3:
        pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_LLAMA3_PATTERN), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    else:
        raise ModelError(f"unsupported GGUF pre-tokenizer {pre!r} in {gguf_path}")

    vocab = {tok: i for i, tok in enumerate(tokens)}
    pairs: list[tuple[str, str]] = []
    for merge in merges:
        left, sep, right = merge.partition(" ")
        if not sep:
            raise ModelError(f"GGUF file {gguf_path} has a malformed tokenizer merge {merge!r}")
        pairs.append((left, right))
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False))
    tokenizer.pre_tokenizer = pre_tokenizer
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(
        [
            AddedToken(tokens[i], special=True, normalized=False)
            for i, t in enumerate(types)
            if t == _TOKEN_CONTROL
        ]
    )
    tokenizer.add_tokens(
        [
            AddedToken(tokens[i], special=False, normalized=False)
            for i, t in enumerate(types)
            if t == _TOKEN_USER_DEFINED
        ]
    )

    def token(key: str) -> str | None:
        i = md.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[i] if isinstance(i, int) and 0 <= i < len(tokens) else None

    bos = token("bos")
    add_bos = bool(md.get("tokenizer.ggml.add_bos_token", False))
    if add_bos and bos is not None:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab[bos])]
        )
    else:
        tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)

    eos_ids: list[int] = []
    for key in ("eos", "eot", "eom"):
        i = md.get(f"tokenizer.ggml.{key}_token_id")
        if isinstance(i, int) and 0 <= i < len(tokens) and i not in eos_ids:
            eos_ids.append(i)
    for text in _END_TOKENS:
        i = vocab.get(text)
        if i is not None and types[i] == _TOKEN_CONTROL and i not in eos_ids:
            eos_ids.append(i)

    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": add_bos,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(md.get(f"{arch}.context_length", 2048)),
    }
    for key in ("bos", "eos", "unk", "pad"):
        if (special := token(key)) is not None:
            config[f"{key}_token"] = special
    if template := md.get("tokenizer.chat_template"):
        config["chat_template"] = template
    return tokenizer, config, eos_ids
