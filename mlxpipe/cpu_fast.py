"""CPU fast paths: faster stand-ins for the model's ``mx.fast`` layers when it computes on a CPU.

``mx.fast.rms_norm`` and ``mx.fast.rope`` have no CPU kernels in mlx: on a CPU each call runs a graph of
many small operations, and on a 135M model the per-operation cost is most of a decode step. The same
maths wrapped in ``mx.compile`` runs as one fused kernel. :func:`apply` swaps ``nn.RMSNorm`` and ``nn.RoPE``
instances for the subclasses below; nothing else changes (weights, parameters, the model's code).
Used by :mod:`mlxpipe.engine` only, and only on a CPU: on Metal and CUDA ``mx.fast`` has real kernels.
``MLXPIPE_CPU_FAST=off`` turns it off. Measurements: bench/RESULTS.md (issue 7).
"""

# ruff: noqa: E402  (blas.setup() has to run before the first import of mlx)
from __future__ import annotations

import math
import os
from collections import Counter
from collections.abc import Callable, Iterable
from functools import cache
from typing import Any

from . import blas

blas.setup()  # before mlx is first imported: it decides which BLAS mlx's matmuls bind to

import mlx.core as mx
from mlx.nn.layers.base import Module
from mlx.nn.layers.normalization import RMSNorm
from mlx.nn.layers.positional_encoding import RoPE

ENV = "MLXPIPE_CPU_FAST"
_OFF = {"off", "0", "no", "false", "none"}
KINDS = ("rms_norm", "rope")

# How often mx.compile traced each fast path (it retraces on new shapes only, never per position).
traces: Counter[str] = Counter()


def enabled() -> bool:
    """False when ``MLXPIPE_CPU_FAST`` turns the fast paths off."""
    return os.environ.get(ENV, "").strip().lower() not in _OFF


@cache
def _rms_norm(eps: float) -> Callable[[mx.array, mx.array], mx.array]:
    # One compiled function per eps (the constant is traced in); mx.compile retraces only on new shapes.
    def norm(x: mx.array, weight: mx.array) -> mx.array:
        traces["rms_norm"] += 1
        # As mx.fast.rms_norm: the mean of squares in float32, the result in x's dtype.
        n = mx.rsqrt(mx.mean(mx.square(x.astype(mx.float32)), axis=-1, keepdims=True) + eps)
        return weight * (x * n).astype(x.dtype)

    return mx.compile(norm)


class FastRMSNorm(RMSNorm):
    """``nn.RMSNorm`` computed by a compiled composition of plain ops instead of ``mx.fast.rms_norm``."""

    def __call__(self, x: mx.array) -> mx.array:
        return _rms_norm(self.eps)(x, self["weight"])


@cache
def _rope(dims: int, traditional: bool, scale: float) -> Callable[[mx.array, mx.array, mx.array], mx.array]:
    half = dims // 2

    def rope(x: mx.array, offset: mx.array, inv_freqs: mx.array) -> mx.array:
        traces["rope"] += 1
        # Positions (B or 1, 1, …, T, 1): offset is a scalar or one offset per row (mlx-lm's BatchKVCache).
        t = x.shape[-2]
        pos = offset.astype(mx.float32).reshape((-1,) + (1,) * (x.ndim - 1))
        pos = pos + mx.arange(t, dtype=mx.float32).reshape(t, 1)
        theta = (pos * scale) * inv_freqs  # in float32, as mx.fast.rope's composition: then cast to x's dtype
        cos, sin = mx.cos(theta).astype(x.dtype), mx.sin(theta).astype(x.dtype)
        if traditional:
            pairs = x[..., :dims].reshape(*x.shape[:-1], half, 2)
            x1, x2 = pairs[..., 0], pairs[..., 1]
            out = mx.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1).reshape(*x.shape[:-1], dims)
        else:
            x1, x2 = x[..., :half], x[..., half:dims]
            out = mx.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)
        if dims < x.shape[-1]:
            out = mx.concatenate([out, x[..., dims:]], axis=-1)
        return out

    return mx.compile(rope)


class FastRoPE(RoPE):
    """``nn.RoPE`` computed by a compiled composition of plain ops instead of ``mx.fast.rope``.

    The offset goes in as an array, so one compiled graph serves every position.
    """

    def __init__(self, dims: int, traditional: bool = False, base: float = 10000, scale: float = 1.0) -> None:
        super().__init__(dims, traditional=traditional, base=base, scale=scale)
        # As mx.fast.rope's own composition computes them; held outside parameters() (a private name).
        self._inv_freqs = mx.exp(
            mx.arange(0, -(dims // 2), -1, dtype=mx.float32) * (math.log(base) / (dims // 2))
        )

    def __call__(self, x: mx.array, offset: Any = 0) -> mx.array:
        pos = offset if isinstance(offset, mx.array) else mx.array(offset)
        return _rope(self.dims, self.traditional, self.scale)(x, pos, self._inv_freqs)


def apply(model: Any, kinds: Iterable[str] = KINDS) -> list[str]:
    """Swap ``model``'s exact ``nn.RMSNorm`` and ``nn.RoPE`` instances in place; the kinds swapped, sorted.

    ``kinds``: which of :data:`KINDS` to swap.

    Only those exact classes: subclasses and mlx-lm's other RoPE variants (scaled, yarn, …) compute
    something else and are left alone.
    """
    wanted, swapped = set(kinds), set()
    for name, module in list(model.named_modules()):
        new: Module | None = None
        if type(module) is RMSNorm and "rms_norm" in wanted:
            new = FastRMSNorm(module.weight.shape[0], eps=module.eps)
            new.weight = module.weight
            kind = "rms_norm"
        elif type(module) is RoPE and "rope" in wanted:
            new = FastRoPE(module.dims, module.traditional, module.base, module.scale)
            kind = "rope"
        if new is None or not name:
            continue
        _set_child(model, name, new)
        swapped.add(kind)
    return sorted(swapped)


def revert(model: Any) -> None:
    """Undo :func:`apply`: put plain ``nn.RMSNorm`` and ``nn.RoPE`` back (for side-by-side measurements)."""
    for name, module in list(model.named_modules()):
        if isinstance(module, FastRMSNorm):
            old: Module = RMSNorm(module.weight.shape[0], eps=module.eps)
            old.weight = module.weight
        elif isinstance(module, FastRoPE):
            old = RoPE(module.dims, module.traditional, module.base, module.scale)
        else:
            continue
        _set_child(model, name, old)


def _set_child(model: Any, name: str, new: Module) -> None:
    """Put ``new`` at the dotted path ``name`` (``model.layers.3.input_layernorm``) of ``model``."""
    *parents, last = name.split(".")
    parent = model
    for part in parents:
        parent = parent[int(part)] if isinstance(parent, list) else getattr(parent, part)
    if isinstance(parent, list):
        parent[int(last)] = new
    else:
        setattr(parent, last, new)
