"""The Python API: records in, events out. The CLI is a thin shell over :func:`run`.

>>> from mlxpipe import Engine, run, records_from_objects
>>> engine = Engine.load()                                    # the embedded default model
>>> for event in run(records_from_objects(["Say hi."]), engine):
...     print(event.to_json())

With ``batch=N`` up to N records generate together (continuous batching). Their events are put back
into input order here (the oldest record streams live, later ones are held until its turn), unless
``ordered=False``.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Generator, Iterable, Iterator

from .errors import RecordError, failure
from .events import FINAL_EVENTS, Error, Event
from .interface import EngineLike, ShouldStop, never
from .records import BadRecord, Record, one_per_sample

POLL_SECONDS = 0.1  # how often a wait for input checks should_stop
# How long a batch waits after its first record to learn whether the input holds no other (a piped short
# input has ended by then); a lone record takes the sequential path, where it needs no batch set up.
LONE_WAIT_SECONDS = 0.05


def run(
    records: Iterable[Record | BadRecord],
    engine: EngineLike,
    should_stop: ShouldStop = never,
    *,
    batch: int = 1,
    ordered: bool = True,
    lone_alone: bool = True,
) -> Generator[Event, None, None]:
    """Answer ``records``, yielding chunk events and exactly one done or error event per record.

    A bad record, or any exception while answering one, becomes an :class:`Error` and the run goes
    on; under ``batch``, an exception in a step ends every record in that step so, and a fresh batch
    answers the rest. ``should_stop`` is polled between tokens and between records: once true, the records in
    flight end as "interrupted" and no further record is read. ``batch`` > 1 generates up to that
    many records at once (an input of one record is answered as with ``batch=1``, unless ``lone_alone`` is
    false); events stay in input order unless ``ordered`` is false (then they come as produced; each
    carries its id). A record asking for several answers (``settings.samples``) is answered once per sample,
    each an answer of its own (:func:`mlxpipe.records.one_per_sample`), in order.
    """
    records = one_per_sample(records)
    if batch > 1:
        yield from _run_batched(records, engine, should_stop, batch, ordered, lone_alone)
        return
    for record in records:
        if should_stop():
            return
        if isinstance(record, BadRecord):
            yield Error.about(record, record.error)
            continue
        try:
            yield from engine.generate(record, should_stop)
        except RecordError as exc:
            yield Error.about(record, str(exc))
        except Exception as exc:  # one record the model chokes on must not end a long batch job
            yield Error.about(record, failure(exc))


def _run_batched(
    records: Iterable[Record | BadRecord],
    engine: EngineLike,
    should_stop: ShouldStop,
    size: int,
    ordered: bool,
    lone_alone: bool,
) -> Generator[Event, None, None]:
    # Read-ahead is bounded: `size` records queued, `size` in flight and, in order mode, at most `size`
    # finished ones held behind a slower older record.
    feed = _Prefetch(records, size)
    try:
        head = _first_records(feed, should_stop, lone_alone)
    except BaseException:
        feed.close()
        raise
    if not head:  # no input, or stopped before any: nothing to answer
        feed.close()
        return
    if lone_alone and len(head) == 1 and feed.done:
        # The input held one record: the sequential path answers it alike, without a batch to set up.
        feed.close()
        yield from run(head, engine, should_stop)
        return
    batched = _Batched(engine, size, feed, should_stop, ordered)
    try:
        yield from batched.events(head)
    finally:
        batched.close()


def _first_records(feed: _Prefetch, should_stop: ShouldStop, lone_alone: bool) -> list[Record | BadRecord]:
    """The records taken before a batch opens: the first and, with ``lone_alone``, a second when one comes
    within ``LONE_WAIT_SECONDS`` (else the input may hold one record); none when there is no input."""
    first = feed.get(block=True, should_stop=should_stop)
    if first is None:
        return []
    if not lone_alone:
        return [first]
    second = feed.get(block=True, should_stop=should_stop, within=LONE_WAIT_SECONDS)
    return [first] if second is None else [first, second]


class _Batched:
    """The records in flight under ``--batch``: which are added to the engine's batch and when, its steps,
    and their events put back into input order (unless not ``ordered``)."""

    def __init__(
        self, engine: EngineLike, size: int, feed: _Prefetch, should_stop: ShouldStop, ordered: bool
    ) -> None:
        self.engine, self.size, self.feed, self.should_stop = engine, size, feed, should_stop
        self.order = _InputOrder() if ordered else None
        self.session = engine.batch(size)
        self.live: dict[int, Record] = {}  # records added to the session and not yet ended, by index

    def events(self, head: list[Record | BadRecord]) -> Iterator[Event]:
        """Every record's events: ``head`` (taken already), then the rest of the feed."""
        while True:
            yield from self._fill(head)
            if self.should_stop():
                yield from self._emit(self.session.interrupt())
                return
            if len(self.session) == 0:
                if self.feed.done:
                    return
                continue
            yield from self._step()

    def _fill(self, head: list[Record | BadRecord]) -> Iterator[Event]:
        """Add records while a slot is free (in order, while at most 2N are unwritten): waiting for input only
        when nothing is in flight, otherwise taking what has arrived."""
        session, order = self.session, self.order
        while len(session) < self.size and (order is None or len(order) < 2 * self.size):
            item = (
                head.pop(0) if head else self.feed.get(block=len(session) == 0, should_stop=self.should_stop)
            )
            if item is None:
                return
            if order is not None:
                order.admit(item.index)
            if isinstance(item, BadRecord):
                yield from self._emit([Error.about(item, item.error)])
                continue
            try:
                session.add(item)
                self.live[item.index] = item
            except RecordError as exc:
                yield from self._emit([Error.about(item, str(exc))])
            except Exception as exc:  # as in sequential mode: one bad record does not end the job
                yield from self._emit([Error.about(item, failure(exc))])

    def _step(self) -> Iterator[Event]:
        """One token step for every record in flight; a step that raises ends each of them with its error."""
        try:
            events = self.session.step()
        except Exception as exc:  # the model failed: every record in its step ends, the run goes on
            failed = [Error.about(self.live[index], failure(exc)) for index in sorted(self.live)]
            self.live.clear()
            with contextlib.suppress(Exception):
                self.session.close()
            self.session = self.engine.batch(self.size)  # a fresh batch: the failed one is not to be trusted
            yield from self._emit(failed)
            return
        for event in events:
            if isinstance(event, FINAL_EVENTS):
                self.live.pop(event.index, None)
        yield from self._emit(events)

    def _emit(self, events: Iterable[Event]) -> Iterator[Event]:
        for event in events:
            if self.order is None:
                yield event
            else:
                yield from self.order.push(event)

    def close(self) -> None:
        self.session.close()
        self.feed.close()


