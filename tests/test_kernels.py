"""mlxpipe's mlx operation (mlxpipe.cpu.kernels): products by quantized matrices from their quantized
bytes, against mlx's own ``quantized_matmul`` on the same arrays, at every width and group size the
converter writes."""

from __future__ import annotations

import ctypes
import itertools
import json
from collections.abc import Iterator
from typing import Any

import pytest

from mlxpipe.cpu import gemv, kernels  # before mlx: the BLAS and the library come first

# The Linux CPU paths' own tests: MLXPIPE_CPU=off (make test-portable) leaves them nothing to test.
pytestmark = pytest.mark.cpu_paths

mx: Any = pytest.importorskip("mlx.core")


@pytest.fixture(autouse=True)
def _integer_products_as_asked() -> Iterator[None]:
    if not kernels.available():
        pytest.skip("mlxpipe's kernels do not run here")
    yield
    gemv.use_int8(gemv.int8_parts())


def _matrix(n: int, k: int, bits: int, group: int, seed: int) -> tuple[Any, ...]:
    mx.random.seed(seed)
    return tuple(mx.quantize(mx.random.normal((n, k)) * 0.05, group, bits))


def _reference(
    x: mx.array, q: mx.array, scales: mx.array, biases: mx.array, bits: int, group: int
) -> mx.array:
    f32 = mx.float32
    return mx.quantized_matmul(x, q, scales.astype(f32), biases.astype(f32), True, group, bits)


def _close(ours: Any, want: Any) -> bool:
    # two 8-bit parts an activation: within ~1e-4 of a product's largest value (the float32 kernels: closer)
    return bool((mx.abs(ours - want).max() <= 2e-4 * mx.abs(want).max()).item())


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_every_width_and_group_matches_mlxs_quantized_matmul(bits: int, group: int) -> None:
    q, scales, biases = _matrix(96, 256, bits, group, seed=bits * group)
    matrix = kernels.Matrix.register(q, scales, biases, bits, group)
    if matrix is None:
        assert bits not in (4, 8) and not gemv.int8_activations()  # other widths: the integer products only
        pytest.skip("no integer products here: other widths than 4 and 8 bits are not registered")
    for rows in (1, 3, 17, 64):  # one row, a few, and a batch's
        x = mx.random.normal((rows, 256))
        assert _close(kernels.product(x, matrix), _reference(x, q, scales, biases, bits, group)), rows
    x = mx.random.normal((2, 5, 256))  # leading axes kept, a strided input made contiguous
    want = _reference(x, q, scales, biases, bits, group)
    assert kernels.product(x, matrix).shape == (2, 5, 96)
    assert _close(kernels.product(x.transpose(1, 0, 2), matrix), want.transpose(1, 0, 2))


@pytest.mark.parametrize("bits", [2, 3, 5, 6])
def test_two_to_six_bit_copies_match_mlx_at_every_shape_and_kind(bits: int) -> None:
    # 2-, 3-, 5- and 6-bit matrices are packed in as many bits (low bits, and a plane of high bits, joined in
    # registers): one row and many, partial tiles of rows, groups of 32, 64, 128, scales in 16 bits (float16
    # values) or 32, on the best kernels, the AVX2 ones (AVX-VNNI's, where the CPU has it), AVX2's alone
    # (vpmaddubsw in vpdpbusd's place: a CPU without VNNI) and the plain loop (MLXPIPE_INT8 off, from the
    # source arrays), all against mlx's own quantized_matmul.
    if not gemv.int8_activations():
        pytest.skip("no integer products here: other widths than 4 and 8 bits are not registered")
    shapes = [(96, 256, 32), (193, 576, 32), (577, 640, 64), (40, 1024, 128)]
    ran = set()
    try:
        for (n, k, group), half, kind in itertools.product(
            shapes, [False, True], ["best", "avx2", "avx2-alone", "portable"]
        ):
            q, scales, biases = _matrix(n, k, bits, group, seed=n + bits + half)
            if half:  # a GGUF's scales: float16 values, kept in 16 bits
                scales, biases = (a.astype(mx.float16).astype(mx.float32) for a in (scales, biases))
            gemv._shim.mlxpipe_qgemv_avx2(int(kind.startswith("avx2")))
            gemv._shim.mlxpipe_qgemm_int8_emulated(2 if kind == "avx2-alone" else 1)
            matrix = kernels.Matrix.register(q, scales, biases, bits, group)
            assert matrix is not None, kind
            if kind == "portable":
                gemv.use_int8(0)
            plain = ctypes.c_long.in_dll(gemv._shim, "mlxpipe_qproduct_plain_calls").value
            for rows in (1, 2, 9, 33):
                x = mx.random.normal((rows, k))
                want = _reference(x, q, scales, biases, bits, group)
                assert _close(kernels.product(x, matrix), want), (n, k, group, half, kind, rows)
            plain = ctypes.c_long.in_dll(gemv._shim, "mlxpipe_qproduct_plain_calls").value - plain
            assert plain == (4 if kind == "portable" else 0)
            gemv.use_int8(gemv.int8_parts())
            ran.add(kind)
    finally:
        gemv._shim.mlxpipe_qgemv_avx2(0)
        gemv._shim.mlxpipe_qgemm_int8_emulated(1)
    assert ran == {"best", "avx2", "avx2-alone", "portable"}


