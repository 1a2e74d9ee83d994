"""The CPU fast paths (mlxpipe/layers.py): the swapped layers compute what mx.fast computes.

Unit tests on random inputs against ``mx.fast`` itself, then the real model with and without the swaps.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
from conftest import cli_env, run_cli

from mlxpipe.cpu import gemv, layers  # first: the cpu package loads the BLAS before mlx is first imported

# isort: split
import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.rope_utils import Llama3RoPE

# The Linux CPU paths' own tests: MLXPIPE_CPU=off (make test-portable) leaves them nothing to test.
pytestmark = pytest.mark.cpu_paths

# On a CPU the compiled compositions matched mx.fast bit for bit in float32, float16 and bfloat16; the
# tolerance leaves room for a compiler that fuses multiply-adds differently.
TOL = {mx.float32: 1e-5, mx.float16: 2e-3, mx.bfloat16: 2e-2}
DTYPES = list(TOL)


@pytest.fixture(autouse=True)
def _on_the_cpu(request: pytest.FixtureRequest) -> Any:
    """The unit tests compute on the CPU, the only device mlxpipe uses these paths on (on a GPU ``mx.fast``
    has kernels of its own, which compute cos and sin differently)."""
    if request.node.get_closest_marker("model"):
        yield
        return
    device = mx.default_device()
    mx.set_default_device(mx.cpu)
    try:
        yield
    finally:
        mx.set_default_device(device)


def _close(a: mx.array, b: mx.array, dtype: Any) -> bool:
    assert a.dtype == b.dtype == dtype and a.shape == b.shape
    return bool(
        mx.allclose(a.astype(mx.float32), b.astype(mx.float32), rtol=TOL[dtype], atol=TOL[dtype]).item()
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1, 576), (3, 7, 64), (2, 5, 3, 128)])
def test_rms_norm_matches_mx_fast(dtype: Any, shape: tuple[int, ...]) -> None:
    mx.random.seed(1)
    x = (mx.random.normal(shape) * 3).astype(dtype)
    plain = nn.RMSNorm(shape[-1], eps=1e-6)
    plain.weight = mx.random.normal((shape[-1],)).astype(dtype)
    fast = layers.FastRMSNorm(shape[-1], eps=1e-6)
    fast.weight = plain.weight
    assert _close(fast(x), plain(x), dtype)


def test_rms_norm_gives_the_same_float32_numbers_below_and_from_fast_rows() -> None:
    # From FAST_ROWS rows on, mlx's own rms_norm: the numbers of a record's row must not depend on how many
    # rows its batch has (greedy answers under --batch are --batch 1's).
    mx.random.seed(2)
    norm = layers.FastRMSNorm(576, eps=1e-5)
    norm.weight = mx.random.normal((576,))
    x = mx.random.normal((3 * layers.FastRMSNorm.FAST_ROWS, 1, 576)) * 4
    together = norm(x)
    for i in range(0, x.shape[0], 7):
        assert mx.array_equal(norm(x[i : i + 1]), together[i : i + 1]).item()


OFFSETS: list[Any] = [0, 1, 70, 4000, mx.array(70), mx.array([3, -2, 100])]  # last: BatchKVCache's per-row


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("traditional", [True, False])
@pytest.mark.parametrize(("dims", "width"), [(64, 64), (32, 64), (128, 128)])
@pytest.mark.parametrize("offset", OFFSETS, ids=["0", "1", "70", "4000", "array", "per-row"])
def test_rope_matches_mx_fast(dtype: Any, traditional: bool, dims: int, width: int, offset: Any) -> None:
    mx.random.seed(2)
    for tokens in (1, 5):
        x = mx.random.normal((3, 9, tokens, width)).astype(dtype)
        for base, scale in ((1e5, 1.0), (1e4, 0.3)):
            plain = nn.RoPE(dims, traditional=traditional, base=base, scale=scale)
            fast = layers.FastRoPE(dims, traditional=traditional, base=base, scale=scale)
            assert _close(fast(x, offset), plain(x, offset), dtype), (tokens, base, scale)


def test_rope_gathers_per_row_positions_from_the_table_with_the_same_numbers() -> None:
    rope = layers.FastRoPE(64, traditional=False, base=1e5)
    offset = mx.array([3, 0, 100, 7])
    for tokens in (1, 5):
        x = mx.random.normal((4, 9, tokens, 64), key=mx.random.key(tokens))
        computed = rope(x, offset)
        assert mx.array_equal(rope(x, offset, bound=105), computed).item()  # grows the table as needed
        assert _close(computed, nn.RoPE(64, traditional=False, base=1e5)(x, offset), mx.float32)


def test_rope_gathers_once_for_offsets_named_the_same() -> None:
    # Every layer's BatchKVCache has its own offsets array of the same values in a step: named alike (the
    # batch's SAME_POSITIONS), they share one gather; a new name gathers again, with its own numbers.
    rope = layers.FastRoPE(64, traditional=False, base=1e5)
    angles = layers._angles(64, False, 1e5, 1.0)
    x = mx.random.normal((4, 9, 1, 64), key=mx.random.key(3))
    step = object()
    first = rope(x, mx.array([3, 0, 100, 7]), bound=105, same=step)
    gathered = angles.last_rows
    again = rope(x, mx.array([3, 0, 100, 7]), bound=105, same=step)  # another layer's array, the same values
    assert angles.last_rows is gathered and mx.array_equal(first, again).item()
    moved = rope(x, mx.array([4, 1, 101, 8]), bound=105, same=object())  # the next step
    assert angles.last_rows is not gathered
    assert mx.array_equal(moved, rope(x, mx.array([4, 1, 101, 8]), bound=105)).item()
    assert not mx.array_equal(moved, first).item()


@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu_is_within_float32_rounding_of_silu(dtype: Any) -> None:
    # Not bit for bit (a rational tanh instead of mlx's exp): compared with float64 maths, next to mlx's own.
    gate = mx.concatenate(
        [mx.linspace(-100, 100, 20001), mx.array([0.0, -0.0, 1e-30, -88.0, 88.0, 7.9, -7.9])]
    )
    x = mx.random.normal(gate.shape, key=mx.random.key(3))
    gate, x = gate.astype(dtype), x.astype(dtype)
    g, u = (
        np.array(gate.astype(mx.float32), dtype=np.float64),
        np.array(x.astype(mx.float32), dtype=np.float64),
    )
    exact = g / (1 + np.exp(-g)) * u
    scale = np.abs(u) * np.maximum(np.abs(g), 1)  # an error relative to the larger of the two factors
    fast = np.array(layers.swiglu(gate, x).astype(mx.float32), dtype=np.float64)
    plain = np.array((nn.silu(gate) * x).astype(mx.float32), dtype=np.float64)
    plain_err = (np.abs(plain - exact) / scale).max()
    assert (np.abs(fast - exact) / scale).max() <= max(3 * plain_err, 5e-7)
    assert layers.swiglu(gate, x).dtype == dtype


ATTENTION_CASES = [(2, 9, 3, 1, 40), (3, 9, 3, 6, 17), (1, 4, 4, 1, 7), (2, 8, 2, 5, 5)]  # B, heads, kv, L, S


def _attention_inputs(b: int, heads: int, kv: int, length: int, positions: int) -> tuple[mx.array, ...]:
    mx.random.seed(b * 100 + positions)
    shape = (b, kv, positions, 64)
    return mx.random.normal((b, heads, length, 64)), mx.random.normal(shape), mx.random.normal(shape) * 3


def _masks(b: int, heads: int, length: int, positions: int) -> list[Any]:
    """No mask, causal, mlx-lm's BatchKVCache mask (left padding; with L > 1 a padded query row is masked
    whole), an additive mask per head, a boolean (L, S) mask."""
    pad = mx.array([(3 * i) % positions for i in range(b)])
    causal = mx.arange(positions - length, positions)[:, None] >= mx.arange(positions)[None]
    left = (pad[:, None, None, None] <= mx.arange(positions)) & causal
    additive = mx.random.normal((b, heads, length, positions))
    return [None, "causal", left, additive, mx.random.uniform(shape=(length, positions)) > 0.3]


def _exact_attention(q: mx.array, k: mx.array, v: mx.array, scale: float, mask: Any) -> np.ndarray:
    """Attention in float64 with numpy: the exact maths both float32 computations round."""
    qq, kk, vv = (np.array(t, dtype=np.float64) for t in (q, k, v))
    rep = qq.shape[1] // kk.shape[1]
    scores = (qq * scale) @ np.repeat(kk, rep, axis=1).swapaxes(-1, -2)
    length, positions = scores.shape[-2:]
    if isinstance(mask, str):
        mask = mx.arange(positions - length, positions)[:, None] >= mx.arange(positions)[None]
    if mask is not None and mask.dtype == mx.bool_:
        scores = np.where(np.array(mask), scores, np.finfo(np.float32).min)
    elif mask is not None:
        scores = scores + np.array(mask, dtype=np.float64)
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    return (weights / weights.sum(axis=-1, keepdims=True)) @ np.repeat(vv, rep, axis=1)  # type: ignore[no-any-return]


@pytest.mark.skipif(not gemv.attention_available(), reason="gemv.c is not in front of the BLAS here")
@pytest.mark.parametrize("case", ATTENTION_CASES)
def test_attention_matches_mx_fast(case: tuple[int, int, int, int, int]) -> None:
    q, k, v = _attention_inputs(*case)
    calls = gemv.attention_calls()
    for mask in _masks(case[0], case[1], case[3], case[4]):
        fast = layers.attention(q, k, v, 0.125, mask)
        plain = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask)
        # The scores are summed in another order than mx.fast sums them: each within float32 rounding of
        # the exact result, ours no further from it than twice mx.fast's own error.
        exact = _exact_attention(q, k, v, 0.125, mask)
        plain_err = np.abs(np.array(plain, dtype=np.float64) - exact).max()
        assert fast.shape == plain.shape, mask
        assert np.abs(np.array(fast, dtype=np.float64) - exact).max() <= max(2 * plain_err, 1e-6), mask
        assert not mx.isnan(fast).any().item()
    assert gemv.attention_calls() > calls


@pytest.mark.skipif(not gemv.attention_available(), reason="gemv.c is not in front of the BLAS here")
def test_a_records_attention_does_not_depend_on_its_batch() -> None:
    # A record alone (no mask) and the same record left-padded in a batch of three (BatchKVCache's mask).
    q, k, v = _attention_inputs(3, 9, 3, 1, 30)
    alone = layers.attention(q[1:2], k[1:2, :, 10:], v[1:2, :, 10:], 0.125, None)
    pad = mx.array([0, 10, 4])
    batch = layers.attention(q, k, v, 0.125, (pad[:, None, None, None] <= mx.arange(30)))
    assert mx.array_equal(alone, batch[1:2]).item()


@pytest.mark.skipif(not gemv.attention_available(), reason="gemv.c is not in front of the BLAS here")
@pytest.mark.parametrize(
    ("b", "heads", "kv", "positions"), [(1, 9, 3, 5), (3, 9, 3, 31), (64, 9, 3, 70), (5, 8, 2, 40)]
)
def test_attention_over_a_caches_buffers_is_attention_to_the_last_bit(
    b: int, heads: int, kv: int, positions: int
) -> None:
    # One query a record over a KV cache just updated (the decode step): every (record, KV head) pair in
    # one product reading the cache's buffers in place (with the helper at 64 records, and without), as
    # attention() computes each pair; under each mask a decode step can have.
    from mlx_lm.models.cache import BatchKVCache, KVCache

    mx.random.seed(b + positions)
    cache = BatchKVCache([(5 * i) % (positions - 2) for i in range(b)]) if b > 1 else KVCache()
    first = (b, kv, positions - 1, 64)
    cache.update_and_fetch(mx.random.normal(first), mx.random.normal(first))
    queries = mx.random.normal((b, heads, 1, 64))
    batch_mask = cache.make_mask(1) if b > 1 else None
    keys, values = cache.update_and_fetch(mx.random.normal((b, kv, 1, 64)), mx.random.normal((b, kv, 1, 64)))
    assert layers.cached_layout(cache, queries) == cache.keys.shape[2] > positions
    masks = [None, "causal", batch_mask, mx.random.normal((b, heads, 1, positions))]
    try:
        for threads in (2, 1):
            gemv.use_threads(threads)
            for mask in masks:
                calls = gemv.attention_calls()
                cached = layers.attention_cached(queries, cache, keys.shape[2], 0.125, mask)
                mx.eval(cached)
                assert gemv.attention_calls() - calls == 2 * b * kv  # each pair's scores and weighted values
                plain = layers.attention(queries, keys, values, 0.125, mask)
                assert mx.array_equal(cached, plain).item(), (threads, mask)
    finally:
        gemv.use_threads(1)  # gemv.c's own default


def test_attention_over_a_caches_buffers_only_where_it_can_read_them() -> None:
    from mlx_lm.models.cache import KVCache, QuantizedKVCache

    cache = KVCache()
    queries = mx.zeros((1, 9, 1, 64))
    assert layers.cached_layout(cache, queries) == 0  # nothing in it yet
    cache.update_and_fetch(mx.zeros((1, 3, 4, 64)), mx.zeros((1, 3, 4, 64)))
    assert layers.cached_layout(cache, queries) == cache.keys.shape[2]
    assert layers.cached_layout(cache, mx.zeros((1, 9, 2, 64))) == 0  # several queries: a prompt's
    assert layers.cached_layout(cache, queries.astype(mx.float16)) == 0
    quantized = QuantizedKVCache()
    quantized.update_and_fetch(mx.zeros((1, 3, 4, 64)), mx.zeros((1, 3, 4, 64)))
    assert layers.cached_layout(quantized, queries) == 0


class _Attention(nn.Module):
    """mlx-lm's Llama attention, as registered by the engine."""

    def __init__(self) -> None:
        super().__init__()
        from mlx_lm.models import llama

        args = llama.ModelArgs("llama", 64, 1, 128, 4, 1e-5, 100, num_key_value_heads=2)
        self.inner = llama.Attention(args)