class _InputOrder:
    """Puts interleaved events back into input order: the oldest unfinished record's events pass at once,
    a later record's are held until every record before it has ended."""

    def __init__(self) -> None:
        self._queue: deque[int] = deque()  # indices of records not yet fully written, in input order
        self._held: dict[int, list[Event]] = {}
        self._ended: set[int] = set()

    def __len__(self) -> int:
        return len(self._queue)

    def admit(self, index: int) -> None:
        """Note that record ``index`` comes next in the input."""
        self._queue.append(index)
        self._held[index] = []

    def push(self, event: Event) -> Iterator[Event]:
        """Take one event; yield the events that may be written now."""
        if event.index != self._queue[0]:
            self._held[event.index].append(event)
            if isinstance(event, FINAL_EVENTS):
                self._ended.add(event.index)
            return
        yield event
        if not isinstance(event, FINAL_EVENTS):
            return
        self._queue.popleft()
        del self._held[event.index]
        while self._queue:  # the next record becomes the live one: release what it has so far
            head = self._queue[0]
            yield from self._held[head]
            self._held[head] = []
            if head not in self._ended:
                return
            self._ended.discard(head)
            self._queue.popleft()
            del self._held[head]


_END = object()


class _Failed:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


class _Prefetch:
    """Reads records on a helper thread into a bounded queue, so that a free slot is refilled with
    whatever input has arrived without blocking the records already generating."""

    def __init__(self, records: Iterable[Record | BadRecord], size: int) -> None:
        self._queue: queue.Queue[object] = queue.Queue(maxsize=size)
        self._closed = False
        self.done = False
        self._thread = threading.Thread(
            target=self._pump, args=(iter(records),), name="mlxpipe-reader", daemon=True
        )
        self._thread.start()

    def _pump(self, records: Iterator[Record | BadRecord]) -> None:
        try:
            for record in records:
                self._queue.put(record)
                if self._closed:
                    return
        except BaseException as exc:  # re-raised on the main thread, where the caller can see it
            self._queue.put(_Failed(exc))
            return
        if not self._closed:
            self._queue.put(_END)

    def get(
        self, *, block: bool, should_stop: Callable[[], bool], within: float | None = None
    ) -> Record | BadRecord | None:
        """The next record; ``None`` at the end of input, when none has arrived (``block`` false, or not
        ``within`` seconds) or when ``should_stop`` turned true while waiting."""
        deadline = None if within is None else time.monotonic() + within
        while not self.done:
            wait = (
                POLL_SECONDS if deadline is None else max(0.0, min(POLL_SECONDS, deadline - time.monotonic()))
            )
            try:
                item = self._queue.get(timeout=wait) if block else self._queue.get_nowait()
            except queue.Empty:
                if block and not should_stop() and (deadline is None or time.monotonic() < deadline):
                    continue
                return None
            if item is _END:
                self.done = True
                return None
            if isinstance(item, _Failed):
                self.done = True
                raise item.exc
            assert isinstance(item, (Record, BadRecord))
            return item
        return None

    def close(self) -> None:
        """Stop reading: unblock the helper thread if it waits for room in the queue."""
        self._closed = True
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                return
