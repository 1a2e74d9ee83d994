"""``--dtype``: the type the weights compute in, chosen per backend and free memory, applied in place."""

from __future__ import annotations

import contextlib
import json
import os
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.nn.layers.base import Module
from mlx.nn.layers.embedding import Embedding
from mlx.nn.layers.linear import Linear
from mlx.nn.layers.quantized import QuantizedEmbedding
from mlx.utils import tree_flatten, tree_unflatten

from ..cachefiles import check_file, publish_file, scratch
from ..cpu import blas, kernels
from ..cpu.quantized import QUANTIZED
from ..errors import ModelError
from ..interface import DTYPES

__all__ = [
    "DTYPES",
    "KeptFile",
    "accelerator",
    "apply_dtype",
    "choose_dtype",
    "dequantize_layers",
    "is_quantized",
]

_FLOATS = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


def accelerator() -> str | None:
    """The GPU backend mlx computes on by default (metal or cuda), or None on a CPU."""
    if mx.default_device() != mx.gpu:
        return None
    if mx.metal.is_available():
        return "metal"
    cuda = getattr(mx, "cuda", None)  # mlx.core.cuda exists only in newer mlx builds
    return "cuda" if cuda is not None and cuda.is_available() else "gpu"


def is_quantized(model: Any) -> bool:
    return any(isinstance(m, QUANTIZED) for _, m in model.named_modules())


def available_memory() -> int | None:
    """Bytes of memory free for the model: MemAvailable on Linux, else physical memory; None if unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None


def gpu_memory() -> int | None:
    """Bytes of GPU memory free for the model (CUDA's free memory, Metal's working set); None if unknown."""
    device_info = getattr(mx, "device_info", None)  # mlx.core.device_info exists only in newer mlx builds
    if device_info is None:
        return None
    try:
        info = device_info()
    except (RuntimeError, ValueError):
        return None
    for key in ("free_memory", "max_recommended_working_set_size", "memory_size", "total_memory"):
        value = info.get(key)
        if isinstance(value, int) and value > 0:
            return value
    return None


def half_dtype(model: Any) -> str:
    """The model's own 16-bit type: that of most of its 16-bit parameters (a GGUF's scales are float16, an
    mlx-community model's often bfloat16), else bfloat16. A tiny model answered worse in the other one."""
    counts: dict[str, int] = {}
    leaves: Any = tree_flatten(model.parameters())
    for _, v in leaves:
        if v.dtype in (mx.float16, mx.bfloat16):
            name = "float16" if v.dtype == mx.float16 else "bfloat16"
            counts[name] = counts.get(name, 0) + int(v.size)
    return max(counts, key=lambda k: counts[k]) if counts else "bfloat16"


def parameter_count(model: Any) -> int:
    """Logical weights in ``model``; a quantized layer counts the values it packs, not its uint32 words."""
    total = 0
    for _, m in model.named_modules():
        if isinstance(m, QUANTIZED):
            total += m.scales.size * m.group_size + (m.bias.size if "bias" in m else 0)
        elif not tree_flatten(m.children(), is_leaf=lambda x: isinstance(x, Module)):
            leaves: Any = tree_flatten(m.parameters())
            total += sum(int(v.size) for _, v in leaves)
    return total


def choose_dtype(model: Any, requested: str, batch: int = 1) -> tuple[str, str]:
    """The dtype to compute in for ``requested`` (one of :data:`DTYPES`), ``batch`` records at once; and why.

    ``auto``: on CUDA with ``batch`` > 1, the model's own 16-bit type (:func:`half_dtype`) when its 16-bit
    weights fit in half the free GPU memory (mlx's quantized matmuls cost grows with the batch there; 16-bit
    ones barely do). Otherwise on a GPU the
    quantized weights (as fast for one stream, 2-4x less memory). On a CPU a quantized model's own weights
    where mlxpipe's kernels run (:mod:`mlxpipe.cpu.kernels`), else float32 (mlx's quantized CPU kernels are
    slower and do not batch) when the float32 weights fit in half the free memory. Measurements:
    bench/RESULTS.md.
    """
    if requested not in DTYPES:
        raise ModelError(f"unknown dtype {requested!r} (choose from {', '.join(DTYPES)})")
    if requested != "auto":
        return requested, "asked for with --dtype"
    backend = accelerator()
    if backend == "cuda" and batch > 1:
        need = parameter_count(model) * 2
        free = gpu_memory()
        half = half_dtype(model)
        if free is not None and need > free // 2:
            gb = need / 1e9
            return "quantized", f"auto on cuda: {half} weights ({gb:.1f} GB) exceed half the free GPU memory"
        return half, f"auto on cuda with --batch: {half} weights (quantized matmuls do not batch there)"
    if backend is not None:
        return "quantized", f"auto on {backend}: quantized weights"
    if is_quantized(model) and kernels.available():
        return "quantized", "auto on cpu: the quantized weights, by mlxpipe's kernels (no float32 copy)"
    need = parameter_count(model) * 4
    free = available_memory()
    if free is not None and need > free // 2:
        return "quantized", f"auto on cpu: float32 weights ({need / 1e9:.1f} GB) exceed half the free memory"
    with_blas = "the reference BLAS" if blas.setup().reference else "an optimized BLAS"
    return "float32", f"auto on cpu: float32 weights with {with_blas} (faster than quantized kernels)"


