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

__all__ = ["FUSED", "QUANTIZED", "attach", "forms", "fuse"]

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


# Attribute of a module whose projections were fused: their concatenated float32 matrix (outside the module's
# parameters), which :mod:`.layers` multiplies by once instead of by each part.
FUSED = "_fused"


def fuse(model: Any, quantized: dict[str, tuple[Any, ...]], groups: dict[type, tuple[str, ...]]) -> int:
    """Concatenate the projections ``groups`` names (per module class) into one matrix each; how many were.

    A module of a class in ``groups`` whose named children all have quantized forms alike (bits, group size,
    input width) and float32 weights without a bias gets the rows of their weights as one float32 matrix
    (:data:`FUSED`); each child's weight becomes a view of its rows, so nothing is stored twice, and
    ``quantized`` gains the fused matrix's form (with the matrix, for :func:`attach`). Each output's sum is
    the one its part's kernel computes: the numbers do not change, there are fewer products a step.
    """
    fused = 0
    for name, module in model.named_modules():
        children = groups.get(type(module))
        if not children:
            continue
        parts: list[Any] = [getattr(module, child, None) for child in children]
        forms = [quantized.get(f"{name}.{child}") for child in children]
        if any(f is None for f in forms) or any(p is None or "bias" in p for p in parts):
            continue
        weights = [p.weight for p in parts]
        if any(w.dtype != mx.float32 or w.ndim != 2 or w.shape[1] != weights[0].shape[1] for w in weights):
            continue
        if len({(f[3], f[4]) for f in forms}) != 1:  # type: ignore[index]
            continue
        whole = mx.concatenate(weights, axis=0)
        packed = [mx.concatenate([f[i] for f in forms], axis=0) for i in range(3)]  # type: ignore[index]
        mx.eval(whole, packed)
        start = 0
        for part, w in zip(parts, weights, strict=True):
            part.weight = whole[start : start + w.shape[0]]  # a view: the rows of the fused matrix
            start += w.shape[0]
        mx.eval([p.weight for p in parts])
        object.__setattr__(module, FUSED, whole)
        quantized[f"{name}.{FUSED}"] = (*packed, *forms[0][3:5], whole)  # type: ignore[index]
        fused += 1
    return fused


def attach(
    owner: object, model: Any, quantized: dict[str, tuple[Any, ...]], streams: Callable[[], tuple[Any, ...]]
) -> int:
    """Attach each dequantized float32 matrix of ``model`` to its quantized form; how many were.

    They stay registered for as long as ``owner`` lives; on release the mlx streams ``streams()`` returns are
    waited for first (mlx computes a step ahead, maybe on these very matrices).
    """
    modules = dict(model.named_modules())
    attached = []
    for name, (q, scales, biases, bits, group_size, *whole) in quantized.items():
        # a fused matrix (fuse) comes with its form; a layer's is its weight
        weight = whole[0] if whole else getattr(modules.get(name), "weight", None)
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