def test_apply_gives_registered_attentions_the_cpus_and_reverts(monkeypatch: pytest.MonkeyPatch) -> None:
    from mlx_lm.models import llama
    from mlx_lm.models.cache import KVCache

    monkeypatch.setattr(layers, "ATTENTIONS", {llama.Attention})
    model = _Attention()
    x = mx.random.normal((1, 5, 64), key=mx.random.key(6))
    plain = model.inner(x, "causal", KVCache())
    swapped = layers.apply(model, ["attention"])
    assert swapped == (["attention"] if gemv.attention_available() else [])
    if swapped:
        assert type(model.inner) is not llama.Attention and isinstance(model.inner, llama.Attention)
        calls = gemv.attention_calls()
        assert mx.allclose(model.inner(x, "causal", KVCache()), plain, rtol=1e-6, atol=1e-6).item()
        assert gemv.attention_calls() > calls
    layers.revert(model)
    assert type(model.inner) is llama.Attention


class _MLP(nn.Module):
    """A stand-in for mlx-lm's Llama MLP: down_proj(silu(gate_proj(x)) * up_proj(x))."""

    def __init__(self) -> None:
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = nn.Linear(8, 16), nn.Linear(8, 16), nn.Linear(16, 8)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


def test_apply_gives_registered_mlps_the_fast_swiglu_and_reverts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(layers, "SWIGLU_MLPS", {_MLP})
    model = nn.Sequential(_MLP(), nn.RMSNorm(8))
    x = mx.random.normal((2, 3, 8), key=mx.random.key(4))
    plain = model(x)
    assert layers.apply(model, ["swiglu"]) == ["swiglu"]
    assert isinstance(model.layers[0], _MLP) and type(model.layers[0]) is not _MLP
    assert type(model.layers[1]) is nn.RMSNorm
    assert mx.allclose(model(x), plain, rtol=1e-5, atol=1e-6).item()
    assert layers.apply(model, ["swiglu"]) == []  # already swapped
    layers.revert(model)
    assert type(model.layers[0]) is _MLP and mx.array_equal(model(x), plain).item()


