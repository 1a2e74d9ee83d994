"""GGUF tokenizer metadata → a ``tokenizers`` tokenizer, its tokenizer_config and the end-of-turn ids."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ...errors import ModelError

__all__ = ["tokenizer_files"]

# llama.cpp pre-tokenizer names grouped by the regex they use (llama-vocab.cpp; the regexes are the models'
# own from tokenizer.json, which llama.cpp hand-expands where its regex engine lacks (?i:...)).
_PRE_GPT2 = {"default", "gpt2", "gpt-2", "mpt", "olmo", "jais"}
_PRE_DIGITS_GPT2 = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}
_PRE_LLAMA3 = {"llama-bpe", "llama3", "llama-v3", "smaug-bpe", "dbrx", "falcon3", "pixtral"}
_PRE_QWEN2 = {"qwen2", "stablelm2", "deepseek-r1-qwen", "hunyuan"}
_PRE_GPT4O = {"gpt-4o", "llama4"}
_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
_LLAMA3_PATTERN = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_PATTERN = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_UPPER, _LOWER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]", r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_GPT4O_PATTERN = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTIONS}?|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_CONTRACTIONS}?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS = {**dict.fromkeys(_PRE_LLAMA3, _LLAMA3_PATTERN), **dict.fromkeys(_PRE_QWEN2, _QWEN2_PATTERN),
           **dict.fromkeys(_PRE_GPT4O, _GPT4O_PATTERN)}  # fmt: skip
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
_TOKEN_NORMAL, _TOKEN_CONTROL, _TOKEN_USER_DEFINED = 1, 3, 4


def tokenizer_files(
    gguf_path: Path, md: dict[str, Any], arch: str = "llama"
) -> tuple[Any, dict[str, Any], list[int]]:
    """Build the tokenizer (a ``tokenizers.Tokenizer``), its tokenizer_config and the eos token ids.

    ``tokenizer.ggml.model`` "gpt2" is byte-level BPE with the pre-tokenizer ``tokenizer.ggml.pre`` names;
    "llama" (also gemma's files) is SentencePiece: pieces merged by score, with byte fallback.
    """
    model = md.get("tokenizer.ggml.model")
    tokens: list[str] = md.get("tokenizer.ggml.tokens") or []
    if not tokens:
        raise ModelError(f"GGUF file {gguf_path} lacks tokenizer tokens")
    types: list[int] = md.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if model == "gpt2":
        tokenizer = _byte_level_bpe(gguf_path, md, tokens)
    elif model == "llama":
        tokenizer = _sentencepiece(gguf_path, md, tokens, types)
    else:
        raise ModelError(
            f"unsupported GGUF tokenizer model {model!r} in {gguf_path} "
            "(supported: byte-level BPE 'gpt2', SentencePiece 'llama')"
        )
    vocab = {tok: i for i, tok in enumerate(tokens)}

    from tokenizers import AddedToken, processors

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
    # llama.cpp's default when the key is absent: SentencePiece vocabularies add BOS, byte-level BPE ones not.
    add_bos = bool(md.get("tokenizer.ggml.add_bos_token", model == "llama"))
    if add_bos and bos is not None:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab[bos])]
        )
    elif model == "gpt2":
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


def _byte_level_bpe(gguf_path: Path, md: dict[str, Any], tokens: list[str]) -> Any:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    pre = md.get("tokenizer.ggml.pre", "default")
    merges: list[str] = md.get("tokenizer.ggml.merges") or []
    if not merges:
        raise ModelError(f"GGUF file {gguf_path} lacks tokenizer merges")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _PRE_GPT2:
        pre_tokenizer: Any = byte_level
    elif pre in _PRE_DIGITS_GPT2:
        pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    elif pre in _SPLITS:
        pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    else:
        known = sorted(_PRE_GPT2 | _PRE_DIGITS_GPT2 | set(_SPLITS))
        raise ModelError(
            f"unsupported GGUF pre-tokenizer {pre!r} in {gguf_path} (supported: {', '.join(known)})"
        )
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
    return tokenizer


def _sentencepiece(gguf_path: Path, md: dict[str, Any], tokens: list[str], types: list[int]) -> Any:
    """SentencePiece as llama.cpp runs it: spaces become ▁ (one prefixed unless add_space_prefix is false),
    adjacent pieces merge highest score first, characters outside the vocabulary fall back to <0xXX> bytes."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    scores: list[float] = md.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
    vocab = {tok: i for i, tok in enumerate(tokens)}
    # Merges ranked by the merged piece's score (as llama.cpp picks the best-scoring pair), ties by id.
    mergeable = [
        i for i, t in enumerate(types) if t in (_TOKEN_NORMAL, _TOKEN_USER_DEFINED) and len(tokens[i]) > 1
    ]
    mergeable.sort(key=lambda i: (-scores[i], i))
    pairs: list[tuple[str, str]] = []
    for i in mergeable:
        piece = tokens[i]
        splits = [(piece[:k], piece[k:]) for k in range(1, len(piece))]
        found = [(vocab[a], vocab[b], a, b) for a, b in splits if a in vocab and b in vocab]
        pairs += [(a, b) for _, _, a, b in sorted(found)]
    unk_id = md.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if isinstance(unk_id, int) and 0 <= unk_id < len(tokens) else None
    tokenizer = Tokenizer(
        models.BPE(vocab=vocab, merges=pairs, unk_token=unk, fuse_unk=True, byte_fallback=True, dropout=None)
    )
    prefix = bool(md.get("tokenizer.ggml.add_space_prefix", True))
    steps = [normalizers.Prepend("▁")] if prefix else []
    tokenizer.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "▁")])
    decode = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        decode.append(decoders.Strip(" ", 1, 0))
    tokenizer.decoder = decoders.Sequence(decode)
    return tokenizer