def test_a_fused_gate_and_up_gives_the_swiglu_of_its_halves() -> None:
    q, scales, biases = _matrix(256, 128, 4, 32, seed=1)
    matrix = kernels.Matrix.register(q, scales, biases, 4, 32)
    assert matrix is not None
    x = mx.random.normal((5, 128))
    both = _reference(x, q, scales, biases, 4, 32)
    gate, up = both[:, :128], both[:, 128:]
    assert _close(kernels.product(x, matrix, swiglu=True), gate * mx.sigmoid(gate) * up)
    part = kernels.Part(matrix, 128, 256)  # a fused projection's part: its rows of the whole's product
    assert mx.array_equal(kernels.product(x, part), kernels.product(x, matrix)[:, 128:]).item()


def test_a_packed_copy_alone_keeps_its_numbers_when_the_integer_products_are_turned_off() -> None:
    if not gemv.int8_activations():
        pytest.skip("no integer products here: no packed copies")
    q, scales, biases = _matrix(64, 256, 6, 32, seed=3)
    x = mx.random.normal((3, 256))
    want = _reference(x, q, scales, biases, 6, 32)
    alone = kernels.Matrix.register(q, scales, biases, 6, 32)
    kept = kernels.Matrix.register(q, scales, biases, 6, 32)
    assert alone is not None and kept is not None and alone.pack_only() and alone.arrays == ()
    before = kernels.product(x, alone)
    gemv.use_int8(0)  # MLXPIPE_INT8=off: the packed copy still computes (two parts); the other, its source
    plain = ctypes.c_long.in_dll(gemv._shim, "mlxpipe_qproduct_plain_calls").value
    assert mx.array_equal(kernels.product(x, alone), before).item()
    assert _close(kernels.product(x, kept), want)  # 6 bits: no float32 kernel, the plain loop computes it
    assert ctypes.c_long.in_dll(gemv._shim, "mlxpipe_qproduct_plain_calls").value == plain + 1
    assert _close(before, want)


@pytest.mark.model
def test_a_second_run_maps_the_packed_copies_the_first_one_kept(tmp_path: Any, monkeypatch: Any) -> None:
    # The first load packs every matrix and keeps the copies in one file; the next maps them (its layers'
    # quantized arrays never read) and computes the same logits; a damaged file is packed and written again.
    from mlx_lm.models.cache import make_prompt_cache

    from mlxpipe import models
    from mlxpipe.engine import Engine

    if not gemv.int8_activations():
        pytest.skip("no integer products here: no packed copies to keep")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))

    def logits(engine: Any) -> Any:
        tokens = mx.array([engine.tokenizer.encode("The capital of France is")])
        out = engine.model(tokens, cache=make_prompt_cache(engine.model))[0, -1]
        mx.eval(out)
        return out

    first = Engine.load()
    path = models.derived_file(first.folder, f"packed-{kernels.layout()}.bin")
    assert path is not None and path.is_file()
    want = logits(first)
    second = Engine.load()
    layer = second.model.model.layers[3].mlp.down_proj.__dict__["_matrix"]
    assert layer.mapped is not None and layer.arrays == ()  # adopted from the file
    assert mx.array_equal(logits(second), want).item()
    size = path.stat().st_size
    with open(path, "r+b") as f:  # its end cut off: not a complete file
        f.truncate(size - 5)
    older = path.with_name(path.name.replace(kernels.layout(), "0123456789ab"))  # an older mlxpipe's layout
    for stale in (older, older.with_name(older.name + ".sum")):
        stale.write_bytes(b"\0" * 64)
    third = Engine.load()
    assert third.model.model.layers[3].mlp.down_proj.__dict__["_matrix"].mapped is None
    assert mx.array_equal(logits(third), want).item() and path.stat().st_size == size  # written again
    assert not older.exists() and not older.with_name(older.name + ".sum").exists()  # the old layout's gone