class _Layer(nn.Module):
    """A stand-in for a decoder layer: x + mlp(norm(x))."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.mlp = nn.RMSNorm(8), _MLP()

    def __call__(self, x: mx.array, mask: Any = None) -> mx.array:
        return x + self.mlp(self.norm(x))


def test_registered_layers_hand_their_output_to_mlx_and_revert(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(layers, "DECODER_LAYERS", {_Layer})
    model = nn.Sequential(_Layer(), _Layer(), _Layer())
    x = mx.random.normal((1, 2, 8), key=mx.random.key(5))
    plain = model(x)
    started: list[mx.array] = []
    async_eval = mx.async_eval
    monkeypatch.setattr(mx, "async_eval", lambda *arrays: (started.extend(arrays), async_eval(*arrays)))
    assert layers.apply(model, ["eval_per_layer", "swiglu"]) == ["eval_per_layer"]  # no MLP registered
    out = model(x)
    assert len(started) == 3 and started[-1] is out  # each layer's output, as soon as it was built
    assert mx.array_equal(out, plain).item()  # the same numbers, only computed sooner
    layers.revert(model)
    assert all(type(layer) is _Layer for layer in model.layers)
    started.clear()
    assert mx.array_equal(model(x), plain).item() and started == []


def test_linear_layers_multiply_by_one_transpose_made_once_and_revert() -> None:
    model = nn.Sequential(nn.Linear(8, 16, bias=False), nn.Linear(16, 8), nn.Embedding(10, 8))
    x = mx.random.normal((2, 3, 8), key=mx.random.key(6))
    plain, head = model.layers[1](model.layers[0](x)), model.layers[2].as_linear(x)
    assert layers.apply(model, ["linear"]) == ["linear"]
    first, bias, embedding = model.layers
    assert type(first) is layers.FastLinear and type(embedding) is layers.FastEmbedding
    out = bias(first(x))
    assert mx.array_equal(out, plain).item() and mx.array_equal(embedding.as_linear(x), head).item()
    transposed = first.__dict__["_transposed"][1]
    mx.eval(first(x))
    assert first.__dict__["_transposed"][1] is transposed  # no new transpose operation per call
    assert set(first.parameters()) == {"weight"}  # the transpose is no parameter
    old = first.weight
    first.weight = old * 2  # a new weight array: a new transpose (doubling is exact)
    assert mx.array_equal(first(x), 2 * (x @ old.T)).item()
    layers.revert(model)
    assert [type(m) for m in model.layers] == [nn.Linear, nn.Linear, nn.Embedding]
    assert "_transposed" not in first.__dict__


def test_rope_is_traced_once_for_every_position() -> None:
    rope = layers.FastRoPE(64, traditional=True, base=1e5)
    x = mx.random.normal((1, 9, 1, 64))
    mx.eval(rope(x, 0))
    before = layers.traces["rope"]
    for offset in range(1, 20):
        mx.eval(rope(x, offset))
    assert layers.traces["rope"] == before  # a retrace per decode step would cost more than it saves


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = [nn.RMSNorm(8), nn.RMSNorm(8, eps=1e-3)]
        self.rope = nn.RoPE(8, traditional=True, base=500)
        self.scaled = Llama3RoPE(8, traditional=False, scaling_config={"factor": 8.0})  # not reproduced
        self.norm = nn.LayerNorm(8)


def test_apply_swaps_exact_classes_keeps_weights_and_reverts() -> None:
    model = _Tiny()
    model.layers[1].weight = mx.arange(8, dtype=mx.float32)
    assert layers.apply(model, ["rope"]) == ["rope"]
    assert type(model.layers[0]) is nn.RMSNorm and isinstance(model.rope, layers.FastRoPE)
    assert layers.apply(model) == ["rms_norm"]  # the RoPE is already swapped
    assert all(isinstance(m, layers.FastRMSNorm) for m in model.layers)
    assert model.layers[1].eps == 1e-3 and model.layers[1].weight.tolist() == list(range(8))
    assert (model.rope.dims, model.rope.traditional, model.rope.base) == (8, True, 500)
    assert type(model.scaled) is Llama3RoPE and type(model.norm) is nn.LayerNorm
    assert len(model.parameters()["layers"]) == 2 and "_inv_freqs" not in model.rope.parameters()
    layers.revert(model)
    assert type(model.layers[1]) is nn.RMSNorm and model.layers[1].eps == 1e-3 and type(model.rope) is nn.RoPE


def test_switch() -> None:
    assert layers.enabled()
    for off in ("off", "0", "OFF", "no"):
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv(layers.ENV, off)
            assert not layers.enabled()


# ---- the real embedded model ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def float32_engine() -> Any:
    """The embedded model dequantized to float32, whose products can all be the float32 kernels' (the
    default engine's packed copies take the integer products alone)."""
    from mlxpipe.engine import Engine

    return Engine.load(dtype="float32")


