"""What the engine promises the rooms around it, without importing it (or mlx).

:class:`EngineLike` and :class:`BatchLike` are the interface the pipeline and the rank exchange use; the real
:class:`mlxpipe.engine.Engine` and the tests' fake engines both satisfy it. :data:`DTYPES` are the choices
of ``--dtype`` (:mod:`mlxpipe.engine.dtype` says what each means).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Protocol

from .events import Chunk, Done, Error
from .records import Record

__all__ = ["DTYPES", "BatchLike", "EngineLike", "ShouldStop", "never"]

# --dtype: the weights' type for computing. "quantized" keeps quantized layers as the model folder has them.
DTYPES = ("auto", "float32", "float16", "bfloat16", "quantized")

ShouldStop = Callable[[], bool]
"""Polled between tokens and between records: once true, records in flight end as "interrupted"."""


def never() -> bool:
    """A :data:`ShouldStop` that never stops."""
    return False


class BatchLike(Protocol):
    """Records generating together (see :class:`mlxpipe.engine.Batch`)."""

    def __len__(self) -> int:
        """Records in flight."""

    def add(self, record: Record) -> None:
        """Start ``record``; raises :class:`mlxpipe.errors.RecordError` when it cannot be answered."""

    def step(self) -> list[Chunk | Done | Error]:
        """Advance every record by one token; the events that produced."""

    def interrupt(self) -> list[Chunk | Done | Error]:
        """End every record in flight as "interrupted", oldest first."""

    def close(self) -> None:
        """Drop every record in flight."""


class EngineLike(Protocol):
    """A loaded model answering records (see :class:`mlxpipe.engine.Engine`)."""

    def generate(self, record: Record, should_stop: ShouldStop | None = None) -> Iterator[Chunk | Done]:
        """Chunks, then one done; raises :class:`mlxpipe.errors.RecordError` before the first event."""

    def batch(self, size: int) -> BatchLike:
        """A batch of up to ``size`` records."""