def apply_dtype(
    model: Any,
    dtype: str,
    stored: KeptFile | Path | None = None,
    joined: Mapping[str, tuple[str, ...]] | None = None,
) -> Any:
    """Turn ``model`` into ``dtype`` in place: dequantize (as mlx-lm's ``dequantize_model``), then cast
    floating weights.

    ``quantized`` keeps the quantized layers; on a GPU a model with float32 parameters (a GGUF's norms, say)
    has its floating parameters cast to its own 16-bit type (:func:`half_dtype`) too, so that activations
    are not computed in float32.
    ``stored``: a file keeping the float32 dequantized matrices between runs (read when it exists, else
    written), for ``float32`` only; a :class:`KeptFile` may have begun reading it already.
    ``joined``: for ``float32``, matrices to make as one: ``module.attribute`` → the quantized layers whose
    weights become views of its rows, in order; the whole is set as that attribute of that module (and kept
    as one in ``stored``, so that later runs read it with no copy).
    """
    if dtype == "quantized":
        leaves: Any = tree_flatten(model.parameters())
        if accelerator() is not None and any(v.dtype == mx.float32 for _, v in leaves):
            model.set_dtype(_FLOATS[half_dtype(model)])
            mx.eval(model.parameters())
        return model
    if is_quantized(model):
        if dtype == "float32":
            # Dequantized in float32: scale * q + bias as the file has them, not rounded to the scales'
            # float16 (and so the same weights as the quantized one-row products of mlxpipe.cpu.gemv).
            for _, m in model.named_modules():
                if isinstance(m, QUANTIZED):
                    m.update({k: m[k].astype(mx.float32) for k in ("scales", "biases") if k in m})
        model = dequantize(model, stored, joined) if dtype == "float32" else dequantize(model)
    model.set_dtype(_FLOATS[dtype])
    mx.eval(model.parameters())
    return model


# Float32 matrices kept in the cache only up to this size: reading them back costs a tenth of computing them
# (bench/RESULTS.md, ``r-derived``), but each is ~8x the quantized file on disk.
STORED_MAX_BYTES = 2 << 30
STORED_VERSION = "v2"  # part of the kept file's name: bump it when the file holds other numbers or layout


def dequantize(
    model: Any, stored: KeptFile | Path | None = None, joined: Mapping[str, tuple[str, ...]] | None = None
) -> Any:
    """Replace ``model``'s quantized linear and embedding layers by float ones, in place (what mlx-lm's
    ``dequantize_model`` does, without importing mlx-lm's loader); other quantized kinds go to mlx-lm's.

    With ``stored``, the dequantized matrices are read from that file when it holds them all (the same
    numbers: ``mx.dequantize`` of the same inputs), else computed and written there for the next run.
    ``joined`` as :func:`apply_dtype` has it.
    """
    layers = [(n, m) for n, m in model.named_modules() if isinstance(m, QUANTIZED)]
    if any("scales" in m and not isinstance(m, QUANTIZED) for _, m in model.named_modules()):
        from mlx_lm.utils import dequantize_model  # MoE's switch layers, among others: mlx-lm knows them

        return dequantize_model(model)
    if not layers:
        return model
    shapes = {n: _shape(m) for n, m in layers}
    joined = {k: v for k, v in (joined or {}).items() if all(n in shapes for n in v)}
    kept_file = KeptFile(stored) if isinstance(stored, Path) else stored
    found = _read(kept_file, shapes)
    weights, wholes, kept = found or ({}, {}, {})
    if found is None:
        weights = {
            n: mx.dequantize(m.weight, m.scales, m.get("biases"), m.group_size, m.bits, m.mode)
            for n, m in layers
        }
    missing = {k: v for k, v in joined.items() if k not in wholes}
    for key, names in missing.items():
        wholes[key] = mx.concatenate([weights[n] for n in names], axis=0)
        weights.update(_rows(wholes[key], names, shapes))
    model.update_modules(tree_unflatten([(name, _float_layer(m, weights[name])) for name, m in layers]))
    modules = dict(model.named_modules())
    for key in joined:
        owner, _, attribute = key.rpartition(".")
        object.__setattr__(modules[owner], attribute, wholes[key])  # outside the module's parameters
    if kept_file is not None and (found is None or missing):
        mx.eval(list(weights.values()), list(wholes.values()))
        _write(kept_file.path, weights, wholes, {**kept, **joined})
    return model


