"""Choice lists (``--choices``, a record's ``choices``): every label scored by the model, no decoding loop."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache

from ..events import Chunk, Done
from ..records import Record
from .kit import Kit
from .prefix import prefill

__all__ = ["choose", "label_logprobs"]

_CHOICES_STEP = 512  # prompt tokens per pass at most, when scoring (bounds attention memory)


def label_logprobs(
    engine: Kit,
    prompt: list[int],
    labels: tuple[str, ...],
    cache: list[Any] | None = None,
    cached: int = 0,
) -> dict[str, float]:
    """Each label's log probability as the start of the answer: the sum of its tokens' log probabilities.

    The prompt is run once (after the ``cached`` tokens already in ``cache``, a shared prefix); each
    label's tokens (as the tokenizer encodes the label alone) then run on that cache, trimmed back
    after each label.
    """
    model = engine.model
    if cache is None:
        cache, cached = make_prompt_cache(model), 0
    prefill(model, cache, prompt[:-1], start=cached, step=min(_CHOICES_STEP, engine.prefill_step))
    scores: dict[str, float] = {}
    for label in labels:
        ids = list(engine.tokenizer.encode(label, add_special_tokens=False))
        logits = model(mx.array([prompt[-1], *ids[:-1]])[None], cache=cache)[0].astype(mx.float32)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        scores[label] = logprobs[mx.arange(len(ids)), mx.array(ids)].sum().item()
        if can_trim_prompt_cache(cache):
            trim_prompt_cache(cache, len(ids))
        else:  # a cache that cannot be trimmed: run the prompt again for the next label
            return {**scores, **label_logprobs(engine, prompt, labels[len(scores) :])}
    return scores


def choose(engine: Kit, record: Record, tokens: list[int]) -> Iterator[Chunk | Done]:
    """Answer a choice-list record by scoring every label (see :mod:`mlxpipe.events`).

    The answer is the most probable label (temperature 0), or one drawn from the label probabilities
    sharpened by the temperature; top-p, top-k and min-p do not apply. So the chosen label always
    agrees with the probabilities reported beside it.
    """
    from ..constrain import normalized

    labels = record.settings.constraint.labels if record.settings.constraint else ()
    started = time.perf_counter()
    cached, cache = engine.prefix_for(record, tokens)
    logprobs = label_logprobs(engine, tokens, labels, cache, cached)
    seconds = time.perf_counter() - started
    temp = record.settings.temperature
    if temp == 0:
        label = max(labels, key=lambda x: logprobs[x])  # the first label wins a tie
    else:
        scaled = mx.array([logprobs[x] for x in labels]) / temp
        seed = record.settings.seed  # its own key, as in sampler_for: neighbours do not change the draw
        key = mx.random.key(seed) if seed is not None else None
        drawn: int = mx.random.categorical(scaled, key=key).item()  # type: ignore[assignment]
        label = labels[drawn]
    encode = engine.tokenizer.encode
    count = len(encode(label, add_special_tokens=False))
    scored = sum(len(encode(x, add_special_tokens=False)) for x in labels)
    tps = (len(tokens) + scored) / seconds if seconds > 0 else 0.0
    yield Chunk(record.index, record.id, label, count, tps, record.sample, record.samples)
    yield Done(
        index=record.index,
        id=record.id,
        text=label,
        finish_reason="stop",
        tokens=count,
        tps=tps,
        prompt_tokens=len(tokens),
        prompt_tps=tps,
        peak_memory=int(mx.get_peak_memory()),
        input=record.input,
        choices=normalized(logprobs),
        sample=record.sample,
        samples=record.samples,
    )
