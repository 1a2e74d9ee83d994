"""A model's quantized layers on a CPU, computed by mlxpipe's kernels.

:func:`to_kernels` (the default where :mod:`.kernels` runs): every quantized linear and embedding layer
computes its products from the kernels' packed copy of its matrix (a linear layer's only copy; an embedding
keeps its arrays for the lookup); each layer is read lazily, registered, packed (or adopted from a kept
:class:`.kernels.PackedFile`) and its arrays let go; a fused projection's parts
(q/k/v, gate/up) compute as rows of one matrix. :func:`attach` (``--dtype float32``): float32 weights
dequantized from the file, whose one-row products still read the quantized bytes.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from functools import partial
from typing import Any

import mlx.core as mx
from mlx.nn.layers.quantized import QuantizedEmbedding, QuantizedLinear

from . import gemv, kernels

__all__ = [
    "FUSED",
    "MATRIX",
    "QUANTIZED",
    "KernelEmbedding",
    "KernelLinear",
    "attach",
    "forms",
    "fuse",
    "joinable",
    "settle",
    "to_kernels",
]

QUANTIZED = (QuantizedLinear, QuantizedEmbedding)


def forms(model: Any, cast: bool = True) -> dict[str, tuple[Any, ...]]:
    """Each affine-quantized layer's (packed weight, float32 scales, float32 biases, bits, group size).

    Casts the layers' scales and biases to float32 in place: the engine dequantizes from those (its own cast
    is then free: the same dtype gives the same array). Without ``cast``, they are as the layer has them.
    """
    found = {}
    for name, m in model.named_modules():
        if isinstance(m, QUANTIZED) and getattr(m, "mode", "affine") == "affine" and "biases" in m:
            if cast:
                m.update({k: m[k].astype(mx.float32) for k in ("scales", "biases")})
            found[name] = (m.weight, m["scales"], m["biases"], m.bits, m.group_size)
    if cast:
        mx.eval([f[:3] for f in found.values()])
    return found


# Attribute of a module whose projections were fused: their concatenated float32 matrix (outside the module's
# parameters), which :mod:`.layers` multiplies by once instead of by each part.
FUSED = "_fused"


def joinable(
    model: Any, quantized: dict[str, tuple[Any, ...]], groups: dict[type, tuple[str, ...]]
) -> dict[str, tuple[str, ...]]:
    """The projections ``groups`` names (per module class) that :func:`fuse` can join: ``module._fused`` →
    the layer names of its parts, for :func:`mlxpipe.engine.dtype.apply_dtype` to dequantize as one matrix.

    A module qualifies when its named children all have quantized forms alike (bits, group size, input width)
    and no bias.
    """
    found = {}
    for name, module in model.named_modules():
        children = groups.get(type(module))
        if not children:
            continue
        parts = [getattr(module, child, None) for child in children]
        kinds = [quantized.get(f"{name}.{child}") for child in children]
        if any(f is None for f in kinds) or any(p is None or "bias" in p for p in parts):
            continue
        if len({(f[3], f[4], f[0].shape[1] * 32 // f[3]) for f in kinds}) != 1:  # type: ignore[index]
            continue
        found[f"{name}.{FUSED}"] = tuple(f"{name}.{child}" for child in children)
    return found


def fuse(model: Any, quantized: dict[str, tuple[Any, ...]], joined: dict[str, tuple[str, ...]]) -> int:
    """Multiply by the projections :func:`joinable` found as one float32 matrix each; how many were.

    The module gets the rows of its parts' weights as one matrix (:data:`FUSED`): the one dequantizing made
    (its parts' weights are views of its rows, nothing is stored twice), or else their concatenation.
    ``quantized`` gains the fused matrix's form (with the matrix, for :func:`attach`). Each output's sum is
    the one its part's kernel computes: the numbers do not change, there are fewer products a step.
    """
    modules = dict(model.named_modules())
    fused, made = 0, []
    for key, names in joined.items():
        owner = modules.get(key.rpartition(".")[0])
        parts = [modules.get(n) for n in names]
        weights: list[Any] = [getattr(p, "weight", None) for p in parts]
        if owner is None or any(w is None or w.dtype != mx.float32 or w.ndim != 2 for w in weights):
            continue
        whole = owner.__dict__.get(FUSED)
        if whole is None:
            whole = mx.concatenate(weights, axis=0)
            start = 0
            for part, w in zip(parts, weights, strict=True):
                part.weight = whole[start : start + w.shape[0]]  # type: ignore[union-attr]  # a view of its rows
                start += w.shape[0]
            object.__setattr__(owner, FUSED, whole)
        forms = [quantized[n] for n in names]
        packed = [mx.concatenate([f[i] for f in forms], axis=0) for i in range(3)]
        quantized[key] = (*packed, *forms[0][3:5], whole)
        made += [*packed, *(p.weight for p in parts)]  # type: ignore[union-attr]
        fused += 1
    mx.eval(made)
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
        weakref.finalize(owner, gemv.detach, attached, lambda: settle(streams))
    return len(attached)


def settle(streams: Callable[[], tuple[Any, ...]]) -> None:
    """Wait for the work mlx has queued on the default stream and ``streams()``."""
    mx.synchronize()
    for stream in streams():
        mx.synchronize(stream)


# Attribute of a layer (or of a module whose projections were fused) computed by mlxpipe's kernels: its
# kernels.Matrix, outside the module's parameters.
MATRIX = "_matrix"


def _placeholder(array: mx.array) -> mx.array:
    """An array of ``array``'s shape and dtype that takes no memory (one zero, broadcast): what a layer keeps
    of a matrix whose kernels' packed copy is the only one."""
    return mx.broadcast_to(mx.zeros((1,) * array.ndim, dtype=array.dtype), array.shape)


def _kernel_linear_call(self: Any, x: mx.array) -> mx.array:
    out = kernels.product(x, self.__dict__[MATRIX])
    return out + self["bias"] if "bias" in self else out


def _kernel_as_linear(self: Any, x: mx.array) -> mx.array:
    return kernels.product(x, self.__dict__[MATRIX])


KernelLinear = type(
    "KernelLinear",
    (QuantizedLinear,),
    {"__call__": _kernel_linear_call, "__doc__": "A quantized linear layer computed by mlxpipe's kernels."},
)
KernelEmbedding = type(
    "KernelEmbedding",
    (QuantizedEmbedding,),
    {"as_linear": _kernel_as_linear, "__doc__": "A quantized embedding whose tied output layer "
     "(``as_linear``) is computed by mlxpipe's kernels; its lookups stay mlx's."},
)  # fmt: skip


def to_kernels(
    model: Any,
    groups: dict[type, tuple[str, ...]],
    fuse_groups: bool = True,
    kept: kernels.PackedFile | None = None,
) -> tuple[list[Any], list[str]]:
    """Compute ``model``'s quantized layers by mlxpipe's kernels (:mod:`.kernels`), in place, from their
    quantized weights alone: the registered matrices, and the layers the kernels do not take (left as
    mlx's quantized layers, for the caller to dequantize).

    With ``fuse_groups``, the projections ``groups`` names per module class (q, k and v; gate and up) become
    one matrix (:data:`FUSED` holds its :class:`.kernels.Matrix`); each part computes as its rows of it
    (:class:`.kernels.Part`). ``kept``: the packed copies of an earlier run, adopted instead of read and
    packed again; those packed now are written there. Floating parameters become float32 (the kernels'
    products are float32).
    """
    found = forms(model, cast=False)  # read a layer at a time as each is registered: less memory at once
    modules = dict(model.named_modules())
    matrices, refused = [], []
    # Where the integer products run, each matrix's packed copy (made now) is its only one: the layer keeps
    # placeholders of its arrays' shapes (an embedding keeps its arrays: mlx looks its rows up).
    lean = gemv.int8_activations() > 0
    for key, names in (joinable(model, found, groups) if fuse_groups else {}).items():
        matrix = _fused_to_kernels(key, names, found, modules, kept, lean)
        if matrix is not None:  # (else its parts are tried alone, below)
            matrices.append(matrix)
        mx.clear_cache()  # what was let go, for the next packed copies (malloc's)
    for name in list(found):
        matrix = _layer_to_kernels(name, found.pop(name), modules[name], kept, lean)
        if matrix is None:
            refused.append(name)
        else:
            matrices.append(matrix)
        mx.clear_cache()
    if kept is not None:
        kept.write()
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    mx.clear_cache()  # the source arrays let go: back to the system, not kept in mlx's cache
    return matrices, refused


def _matrix_of(
    name: str, arrays: Callable[[], list[Any]], form: list[int], kept: kernels.PackedFile | None, lean: bool
) -> kernels.Matrix | None:
    """The matrix ``name`` (``form``: rows, columns, bits, group size) adopted from ``kept``, or else
    registered from ``arrays()`` (and kept there for the next run, where its packed copy is its only one)."""
    matrix = kept.adopt(name, form) if kept is not None else None
    if matrix is None:
        q, scales, biases = arrays()
        matrix = kernels.Matrix.register(q, scales, biases, form[2], form[3])
        if matrix is not None and kept is not None and lean:
            kept.remember(name, matrix, form)
    return matrix


def _fused_to_kernels(
    key: str,
    names: tuple[str, ...],
    found: dict[str, tuple[Any, ...]],
    modules: dict[str, Any],
    kept: kernels.PackedFile | None,
    lean: bool,
) -> kernels.Matrix | None:
    """The layers ``names`` computed as the rows of one registered matrix (``key``: its owner's
    :data:`FUSED`); their forms leave ``found``. None where the kernels do not take it (``found`` kept)."""
    parts = [found[n] for n in names]
    bits, group = parts[0][3], parts[0][4]
    rows = sum(int(f[0].shape[0]) for f in parts)

    def joined() -> list[Any]:
        whole = [mx.concatenate([f[i] for f in parts], axis=0) for i in range(3)]
        mx.eval(whole)
        return whole

    matrix = _matrix_of(key, joined, [rows, int(parts[0][0].shape[1]) * 32 // bits, bits, group], kept, lean)
    if matrix is None:
        return None
    only = lean and (matrix.arrays == () or matrix.pack_only())
    start = 0
    for name, form in zip(names, parts, strict=True):  # the parts' arrays: views of the whole's rows
        stop = start + form[0].shape[0]
        arrays = [_placeholder(a) for a in form[:3]] if only else [w[start:stop] for w in matrix.arrays]
        modules[name].update(dict(zip(("weight", "scales", "biases"), arrays, strict=True)))
        object.__setattr__(modules[name], MATRIX, kernels.Part(matrix, start, stop))
        modules[name].__class__ = KernelLinear
        del found[name]
        start = stop
    object.__setattr__(modules[key.rpartition(".")[0]], FUSED, matrix)
    return matrix


def _layer_to_kernels(
    name: str, form: tuple[Any, ...], module: Any, kept: kernels.PackedFile | None, lean: bool
) -> kernels.Matrix | None:
    """Layer ``name`` (``module``, its ``form``) computed by its registered matrix; None where the kernels do
    not take it."""
    q, scales, biases, bits, group_size = form
    source = [q, scales, biases]
    cols = int(q.shape[1]) * 32 // bits
    matrix = _matrix_of(name, partial(list, source), [int(q.shape[0]), cols, bits, group_size], kept, lean)
    if matrix is None:
        return None
    embedding = isinstance(module, QuantizedEmbedding)
    if embedding or not lean:  # the layer and the kernels read the same arrays where both keep them
        if matrix.arrays:
            module.update(dict(zip(("weight", "scales", "biases"), matrix.arrays, strict=True)))
    elif matrix.arrays == () or matrix.pack_only():
        module.update({k: _placeholder(module[k]) for k in ("weight", "scales", "biases")})
    object.__setattr__(module, MATRIX, matrix)
    module.__class__ = KernelEmbedding if embedding else KernelLinear
    return matrix