def dequantize_layers(model: Any, names: list[str]) -> None:
    """Replace the quantized layers ``names`` of ``model`` by float32 ones, in place."""
    modules = dict(model.named_modules())
    new = []
    for name in names:
        m = modules[name]
        weight = mx.dequantize(m.weight, m.scales, m.get("biases"), m.group_size, m.bits, m.mode)
        new.append((name, _float_layer(m, weight)))
    model.update_modules(tree_unflatten(new))
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())


def _float_layer(quantized: Any, weight: Any) -> Module:
    """The float layer of ``weight``, for the quantized layer it was dequantized from (its bias kept)."""
    if isinstance(quantized, QuantizedEmbedding):
        layer: Module = Embedding(*weight.shape)
    else:
        layer = Linear(weight.shape[1], weight.shape[0], bias="bias" in quantized)
        if "bias" in quantized:
            layer.bias = quantized.bias
    layer.weight = weight
    return layer


def _rows(whole: Any, names: tuple[str, ...], shapes: Mapping[str, tuple[int, int]]) -> dict[str, Any]:
    """Each of ``names``' matrix as a view of its rows of ``whole``."""
    views, start = {}, 0
    for name in names:
        views[name] = whole[start : start + shapes[name][0]]
        start += shapes[name][0]
    return views


def _shape(m: Any) -> tuple[int, int]:
    rows, packed = m.weight.shape
    return rows, packed * 32 // m.bits


_JOINED = "mlxpipe.joined"  # the kept file's metadata: which of its matrices are others' rows, as JSON


class KeptFile:
    """The file of float32 matrices :func:`apply_dtype` keeps, read on a thread from the moment this is made
    when it exists: mlx releases the GIL while it reads, so building the model and parsing the tokenizer go
    on meanwhile (mlx evaluates on several threads since 0.31.2)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._loaded: tuple[dict[str, Any], dict[str, str]] | None = None
        self._thread: threading.Thread | None = None
        if check_file(path) is None:  # whole: its size, mtime and ends as its manifest says
            self._thread = threading.Thread(target=self._read, name="weights", daemon=True)
            self._thread.start()

    def _read(self) -> None:
        with contextlib.suppress(RuntimeError, ValueError, OSError):  # damaged: made again and rewritten
            loaded: Any = mx.load(str(self.path), return_metadata=True)
            mx.eval(list(loaded[0].values()))
            self._loaded = loaded

    def loaded(self) -> tuple[dict[str, Any], dict[str, str]] | None:
        """The file's arrays (evaluated) and metadata; None when it does not exist or cannot be read."""
        if self._thread is not None:
            self._thread.join()
        return self._loaded


def _read(
    kept: KeptFile | None, shapes: Mapping[str, tuple[int, int]]
) -> tuple[dict[str, Any], dict[str, Any], dict[str, tuple[str, ...]]] | None:
    """The float32 matrices ``kept`` holds when they are exactly ``shapes``: each layer's (views of a joined
    whole's rows where it was kept joined), the joined wholes, their parts' names; None otherwise."""
    loaded = kept.loaded() if kept is not None else None
    if loaded is None:
        return None
    arrays, metadata = loaded
    try:
        joins = {k: tuple(v) for k, v in json.loads(metadata.get(_JOINED, "{}")).items()}
        weights = {n: w for n, w in arrays.items() if n not in joins}
        wholes = {k: arrays[k] for k in joins}
        for key, names in joins.items():
            if any(n not in shapes or n in weights for n in names):
                return None
            weights.update(_rows(wholes[key], names, shapes))
    except (ValueError, KeyError, TypeError, AttributeError):  # damaged: made again and rewritten
        return None
    if {n: tuple(w.shape) for n, w in weights.items()} != dict(shapes) or any(
        w.dtype != mx.float32 for w in arrays.values()
    ):
        return None
    return weights, wholes, joins


def _write(
    path: Path, weights: dict[str, Any], wholes: dict[str, Any], joins: Mapping[str, tuple[str, ...]]
) -> None:
    """Keep ``weights`` at ``path`` (atomically), each of ``joins`` as its whole from ``wholes`` instead of
    its parts; a cache that cannot be written is only slower next time."""
    parts = {n for names in joins.values() for n in names}
    arrays = {n: w for n, w in weights.items() if n not in parts} | {k: wholes[k] for k in joins}
    if sum(int(w.nbytes) for w in arrays.values()) > STORED_MAX_BYTES:
        return
    try:
        with scratch(path.parent) as room:
            tmp = room / path.name
            mx.save_safetensors(str(tmp), arrays, metadata={_JOINED: json.dumps(dict(joins))})
            publish_file(tmp, path, {"version": STORED_VERSION}, whole=False)  # 540 MB: not hashed whole
    except (OSError, RuntimeError, ValueError):
        pass
