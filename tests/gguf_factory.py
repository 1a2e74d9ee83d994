"""Small random-weight GGUF files, written the way llama.cpp's converter writes each architecture.

Used by the tests (tiny shapes, fast) and by bench/gguf_conformance.py (larger, quantized by llama.cpp).
Tokenizers: a tiny byte-level BPE (256 byte tokens, a few merges, chat specials), any vocabulary and merges
given (the bench passes the embedded SmolLM2's), or a SentencePiece model trained here with sentencepiece.
``dequantized_copy`` turns any GGUF into an F32 one with the same metadata (real weights to quantize afresh,
or a quantized file's own weights for llama.cpp to run in float arithmetic).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
ARCHS = ("llama", "qwen2", "qwen3", "gemma2", "gemma3", "phi3")


def _bytes_to_unicode() -> dict[int, str]:
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs), strict=True))


def tiny_bpe(pre: str = "llama-bpe") -> dict[str, Any]:
    """Tokenizer metadata of a tiny byte-level BPE: every byte, some merges, ChatML specials."""
    byte_chars = _bytes_to_unicode()
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + [byte_chars[b] for b in range(256)]
    types = [3, 3, 3] + [1] * 256
    merges = []
    sp = byte_chars[ord(" ")]
    pairs = [
        ("h", "e"),
        (sp, "t"),
        ("he", "l"),
        ("hel", "l"),
        ("hell", "o"),
        (sp, "w"),
        ("o", "r"),
        ("1", "2"),
    ]
    for left, right in [*pairs, (sp, sp), ("i", "n")]:
        merges.append(f"{left} {right}")
        if left + right not in tokens:
            tokens.append(left + right)
            types.append(1)
    return {
        "model": "gpt2",
        "pre": pre,
        "tokens": tokens,
        "types": types,
        "merges": merges,
        "bos": 0,
        "eos": 2,
        "add_bos": False,
        "template": CHATML,
    }


def trained_spm(path: Path, vocab_size: int = 400, text: str | None = None) -> dict[str, Any]:
    """Tokenizer metadata of a SentencePiece (BPE, byte fallback) model trained here on a small corpus."""
    import sentencepiece as spm

    corpus = path.with_suffix(".txt")
    corpus.write_text(
        text
        or "\n".join(
            [
                "The quick brown fox jumps over the lazy dog. Hello world, hello there!",
                "Numbers 12345 and 3.14159; code: def f(x): return x * 2  # done",
                "Café naïve façade — 東京は晴れ 🌸 ünïcödé",
                "    indented   spaces\tand tabs\n\nnew lines",
            ]
            * 20
        ),
        encoding="utf-8",
    )
    prefix = str(path.with_suffix(""))
    spm.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=prefix, vocab_size=vocab_size, model_type="bpe", byte_fallback=True,
        character_coverage=1.0, user_defined_symbols=["<start_of_turn>", "<end_of_turn>"],
        bos_id=1, eos_id=2, unk_id=0, pad_id=-1, minloglevel=2, normalization_rule_name="identity",
        remove_extra_whitespaces=False,
    )  # fmt: skip
    proc = spm.SentencePieceProcessor(model_file=prefix + ".model")
    tokens, scores, types = [], [], []
    for i in range(proc.get_piece_size()):
        tokens.append(proc.id_to_piece(i))
        scores.append(proc.get_score(i))
        if proc.is_unknown(i):
            types.append(2)
        elif proc.is_control(i):
            types.append(3)
        elif proc.is_byte(i):
            types.append(6)
        elif tokens[-1] in ("<start_of_turn>", "<end_of_turn>"):
            types.append(4)
        else:
            types.append(1)
    return {
        "model": "llama",
        "tokens": tokens,
        "scores": scores,
        "types": types,
        "bos": 1,
        "eos": 2,
        "unk": 0,
        "add_bos": True,
        "template": (
            "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}"
            "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
        ),
        "processor": proc,
    }


def write_gguf(
    path: Path,
    arch: str,
    tok: dict[str, Any],
    *,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    ffn: int = 128,
    head_dim: int | None = None,
    rope_freqs: bool = False,
    tied: bool = True,
    seed: int = 0,
    scale: float = 1.0,
    output_noise: float | None = None,
    qtype: Any = None,
    quantize: Any = None,
    sliding_window: int = 64,
    metadata: dict[str, Any] | None = None,
    norm_spread: float = 0.1,
) -> Path:
    """Write a random-weight GGUF of ``arch`` with llama.cpp's tensor names and metadata keys.

    ``scale`` multiplies the weights' usual 1/sqrt(fan_in) spread (larger gives sharper logits); the embedding
    (a tied model's output) has spread ``scale``. An untied output is random like the other matrices, which
    gives flat logits (top-2 margins below llama.cpp's activation noise), or with ``output_noise`` the
    embedding plus noise of that spread: margins as clear as a tied model's, whose output is its input's
    embedding. ``sliding_window``: gemma's window (its sliding layers see that many positions); ``metadata``:
    more keys (an int as uint32, a float as float32, a str, a list of ints), the architecture's own or
    replacing them; ``norm_spread``: the spread of the RMS norms' weights around 1 (a gemma, whose output
    layer is its embedding, answers more than its last token again with a wide one). ``qtype`` (a
    gguf-py type gguf-py can quantize, e.g. Q8_0) is applied to the 2-D weights, else they are F32.
    """
    import gguf

    rng = np.random.default_rng(seed)
    head_dim = head_dim or hidden // heads
    vocab = len(tok["tokens"])
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(512)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_vocab_size(vocab)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    if arch in ("gemma2", "gemma3"):
        w.add_sliding_window(sliding_window)
    if arch == "gemma2":
        w.add_attn_logit_softcapping(50.0)
        w.add_final_logit_softcapping(30.0)
    if arch == "phi3":
        w.add_rope_dimension_count(head_dim)
    if rope_freqs:
        w.add_rope_scaling_orig_ctx_len(8192)
    for key, value in (metadata or {}).items():  # (before the tokenizer's keys, which none replaces)
        w.kv_data[0].pop(key, None)  # a key the writer already holds is replaced
        if isinstance(value, bool) or not isinstance(value, (int, float, str, list)):
            raise TypeError(f"metadata {key}: {value!r}")
        if isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        else:
            w.add_array(key, value)

    w.add_tokenizer_model(tok["model"])
    if "pre" in tok:
        w.add_tokenizer_pre(tok["pre"])
    w.add_token_list(tok["tokens"])
    w.add_token_types(tok["types"])
    if "merges" in tok:
        w.add_token_merges(tok["merges"])
    if "scores" in tok:
        w.add_token_scores(tok["scores"])
    w.add_bos_token_id(tok["bos"])
    w.add_eos_token_id(tok["eos"])
    if "unk" in tok:
        w.add_unk_token_id(tok["unk"])
    w.add_add_bos_token(tok["add_bos"])
    w.add_chat_template(tok["template"])

    def mat(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * scale / np.sqrt(cols)).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        # Gemma's files store 1 + w, w near 0; the others w near 1.
        return (1.0 + norm_spread * rng.standard_normal(n)).astype(np.float32)

    def add(name: str, data: np.ndarray) -> None:
        if quantize is not None and data.ndim == 2 and (done := quantize(name, data)) is not None:
            w.add_tensor(name, done[0], raw_dtype=done[1])
        elif qtype is not None and data.ndim == 2 and data.shape[1] % 32 == 0:
            w.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, data)

    embedding = (rng.standard_normal((vocab, hidden)) * scale).astype(np.float32)
    add("token_embd.weight", embedding)
    add("output_norm.weight", norm(hidden))
    if not tied or arch == "phi3":
        if output_noise is None:
            add("output.weight", mat(vocab, hidden))
        else:
            add(
                "output.weight",
                embedding + (rng.standard_normal((vocab, hidden)) * output_noise).astype(np.float32),
            )
    if rope_freqs:
        # Llama 3.1's scaling (factor 8, low 1, high 4, 8192) as llama.cpp's converter bakes it into a tensor.
        from mlxpipe.models.gguf.config import llama3_factors

        scaling = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192}  # fmt: skip
        w.add_tensor("rope_freqs.weight", llama3_factors(scaling, 10000.0, head_dim).astype(np.float32))
    q, kv = heads * head_dim, kv_heads * head_dim
    for i in range(layers):
        b = f"blk.{i}."
        add(b + "attn_norm.weight", norm(hidden))
        if arch == "phi3":
            add(b + "attn_qkv.weight", mat(q + 2 * kv, hidden))
        else:
            add(b + "attn_q.weight", mat(q, hidden))
            add(b + "attn_k.weight", mat(kv, hidden))
            add(b + "attn_v.weight", mat(kv, hidden))
        if arch == "qwen2":
            for name, n in (("attn_q", q), ("attn_k", kv), ("attn_v", kv)):
                add(b + name + ".bias", (0.1 * rng.standard_normal(n)).astype(np.float32))
        if arch in ("qwen3", "gemma3"):
            add(b + "attn_q_norm.weight", norm(head_dim))
            add(b + "attn_k_norm.weight", norm(head_dim))
        add(b + "attn_output.weight", mat(hidden, q))
        if arch in ("gemma2", "gemma3"):
            add(b + "post_attention_norm.weight", norm(hidden))
            add(b + "post_ffw_norm.weight", norm(hidden))
        add(b + "ffn_norm.weight", norm(hidden))
        if arch == "phi3":
            add(b + "ffn_up.weight", mat(2 * ffn, hidden))
        else:
            add(b + "ffn_gate.weight", mat(ffn, hidden))
            add(b + "ffn_up.weight", mat(ffn, hidden))
        add(b + "ffn_down.weight", mat(hidden, ffn))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def mlx_folder_from_gguf(gguf_path: Path, out: Path) -> Path:
    """A tiny MLX model folder, converted from ``gguf_path`` by mlxpipe's own converter."""
    from mlxpipe.models import convert_gguf

    convert_gguf(gguf_path, out)
    return out


def dequantized_copy(src: Path, dst: Path) -> Path:
    """Write ``dst``: ``src`` with the same metadata and every tensor dequantized to F32 by gguf-py (the
    reference dequantizer), e.g. to quantize real weights to another type or to run a file's exact weights
    without llama.cpp's quantized activations."""
    import gguf

    reader = gguf.GGUFReader(str(src))
    arch = reader.get_field("general.architecture")
    assert arch is not None
    w = gguf.GGUFWriter(str(dst), str(arch.contents()))
    for field in reader.fields.values():
        if field.name == "general.architecture" or field.name.startswith("GGUF."):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        value = field.contents()
        if field.name == "general.file_type":
            value = int(gguf.LlamaFileType.ALL_F32)
        w.add_key_value(field.name, value, vtype, sub_type=sub)
    for t in reader.tensors:
        data = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        w.add_tensor(t.name, data.reshape([int(d) for d in reversed(t.shape)]))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst
