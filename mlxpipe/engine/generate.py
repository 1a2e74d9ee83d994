"""One record's tokens and text as mlx-lm's ``stream_generate`` makes them (its ``generate_step`` loop),
without importing ``mlx_lm.generate``, which imports transformers (most of a second of a one-record run).

The same steps in the same order: the prompt but its last token read in chunks, then each step's logits
through the logits processors, log-softmax, the sampler, the next step queued before the token is handed
out; the EOS token ends without text, ``max_tokens`` with "length". A greedy step with no processor skips the
log-softmax (the argmax of the logits, as a greedy ``--batch`` step). tests/test_generate.py holds it to
``mlx_lm.stream_generate`` token for token. Not done here: mlx-lm's raising of Metal's wired-memory limit
while generating (nothing on other backends).
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import greedy_sampler

from .tokenizer import finalize_whole

__all__ = ["Response", "generation_stream", "stream_generate"]

# Off only in benchmarks, to measure the log-softmax a greedy step skips.
GREEDY_ARGMAX = True

# A stream on the default device just for generation, as mlx-lm's.
generation_stream = mx.new_thread_local_stream(mx.default_device())


@dataclass
class Response:
    """One generated token: its text segment (maybe empty) and counts, as mlx-lm's ``GenerationResponse``."""

    text: str
    token: int
    generation_tokens: int
    peak_memory: float  # GB, as mlx-lm reports it
    finish_reason: str | None = None


def greedy_argmax(logits: mx.array) -> mx.array:
    """Each row's token for a greedy step that needs no log-probabilities: ``mx.argmax``, last axis."""
    return mx.argmax(logits, axis=-1)


def _steps(
    prompt: mx.array,
    model: Any,
    *,
    max_tokens: int,
    sampler: Callable[[mx.array], mx.array],
    logits_processors: list[Callable[[mx.array, mx.array], mx.array]],
    prompt_cache: list[Any] | None,
    prefill_step_size: int,
    argmax: Callable[[mx.array], mx.array],
) -> Generator[int, None, None]:
    """The token ids, as mlx-lm's ``generate_step`` yields them (without its logprobs)."""
    cache = prompt_cache if prompt_cache is not None else make_prompt_cache(model)
    tokens: mx.array | None = None
    # Greedy with no processor: the logits' argmax is the log-probabilities' (as a greedy --batch step picks),
    # without a log-softmax over the vocabulary each token (its exp is slow on a CPU).
    argmax_only = GREEDY_ARGMAX and sampler is greedy_sampler and not logits_processors

    def step(inputs: mx.array) -> mx.array:
        nonlocal tokens
        with mx.stream(generation_stream):
            logits = model(inputs[None], cache=cache)[:, -1, :]
            if logits_processors and len(inputs) > 0:
                tokens = mx.concat([tokens, inputs]) if tokens is not None else inputs
                for processor in logits_processors:
                    logits = processor(tokens, logits)
            if argmax_only:
                return argmax(logits)
            logprobs = logits - mx.logsumexp(logits, keepdims=True)
            return sampler(logprobs)

    with mx.stream(generation_stream):
        while len(prompt) > 1:
            n = min(prefill_step_size, len(prompt) - 1)
            model(prompt[:n][None], cache=cache)
            mx.eval([c.state for c in cache])
            if logits_processors:
                tokens = mx.concat([tokens, prompt[:n]]) if tokens is not None else prompt[:n]
            prompt = prompt[n:]
            mx.clear_cache()
        y = step(prompt)
        mx.async_eval(y)  # type: ignore[no-untyped-call]  # (mlx ships no types for it)
        n = 0
        while True:
            # The next step is queued before this token is handed out, except after the last one (mlx-lm
            # computes that one too, and drops it: one decode step of a one-token answer).
            more = max_tokens < 0 or n + 1 < max_tokens
            if more:
                next_y = step(y)
                mx.async_eval(next_y)  # type: ignore[no-untyped-call]
            if n == 0:
                mx.eval(y)
            yield int(y.item())  # type: ignore[arg-type]
            if not more:
                break
            if n % 256 == 0:
                mx.clear_cache()
            y = next_y
            n += 1


def stream_generate(
    model: Any,
    tokenizer: Any,
    prompt: list[int],
    *,
    max_tokens: int,
    sampler: Callable[[mx.array], mx.array],
    logits_processors: list[Callable[[mx.array, mx.array], mx.array]],
    prompt_cache: list[Any] | None = None,
    prefill_step_size: int = 2048,
    argmax: Callable[[mx.array], mx.array] = greedy_argmax,
) -> Generator[Response, None, None]:
    """What ``mlx_lm.stream_generate`` yields for token ids and the arguments mlxpipe passes (``argmax``: a
    greedy step's pick, :func:`greedy_argmax` or the same picks computed otherwise)."""
    detokenizer = tokenizer.detokenizer
    eos = tokenizer.eos_token_ids
    token, n = 0, 0
    steps = _steps(
        mx.array(prompt),
        model,
        max_tokens=max_tokens,
        sampler=sampler,
        logits_processors=logits_processors,
        prompt_cache=prompt_cache,
        prefill_step_size=prefill_step_size,
        argmax=argmax,
    )
    try:
        for n, token in enumerate(steps):
            if token in eos:
                break
            detokenizer.add_token(token)
            if n + 1 == max_tokens:
                break
            yield Response(detokenizer.last_segment, token, n + 1, mx.get_peak_memory() / 1e9)
        finalize_whole(detokenizer)  # never a half character (U+FFFD) at a cut
        finish = "stop" if token in eos else "length"
        yield Response(detokenizer.last_segment, token, n + 1, mx.get_peak_memory() / 1e9, finish)
    finally:
        steps.close()
