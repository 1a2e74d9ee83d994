"""The Python API: records in, events out. The CLI is a thin shell over :func:`run`.

>>> from mlxpipe import Engine, run, records_from_objects
>>> engine = Engine.load()                                    # the embedded default model
>>> for event in run(records_from_objects(["Say hi."]), engine):
...     print(event.to_json())
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterable
from typing import TYPE_CHECKING

from .events import Error, Event
from .io import BadRecord, Record

if TYPE_CHECKING:
    from .engine import Engine


def _never() -> bool:
    return False


def run(
    records: Iterable[Record | BadRecord], engine: Engine, should_stop: Callable[[], bool] = _never
) -> Generator[Event, None, None]:
    """Answer ``records`` in order, yielding chunk events and exactly one done or error event per record.

    A bad record becomes an :class:`Error` and the run goes on. ``should_stop`` is polled between
    tokens and between records: once true, the record in flight ends as "interrupted" and no
    further record is read.
    """
    from .engine import RecordError

    for record in records:
        if should_stop():
            return
        if isinstance(record, BadRecord):
            yield Error(record.index, record.id, record.file, record.line, record.error)
            continue
        try:
            yield from engine.generate(record, should_stop)
        except RecordError as exc:
            yield Error(record.index, record.id, record.file, record.line, str(exc))
