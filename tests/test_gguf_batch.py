"""Every GGUF architecture batches (issue 40): tiny random-weight files whose query heads share KV heads give
the same greedy answers under ``--batch 3`` as one at a time, and gemma's sliding windows hold on prompts
past the window, against a plain numpy forward pass that masks what the window hides."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import run_cli
from gguf_factory import ARCHS, mlx_folder_from_gguf, tiny_bpe, write_gguf
from test_batch import _WordBatch

from mlxpipe.events import FINAL_EVENTS, Chunk, Done, Error
from mlxpipe.pipeline import run
from mlxpipe.records import Record, Settings

pytest.importorskip("gguf")

PROMPTS = [
    "hello world",
    "the quick brown fox jumps over it",
    "what is 12 times 12? tell me in words",
    "in the world",
    "hello hello, the lazy dog sleeps",
]
LENGTHS = [3, 7, 5, 6, 4]  # records end at different steps: later ones take the rows of those that ended


def _gguf(tmp_path: Path, arch: str, **kwargs: Any) -> Path:
    layers = 6 if arch == "gemma3" else 2  # mlx-lm's gemma3 needs a full sliding-window pattern of layers
    path = tmp_path / f"{arch}.gguf"
    return write_gguf(path, arch, tiny_bpe(), layers=layers, heads=4, kv_heads=2, **kwargs)


def _answers(path: Path, prompts: list[str], batch: int, lengths: list[int]) -> list[dict[str, Any]]:
    lines = "".join(
        json.dumps({"id": f"r{n}", "prompt": p, "max_tokens": m}) + "\n"
        for n, (p, m) in enumerate(zip(prompts, lengths, strict=True))
    )
    args = ["-m", str(path), "--jsonl", "--raw", "--no-stream", "--batch", str(batch)]
    r = run_cli(args, input=lines)
    assert r.returncode == 0 and r.stderr == b"", r.stderr.decode()
    finals = [json.loads(line) for line in r.stdout.decode().splitlines()]
    assert [e["event"] for e in finals] == ["done"] * len(prompts)
    assert [e["id"] for e in finals] == [f"r{n}" for n in range(len(prompts))]
    return finals


@pytest.mark.parametrize("arch", ARCHS)
def test_every_architecture_batches_with_shared_kv_heads(
    arch: str, tmp_path: Path, batch_is_exact: bool
) -> None:
    # Gemma's prompts reach past a window of 8 (its sliding layers' masks are batched too); its wide norms
    # make its tied output answer more than the last token again.
    gemma = arch.startswith("gemma")
    path = _gguf(
        tmp_path, arch, scale=1.0 if gemma else 3.0, sliding_window=8, norm_spread=3.0 if gemma else 0.1
    )
    one = _answers(path, PROMPTS, 1, LENGTHS)
    three = _answers(path, PROMPTS, 3, LENGTHS)
    assert [e["tokens"] for e in one] == [e["tokens"] for e in three] == LENGTHS  # every step compared
    if batch_is_exact:  # (on a CPU; see conftest)
        assert [e["text"] for e in three] == [e["text"] for e in one]


# --- sliding windows -------------------------------------------------------------------------------------


def _rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return np.asarray(x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * (1.0 + w))


def _rope(x: np.ndarray, base: float) -> np.ndarray:
    """Rotary embedding of (positions, heads, dims) in mlx's non-traditional layout (halves rotated)."""
    t, _, d = x.shape
    freqs = base ** (-np.arange(0, d, 2) / d)
    angle = np.arange(t)[:, None, None] * freqs[None, None, :]
    cos, sin = np.cos(angle), np.sin(angle)
    a, b = x[..., : d // 2], x[..., d // 2 :]
    return np.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)


def _gelu(x: np.ndarray) -> np.ndarray:
    return np.asarray(0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3))))


