"""CPU fast paths: faster stand-ins for the model's ``mx.fast`` layers when it computes on a CPU.

``mx.fast.rms_norm`` and ``mx.fast.rope`` have no CPU kernels in mlx: on a CPU each call runs a graph of
many small operations, and on a 135M model the per-operation cost is most of a decode step. The same
maths wrapped in ``mx.compile`` runs as one fused kernel. :func:`apply` swaps ``nn.RMSNorm`` and ``nn.RoPE``
instances for the subclasses below; nothing else changes (weights, parameters, the model's code).
The MLP's SwiGLU is the one swap that is not bit for bit: mlx's CPU ``exp`` (inside its sigmoid) costs
~9 ns a value, a quarter of a ``--batch 128`` decode step; a rational approximation, within float32
rounding of exact maths (2.5e-7, mlx's own 1.4e-7), takes less than half the time.
Attention (mlx-lm's Llama ``Attention``, registered by the engine) computes its scores and its softmax times
the values in gemv.c's kernels instead of mx.fast's CPU fallback, whose scalar exp cost a quarter of a
``--batch 64`` step; each score summed in one order, so a record's numbers do not depend on its batch.
Decoder layers hand their output to mlx as soon as Python has built it (``eval_per_layer``): mlx computes
layer i while Python builds layer i + 1, where one evaluation per token left the CPU idle while Python built
the whole step (numbers unchanged, only when they are computed). Linear layers (and a tied output layer)
multiply by their weight's transpose made once, not by a new transpose operation each call (``linear``: a
tenth of a decode step's operations, the same products). Where :func:`.quantized.fuse` concatenated an
attention's q, k and v projections (or an MLP's gate and up), one product by the whole replaces the parts'
(``fused``: the same sums, a quarter fewer products and operations a step). :func:`argmax` is a greedy
step's pick over the vocabulary, by gemv.c (the engine's, on a CPU).
Used by :mod:`mlxpipe.engine` only, and only on a CPU: on Metal and CUDA ``mx.fast`` has real kernels.
``MLXPIPE_CPU_FAST=off`` turns it off. Measurements: bench/RESULTS.md (the CPU paths, one at a time).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable
from functools import cache, partial
from typing import Any

import mlx.core as mx
from mlx.nn.layers.base import Module
from mlx.nn.layers.embedding import Embedding
from mlx.nn.layers.linear import Linear
from mlx.nn.layers.normalization import RMSNorm
from mlx.nn.layers.positional_encoding import RoPE

from ..switches import turned_off
from . import gemv, kernels
from .quantized import FUSED

ENV = "MLXPIPE_CPU_FAST"
KINDS = ("rms_norm", "rope", "swiglu", "attention", "eval_per_layer", "linear", "fused")

# How often mx.compile traced each fast path (it retraces on new shapes only, never per position).
traces: Counter[str] = Counter()


def enabled() -> bool:
    """False when ``MLXPIPE_CPU_FAST`` turns the fast paths off."""
    return not turned_off(ENV)


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
    """``nn.RMSNorm`` computed by a compiled composition of plain ops instead of ``mx.fast.rms_norm`` for a
    few rows (a single stream's step); from ``FAST_ROWS`` rows on mlx's own is the faster (same numbers)."""

    FAST_ROWS = 16

    def __call__(self, x: mx.array) -> mx.array:
        if x.size >= self.FAST_ROWS * x.shape[-1]:
            return mx.fast.rms_norm(x, self["weight"], self.eps)
        return _rms_norm(self.eps)(x, self["weight"])


class _Angles:
    """The cos and sin of RoPE's rotation angles for positions 0, 1, …, kept and grown as positions come.

    Laid out for :func:`_rotate_fn`: ``cos`` spread over each rotated pair, ``sin`` signed for its partner.
    Every layer's RoPE of one configuration shares one table, and one slice of it per step.
    """

    def __init__(self, dims: int, traditional: bool, base: float, scale: float) -> None:
        half = dims // 2
        self.scale = scale
        # As mx.fast.rope's own composition computes them.
        self.inv_freqs = mx.exp(mx.arange(0, -half, -1, dtype=mx.float32) * (math.log(base) / half))
        # Element i turns with its partner: pairs (2k, 2k + 1) when traditional, else halves.
        first = [i % 2 == 0 if traditional else i < half for i in range(dims)]
        self.order = mx.array([k // 2 if traditional else k % half for k in range(dims)])
        self.sign = mx.array([-1.0 if f else 1.0 for f in first], dtype=mx.float32)
        self.cos = self.sin = mx.zeros((0, dims), dtype=mx.float32)
        self.last: tuple[int, int, mx.array, mx.array] | None = None
        self.last_rows: tuple[object, tuple[int, int], mx.array, mx.array] | None = None

    def spread(self, positions: mx.array) -> tuple[mx.array, mx.array]:
        """cos and sin laid out for :func:`_rotate_fn` at ``positions`` (float32; adds a last axis)."""
        theta = (positions[..., None] * self.scale) * self.inv_freqs  # float32, as mx.fast.rope
        theta = mx.take(theta, self.order, axis=-1)
        return mx.cos(theta), mx.sin(theta) * self.sign

    def grow(self, bound: int) -> None:
        """Make the table hold positions 0 to ``bound`` - 1."""
        if bound > self.cos.shape[0]:
            size = max(2 * self.cos.shape[0], bound, 256)
            self.cos, self.sin = self.spread(mx.arange(size, dtype=mx.float32))

    def rows(
        self, offsets: mx.array, count: int, bound: int, ndim: int, same: object = None
    ) -> tuple[mx.array, mx.array]:
        """Rows ``offsets[b]`` to ``offsets[b] + count`` of the table for each b (positions below ``bound``;
        negative ones read row 0), shaped for ``ndim``-dimensional inputs; the last result again for the same
        offsets array (a layer's queries, then its keys), or for the same ``same`` (not None: offsets of the
        same values, as every layer's KV cache has in one step)."""
        key = offsets if same is None else same
        if self.last_rows is not None and self.last_rows[0] is key and self.last_rows[1] == (count, ndim):
            return self.last_rows[2], self.last_rows[3]
        self.grow(bound)
        rows = mx.maximum(offsets.reshape(-1, 1) + mx.arange(count), 0)
        shape = (-1,) + (1,) * (ndim - 3) + (count, self.cos.shape[-1])
        cos, sin = (mx.take(table, rows, axis=0).reshape(shape) for table in (self.cos, self.sin))
        self.last_rows = (key, (count, ndim), cos, sin)  # holds the key: its id stays its own
        return cos, sin

    def at(self, offset: int, count: int) -> tuple[mx.array, mx.array]:
        """Rows ``offset`` to ``offset + count`` of the table, growing it when they are new."""
        if self.last is not None and self.last[:2] == (offset, count):
            return self.last[2], self.last[3]
        self.grow(offset + count)
        cos, sin = self.cos[offset : offset + count], self.sin[offset : offset + count]
        self.last = (offset, count, cos, sin)
        return cos, sin


@cache
def _angles(dims: int, traditional: bool, base: float, scale: float) -> _Angles:
    return _Angles(dims, traditional, base, scale)


def _rotate_fn(traditional: bool, x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    # x1 * cos - x2 * sin and x1 * sin + x2 * cos for every pair at once: x2 * -sin is -(x2 * sin) exactly.
    # Each element's partner (its neighbour when traditional, else across the halves) is read through a view
    # of x with the pairs or the halves reversed: no gather (mlx's CPU gather was ~8% of the operations of a
    # --batch 64 step besides its products), no copy.
    traces["rope"] += 1
    dims = cos.shape[-1]
    rot = x[..., :dims] if dims < x.shape[-1] else x
    split = (dims // 2, 2) if traditional else (2, dims // 2)
    r, c, s = (a.reshape(*a.shape[:-1], *split) for a in (rot, cos.astype(x.dtype), sin.astype(x.dtype)))
    partner = r[..., ::-1] if traditional else r[..., ::-1, :]
    out = (r * c + partner * s).reshape(rot.shape)
    return mx.concatenate([out, x[..., dims:]], axis=-1) if dims < x.shape[-1] else out


_rotate_pairs = mx.compile(partial(_rotate_fn, True))
_rotate_halves = mx.compile(partial(_rotate_fn, False))


class FastRoPE(RoPE):
    """``nn.RoPE`` computed from a table of cos and sin by one gather and one fused kernel, instead of
    ``mx.fast.rope``'s composition (eighteen operations a call on a CPU).

    An integer offset (one stream's KV cache) reads the table; an array offset (mlx-lm's ``BatchKVCache``:
    one per row) gathers its rows from it when ``bound`` says that no position reaches it (negative ones,
    left padding that no query sees, read row 0), else computes its angles. The same numbers either way, and
    no retrace per position. ``same``: offsets passed with the same object (not None) have the same values,
    and their rows are gathered once (:data:`SAME_POSITIONS`).
    """

    def __call__(
        self, x: mx.array, offset: Any = 0, bound: int | None = None, same: object = None
    ) -> mx.array:
        angles = _angles(self.dims, self.traditional, self.base, self.scale)
        t = x.shape[-2]
        if isinstance(offset, int):
            cos, sin = angles.at(offset, t)
        elif bound is not None:  # a gather instead of 2 x B x dims cos and sin (~20 ns each on a CPU)
            cos, sin = angles.rows(offset, t, bound, x.ndim, same)
        else:  # positions (B or 1, 1, …, T): one offset per row, or one for all
            pos = offset.astype(mx.float32).reshape((-1,) + (1,) * (x.ndim - 2))
            cos, sin = angles.spread(pos + mx.arange(t, dtype=mx.float32))
        return (_rotate_pairs if self.traditional else _rotate_halves)(x, cos, sin)


# tanh(x) on |x| <= 7.905 (beyond it tanh rounds to +-1 in float32) as an odd 13/6 rational function: the
# minimax fit Eigen uses for float32 (max error a few ulp), made of multiply-adds and one division only.
_TANH_P = (4.89352455891786e-03, 6.37261928875436e-04, 1.48572235717979e-05, 5.12229709037114e-08,
           -8.60467152213735e-11, 2.00018790482477e-13, -2.76076847742355e-16)  # fmt: skip
_TANH_Q = (4.89352518554385e-03, 2.26843463243900e-03, 1.18534705686654e-04, 1.19825839466702e-06)
_TANH_CLAMP = 7.90531110763549805


def _swiglu_fast(gate: mx.array, x: mx.array) -> mx.array:
    """``silu(gate) * x``, with sigmoid(g) = (1 + tanh(g / 2)) / 2 and tanh as the rational function above.

    The sigmoid in float32 whatever the inputs' dtype, then as ``nn.silu``: ``gate * sigmoid(gate) * x``.
    """
    t = mx.clip(0.5 * gate.astype(mx.float32), -_TANH_CLAMP, _TANH_CLAMP)
    t2 = t * t
    p = t2 * _TANH_P[6] + _TANH_P[5]
    for c in _TANH_P[4::-1]:
        p = p * t2 + c
    q = ((t2 * _TANH_Q[3] + _TANH_Q[2]) * t2 + _TANH_Q[1]) * t2 + _TANH_Q[0]
    return gate * (0.5 + 0.5 * (p * t) / q).astype(gate.dtype) * x


# Not shapeless: traced per shape (well under a millisecond each), mlx fuses the chain into 3 kernels, not 5.
swiglu = mx.compile(_swiglu_fast)


_LOWEST = float(mx.finfo(mx.float32).min)  # mx.fast's masked score (a row masked whole weighs all alike)


def attention(queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Any) -> mx.array:
    """``mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)`` in float32 on a
    CPU where :func:`mlxpipe.cpu.gemv.attention_available`.

    Shapes ``[B, heads, L, D]``, keys and values ``[B, kv_heads, S, D]``; ``mask`` None, ``"causal"`` or an
    array (boolean: where to attend; else added to the scores) broadcastable to ``[B, heads, L, S]``.
    mx.fast's CPU fallback makes a product per query head and calls a scalar exp per score; here the query
    heads of a key head make one product for the scores, and the softmax and the product by the values
    another: gemv.c's kernels, asked for by the products' alpha, once per record and key head. A record's
    numbers depend neither on its batch nor on its left padding; within float32 rounding of mx.fast.
    """
    b, heads, length, dim = queries.shape
    kv_heads, positions = keys.shape[1], keys.shape[2]
    rep = heads // kv_heads
    q = (queries * scale).reshape(b, kv_heads, rep * length, dim)
    scores = mx.addmm(_ZERO, q, keys.swapaxes(-1, -2), alpha=gemv.SCORES_ALPHA, beta=0.0)  # [B, kv, rep L, S]
    scores = _masked(scores, mask, (b, kv_heads, rep, length, positions))
    out = mx.addmm(_ZERO, scores, values, alpha=gemv.SOFTMAX_ALPHA, beta=0.0)
    return out.reshape(b, heads, length, dim)


def _masked(scores: mx.array, mask: Any, shape: tuple[int, int, int, int, int]) -> mx.array:
    """Attention's ``scores`` (any layout of ``shape``: records, KV heads, query heads a KV head, queries,
    positions) under :func:`attention`'s ``mask``, in their own layout: a masked score at float32's lowest
    (boolean masks), or the mask added."""
    _, kv_heads, rep, length, positions = shape
    if isinstance(mask, str):  # "causal": the queries are the last `length` positions (one query sees all)
        if length == 1:
            return scores
        mask = mx.arange(positions - length, positions)[:, None] >= mx.arange(positions)[None]
    if mask is None:
        return scores
    if mask.ndim >= 3 and mask.shape[-3] == kv_heads * rep:
        mask = mask.reshape(*mask.shape[:-3], kv_heads, rep, *mask.shape[-2:])
    elif mask.ndim >= 3:
        mask = mx.expand_dims(mask, -3)
    s5 = scores.reshape(shape)
    s5 = mx.where(mask, s5, _LOWEST) if mask.dtype == mx.bool_ else s5 + mask.astype(mx.float32)
    return s5.reshape(scores.shape)


_ZERO = mx.zeros((1,), dtype=mx.float32)
_CACHES = {("mlx_lm.models.cache", "KVCache"), ("mlx_lm.models.cache", "BatchKVCache")}  # attention_cached's
CACHED_ATTENTION = True  # off only in bench/batch_steps.py (``pairs``): attention() beside attention_cached()


_ARGMAX_COLUMNS: dict[int, mx.array] = {}  # a product's second operand per vocabulary (never read)


def argmax(logits: mx.array) -> mx.array:
    """``mx.argmax(logits, axis=-1)`` (each row's first NaN, else the first of its largest), by gemv.c for
    2-d float32 logits: mlx's CPU argmax compares one element at a time (~3 ms a 64-row step over 49152)."""
    width = logits.shape[-1]
    if logits.ndim != 2 or logits.dtype != mx.float32 or width > gemv.ARGMAX_MAX_COLUMNS:
        return mx.argmax(logits, axis=-1)
    column = _ARGMAX_COLUMNS.get(width)
    if column is None:
        column = _ARGMAX_COLUMNS[width] = mx.zeros((width, 2), dtype=mx.float32)
    picks = mx.addmm(_ZERO, logits, column, alpha=gemv.ARGMAX_ALPHA, beta=0.0)
    return picks[:, 0].astype(mx.uint32)


def cached_layout(cache: Any, queries: mx.array) -> int:
    """The capacity (positions) of ``cache``'s buffers when :func:`attention_cached` can read them: a plain
    or batched float32 KV cache (mlx-lm's ``KVCache``, ``BatchKVCache``) just updated, one query a record;
    else 0."""
    if not CACHED_ATTENTION:
        return 0
    b, heads, length, _ = queries.shape
    kind = type(cache)  # by name: this room does not import mlx-lm (ARCHITECTURE.md)
    if (
        (kind.__module__, kind.__name__) not in _CACHES
        or length != 1
        or cache.keys is None
        or queries.dtype != mx.float32
    ):
        return 0
    keys = cache.keys
    kv_heads, capacity = keys.shape[1], keys.shape[2]
    if keys.dtype != mx.float32 or keys.shape[0] != b or heads % kv_heads or heads // kv_heads > 31:
        return 0
    return capacity if capacity <= gemv.ATTENTION_MAX_CAPACITY else 0


def attention_cached(queries: mx.array, cache: Any, positions: int, scale: float, mask: Any) -> mx.array:
    """:func:`attention` of one query a record over the first ``positions`` of ``cache``'s keys and values
    (``cached_layout`` said it can), the same numbers: each product one call for every (record, KV head) pair,
    reading the cache's buffers in place, where mlx makes one call per pair on its one thread; gemv.c shares
    the pairs with its helper thread."""
    b, heads, _, dim = queries.shape
    kv_heads, capacity = cache.keys.shape[1], cache.keys.shape[2]
    rep = heads // kv_heads
    q = (queries * scale).reshape(b * heads, dim)  # pair (record, KV head) p: rows p * rep ... p * rep + rep
    # the buffers from their start, a row a position: pair p's keys begin p * capacity rows in (no copy)
    keys = mx.as_strided(cache.keys, (positions, dim), (dim, 1))
    values = mx.as_strided(cache.values, (positions, dim), (dim, 1))
    scores = mx.addmm(_ZERO, q, keys.T, alpha=gemv.attention_alpha(False, rep, capacity), beta=0.0)
    scores = _masked(scores, mask, (b, kv_heads, rep, 1, positions))
    out = mx.addmm(_ZERO, scores, values, alpha=gemv.attention_alpha(True, rep, capacity), beta=0.0)
    return out.reshape(b, heads, 1, dim)


def _subclass(base: type, prefix: str, call: Callable[..., Any], doc: str) -> type:
    """``base`` with another ``__call__``; ``_plain`` remembers ``base`` for :func:`revert`."""
    return type(f"{prefix}{base.__name__}", (base,), {"__call__": call, "__doc__": doc, "_plain": base})


def _fused_transposed(module: Module) -> mx.array:
    """The transpose of ``module``'s fused matrix (:func:`.quantized.fuse`), made once."""
    held = module.__dict__.get("_fused_transposed")
    if held is None:
        held = module.__dict__[FUSED].T
        object.__setattr__(module, "_fused_transposed", held)
    transposed: mx.array = held
    return transposed


def _project(linear: Any, rows: mx.array) -> mx.array:
    """``linear`` of a 2-d ``rows``: an ``nn.Linear`` by its transpose made once where it has no bias, any
    other layer (mlxpipe's kernels' among them) as it computes itself."""
    plain = isinstance(linear, Linear) and "bias" not in linear
    out: mx.array = rows @ _transposed(linear) if plain else linear(rows)
    return out


def _fused_product(module: Module, rows: mx.array) -> mx.array:
    """``rows`` times the transpose of ``module``'s fused matrix (:func:`.quantized.fuse` or
    :func:`.quantized.to_kernels`)."""
    whole = module.__dict__[FUSED]
    out: mx.array = (
        kernels.product(rows, whole)
        if isinstance(whole, kernels.Matrix)
        else rows @ _fused_transposed(module)
    )
    return out


@cache
def _fused_mlp(base: type) -> type:
    def __call__(self: Any, x: mx.array) -> Any:
        # The rows as one matrix: a product of a 3-d input is a flatten, the product and an unflatten.
        rows = x.reshape(-1, x.shape[-1])
        gate = self.gate_proj.weight.shape[0]
        if isinstance(self.__dict__[FUSED], kernels.Matrix):  # the SwiGLU in the kernels' call
            hidden = kernels.product(rows, self.__dict__[FUSED], swiglu=True)
        elif rows.dtype == mx.float32 and gemv.swiglu_available():  # the SwiGLU too, in the product's call
            both = mx.addmm(_ZERO, rows, _fused_transposed(self), alpha=gemv.SWIGLU_ALPHA, beta=0.0)
            hidden = both.reshape(-1)[: rows.shape[0] * gate].reshape(-1, gate)  # packed at its start
        else:
            both = _fused_product(self, rows)  # gate's outputs, then up's
            hidden = swiglu(both[:, :gate], both[:, gate:])
        return _project(self.down_proj, hidden).reshape(*x.shape[:-1], -1)

    return _subclass(
        base, "Fused", __call__, f"{base.__name__} with one product for gate and up, the fast SwiGLU."
    )


@cache
def _fast_mlp(base: type) -> type:
    def __call__(self: Any, x: mx.array) -> Any:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))

    return _subclass(base, "Fast", __call__, f"{base.__name__} with the fast SwiGLU.")


def _rope(self: Any, x: mx.array, cache: Any, length: int) -> mx.array:
    """The attention's RoPE of ``x`` (queries' and/or keys' heads) at the cache's offset."""
    if cache is None:
        return self.rope(x)  # type: ignore[no-any-return]
    # BatchKVCache: no row's position reaches its buffer's count plus these (FastRoPE's gather); the caches
    # of one step's layers name their same positions by one object (SAME_POSITIONS): gathered once a step.
    idx = getattr(cache, "_idx", None)
    if isinstance(self.rope, FastRoPE) and isinstance(idx, int) and not isinstance(cache.offset, int):
        return self.rope(x, cache.offset, bound=idx + length, same=getattr(cache, SAME_POSITIONS, None))
    return self.rope(x, offset=cache.offset)  # type: ignore[no-any-return]


@cache
def _fast_attention(base: type, fused: bool, cpu_attention: bool) -> type:
    def __call__(self: Any, x: mx.array, mask: Any = None, cache: Any = None) -> Any:
        if cache is not None and hasattr(cache, "bits"):
            return base.__call__(self, x, mask, cache)  # a quantized KV cache: mlx-lm's own
        # mlx-lm's Llama Attention.__call__, with fewer operations and the CPU's attention.
        b, length, _ = x.shape
        heads, kv = self.n_heads, self.n_kv_heads
        if fused:  # one product for q, k and v; RoPE turns each head alone: queries' and keys' at once
            qkv = _fused_product(self, x.reshape(b * length, -1))  # (see the fused MLP)
            qkv = qkv.reshape(b, length, heads + 2 * kv, -1).transpose(0, 2, 1, 3)
            qk = _rope(self, qkv[:, : heads + kv], cache, length)
            queries, keys, values = qk[:, :heads], qk[:, heads:], qkv[:, heads + kv :]
        else:
            queries = self.q_proj(x).reshape(b, length, heads, -1).transpose(0, 2, 1, 3)
            keys = self.k_proj(x).reshape(b, length, kv, -1).transpose(0, 2, 1, 3)
            values = self.v_proj(x).reshape(b, length, kv, -1).transpose(0, 2, 1, 3)
            queries, keys = _rope(self, queries, cache, length), _rope(self, keys, cache, length)
        if cache is not None:
            keys, values = cache.update_and_fetch(keys, values)
        if cpu_attention and x.dtype == mx.float32 and cache is not None and cached_layout(cache, queries):
            out = attention_cached(queries, cache, keys.shape[2], self.scale, mask)
        elif cpu_attention and x.dtype == mx.float32:
            out = attention(queries, keys, values, self.scale, mask)
        else:
            out = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=self.scale, mask=mask)
        out = out.transpose(0, 2, 1, 3).reshape(b * length, -1)
        return (_project(self.o_proj, out) if fused else self.o_proj(out)).reshape(b, length, -1)

    what = " and ".join(["one product for q, k and v"] * fused + ["the CPU's attention"] * cpu_attention)
    return _subclass(base, "Fast", __call__, f"{base.__name__} with {what}.")


@cache
def _eval_ahead(base: type) -> type:
    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = base.__call__(self, *args, **kwargs)
        # mx.async_eval returns only once mlx's queue is down to its last few dozen operations: evaluating
        # once a step kept Python from building the next step until this one was nearly done (~3 ms idle).
        mx.async_eval(out)  # type: ignore[no-untyped-call]  # (mlx ships no types for it)
        return out

    return _subclass(base, "EvalAhead", __call__, f"{base.__name__}, computed as soon as it is built.")


def _transposed(module: Module) -> mx.array:
    """``module``'s weight transposed: one view of its memory, kept while the weight is the same array."""
    weight: mx.array = module["weight"]
    held = module.__dict__.get("_transposed")
    if held is None or held[0] is not weight:
        held = (weight, weight.T)  # evaluated with the first product, then a plain input of every other
        object.__setattr__(module, "_transposed", held)  # not a parameter: outside the module's dict
    transposed: mx.array = held[1]
    return transposed


def _linear_call(self: Any, x: mx.array) -> mx.array:
    return x @ _transposed(self) if "bias" not in self else Linear.__call__(self, x)


def _as_linear(self: Any, x: mx.array) -> mx.array:
    return x @ _transposed(self)


FastLinear = _subclass(Linear, "Fast", _linear_call, "``nn.Linear`` by its weight's transpose made once.")
_EMBEDDING_DOC = "``nn.Embedding`` whose ``as_linear`` (a tied output layer) multiplies by one transpose."
FastEmbedding = type(
    "FastEmbedding", (Embedding,), {"as_linear": _as_linear, "__doc__": _EMBEDDING_DOC, "_plain": Embedding}
)


# A KV cache's attribute naming its rows' positions for one step, set by whoever steps the caches: the caches
# holding the same object (not None) have offsets of the same values (mlxpipe's batch sets a new one on each
# layer's cache before a decode step, None after), so RoPE gathers their table rows once, not per layer.
SAME_POSITIONS = "same_positions"

# Decoder layer classes that return their output as arrays: filled by the engine, as SWIGLU_MLPS below.
DECODER_LAYERS: set[type] = set()

# Attention classes whose __call__ is mlx-lm's Llama Attention's (q, k, v projections without bias, RoPE at
# the cache's offset, the cache's update, mx.fast's attention, o_proj): filled by the engine.
ATTENTIONS: set[type] = set()

# MLP classes whose __call__ is down_proj(swiglu(gate_proj(x), up_proj(x))): filled by the engine, which knows
# mlx-lm's model code (this module does not import it).
SWIGLU_MLPS: set[type] = set()


def apply(model: Any, kinds: Iterable[str] = KINDS) -> list[str]:
    """Swap ``model``'s exact ``nn.RMSNorm`` and ``nn.RoPE`` instances, the MLPs of :data:`SWIGLU_MLPS`, the
    attentions of :data:`ATTENTIONS` (fused projections where :func:`.quantized.fuse` made them, gemv.c's
    attention where its AVX-512 or AVX2 kernels run), the plain linear layers and the layers of
    :data:`DECODER_LAYERS`, in place; the kinds swapped, sorted.

    ``kinds``: which of :data:`KINDS` to swap.

    Only those exact classes: subclasses and mlx-lm's other RoPE variants (scaled, yarn, …) compute
    something else and are left alone.
    """
    wanted, swapped = set(kinds), set()
    for name, module in list(model.named_modules()):
        fused = "fused" in wanted and FUSED in module.__dict__
        if type(module) in SWIGLU_MLPS and "swiglu" in wanted:
            swap = _fused_mlp if fused else _fast_mlp
            module.__class__ = swap(type(module))  # type: ignore[arg-type]  # same parameters, new __call__
            swapped.update(["swiglu", "fused"] if fused else ["swiglu"])
            continue
        cpu_attention = "attention" in wanted and gemv.attention_available()
        if type(module) in ATTENTIONS and (fused or cpu_attention):
            module.__class__ = _fast_attention(type(module), fused, cpu_attention)  # type: ignore[arg-type]
            swapped.update(["fused"] * fused + ["attention"] * cpu_attention)
            continue
        if type(module) in DECODER_LAYERS and "eval_per_layer" in wanted:
            module.__class__ = _eval_ahead(type(module))  # type: ignore[arg-type]
            swapped.add("eval_per_layer")
            continue
        if type(module) in (Linear, Embedding) and "linear" in wanted:
            module.__class__ = FastLinear if type(module) is Linear else FastEmbedding
            swapped.add("linear")
            continue
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
    """Undo :func:`apply`: put the plain norms, RoPEs, MLPs, attentions and layers back (side by side)."""
    for name, module in list(model.named_modules()):
        if plain := type(module).__dict__.get("_plain"):
            module.__class__ = plain
            module.__dict__.pop("_transposed", None)
            continue
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
