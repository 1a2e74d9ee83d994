"""Every supported GGUF architecture and tokenizer kind: tiny random-weight files written with gguf-py's
GGUFWriter the way llama.cpp's converter writes them, converted, loaded with mlx_lm.load and run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from gguf_factory import ARCHS, tiny_bpe, trained_spm, write_gguf

from mlxpipe.models import ModelError, convert_gguf

pytest.importorskip("gguf")

CORPUS = [
    "Hello world! hello   there,\tfriend.\n\n  Indented\r\nline",
    "Numbers: 1234567 and 3.14159, 42nd; 1,000,000 — done",
    "Café naïve façade 東京は晴れ 北京欢迎你 🌸👩‍👩‍👧🇫🇷 ünïcödé",
    "def f(x):\n    return x**2  # it's, we'll, I'd, THEY'RE\n",
    "   leading and trailing spaces   ",
]


def _load(folder: Path) -> tuple[Any, Any]:
    import mlx_lm

    return mlx_lm.load(str(folder))


@pytest.mark.parametrize("arch", ARCHS)
def test_architecture_converts_loads_and_generates(arch: str, tmp_path: Path) -> None:
    import mlx.core as mx
    import mlx_lm

    layers = 6 if arch == "gemma3" else 2  # mlx-lm's gemma3 needs a full sliding-window pattern of layers
    path = write_gguf(tmp_path / f"{arch}.gguf", arch, tiny_bpe(), layers=layers, tied=arch != "qwen2")
    convert_gguf(path, tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    model, tokenizer = _load(tmp_path / "out")
    assert config["model_type"] == {"gemma3": "gemma3_text"}.get(arch, arch)
    logits = model(mx.array([[5, 6, 7, 8]]))
    assert logits.shape == (1, 4, len(tiny_bpe()["tokens"]))
    assert bool(mx.all(mx.isfinite(logits)))
    text = mlx_lm.generate(model, tokenizer, "hello world", max_tokens=4)
    assert isinstance(text, str)


def test_gemma_norms_lose_the_stored_one(tmp_path: Path) -> None:
    import mlx.core as mx

    path = write_gguf(tmp_path / "g.gguf", "gemma2", tiny_bpe())
    convert_gguf(path, tmp_path / "out")
    weights = mx.load(str(tmp_path / "out" / "model.safetensors"))
    # The file stores 1 + w with w near 0 (as gemma's files do); mlx-lm's gemma adds the 1 itself.
    norm = weights["model.layers.0.input_layernorm.weight"]
    assert abs(float(norm.mean())) < 0.1


def test_llama3_rope_scaling_from_rope_freqs(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "l3.gguf", "llama", tiny_bpe(), rope_freqs=True)
    convert_gguf(path, tmp_path / "out")
    scaling = json.loads((tmp_path / "out" / "config.json").read_text())["rope_scaling"]
    assert scaling["rope_type"] == "llama3"
    assert scaling["factor"] == 8.0 and scaling["original_max_position_embeddings"] == 8192
    assert scaling["low_freq_factor"] == 1.0 and abs(scaling["high_freq_factor"] - 4.0) < 1e-3
    _load(tmp_path / "out")


def test_rope_freqs_that_are_not_llama3_are_refused(tmp_path: Path) -> None:
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(tmp_path / "odd2.gguf"), "llama")
    for key, value in (("llama.embedding_length", 64), ("llama.attention.head_count", 4)):
        w.add_uint32(key, value)
    w.add_tensor("rope_freqs.weight", np.linspace(1.0, 3.0, 8).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelError):
        convert_gguf(tmp_path / "odd2.gguf", tmp_path / "out")


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2", "gpt-4o", "smollm", "gpt2"])
def test_byte_level_bpe_round_trips(pre: str, tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "t.gguf", "llama", tiny_bpe(pre))
    convert_gguf(path, tmp_path / "out")
    _, tokenizer = _load(tmp_path / "out")
    for text in CORPUS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.decode(ids, skip_special_tokens=True) == text
    # The pre-tokenizers differ where they should: qwen2 splits digits one by one, llama-bpe in threes.
    ids = tokenizer.encode("12 12345", add_special_tokens=False)
    pieces = [tokenizer.decode([i]) for i in ids]
    if pre in ("qwen2", "smollm"):
        assert pieces.count("1") == 2
    if pre == "llama-bpe":
        assert "12" in pieces


def test_unknown_pre_tokenizer_is_named(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "t.gguf", "llama", tiny_bpe("mystery"))
    with pytest.raises(ModelError, match=r"pre-tokenizer 'mystery' .*supported: .*qwen2"):
        convert_gguf(path, tmp_path / "out")


def test_sentencepiece_matches_sentencepiece(tmp_path: Path) -> None:
    tok = trained_spm(tmp_path / "spm")
    proc = tok.pop("processor")
    path = write_gguf(tmp_path / "s.gguf", "gemma2", tok)
    convert_gguf(path, tmp_path / "out")
    config = json.loads((tmp_path / "out" / "tokenizer_config.json").read_text())
    assert config["add_bos_token"] is True and "<start_of_turn>" in config["chat_template"]
    _, tokenizer = _load(tmp_path / "out")
    for text in CORPUS:
        ids = tokenizer.encode(text)
        assert ids == [1, *proc.encode(text)], text
        assert tokenizer.decode(ids, skip_special_tokens=True) == text
    # Added pieces stay whole; like llama.cpp, the text after one gets the space prefix again.
    ids = tokenizer.encode("<start_of_turn>user\nhi<end_of_turn>", add_special_tokens=False)
    start, end = tokenizer.convert_tokens_to_ids(["<start_of_turn>", "<end_of_turn>"])
    assert ids[0] == start and ids[-1] == end and ids[1:-1] == proc.encode("user\nhi")
    # The streaming detokenizer mlx-lm picks for it keeps multi-byte characters whole.
    detok = tokenizer.detokenizer
    detok.reset()
    for i in tokenizer.encode(CORPUS[2], add_special_tokens=False):
        detok.add_token(i)
    detok.finalize()
    assert detok.text == CORPUS[2]


@pytest.mark.parametrize(
    ("arch", "metadata", "why"),
    [
        ("llama", {"llama.rope.dimension_count": 8}, "RoPE over 8 of each head's 16 dimensions"),
        ("qwen3", {"qwen3.attention.value_length": 8}, "values of another head size than keys"),
        ("qwen2", {"qwen2.attention.head_count_kv": [2, 4]}, "KV heads that differ per layer"),
        (
            "gemma2",
            {"gemma2.rope.scaling.type": "linear", "gemma2.rope.scaling.factor": 8.0},
            "RoPE scaling",
        ),
    ],
)
def test_what_mlx_lm_would_leave_out_is_refused(
    arch: str, metadata: dict[str, Any], why: str, tmp_path: Path
) -> None:
    # Run anyway, these files would answer otherwise than llama.cpp does, in silence (issue 40).
    path = write_gguf(tmp_path / f"{arch}.gguf", arch, tiny_bpe(), metadata=metadata)
    message = f"unsupported GGUF feature in {path}: {why} (mlx-lm's {arch} model has none)"
    with pytest.raises(ModelError) as refused:
        convert_gguf(path, tmp_path / "out")
    assert str(refused.value) == message


def test_a_refused_file_is_one_line_and_exit_3(tmp_path: Path) -> None:
    from conftest import run_cli

    path = write_gguf(tmp_path / "l.gguf", "llama", tiny_bpe(), metadata={"llama.rope.dimension_count": 8})
    r = run_cli(["-m", str(path), "-n", "2"], input="hello\n")
    assert r.returncode == 3 and r.stdout == b""
    err = r.stderr.decode()
    assert err.count("\n") == 1 and "Traceback" not in err and "RoPE over 8 of each head's 16" in err