def reference_logits(folder: Path, tokens: list[int], windowed: bool = True) -> np.ndarray:
    """Gemma 2 / Gemma 3 logits of every position, in float64 numpy, from a converted folder: each sliding
    layer's query at position p sees keys at p - window < q <= p (llama.cpp's ``p1 - p0 < n_swa``)."""
    import mlx.core as mx

    cfg = json.loads((folder / "config.json").read_text())
    weights = mx.load(str(folder / "model.safetensors"))
    w = {k: np.array(v.astype(mx.float32), dtype=np.float64) for k, v in weights.items()}  # type: ignore[union-attr]
    gemma2 = cfg["model_type"] == "gemma2"
    hidden, heads, kv, eps = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], 1e-6
    eps = cfg["rms_norm_eps"]
    d, window, n = cfg["head_dim"], cfg["sliding_window"], len(tokens)
    emb = w["model.embed_tokens.weight"]
    h = emb[tokens] * math.sqrt(hidden)
    pos = np.arange(n)
    causal = pos[None, :] <= pos[:, None]
    near = causal & (pos[:, None] - pos[None, :] < window)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        sliding = i % 2 == 0 if gemma2 else (i + 1) % cfg["sliding_window_pattern"] != 0
        x = _rms(h, w[p + "input_layernorm.weight"], eps)
        q = (x @ w[p + "self_attn.q_proj.weight"].T).reshape(n, heads, d)
        k = (x @ w[p + "self_attn.k_proj.weight"].T).reshape(n, kv, d)
        v = (x @ w[p + "self_attn.v_proj.weight"].T).reshape(n, kv, d)
        if not gemma2:
            q = _rms(q, w[p + "self_attn.q_norm.weight"], eps)
            k = _rms(k, w[p + "self_attn.k_norm.weight"], eps)
        base = cfg["rope_local_base_freq"] if not gemma2 and sliding else cfg["rope_theta"]
        q, k = _rope(q, base) * cfg["query_pre_attn_scalar"] ** -0.5, _rope(k, base)
        mask = near if sliding and windowed else causal
        out = np.zeros((n, heads, d))
        for head in range(heads):
            g = head // (heads // kv)
            s = q[:, head] @ k[:, g].T
            if gemma2:
                s = np.tanh(s / cfg["attn_logit_softcapping"]) * cfg["attn_logit_softcapping"]
            s = np.where(mask, s, -np.inf)
            e = np.exp(s - s.max(axis=-1, keepdims=True))
            out[:, head] = (e / e.sum(axis=-1, keepdims=True)) @ v[:, g]
        o = out.reshape(n, heads * d) @ w[p + "self_attn.o_proj.weight"].T
        h = h + _rms(o, w[p + "post_attention_layernorm.weight"], eps)
        x = _rms(h, w[p + "pre_feedforward_layernorm.weight"], eps)
        up = _gelu(x @ w[p + "mlp.gate_proj.weight"].T) * (x @ w[p + "mlp.up_proj.weight"].T)
        h = h + _rms(up @ w[p + "mlp.down_proj.weight"].T, w[p + "post_feedforward_layernorm.weight"], eps)
    logits = _rms(h, w["model.norm.weight"], eps) @ emb.T
    if gemma2:
        cap = cfg["final_logit_softcapping"]
        logits = np.tanh(logits / cap) * cap
    return np.asarray(logits)


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_sliding_window_past_the_window_matches_a_reference_on_every_path(arch: str, tmp_path: Path) -> None:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from mlxpipe.engine import loader

    window = 8
    folder = mlx_folder_from_gguf(_gguf(tmp_path, arch, scale=3.0, sliding_window=window), tmp_path / "out")
    model, _ = loader.load(str(folder))
    rng = np.random.default_rng(1)
    seqs = [rng.integers(3, 250, n).tolist() for n in (4 * window, 3 * window - 3, window + 2)]
    refs = [reference_logits(folder, s) for s in seqs]
    # The window changes the numbers past it (else this test could not tell whether it was applied).
    assert np.abs(refs[0][-1] - reference_logits(folder, seqs[0], windowed=False)[-1]).max() > 0.1
    for s, ref in zip(seqs, refs, strict=True):
        np.testing.assert_allclose(np.array(model(mx.array([s]))[0]), ref, atol=2e-3)  # a prompt at once
        cache = make_prompt_cache(model)  # a prompt's start, then one token at a time through the KV cache
        model(mx.array([s[:5]]), cache=cache)
        for t in range(5, len(s)):
            step = model(mx.array([[s[t]]]), cache=cache)[0, -1]
            np.testing.assert_allclose(np.array(step), ref[t], atol=2e-3)
    # A batch of the three, left-padded to the longest as mlx-lm's batches are: each row's next token.
    caches = []
    for s in seqs:
        caches.append(make_prompt_cache(model))
        model(mx.array([s[:-1]]), cache=caches[-1])
    merged = [layer[0].merge(list(layer)) for layer in zip(*caches, strict=True)]
    logits = np.array(model(mx.array([[s[-1]] for s in seqs]), cache=merged)[:, -1])
    for row, ref in zip(logits, refs, strict=True):
        np.testing.assert_allclose(row, ref[-1], atol=2e-3)


# --- a model that fails in a batch step ----------------------------------------------------------------


class _FailingBatch(_WordBatch):
    """Answers each record with its prompt's words, one a step (test_batch's stand-in); a step with a record
    whose next word is "boom" raises before any event, as a model's exception would, noting the records in
    flight."""

    def __init__(self, failed: list[set[int]]) -> None:
        super().__init__(0)
        self.failed = failed

    def step(self) -> list[Chunk | Done]:
        if any(words[0] == "boom" for _, words in self.slots.values()):
            self.failed.append(set(self.slots))
            raise ValueError("[broadcast_shapes] Shapes (4,1,8,8) and (4,2,2,8,8) cannot be broadcast.\nmore")
        return super().step()

    def interrupt(self) -> list[Chunk | Done]:
        self.slots.clear()
        return []


class _FailingEngine:
    def __init__(self) -> None:
        self.batches = 0
        self.failed: list[set[int]] = []

    def batch(self, size: int) -> _FailingBatch:
        self.batches += 1
        return _FailingBatch(self.failed)


def test_a_model_exception_in_a_batch_step_ends_the_records_of_that_step_only() -> None:
    prompts = ["a b c", "boom", "c", "d e", "f g h", "i"]
    records = [Record(n, "in.txt", n, n, None, Settings(), prompt=p) for n, p in enumerate(prompts, 1)]
    engine = _FailingEngine()
    out = list(run(records, engine, batch=2))  # type: ignore[arg-type]
    finals = [e for e in out if isinstance(e, FINAL_EVENTS)]
    assert [e.index for e in finals] == [1, 2, 3, 4, 5, 6]  # one final event each, in input order
    assert len(engine.failed) == 1 and 2 in engine.failed[0]
    errors = {e.index: e for e in finals if isinstance(e, Error)}
    assert set(errors) == engine.failed[0]  # every record in the failed step, and no other
    message = "ValueError: [broadcast_shapes] Shapes (4,1,8,8) and (4,2,2,8,8) cannot be broadcast."
    assert all(e.error == message for e in errors.values())  # its first line only
    assert engine.batches == 2 and all(isinstance(e, Done) for e in finals[3:])  # the run went on
