"""A GGUF file → an MLX model folder (config.json, model.safetensors, tokenizer files).

Tensors are read (``pread``) and written one slice of rows at a time straight into the safetensors file (its
header is planned first), so converting holds a few slices' worth of memory, never a copy of the model.
"""

from __future__ import annotations

import json
import math
import os
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ...errors import ModelError
from . import quants
from .config import ARCHITECTURES, build_config, float_fix, mlx_name
from .reader import GGML_TYPES, SUPPORTED_TYPES, TensorInfo, read_header
from .tokenizer import tokenizer_files

__all__ = ["convert_gguf"]

_SLICE_BYTES = 4 << 20  # GGUF bytes converted per step: its intermediates are ~10x that
_ST_DTYPES = {"<f4": "F32", "<f2": "F16", "<u2": "BF16", "<u4": "U32"}


@dataclass
class _Out:
    """One safetensors entry: its name, dtype, shape and where its bytes go."""

    name: str
    dtype: str
    shape: list[int]
    offset: int = 0

    @property
    def nbytes(self) -> int:
        n = 4 if self.dtype in ("<f4", "<u4") else 2
        for d in self.shape:
            n *= d
        return n


def convert_gguf(gguf_path: Path, out_dir: Path, progress: Callable[[int, int], None] | None = None) -> None:
    """Convert a GGUF file into an MLX model folder at ``out_dir`` (created if needed).

    Architectures: see :data:`.config.ARCHITECTURES`. Tensor types: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1,
    Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K (:mod:`.quants` says what each becomes); quantized tensors stay
    quantized, each layer keeping its own bit width. Raises ModelError naming what is unsupported, or if the
    file is truncated or corrupt. ``progress(done, total)`` is told the GGUF's bytes converted so far.
    """
    gguf_path = Path(gguf_path)
    out_dir = Path(out_dir)
    metadata, infos = read_header(gguf_path)

    arch = metadata.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ModelError(
            f"unsupported GGUF architecture {arch!r} in {gguf_path} (supported: {', '.join(ARCHITECTURES)})"
        )
    bad = sorted({GGML_TYPES.get(t.ggml_type, f"type {t.ggml_type}") for t in infos} - _supported_names())
    if bad:
        raise ModelError(
            f"unsupported GGUF tensor type {', '.join(bad)} in {gguf_path} "
            f"(supported: {', '.join(sorted(_supported_names()))})"
        )
    names = {t.name for t in infos}
    plan: list[tuple[TensorInfo, str, list[_Out]]] = []
    for t in infos:
        target = mlx_name(arch, t.name)
        if target is None:
            continue
        if not target:
            raise ModelError(f"unsupported GGUF tensor {t.name!r} in {gguf_path} for a {arch} model")
        plan.append((t, target, _outputs(t, target)))

    rope_freqs = None
    by_name = {t.name: t for t in infos}
    with open(gguf_path, "rb") as f:
        source = f.fileno()
        if "rope_freqs.weight" in by_name:
            rope_freqs = _rows(source, by_name["rope_freqs.weight"], 0, 1).view("<f4")
        config = build_config(gguf_path, arch, metadata, names, rope_freqs)
        tokenizer, tokenizer_config, eos_ids = tokenizer_files(gguf_path, metadata, arch)
        config["eos_token_id"] = eos_ids
        pad = metadata.get("tokenizer.ggml.padding_token_id")
        # mlx-lm ignores it; transformers warns when a class's default (phi3: 32000) lies outside the vocab.
        config["pad_token_id"] = pad if isinstance(pad, int) else (eos_ids[0] if eos_ids else None)
        quantization = _quantization(plan)
        if quantization is not None:
            config["quantization"] = quantization

        out_dir.mkdir(parents=True, exist_ok=True)
        try:
            _write_safetensors(out_dir / "model.safetensors", source, plan, arch, progress)
        except OSError as e:
            raise ModelError(f"cannot write converted model to {out_dir}: {e}") from None
    _write_json(out_dir / "config.json", config)
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config)
    tokenizer.save(str(out_dir / "tokenizer.json"), pretty=False)  # indented, it is twice the size


def _supported_names() -> set[str]:
    return {GGML_TYPES[t] for t in SUPPORTED_TYPES}


