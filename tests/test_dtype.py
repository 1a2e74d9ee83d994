"""--dtype on the real embedded model: the float32 path answers as the quantized one does; auto's choices."""

from __future__ import annotations

import json
from typing import Any

import pytest
from conftest import run_cli

from mlxpipe import blas

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


def test_auto_on_cpu_is_float32_unless_memory_is_short(engine: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from mlxpipe import engine as engine_module

    monkeypatch.setattr(engine_module, "_accelerator", lambda: None)
    fast = blas.BlasChoice("/lib/libopenblas.so.0", "cmeel-openblas", "loaded before mlx")
    monkeypatch.setattr(blas, "_choice", fast)
    assert engine_module.choose_dtype(engine.model, "auto")[0] == "float32"
    # 135M weights in float32 are ~540 MB: with 800 MB free they do not fit in half.
    monkeypatch.setattr(engine_module, "_available_memory", lambda: 800_000_000)
    used, reason = engine_module.choose_dtype(engine.model, "auto")
    assert used == "quantized" and "memory" in reason
    assert engine_module.choose_dtype(engine.model, "float16") == ("float16", "asked for with --dtype")


def test_auto_on_cpu_is_float32_with_reference_blas(engine: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # Measured (bench/RESULTS.md): float32 beat mlx's quantized CPU kernels even without OpenBLAS.
    from mlxpipe import engine as engine_module

    monkeypatch.setattr(engine_module, "_accelerator", lambda: None)
    slow = blas.BlasChoice(None, "mlx", "turned off by MLXPIPE_BLAS=off", reference=True)
    monkeypatch.setattr(blas, "_choice", slow)
    used, reason = engine_module.choose_dtype(engine.model, "auto")
    assert used == "float32" and "reference BLAS" in reason


def test_auto_on_a_gpu_keeps_quantized_weights(engine: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from mlxpipe import engine as engine_module

    monkeypatch.setattr(engine_module, "_accelerator", lambda: "metal")
    assert engine_module.choose_dtype(engine.model, "auto")[0] == "quantized"


def test_parameter_count_counts_packed_values(engine: Any) -> None:
    from mlxpipe import engine as engine_module

    # The same count whether the weights are packed 4-bit words or float32 values.
    assert abs(engine_module._parameter_count(engine.model) - 134_515_008) < 1_000_000