@pytest.mark.model
def test_logits_agree_with_and_without_the_swaps(float32_engine: Any) -> None:
    engine = float32_engine
    if not engine.cpu_fast_paths:
        pytest.skip("the fast paths are used on a CPU only")
    tokens = engine.tokenizer.encode("The capital of France is Paris, and the capital of Italy is")
    prompt = mx.array([tokens])
    parts = gemv.use_int8(0)  # the float32 kernels (the 8-bit parts' precision: test_gemv)
    try:
        fast = engine.model(prompt)
        layers.revert(engine.model)
        plain = engine.model(prompt)
        mx.eval(fast, plain)
    finally:
        layers.apply(engine.model, engine.cpu_fast_paths)
        gemv.use_int8(parts)
    # RMSNorm and RoPE are bit for bit equal on this CPU, the SwiGLU within float32 rounding: allow that
    # over 30 layers.
    assert mx.allclose(fast, plain, rtol=1e-4, atol=1e-4).item()
    assert mx.argmax(fast[0, -1]).item() == mx.argmax(plain[0, -1]).item()


@pytest.mark.model
def test_fused_projections_give_the_numbers_of_the_parts(engine: Any) -> None:
    from mlx_lm.models.cache import make_prompt_cache

    from mlxpipe.cpu import gemv, kernels, quantized

    if "fused" not in engine.cpu_fast_paths:
        pytest.skip("projections are fused on a CPU with the quantized kernels (AVX-512) only")
    attention = engine.model.model.layers[0].self_attn
    whole = attention.__dict__[quantized.FUSED]
    parts = (attention.q_proj, attention.k_proj, attention.v_proj)
    if isinstance(whole, kernels.Matrix):  # mlxpipe's kernels: each part computes as its rows of the whole
        assert all(p.__dict__[quantized.MATRIX].whole is whole for p in parts)
        assert whole.n == sum(p.weight.shape[0] for p in parts)
    else:
        assert gemv._address(whole) == gemv._address(attention.q_proj.weight)  # the parts are views of it
        assert whole.shape[0] == sum(p.weight.shape[0] for p in parts)
    tokens = mx.array(
        [engine.tokenizer.encode("The capital of France is Paris, and the capital of Italy is")] * 2
    )

    def logits(kinds: list[str]) -> list[mx.array]:
        """A prompt of two rows, a decode step of two rows, then of one: several-row and one-row products."""
        layers.revert(engine.model)
        layers.apply(engine.model, kinds)
        cache = make_prompt_cache(engine.model)
        out = [engine.model(tokens[:, :-1], cache=cache), engine.model(tokens[:, -1:], cache=cache)]
        single = make_prompt_cache(engine.model)
        engine.model(tokens[:1, :-1], cache=single)
        out.append(engine.model(tokens[:1, -1:], cache=single))
        mx.eval(out)
        return out

    try:
        fused = logits(engine.cpu_fast_paths)
        parts = logits([k for k in engine.cpu_fast_paths if k != "fused"])
    finally:
        layers.revert(engine.model)
        layers.apply(engine.model, engine.cpu_fast_paths)
    assert all(mx.array_equal(a, b).item() for a, b in zip(fused, parts, strict=True))  # to the last bit


