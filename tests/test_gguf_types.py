"""GGUF tensor types → MLX forms, checked against gguf-py's own dequantization (the reference).

Tensors come from gguf-py's quantizer where it has one (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, BF16) and from random
bytes for the K-quants (any bytes are a valid K-quant block once its f16 d/dmin are finite: set here).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf_factory import tiny_bpe, write_gguf

from mlxpipe.models import ModelError, convert_gguf
from mlxpipe.models.gguf import quants

gguf = pytest.importorskip("gguf")
T = gguf.GGMLQuantizationType
ROWS, COLS = 8, 512


def _mlx_form(a: quants.Affine) -> np.ndarray:
    # What MLX computes from the stored (float16) scales and biases.
    s = a.scales.astype(np.float16).astype(np.float32)
    b = a.biases.astype(np.float16).astype(np.float32)
    q = a.q.reshape(a.q.shape[0], -1, quants.GROUP).astype(np.float32)
    return (q * s[:, :, None] + b[:, :, None]).reshape(a.q.shape)


def _k_blocks(qtype: Any, rng: np.random.Generator, rows: int = ROWS, cols: int = COLS) -> np.ndarray:
    block, size = quants.BLOCKS[int(qtype)]
    raw = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
    d = rng.uniform(1e-3, 2e-2, (raw.shape[0], 2)).astype("<f2").view(np.uint8)
    # d (and dmin) sit at the start for Q4_K/Q5_K/ (end for Q2_K: d then dmin; Q3_K, Q6_K: d last).
    at = {T.Q4_K: [0], T.Q5_K: [0], T.Q2_K: [80], T.Q3_K: [108], T.Q6_K: [208]}[qtype]
    for start in at:
        width = 4 if qtype in (T.Q4_K, T.Q5_K, T.Q2_K) else 2
        raw[:, start : start + width] = d[:, :width]
    return raw.reshape(rows, -1)


def _random_weights(rng: np.random.Generator, rows: int = ROWS, cols: int = COLS) -> np.ndarray:
    return (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0])
def test_32_weight_blocks_are_exact(qtype: Any) -> None:
    raw = gguf.quants.quantize(_random_weights(np.random.default_rng(1)), qtype)
    a = quants.convert_rows(raw, int(qtype), COLS)
    assert isinstance(a, quants.Affine)
    assert int(a.q.max()) < 1 << quants.bits_of(int(qtype))
    np.testing.assert_array_equal(_mlx_form(a), gguf.quants.dequantize(raw, qtype))


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q5_K])
def test_k_quants_with_32_weight_groups_map_exactly(qtype: Any) -> None:
    raw = _k_blocks(qtype, np.random.default_rng(2))
    a = quants.convert_rows(raw, int(qtype), COLS)
    assert isinstance(a, quants.Affine)
    ref = gguf.quants.dequantize(raw, qtype)
    # Exact with float32 scales; stored as float16, d*sc is rounded to 11 bits: at most 2^-11 of each term.
    q = a.q.reshape(ROWS, -1, 32).astype(np.float32)
    exact = (q * a.scales[:, :, None] + a.biases[:, :, None]).reshape(ROWS, COLS)
    np.testing.assert_allclose(exact, ref, rtol=1e-6, atol=1e-7)
    bound = (q * np.abs(a.scales[:, :, None]) + np.abs(a.biases[:, :, None])).reshape(ROWS, COLS) * 2.0**-11
    assert np.all(np.abs(_mlx_form(a) - ref) <= bound + 1e-9)


@pytest.mark.parametrize("qtype", [T.Q6_K, T.Q3_K, T.Q2_K])
def test_16_weight_group_types_are_requantized_within_half_a_step(qtype: Any) -> None:
    raw = _k_blocks(qtype, np.random.default_rng(3))
    blocks = raw.reshape(-1, quants.BLOCKS[int(qtype)][1])
    ref = gguf.quants.dequantize(raw, qtype)
    np.testing.assert_allclose(quants.dequantize_16(blocks, int(qtype)).reshape(ROWS, COLS), ref, rtol=1e-6)
    a = quants.convert_rows(raw, int(qtype), COLS)
    assert isinstance(a, quants.Affine)
    groups = ref.reshape(ROWS, -1, 32)
    step = (groups.max(axis=2) - groups.min(axis=2)) / ((1 << quants.bits_of(int(qtype))) - 1)
    err = np.abs(_mlx_form(a) - ref).reshape(ROWS, -1, 32).max(axis=2)
    # Half a step, plus what float16 scale and bias add (their rounding, amplified by q up to 2^bits).
    assert np.all(err <= 0.5 * step * (1 + 2.0**-8) + np.abs(groups).max(axis=2) * 2.0**-9)


def test_floats_and_bf16() -> None:
    w = _random_weights(np.random.default_rng(4))
    bf = gguf.quants.quantize(w, T.BF16)
    out = quants.convert_rows(bf.view(np.uint8).reshape(ROWS, -1), int(T.BF16), COLS)
    assert isinstance(out, np.ndarray) and out.dtype == np.dtype("<u2")
    np.testing.assert_array_equal(
        (out.astype(np.uint32) << 16).view(np.float32), gguf.quants.dequantize(bf, T.BF16)
    )


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_packing_is_mlxs(bits: int) -> None:
    from mlxpipe.cpu import mlx_core

    mx = mlx_core()
    q = np.random.default_rng(bits).integers(0, 1 << bits, (4, 128), dtype=np.uint8)
    ones, zeros = mx.ones((4, 4)), mx.zeros((4, 4))
    packed = mx.array(quants.pack(q, bits))
    out = mx.dequantize(packed, ones, zeros, group_size=32, bits=bits)
    np.testing.assert_array_equal(np.array(out), q.astype(np.float32))


def _mixed_file(path: Path) -> tuple[Path, dict[str, np.ndarray]]:
    """A llama GGUF whose weights use every supported type, with the reference dequantization of each."""
    rng = np.random.default_rng(5)
    types = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K, T.Q3_K, T.Q2_K, T.BF16, T.F16]
    refs: dict[str, np.ndarray] = {}

    def quantize(name: str, data: np.ndarray) -> tuple[np.ndarray, Any]:
        qtype = types[len(refs) % len(types)]
        if qtype in (T.Q4_K, T.Q5_K, T.Q6_K, T.Q3_K, T.Q2_K):
            raw = _k_blocks(qtype, rng, *data.shape)
        else:
            raw = gguf.quants.quantize(data, qtype)
        refs[name] = gguf.quants.dequantize(raw, qtype)
        return raw, qtype

    write_gguf(
        path, "llama", tiny_bpe(), hidden=256, ffn=512, heads=4, kv_heads=2, tied=False, quantize=quantize
    )
    return path, refs


@pytest.mark.model
def test_every_type_in_one_file_loads_and_matches(tmp_path: Path) -> None:
    import mlx_lm

    from mlxpipe.cpu import mlx_core

    mx = mlx_core()
    path, refs = _mixed_file(tmp_path / "base.gguf")
    folder = tmp_path / "out"
    convert_gguf(path, folder)
    config = json.loads((folder / "config.json").read_text())
    assert config["quantization"]["group_size"] == 32
    model, _ = mlx_lm.load(str(folder))
    params = dict(_flatten(model.parameters()))
    names = {"token_embd.weight": "model.embed_tokens", "output.weight": "lm_head"}
    worst = 0.0
    for name, ref in refs.items():
        base = names.get(name) or name.replace("blk.", "model.layers.").rsplit(".", 1)[0]
        for short, long in [
            ("attn_q", "self_attn.q_proj"), ("attn_k", "self_attn.k_proj"), ("attn_v", "self_attn.v_proj"),
            ("attn_output", "self_attn.o_proj"), ("ffn_gate", "mlp.gate_proj"), ("ffn_up", "mlp.up_proj"),
            ("ffn_down", "mlp.down_proj"),
        ]:  # fmt: skip
            base = base.replace(f".{short}", f".{long}")
        if f"{base}.scales" in params:
            bits = config["quantization"].get(base, config["quantization"])["bits"]
            got = mx.dequantize(
                params[f"{base}.weight"], params[f"{base}.scales"], params[f"{base}.biases"], group_size=32,
                bits=bits,
            )  # fmt: skip
        else:
            got = params[f"{base}.weight"]
        got = np.array(got.astype(mx.float32))
        worst = max(worst, float(np.abs(got - ref).max() / np.abs(ref).max()))
    assert worst < 0.1  # the requantized 16-group types; the exact ones are checked above
    logits = model(mx.array([[1, 2, 3]]))
    assert logits.shape == (1, 3, len(tiny_bpe()["tokens"])) and bool(mx.all(mx.isfinite(logits)))
    # Size: no larger than the GGUF + 10% is the goal for files of one K-quant mix; here, for every type at
    # once, the 16-group types' extra bits show.
    assert (folder / "model.safetensors").stat().st_size < 1.6 * path.stat().st_size


def _flatten(tree: Any, prefix: str = "") -> list[tuple[str, Any]]:
    if isinstance(tree, dict):
        return [kv for k, v in tree.items() for kv in _flatten(v, f"{prefix}{k}.")]
    if isinstance(tree, list):
        return [kv for i, v in enumerate(tree) for kv in _flatten(v, f"{prefix}{i}.")]
    return [(prefix[:-1], tree)]


@pytest.mark.model
def test_embedded_q4_1_and_q8_0_bit_exact_with_mx_load(tmp_path: Path) -> None:
    from mlxpipe.cpu import mlx_core
    from mlxpipe.models import resolve

    mx = mlx_core()
    source = resolve(None)
    assert source.path is not None
    convert_gguf(source.path, tmp_path / "out")
    ours = mx.load(str(tmp_path / "out" / "model.safetensors"))
    theirs = mx.load(str(source.path), format="gguf")
    pairs = {"token_embd": "model.embed_tokens", "blk.3.attn_q": "model.layers.3.self_attn.q_proj"}
    for gguf_name, mlx_name in pairs.items():
        for suffix in ("weight", "scales", "biases"):
            a, b = ours[f"{mlx_name}.{suffix}"], theirs[f"{gguf_name}.{suffix}"]
            assert a.dtype == b.dtype and bool(mx.array_equal(a, b)), (gguf_name, suffix)
    assert len([k for k in ours if k.endswith(".scales")]) == len(
        [k for k in theirs if k.endswith(".scales")]
    )


def test_other_bit_widths_take_the_integer_products_only() -> None:
    from mlxpipe.cpu import gemv

    w = np.zeros((64, 128), np.float32)
    s = np.ones((64, 4), np.float32)
    # 3-, 5- and 6-bit forms are registered where the integer products run (their copies packed for them),
    # else never: their products stay on the float path.
    for bits in (3, 5, 6):
        q = np.zeros((64, 128 * bits // 32), np.uint32)
        registered = gemv.attach(w, q, s, s, bits, 32)
        assert registered is (gemv.int8_activations() > 0)
        if registered:
            gemv.detach([w])


def test_unknown_type_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "iq.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("blk.0.attn_q.weight", np.zeros((4, 66), np.uint8), raw_dtype=T.IQ2_XXS)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelError, match=r"unsupported GGUF tensor type IQ2_XXS .*\(supported: .*Q6_K"):
        convert_gguf(path, tmp_path / "out")


@pytest.mark.model
def test_engine_on_5_and_8_bit_layers_matches_the_quantized_model(tmp_path: Path, monkeypatch: Any) -> None:
    import mlx_lm

    from mlxpipe.cpu import gemv, mlx_core
    from mlxpipe.engine import Engine

    mx = mlx_core()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    names: list[str] = []

    def quantize(name: str, data: np.ndarray) -> tuple[np.ndarray, Any]:
        qtype = T.Q8_0 if len(names) % 2 else T.Q5_0
        names.append(name)
        return gguf.quants.quantize(data, qtype), qtype

    path = write_gguf(tmp_path / "q58.gguf", "llama", tiny_bpe(), hidden=128, ffn=256, quantize=quantize)
    engine = Engine.load(str(path), dtype="float32")
    # The 8-bit matrices read their quantized bytes; the 5-bit ones too where the integer products run, else
    # they stay on the float path.
    eight = sum(1 for i, n in enumerate(names) if i % 2 and n != "token_embd.weight")
    assert engine.quantized_rows <= (len(names) if gemv.int8_activations() else eight)
    if gemv.quantized_available():
        assert engine.quantized_rows > 0
    reference, _ = mlx_lm.load(engine.folder)
    # --dtype auto: on a CPU with mlxpipe's kernels, every matrix from its quantized bytes alone
    for model in (engine.model, Engine.load(str(path)).model):
        tokens = mx.array([[5, 6, 7]])
        for step in range(3):  # one-row products (the decode path) included
            ours = np.array(model(tokens[:, step : step + 1]).astype(mx.float32))
            theirs = np.array(reference(tokens[:, step : step + 1]).astype(mx.float32))
            # Against mlx's quantized kernels: rounding differs, a misread weight would not be this close.
            assert np.abs(ours - theirs).max() < 2e-3 * np.abs(theirs).max()
            assert ours.argmax() == theirs.argmax()


def test_dequantized_copy_is_the_same_model_in_f32(tmp_path: Path) -> None:
    # The benches' float reference (llama.cpp on a file's weights without its quantized activations).
    from gguf_factory import dequantized_copy

    src = write_gguf(tmp_path / "q8.gguf", "llama", tiny_bpe(), qtype=T.Q8_0)
    dst = dequantized_copy(src, tmp_path / "f32.gguf")
    before, after = gguf.GGUFReader(str(src)), gguf.GGUFReader(str(dst))
    for t, u in zip(before.tensors, after.tensors, strict=True):
        assert (t.name, list(t.shape)) == (u.name, list(u.shape)) and u.tensor_type == T.F32
        np.testing.assert_array_equal(
            np.array(u.data).reshape(-1), gguf.quants.dequantize(t.data, t.tensor_type).reshape(-1)
        )
    kept = [k for k in before.fields if k != "general.file_type"]
    assert [k for k in after.fields if k != "general.file_type"] == kept
    assert after.get_field("tokenizer.ggml.tokens").contents() == tiny_bpe()["tokens"]
    convert_gguf(src, tmp_path / "a")
    convert_gguf(dst, tmp_path / "b")
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() == (
        tmp_path / "b" / "tokenizer.json"
    ).read_bytes()