def _outputs(t: TensorInfo, target: str) -> list[_Out]:
    base, _, suffix = target.rpartition(".")
    shape = list(t.shape)
    if t.ggml_type in quants.FLOAT_TYPES:
        return [_Out(target, {0: "<f4", 1: "<f2", 30: "<u2"}[t.ggml_type], shape)]
    if len(shape) != 2 or suffix != "weight":
        raise ModelError(f"unsupported quantized GGUF tensor {t.name!r} of shape {shape}")
    rows, cols = shape
    bits = quants.bits_of(t.ggml_type)
    groups = [rows, cols // quants.GROUP]
    return [
        _Out(f"{base}.weight", "<u4", [rows, cols * bits // 32]),
        _Out(f"{base}.scales", "<f2", groups),
        _Out(f"{base}.biases", "<f2", groups),
    ]


def _row_bytes(t: TensorInfo) -> int:
    block, size = quants.BLOCKS[t.ggml_type]
    return t.shape[-1] // block * size


def _rows(source: int, t: TensorInfo, start: int, stop: int) -> np.ndarray:
    per = _row_bytes(t)
    data = os.pread(source, (stop - start) * per, t.offset + start * per)
    if len(data) != (stop - start) * per:
        raise ModelError(f"GGUF tensor {t.name!r} extends past the end of the file (truncated?)")
    return np.frombuffer(data, np.uint8).reshape(stop - start, per)


def _write_safetensors(
    path: Path,
    source: int,
    plan: list[tuple[TensorInfo, str, list[_Out]]],
    arch: str,
    progress: Callable[[int, int], None] | None = None,
) -> None:
    header: dict[str, Any] = {"__metadata__": {"format": "mlx"}}
    offset = 0
    for _, _, outs in plan:
        for out in outs:
            out.offset = offset
            header[out.name] = {
                "dtype": _ST_DTYPES[out.dtype],
                "shape": out.shape,
                "data_offsets": [offset, offset + out.nbytes],
            }
            offset += out.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    start = 8 + len(text)
    total = sum(_row_bytes(t) * math.prod(t.shape[:-1]) for t, _, _ in plan)
    done = 0
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.pwrite(fd, len(text).to_bytes(8, "little") + text, 0)
        for t, target, outs in plan:
            rows = 1
            for d in t.shape[:-1]:
                rows *= d
            step = max(1, _SLICE_BYTES // max(1, _row_bytes(t)))
            for r0 in range(0, rows, step):
                r1 = min(rows, r0 + step)
                result = quants.convert_rows(_rows(source, t, r0, r1), t.ggml_type, t.shape[-1])
                if isinstance(result, np.ndarray):
                    pieces = [float_fix(arch, target, result)]
                else:
                    pieces = [
                        quants.pack(result.q, quants.bits_of(t.ggml_type)),
                        _half(result.scales, t),
                        _half(result.biases, t),
                    ]
                for out, piece in zip(outs, pieces, strict=True):
                    at = start + out.offset + r0 * (out.nbytes // rows)
                    os.pwrite(fd, np.ascontiguousarray(piece, dtype=out.dtype).tobytes(), at)
                done += (r1 - r0) * _row_bytes(t)
                if progress is not None:
                    progress(done, total)
    finally:
        os.close(fd)


def _half(values: np.ndarray, t: TensorInfo) -> np.ndarray:
    half = values.astype("<f2")
    if not np.all(np.isfinite(half)):
        raise ModelError(f"GGUF tensor {t.name!r} has scales outside float16's range")
    return half


def _quantization(plan: list[tuple[TensorInfo, str, list[_Out]]]) -> dict[str, Any] | None:
    """MLX quantization config: the commonest bit width as default, others as per-layer overrides."""
    layers: dict[str, int] = {}
    for t, target, _ in plan:
        if t.ggml_type not in quants.FLOAT_TYPES:
            layers[target.rpartition(".")[0]] = quants.bits_of(t.ggml_type)
    if not layers:
        return None
    bits, _ = Counter(layers.values()).most_common(1)[0]
    quant: dict[str, Any] = {"group_size": quants.GROUP, "bits": bits}
    for prefix, b in sorted(layers.items()):
        if b != bits:
            quant[prefix] = {"group_size": quants.GROUP, "bits": b}
    return quant


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