@pytest.mark.model
def test_a_kernel_build_that_fails_is_said_once_and_the_model_computes_in_float32(tmp_path: Any) -> None:
    # A C++ compiler that fails (a real process): the run answers from float32 copies and says why, once.
    from conftest import cli_env, run_cli, seed_cache

    compiler = tmp_path / "broken-c++"
    compiler.write_text("#!/bin/sh\necho 'fatal error: no space left on device' >&2\nexit 1\n")
    compiler.chmod(0o755)
    seed_cache(tmp_path / "cache", "gemv")  # gemv.c's library (a C build): only the C++ one fails
    env = cli_env(CXX=str(compiler), XDG_CACHE_HOME=str(tmp_path / "cache"))
    r = run_cli(["-n", "8", "-p", "What is the capital of France?"], env=env)
    assert r.returncode == 0, r.stderr
    warnings = [line for line in r.stderr.decode().splitlines() if "float32 copies" in line]
    assert len(warnings) == 1 and "no space left on device" in warnings[0], r.stderr
    assert b"Paris" in r.stdout
    info = json.loads(run_cli(["--model-info"], env=env).stdout)
    assert info["dtype"] == "float32"


@pytest.mark.model
def test_a_six_bit_model_gives_mlx_lms_greedy_tokens(engine: Any, tmp_path: Any, monkeypatch: Any) -> None:
    # The embedded model requantized to 6 bits, group 32 (every matrix packed as a nibble plane and a plane
    # of high bits): mlxpipe's greedy tokens are mlx-lm's on the same folder (mlx's own quantized kernels).
    import shutil
    from pathlib import Path

    import mlx_lm
    from mlx_lm.sample_utils import make_sampler
    from mlx_lm.utils import dequantize_model, load_model, quantize_model, save_config, save_model

    from mlxpipe.cpu import quantized
    from mlxpipe.engine import Engine
    from mlxpipe.engine.generate import stream_generate
    from mlxpipe.reader import records_from_objects

    if not gemv.int8_activations():
        pytest.skip("no integer products here: 6-bit matrices are dequantized")
    source = Path(engine.folder)
    folder = tmp_path / "six"
    folder.mkdir()
    model, config = load_model(source)
    config.pop("quantization", None), config.pop("quantization_config", None)
    model, config = quantize_model(dequantize_model(model), config, 32, 6)
    save_model(folder, model)
    save_config(config, folder / "config.json")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, folder)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    ours = Engine.load(str(folder))
    down = ours.model.model.layers[0].mlp.down_proj.__dict__[quantized.MATRIX]
    assert ours.dtype == "quantized" and isinstance(down, kernels.Matrix)
    reference, tokenizer = mlx_lm.load(str(folder))
    (record,) = records_from_objects(["What is the capital of France? Answer in one sentence."])
    tokens = ours.prompts.tokens(record)
    runs = []
    for generate, model, tok in (
        (stream_generate, ours.model, ours.tokenizer),
        (mlx_lm.stream_generate, reference, tokenizer),
    ):
        responses = generate(
            model, tok, tokens, max_tokens=16, sampler=make_sampler(0.0), logits_processors=[]
        )
        runs.append([r.token for r in responses])
    assert runs[0] == runs[1] and len(runs[0]) > 4, runs