@pytest.mark.model
def test_a_batchs_decode_steps_take_attention_over_the_caches_buffers(
    engine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The real batched path (mlx-lm's BatchKVCache, left padding) and the single stream (KVCache) decode with
    # attention_cached: the cache classes are named, not imported, so a rename in mlx-lm would turn it off.
    from mlxpipe import records_from_objects, run
    from mlxpipe.events import Done
    from mlxpipe.records import Settings

    if "attention" not in engine.cpu_fast_paths or not gemv.attention_available():
        pytest.skip("attention runs in gemv.c's kernels on an AVX2 or AVX-512 CPU only")
    seen: list[int] = []
    real = layers.attention_cached

    def counted(queries: mx.array, *args: Any) -> mx.array:
        seen.append(queries.shape[0])
        return real(queries, *args)

    monkeypatch.setattr(layers, "attention_cached", counted)
    prompts = ["Name a colour.", "Write one sentence about the sea and the wind.", "Count to three."]
    texts = {}
    for size in (1, 3):
        records = records_from_objects(prompts, Settings(max_tokens=4))
        done = [e for e in run(records, engine, batch=size) if isinstance(e, Done)]
        texts[size] = [d.text for d in sorted(done, key=lambda d: d.index)]
    assert 1 in seen and 3 in seen  # one record's steps, and the three's
    assert texts[1] == texts[3]


@pytest.mark.model
def test_greedy_steps_pick_tokens_by_gemvs_argmax_as_mx_argmax_picks_them(engine: Any) -> None:
    # layers.argmax (gemv.c, through mlx's product) gives mx.argmax's indices; a greedy record's steps take
    # it, one stream and a batch alike, with the texts mx.argmax gives.
    from mlxpipe import records_from_objects, run
    from mlxpipe.engine.generate import greedy_argmax
    from mlxpipe.events import Done
    from mlxpipe.records import Settings

    if "argmax" not in engine.cpu_fast_paths:
        pytest.skip("gemv.c's library is not in front of this BLAS")
    assert engine.argmax is layers.argmax
    rng = np.random.default_rng(9)
    for rows in (1, 3, 64):
        logits = mx.array(rng.standard_normal((rows, 49152)).astype(np.float32))
        assert mx.array_equal(layers.argmax(logits), mx.argmax(logits, axis=-1)).item()
        assert layers.argmax(logits).dtype == mx.argmax(logits, axis=-1).dtype
    strided = mx.array(rng.standard_normal((4, 300)).astype(np.float32))[:, ::3]  # mlx copies it first
    assert mx.array_equal(layers.argmax(strided), mx.argmax(strided, axis=-1)).item()
    prompts = ["Name a colour.", "Write one sentence about the sea and the wind.", "Count to three."]
    texts = {}
    plain_steps = []

    def plain(logits: mx.array) -> mx.array:
        plain_steps.append(logits.shape[0])
        return greedy_argmax(logits)

    for pick in (layers.argmax, plain):
        engine.argmax = pick
        try:
            for size in (1, 3):
                before = gemv.argmax_calls()
                records = records_from_objects(prompts, Settings(max_tokens=6))
                done = [e for e in run(records, engine, batch=size) if isinstance(e, Done)]
                texts[pick, size] = [d.text for d in sorted(done, key=lambda d: d.index)]
                assert pick is plain or gemv.argmax_calls() > before
        finally:
            engine.argmax = layers.argmax
    assert 1 in plain_steps and 3 in plain_steps  # one record's steps, and the three's
    assert len(set(map(tuple, texts.values()))) == 1


def _texts(args: list[str], lines: str, fast: bool) -> list[str]:
    env = cli_env() if fast else cli_env(**{layers.ENV: "off"})
    r = run_cli(["--jsonl", "--no-stream", *args], input=lines, env=env)
    assert r.returncode == 0 and r.stderr == b"", r.stderr
    return [json.loads(line)["text"] for line in r.stdout.decode().splitlines()]


@pytest.mark.model
def test_model_info_reports_the_fast_paths() -> None:
    info = json.loads(run_cli(["--model-info"]).stdout)
    on_cpu = info["device"].startswith("Device(cpu")
    fast = ["argmax"] * gemv.argmax_available() + ["eval_per_layer", "rms_norm", "rope", "swiglu"]
    fast += ["linear"] * (info["dtype"] == "float32")  # plain linear layers: the dequantized weights
    fast += ["attention"] * gemv.attention_available()
    if info["quantized_rows"]:  # the quantized kernels (AVX-512): fused projections too
        fast += ["fused"]
    fast.sort()
    assert info["cpu_fast_paths"] == (fast if on_cpu else [])
    off = json.loads(run_cli(["--model-info"], env=cli_env(**{layers.ENV: "off"})).stdout)
    assert off["cpu_fast_paths"] == []


@pytest.mark.model
def test_greedy_answers_single_and_batched_are_unchanged() -> None:
    # Prompts of different lengths: --batch left-pads them, so RoPE gets per-row array offsets.
    prompts = ["What is the capital of France?", "Name a colour.", "Count from one to five, in words please."]
    lines = "".join(json.dumps({"prompt": p}) + "\n" for p in prompts)
    single = _texts(["-n", "8"], lines, fast=True)
    assert single[0].startswith("The capital of France is Paris")
    assert single == _texts(["-n", "8"], lines, fast=False)
    assert _texts(["-n", "8", "--batch", "3"], lines, fast=True) == _texts(
        ["-n", "8", "--batch", "3"], lines, fast=False
    )
