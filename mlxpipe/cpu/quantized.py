"""Attaching a model's quantized weights to the one-row kernels of :mod:`.gemv`.

On a CPU the engine computes from float32 weights dequantized from the file's 4/8-bit ones; a single stream's
one-row products can still read the quantized bytes (5-8x fewer), which the dequantizing would otherwise drop.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import mlx.core as mx
from mlx.nn.layers.quantized import QuantizedEmbedding, QuantizedLinear

from . import gemv

__all__ = ["QUANTIZED", "attach", "forms"]

QUANTIZED = (QuantizedLinear, QuantizedEmbedding)


def forms(model: Any) -> dict[str, tuple[Any, ...]]:
    """Each affine-quantized layer's (packed weight, float32 scales, float32 biases, bits, group size).

    Casts the layers' scales and biases to float32 in place: the engine dequantizes from those (its own cast
    is then free: the same dtype gives the same array).
    """
    found = {}
    for name, m in model.named_modules():
        if isinstance(m, QUANTIZED) and getattr(m, "mode", "affine") == "affine" and "biases" in m:
            m.update({k: m[k].astype(mx.float32) for k in ("scales", "biases")})
            found[name] = (m.weight, m["scales"], m["biases"], m.bits, m.group_size)
    mx.eval([f[:3] for f in found.values()])
    return found


def attach(
    owner: object, model: Any, quantized: dict[str, tuple[Any, ...]], streams: Callable[[], tuple[Any, ...]]
) -> int:
    """Attach each dequantized float32 matrix of ``model`` to its quantized form; how many were.

    They stay registered for as long as ``owner`` lives; on release the mlx streams ``streams()`` returns are
    waited for first (mlx computes a step ahead, maybe on these very matrices).
    """
    modules = dict(model.named_modules())
    attached = []
    for name, (q, scales, biases, bits, group_size) in quantized.items():
        weight = getattr(modules.get(name), "weight", None)
        usable = weight is not None and weight.dtype == mx.float32 and weight.ndim == 2
        if usable and gemv.attach(weight, q, scales, biases, bits, group_size):
            attached.append(weight)
    if attached:
        weakref.finalize(owner, gemv.detach, attached, lambda: _settle(streams))
    return len(attached)


def _settle(streams: Callable[[], tuple[Any, ...]]) -> None:
    """Wait for the work mlx has queued on the default stream and ``streams()``."""
    mx.synchronize()
    for stream in streams():
        mx.synchronize(stream)
