"""One record at a time: its tokens through :func:`.generate.stream_generate`, turned into events (chunks held
back while a stop string may be starting, one done), as :class:`.batch.Batch` does for many records."""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Iterator

from ..events import Chunk, Done, decode_tps
from ..records import Record
from .choices import choose
from .generate import Response, stream_generate
from .kit import Kit
from .sampling import StopStrings, after_prefix

__all__ = ["answer"]


def answer(kit: Kit, record: Record, should_stop: Callable[[], bool] | None = None) -> Iterator[Chunk | Done]:
    """Stream one record: zero or more :class:`Chunk` events, then exactly one :class:`Done`.

    Raises :class:`RecordError` before the first event when the record cannot be answered.
    ``should_stop`` is polled once per token; when it turns true the record ends as "interrupted".
    """
    tokens = kit.encode(record)
    constraint = record.settings.constraint
    if constraint is not None and constraint.kind == "choices":
        yield from choose(kit, record, tokens)
        return
    started = time.perf_counter()
    budget, bound = kit.budget(record, tokens)
    responses = _responses(kit, record, tokens, budget)
    stops = StopStrings(record.settings.stop)
    text: list[str] = []
    prompt_tps = first = 0.0
    try:
        for r in responses:
            now = time.perf_counter()
            if r.generation_tokens == 1:  # the whole prompt, the reused prefix included, over its time
                prompt_tps = len(tokens) / max(now - started, 1e-9)
                first = now
            # As under --batch (events.decode_tps): mlx-lm's own rate counts the first token over ~0 s.
            tps = decode_tps(r.generation_tokens, first, now)
            segment, finish = stops.feed(r.text, r.finish_reason)
            if finish is None and should_stop is not None and should_stop():
                segment, finish = segment + stops.flush(), "interrupted"
            if segment:
                text.append(segment)
                yield Chunk(
                    record.index, record.id, segment, r.generation_tokens, tps, record.sample, record.samples
                )
            if finish is not None:
                if finish == "length" and bound:
                    finish = "context"
                yield _done(kit, record, "".join(text), finish, r, tps, len(tokens), prompt_tps)
                return
    finally:
        responses.close()  # ends generation at once when our consumer stops early


def _responses(kit: Kit, record: Record, tokens: list[int], budget: int) -> Generator[Response, None, None]:
    """``stream_generate`` on ``record``'s prompt after the cached prefix it shares, at most ``budget``
    tokens."""
    cached, cache = kit.prefix_for(record, tokens)
    processors = kit.processors_for(record)
    if cached and processors:
        # stream_generate shows them only the tokens it was given; the batched path passes the cached
        # prefix as all_tokens. Both must see the whole prompt (a repetition penalty looks back).
        processors = [after_prefix(tokens[:cached], processors)]
    return stream_generate(
        kit.model,
        kit.tokenizer,
        tokens[cached:],
        max_tokens=budget,
        sampler=kit.sampler_for(record),
        logits_processors=processors,
        prompt_cache=cache,
        prefill_step_size=kit.prefill_step,
        argmax=kit.argmax,
    )


def _done(
    kit: Kit,
    record: Record,
    answer: str,
    finish: str,
    last: Response,
    tps: float,
    prompt_tokens: int,
    prompt_tps: float,
) -> Done:
    return Done(
        index=record.index,
        id=record.id,
        text=answer,
        finish_reason=finish,
        tokens=last.generation_tokens,
        tps=tps,
        prompt_tokens=prompt_tokens,
        prompt_tps=prompt_tps,
        peak_memory=int(last.peak_memory * 1e9),  # mlx-lm reports GB
        input=record.input,
        **kit.finish_fields(record, answer, finish),
        sample=record.sample,
        samples=record.samples,
    )
