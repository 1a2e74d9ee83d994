"""Gemma 2 as its GGUF files and Hugging Face configs specify it: mlx-lm's ``gemma2`` model with what it
leaves out put back (issue 40).

mlx-lm's model attends over every earlier position in every layer; Gemma 2's even layers (0, 2, …) see only
the last ``sliding_window`` positions (llama.cpp: ``set_swa_pattern(2)``; transformers: even ``layer_idx``),
so past the window (4,096 tokens in real files) its answers differed from llama.cpp's. Its attention also
broadcast a batch's padding mask (records, 1, queries, positions) against scores grouped by KV head (records,
KV heads, query heads a KV head, queries, positions), which failed for any batch of a model whose query heads
share KV heads. Its soft-caps (attention and final logits) it applies on every path; they are kept.

:func:`install` puts these classes in place of mlx-lm's, for mlx-lm's loader and mlxpipe's alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx.nn.layers.base import Module
from mlx.nn.layers.embedding import Embedding
from mlx_lm.models import gemma2 as base
from mlx_lm.models.base import create_attention_mask

__all__ = ["Model", "ModelArgs", "install", "sliding_layer"]


@dataclass
class ModelArgs(base.ModelArgs):
    """mlx-lm's arguments and the window of the sliding layers (None: every layer attends to all)."""

    sliding_window: int | None = None


def sliding_layer(index: int) -> bool:
    """Whether layer ``index`` attends through the sliding window: the even ones, as in llama.cpp."""
    return index % 2 == 0


class Attention(base.Attention):
    """mlx-lm's Gemma 2 attention (soft-capped scores), its mask shaped for grouped KV heads."""

    def __call__(self, x: mx.array, mask: mx.array | None = None, cache: Any = None) -> mx.array:
        B, L, _ = x.shape
        queries = self.q_proj(x).reshape(B, L, self.n_heads, -1).transpose(0, 2, 1, 3)
        keys = self.k_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        values = self.v_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        if cache is not None:
            queries = self.rope(queries, offset=cache.offset)
            keys = self.rope(keys, offset=cache.offset)
            keys, values = cache.update_and_fetch(keys, values)
        else:
            queries = self.rope(queries)
            keys = self.rope(keys)
        queries = queries * self.scale
        if self.repeats > 1:
            queries = queries.reshape(B, self.n_kv_heads, self.repeats, L, self.head_dim)
            keys = mx.expand_dims(keys, 2)
            values = mx.expand_dims(values, 2)
            if mask is not None and mask.ndim == 4:
                mask = mx.expand_dims(mask, 2)  # a batch's (records, 1, queries, positions): one axis more
        scores = queries @ keys.swapaxes(-1, -2)
        scores = mx.tanh(scores / self.attn_logit_softcapping) * self.attn_logit_softcapping
        if mask is not None:
            if mask.dtype == mx.bool_:
                scores = mx.where(mask, scores, mx.array(mx.finfo(scores.dtype).min, scores.dtype))
            else:
                scores = scores + mask
        scores = mx.softmax(scores, precise=True, axis=-1)
        output = scores @ values
        if self.repeats > 1:
            output = output.reshape(B, self.n_heads, L, self.head_dim)
        out: mx.array = self.o_proj(output.transpose(0, 2, 1, 3).reshape(B, L, -1))
        return out


class TransformerBlock(base.TransformerBlock):
    """mlx-lm's Gemma 2 layer with :class:`Attention`."""

    def __init__(self, args: ModelArgs, sliding: bool) -> None:
        Module.__init__(self)  # type: ignore[no-untyped-call]  # not the parent's: it would build its own parts
        self.num_attention_heads = args.num_attention_heads
        self.hidden_size = args.hidden_size
        self.self_attn = Attention(args)
        self.mlp = base.MLP(args.hidden_size, args.intermediate_size)
        self.input_layernorm = base.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.pre_feedforward_layernorm = base.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_feedforward_layernorm = base.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = base.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.args = args
        self.sliding = sliding and args.sliding_window is not None


class GemmaModel(base.GemmaModel):
    """mlx-lm's Gemma 2 body, whose sliding layers get a mask that hides positions older than the window."""

    def __init__(self, args: ModelArgs) -> None:
        Module.__init__(self)  # type: ignore[no-untyped-call]  # not the parent's: it would build its own parts
        self.args = args
        self.vocab_size = args.vocab_size
        self.num_hidden_layers = args.num_hidden_layers
        self.embed_tokens = Embedding(args.vocab_size, args.hidden_size)
        self.layers = [TransformerBlock(args, sliding_layer(i)) for i in range(args.num_hidden_layers)]
        self.norm = base.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, inputs: mx.array, cache: Any = None) -> mx.array:
        h = self.embed_tokens(inputs) * (self.args.hidden_size**0.5)
        if cache is None:
            cache = [None] * len(self.layers)
        full = create_attention_mask(h, cache[0], return_array=True)
        window = self.args.sliding_window if isinstance(self.args, ModelArgs) else None
        # Every layer's cache holds every position (a window mask, not a rotating cache), so a batch's rows
        # and a shared prefix's cache stay what they are for the other architectures.
        local = create_attention_mask(h, cache[0], window_size=window, return_array=True) if window else full
        for layer, c in zip(self.layers, cache, strict=True):
            h = layer(h, local if layer.sliding else full, c)
        out: mx.array = self.norm(h)
        return out


class Model(base.Model):
    """mlx-lm's Gemma 2 (final logits soft-capped) on :class:`GemmaModel`."""

    def __init__(self, args: ModelArgs) -> None:
        Module.__init__(self)  # type: ignore[no-untyped-call]  # not the parent's: it would build its own parts
        self.model_type = args.model_type
        self.final_logit_softcapping = args.final_logit_softcapping
        self.model = GemmaModel(args)
        self.args = args


def install() -> None:
    """Make mlx-lm's ``gemma2`` module build these classes (its loader reads ``Model`` and ``ModelArgs``)."""
    setattr(base, "Model", Model)  # noqa: B010  (a module's class replaced: mypy would refuse the assignment)
    setattr(base, "ModelArgs", ModelArgs)  # noqa: B010
