"""What every way of answering a record (one at a time, in a batch, a choice list scored) is handed: the
loaded model and tokenizer, and what each record gets (its tokens, shared prefix, token budget, sampler,
processors, and the check of a finished answer).

:class:`Kit` is a ``Protocol`` that :class:`.engine.Engine` satisfies, so :mod:`.sequential`, :mod:`.batch`
and :mod:`.choices` take the engine without importing it: the arrows run one way, from the engine to them.
"""

from __future__ import annotations

from typing import Any, Protocol

import mlx.core as mx

from ..records import Record
from .sampling import Processor, Sampler

__all__ = ["Kit"]


class Kit(Protocol):
    """A loaded model and what each record gets (see :class:`.engine.Engine`, which is one)."""

    @property
    def model(self) -> Any:
        """mlx-lm's model (an ``mlx.nn.Module``)."""

    @property
    def tokenizer(self) -> Any:
        """mlx-lm's ``TokenizerWrapper`` or the engine's own, which answers alike."""

    @property
    def prefill_step(self) -> int:
        """Prompt tokens per forward pass."""

    def argmax(self, logits: mx.array) -> mx.array:
        """A greedy step's pick: each row's argmax."""

    def encode(self, record: Record) -> list[int]:
        """The prompt tokens for ``record``; raises :class:`mlxpipe.errors.RecordError`."""

    def prefix_for(self, record: Record, tokens: list[int]) -> tuple[int, list[Any] | None]:
        """How many of ``tokens`` come from a cached prefix, and a private copy of its KV cache."""

    def budget(self, record: Record, tokens: list[int]) -> tuple[int, bool]:
        """The most tokens ``record`` may generate, and whether the model's context is that limit."""

    def sampler_for(self, record: Record) -> Sampler:
        """mlx-lm's sampler for ``record``."""

    def processors_for(self, record: Record) -> list[Processor]:
        """mlx-lm's logits processors for ``record``."""

    def finish_fields(self, record: Record, text: str, finish_reason: str) -> dict[str, Any]:
        """Extra done fields for a finished answer; raises :class:`mlxpipe.errors.RecordError`."""
