"""--dtype on the real embedded model: the float32 path answers as the quantized one does; auto's choices."""

from __future__ import annotations

import json
from typing import Any

import pytest
from conftest import run_cli

from mlxpipe.cpu import blas

pytestmark = pytest.mark.model

PARIS = "What is the capital of France?"


def _answer(dtype: str) -> dict[str, Any]:
    r = run_cli(["--dtype", dtype, "--out", "jsonl", "--no-stream", "-n", "16"], input=PARIS + "\n")
    assert r.returncode == 0, r.stderr
    assert r.stderr == b""
    (done,) = [json.loads(line) for line in r.stdout.decode().splitlines()]
    return done


def test_float32_greedy_answer_matches_the_quantized_one() -> None:
    f32, q = _answer("float32"), _answer("quantized")
    assert f32["text"] == q["text"] == "The capital of France is Paris."
    assert f32["finish_reason"] == q["finish_reason"] == "stop"


@pytest.mark.cpu_paths
def test_auto_on_cpu_keeps_the_quantized_weights_where_the_kernels_run(
    engine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mlxpipe.cpu import kernels
    from mlxpipe.engine import dtype as engine_module

    monkeypatch.setattr(engine_module, "accelerator", lambda: None)
    used, reason = engine_module.choose_dtype(engine.model, "auto")
    assert (used, kernels.available()) == ("quantized", True) and "kernels" in reason
    r = run_cli(["--model-info"])
    info = json.loads(r.stdout)
    assert info["dtype"] == "quantized" and info["quantized_rows"] > 0, info


def test_auto_on_cpu_is_float32_without_the_kernels_unless_memory_is_short(
    engine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mlxpipe.cpu import kernels
    from mlxpipe.engine import dtype as engine_module

    monkeypatch.setattr(engine_module, "accelerator", lambda: None)
    monkeypatch.setattr(kernels, "available", lambda: False)
    fast = blas.BlasChoice("/lib/libopenblas.so.0", "cmeel-openblas", "loaded before mlx")
    monkeypatch.setattr(blas, "_choice", fast)
    assert engine_module.choose_dtype(engine.model, "auto")[0] == "float32"
    # 135M weights in float32 are ~540 MB: with 800 MB free they do not fit in half.
    monkeypatch.setattr(engine_module, "available_memory", lambda: 800_000_000)
    used, reason = engine_module.choose_dtype(engine.model, "auto")
    assert used == "quantized" and "memory" in reason
    assert engine_module.choose_dtype(engine.model, "float16") == ("float16", "asked for with --dtype")


def test_auto_on_cpu_is_float32_with_reference_blas(engine: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # Measured (bench/RESULTS.md, r-f32-vs-q): float32 beat mlx's quantized CPU kernels even without OpenBLAS.
    from mlxpipe.cpu import kernels
    from mlxpipe.engine import dtype as engine_module

    monkeypatch.setattr(engine_module, "accelerator", lambda: None)
    monkeypatch.setattr(kernels, "available", lambda: False)
    slow = blas.BlasChoice(None, "mlx", "turned off by MLXPIPE_BLAS=off", reference=True)
    monkeypatch.setattr(blas, "_choice", slow)
    used, reason = engine_module.choose_dtype(engine.model, "auto")
    assert used == "float32" and "reference BLAS" in reason


def test_auto_on_a_gpu_keeps_quantized_weights(engine: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from mlxpipe.engine import dtype as engine_module

    monkeypatch.setattr(engine_module, "accelerator", lambda: "metal")
    assert engine_module.choose_dtype(engine.model, "auto")[0] == "quantized"


def test_parameter_count_counts_packed_values(engine: Any) -> None:
    from mlxpipe.engine import dtype as engine_module

    # The same count whether the weights are packed 4-bit words or float32 values.
    assert abs(engine_module.parameter_count(engine.model) - 134_515_008) < 1_000_000


def test_auto_on_cuda_batches_in_bfloat16_when_it_fits_in_gpu_memory(
    engine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mlxpipe.engine import dtype as engine_module

    monkeypatch.setattr(engine_module, "accelerator", lambda: "cuda")
    monkeypatch.setattr(engine_module, "gpu_memory", lambda: 140_000_000_000)
    assert engine_module.choose_dtype(engine.model, "auto")[0] == "quantized"  # one stream
    half = engine_module.half_dtype(engine.model)
    assert engine_module.choose_dtype(engine.model, "auto", batch=8)[0] == half
    # 135M weights in bfloat16 are ~270 MB: with 400 MB of GPU memory free they do not fit in half.
    monkeypatch.setattr(engine_module, "gpu_memory", lambda: 400_000_000)
    used, reason = engine_module.choose_dtype(engine.model, "auto", batch=8)
    assert used == "quantized" and "GPU memory" in reason
    monkeypatch.setattr(engine_module, "accelerator", lambda: "metal")
    assert engine_module.choose_dtype(engine.model, "auto", batch=8)[0] == "quantized"


def test_quantized_weights_on_a_gpu_compute_in_their_own_16_bit_type(monkeypatch: pytest.MonkeyPatch) -> None:
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    from mlxpipe.engine import dtype as engine_module

    def tiny() -> Any:
        args = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 1, "intermediate_size": 128}
        args |= {"num_attention_heads": 2, "rms_norm_eps": 1e-5, "vocab_size": 128}
        model = llama.Model(llama.ModelArgs.from_dict(args))  # float32, as a GGUF's norms are
        nn.quantize(model, group_size=32, bits=4)
        return model

    def dtypes(model: Any) -> set[Any]:
        return {v.dtype for _, v in tree_flatten(model.parameters())}

    monkeypatch.setattr(engine_module, "accelerator", lambda: None)
    assert dtypes(engine_module.apply_dtype(tiny(), "quantized")) == {mx.uint32, mx.float32}
    monkeypatch.setattr(engine_module, "accelerator", lambda: "cuda")
    model = engine_module.apply_dtype(tiny(), "quantized")
    assert dtypes(model) == {mx.uint32, mx.bfloat16}  # packed weights kept; scales, biases and norms 16-bit
    assert model(mx.array([[1, 2, 3]])).dtype == mx.bfloat16
    # As a GGUF has it: float16 scales and biases, float32 norms. The model's own 16-bit type is float16.
    gguf_like = tiny()
    for _, m in gguf_like.named_modules():
        if isinstance(m, nn.QuantizedLinear | nn.QuantizedEmbedding):
            m.update({k: m[k].astype(mx.float16) for k in ("scales", "biases")})
    assert engine_module.half_dtype(gguf_like) == "float16"
    model = engine_module.apply_dtype(gguf_like, "quantized")
    assert dtypes(model) == {mx.uint32, mx.float16}
    assert model(mx.array([[1, 2, 3]])).dtype == mx.float16


def test_the_embedded_gguf_computes_in_float16_where_16_bits_are_chosen() -> None:
    # Its scales are float16; in bfloat16 this 135M model no longer knows the capital of France.
    import mlx_lm

    from mlxpipe import models
    from mlxpipe.engine import dtype as engine_module

    model = mlx_lm.load(models.materialize(models.resolve(None)))[0]
    assert engine_module.half_dtype(model) == "float16"
    r = run_cli(["--dtype", "float16", "--out", "jsonl", "--no-stream", "-n", "16"], input=PARIS + "\n")
    assert json.loads(r.stdout)["text"] == _answer("float32")["text"]


def test_float32_matrices_kept_in_the_cache_are_what_dequantizing_gives(tmp_path: Any) -> None:
    # mlx-lm's own dequantize_model is the reference; the kept file is read back on the next load.
    from pathlib import Path

    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import dequantize_model, load_model

    from mlxpipe import models
    from mlxpipe.engine import dtype as engine_module

    folder = models.materialize(models.resolve(None))

    def loaded() -> Any:
        model, _ = load_model(Path(folder))
        for _, m in model.named_modules():  # as apply_dtype does for float32: the file's scales, unrounded
            if isinstance(m, engine_module.QUANTIZED):
                m.update({k: m[k].astype(mx.float32) for k in ("scales", "biases")})
        return model

    want = dict(tree_flatten(dequantize_model(loaded()).parameters()))
    kept = tmp_path / "float32.safetensors"
    for _ in range(2):  # the first load writes the file, the second reads it
        got = dict(tree_flatten(engine_module.apply_dtype(loaded(), "float32", kept).parameters()))
        assert kept.is_file()
        assert got.keys() == want.keys()
        assert all(got[k].dtype == mx.float32 and mx.array_equal(got[k], want[k]).item() for k in want)
    matrices = {k.removesuffix(".weight") for k in want if k.endswith("proj.weight")}
    assert set(mx.load(str(kept))) == matrices | {"model.embed_tokens"}

    # Projections joined as one matrix (what fusing them needs): the file is rewritten holding the wholes,
    # read back as views of their rows, the same numbers; a load that does not join them reads it as it is.
    from mlxpipe.cpu import quantized
    from mlxpipe.engine.engine import _FUSED

    for _ in range(2):
        model = loaded()
        joined = quantized.joinable(model, quantized.forms(model), _FUSED)
        assert len(joined) == 60  # q/k/v and gate/up of 30 layers
        got_model = engine_module.apply_dtype(model, "float32", kept, joined)
        got = dict(tree_flatten(got_model.parameters()))
        assert all(got[k].dtype == mx.float32 and mx.array_equal(got[k], want[k]).item() for k in want)
        modules = dict(got_model.named_modules())
        for key, names in joined.items():
            whole = modules[key.rpartition(".")[0]].__dict__[quantized.FUSED]
            parts = [got[f"{n}.weight"] for n in names]
            assert mx.array_equal(whole, mx.concatenate(parts)).item()
    on_disk = set(mx.load(str(kept)))
    assert set(joined) <= on_disk
    assert not any(n in on_disk for names in joined.values() for n in names)
    written = kept.stat().st_mtime_ns
    got = dict(tree_flatten(engine_module.apply_dtype(loaded(), "float32", kept).parameters()))
    assert all(mx.array_equal(got[k], want[k]).item() for k in want)
    assert kept.stat().st_mtime_ns == written
