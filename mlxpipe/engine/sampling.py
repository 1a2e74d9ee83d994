"""How each token is picked: samplers, logits processors (repetition penalty, a constraint's mask), stops.

Every generation path (sequential or batched) takes a record's sampler and processors from here, so a record's
answer does not depend on the path.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, make_logits_processors, make_sampler

from ..records import Settings

if TYPE_CHECKING:
    from ..constrain import Matcher

__all__ = [
    "Processor",
    "Sampler",
    "StopStrings",
    "after_prefix",
    "mask_processor",
    "processors_for",
    "sampler_for",
]

# The typed boundary: mlx-lm's samplers and logits processors map arrays to arrays.
Sampler = Callable[[mx.array], mx.array]
Processor = Callable[[mx.array, mx.array], mx.array]


def sampler_for(s: Settings, vocab_size: int) -> Sampler:
    """mlx-lm's sampler for a record's settings ``s``.

    With a seed, the sampler carries its own PRNG key, so the record's draws do not depend on other
    records sampled before it or beside it in a batch.
    """
    top_k = s.top_k if s.top_k < vocab_size else 0  # keeping every token is no top-k at all
    if s.temperature == 0 or s.seed is None:
        return make_sampler(temp=s.temperature, top_p=s.top_p, min_p=s.min_p, top_k=top_k)
    return _SeededSampler(s.seed, s.temperature, s.top_p, s.min_p, top_k)


def processors_for(s: Settings, matcher: Matcher | None) -> list[Processor]:
    """mlx-lm logits processors for settings ``s``: repetition penalty, then ``matcher``'s token mask."""
    processors = list(make_logits_processors(repetition_penalty=s.repetition_penalty))
    if matcher is not None:
        processors.append(mask_processor(matcher))
    return processors


def mask_processor(matcher: Matcher) -> Processor:
    """A logits processor that keeps only the tokens ``matcher`` allows next.

    The mask is applied with ``mx.where``, which runs on every backend (llguidance's own mlx helper is
    Metal-only).
    """
    seen: int | None = None  # tokens already accounted for: the prompt, then each sampled token

    def process(tokens: Any, logits: Any) -> Any:
        nonlocal seen
        if seen is None:
            seen = tokens.size  # the first call sees the prompt alone
        elif tokens.size > seen:
            matcher.consume(tokens[seen:].tolist())
            seen = tokens.size
        allowed = mx.array(matcher.mask(logits.shape[-1]))
        return mx.where(allowed, logits, mx.array(-mx.inf, dtype=logits.dtype))

    return process


def after_prefix(head: Sequence[int], processors: list[Processor]) -> Processor:
    """One processor running ``processors`` in order, each seeing ``head`` before the tokens it is given."""
    before = mx.array(list(head))

    def process(tokens: Any, logits: Any) -> Any:
        tokens = mx.concatenate([before, tokens])  # once a step, whatever the number of processors
        for processor in processors:
            logits = processor(tokens, logits)
        return logits

    return process


class _SeededSampler:
    """mlx-lm's sampling chain (top-p, min-p, top-k, then temperature) drawing from its own PRNG key."""

    def __init__(self, seed: int, temp: float, top_p: float, min_p: float, top_k: int) -> None:
        self.key = mx.random.key(seed)
        self.temp, self.top_p, self.min_p, self.top_k = temp, top_p, min_p, top_k

    def __call__(self, logprobs: Any) -> Any:
        if 0 < self.top_p < 1.0:
            logprobs = apply_top_p(logprobs, self.top_p)
        if self.min_p != 0.0:
            logprobs = apply_min_p(logprobs, self.min_p, 1)
        if self.top_k > 0:
            logprobs = apply_top_k(logprobs, self.top_k)
        self.key, draw = mx.random.split(self.key)
        return mx.random.categorical(logprobs * (1.0 / self.temp), key=draw)


class StopStrings:
    """Cuts a stream of text at the first stop string, holding back text that could begin one.

    Built on mlx-lm's :class:`TextStateMachine`: a stop string moves it to the end state.
    """

    def __init__(self, stops: tuple[str, ...]) -> None:
        self._state: Any = None
        if stops:
            from mlx_lm.generate import TextStateMachine  # imports transformers: only with stop strings

            self._state = TextStateMachine({"normal": [(w, None) for w in stops]}).make_state()

    def feed(self, text: str, finish: str | None) -> tuple[str, str | None]:
        """Take the next segment; return the text safe to emit and the finish reason, if any."""
        if self._state is None:
            return text, finish
        from mlx_lm.generate import TextStateMachine

        self._state, segments = TextStateMachine.split(self._state, text)
        safe = "".join(t for _, t in segments)
        if self._state[0] is None:  # a stop string matched: it and everything after it are dropped
            return safe, "stop"
        if finish is not None:
            safe += self.flush()
        return safe, finish

    def flush(self) -> str:
        """Release the held-back text (the stream ended without completing a stop string)."""
        if self._state is None:
            return ""
        from mlx_lm.generate import TextStateMachine

        self._state, held, _ = TextStateMachine.flush(self._state)
        return str(held)
