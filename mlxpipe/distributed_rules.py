"""The rules of an ``mlx.launch`` job's protocol, the one place they are written down: what a rank says at a
tick, and, from every rank's frame, which records it is handed, what it may write, when the job ends.

:class:`Rules` is one rank's side of them. It takes frames and gives answers, with no sockets, threads or
clocks: :mod:`mlxpipe.distributed` gathers the frames (the transport) and feeds the pipeline (the glue).

Input. Every rank reads the same FILE arguments, so every rank sees the same records in the same order and
can name a record by its *position* (0-based, bad records included; records ``--resume`` skips are not in
the stream, on any rank, so a record's number and its position differ). Before anything else the ranks
compare a digest of the files' contents (``distributed.same_input``); what decides which records are skipped
must be the same on every rank too (rank 0 shares it with ``distributed.broadcast``).

Frames. At a *tick* every rank sends one frame and receives every rank's, in rank order. A frame is UTF-8
JSON::

    {"events": [...], "at": {"<record number>": position}, "want": int, "eof": int | null,
     "idle": bool, "stopped": bool, "stop": int, "quit": str | null}

``events``: the rank's chunk and final events since its last tick (:func:`encode_event`), ``at`` their
records' positions; ``want``: how many more records it asks for (``--batch`` N, or 1, plus a lookahead,
at least N/4 under ``--batch``, so that it starts its next record without waiting for a tick, minus what it
holds; no lookahead, and at most an equal share of what is left, once fewer records are left than the ranks
could hold, where it would leave a rank idle at the end; 0 while more than ``HOLD`` * ranks * that depth
records are read but not yet written, behind one old record still generating); ``eof``: the number of
records in its input once it has read the end; ``idle``: its own pipeline has finished (the end of input,
or a stop); ``stopped``/``stop``: a signal stopped it (the signal's number); ``quit``: it leaves the job now
(``closed`` when its events were closed: ``--fail-fast``, a closed stdout; otherwise the error it raises).

Assignment. After a tick every rank holds the same frames and applies them alike (what it decides depends on
the frames and on what its own frame said, never on a stop noticed since), so no rank coordinates:
positions are handed out in input order, ``want`` of them to each rank in rank order. Each rank reads ahead
of the last position handed out far enough to know whether the input ends within what every rank could take.
Each record is handed out once, so it is generated once.

Output. Every rank puts all events back into input order (:class:`mlxpipe.pipeline._InputOrder`): the oldest
unwritten record's events pass at once (rank 0's own stream live), later ones are held until its turn;
``--unordered`` passes them as they arrive. Rank 0 writes them; the others only count them, for the exit
status, and see the same stream. The job ends at the tick in which every rank is ``idle``.

Stop. A rank stopped by a signal ends its records in flight as "interrupted" and says ``stopped``; at that
tick every other rank does the same, and takes no more records. Records handed out but not started are never
answered, so every rank's ordered stream stops before the first of them: the output is records 1..K (the last
ones possibly "interrupted"), and a rerun with ``--resume`` does the rest. A rank that quits ends the
job at once; a rank that quits with an error is reported by rank 0 as :class:`RankLost`. Once the job has an
error, nothing more is written: only whole records before it.

Checks. Each rank knows which record every position holds; rank 0 raises :class:`RanksDisagree` when a rank
answers a record other than the one rank 0 read at that position, past the end of rank 0's input, reports an
input of another length, or never answers a record handed to it. The other ranks leave that to rank 0.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Iterable
from typing import Any

from .events import FINAL_EVENTS, Chunk, Done, Error, Event
from .pipeline import _InputOrder
from .records import BadRecord, Record

HOLD = 4  # records read but not yet written, at most HOLD * ranks * depth: then no rank asks for more

Frame = dict[str, Any]  # a frame as JSON decodes it (the module docstring says its fields)

_KINDS: dict[str, type[Chunk] | type[Done] | type[Error]] = {"chunk": Chunk, "done": Done, "error": Error}


class RankLost(Exception):
    """Another rank of the job went away (it died, or its host dropped off): the run cannot go on."""


class RanksDisagree(Exception):
    """Another rank read a different stream of records (another input, another ``--resume`` file)."""


def encode_event(event: Event) -> dict[str, Any]:
    """An event as a JSON object with every field (``index`` and unrounded rates included)."""
    return {"kind": event.kind, **dataclasses.asdict(event)}


def decode_event(obj: dict[str, Any]) -> Event:
    """The inverse of :func:`encode_event`."""
    fields = dict(obj)
    return _KINDS[fields.pop("kind")](**fields)


class _Input:
    """This rank's records as positions: read ahead of the last position handed out, its end once read."""

    def __init__(self, records: Iterable[Record | BadRecord]) -> None:
        self.records = iter(records)
        self.ahead: deque[Record | BadRecord] = deque()  # read, not yet handed out
        self.eof: int | None = None  # how many records the input has, once its end was read
        self.frontier = 0  # positions handed out so far

    def read(self, n: int) -> None:
        """Read up to ``n`` more records ahead, unless the end was read."""
        for _ in range(n):
            if self.eof is not None:
                return
            try:
                self.ahead.append(next(self.records))
            except StopIteration:
                self.eof = self.frontier + len(self.ahead)

    def take(self) -> tuple[int, Record | BadRecord] | None:
        """The next position and its record; None past the end."""
        if not self.ahead:
            self.read(1)
        if not self.ahead:
            return None
        position, self.frontier = self.frontier, self.frontier + 1
        return position, self.ahead.popleft()

    def all_taken(self) -> bool:
        """Every record was handed out, and the end read."""
        return self.eof is not None and not self.ahead

    def check_ends(self, frames: list[Frame]) -> None:
        """Rank 0: every rank's input ends where this one does."""
        for rank, frame in enumerate(frames):
            end = frame["eof"]
            if end is None or end == self.eof:
                continue
            if self.eof is not None or self.frontier + len(self.ahead) > end:
                mine = "after " + str(self.eof) if self.eof is not None else "later"
                raise RanksDisagree(f"rank {rank}'s input ends after {end} records, rank 0's {mine}")


@dataclasses.dataclass(frozen=True)
class Said:
    """What this rank said at a tick, as :meth:`Rules.apply` needs it back once the frames are in."""

    frame: Frame
    finals: list[int]  # the numbers of its records whose final event the frame carries
    halted: bool  # it had stopped when it said it (a stop noticed since must not change what it decides)


class Rules:
    """One rank's side of the protocol (the module docstring): what it reads, holds, says, is handed, writes.

    ``records``: this rank's input; ``batch``: how many records it generates at once; ``lookahead``: how many
    more it asks for (0: none; under ``--batch`` at least N/4, where records end more often between ticks);
    ``ordered``: put the events back into input order (else they pass as they arrive).
    """

    def __init__(
        self,
        records: Iterable[Record | BadRecord],
        rank: int,
        size: int,
        *,
        batch: int = 1,
        lookahead: int = 1,
        ordered: bool = True,
    ) -> None:
        self.input = _Input(records)
        self.rank, self.size = rank, size
        self.capacity = batch  # records this rank generates at once
        self.lookahead = max(lookahead, batch // 4) if lookahead > 0 else 0
        self.order = _InputOrder() if ordered else None
        self.held = 0  # records handed to this rank and not yet finished
        self.handed: deque[Record | BadRecord] = deque()  # handed to this rank, not yet taken by its pipeline
        self.mine_at: dict[int, int] = {}  # record number -> position, for this rank's records
        self.expect: dict[int, tuple[int, int]] = {}  # position -> (rank, record number), the others' records
        self.outbox: list[Event] = []  # own events not yet said
        self.ready: deque[Event] = deque()  # events that may be written now
        self.stopping = False  # takes no more records
        self.stopped = False  # a signal stopped this rank
        self.stop = 0  # that signal's number (0: none, or no number)
        self.signal: int | None = None  # the job's stop signal, once some rank said it was stopped
        self.finished = False  # its own pipeline has returned: nothing in flight, nothing more to say
        self.ended = False  # the job is over: no more ticks
        self.error: Exception | None = None  # the job ends with this error

    # -- what this rank does between ticks

    def own(self, event: Event) -> None:
        """An event of this rank's own records: to say at the next tick, and to write in its turn."""
        self.outbox.append(event)
        if isinstance(event, FINAL_EVENTS):
            self.held -= 1
        self._push(event)

    def halt(self, signal: int) -> None:
        """A signal (``signal``: its number, or 0) stopped this rank."""
        self.stop, self.stopped = signal, True
        self._stop()

    def finish(self) -> None:
        """This rank's own pipeline has returned."""
        self.finished = True

    def fail(self, error: Exception, *, ended: bool = False) -> None:
        """The job ends with ``error``; ``ended``: at once, without another tick (the others are gone)."""
        self.error = error
        self.ended = self.ended or ended
        self._stop()

    def writable(self) -> list[Event]:
        """The events that may be written now (each once)."""
        ready, self.ready = list(self.ready), deque()
        return ready

    def over(self) -> bool:
        """No record will be handed to this rank any more."""
        return self.stopping or self.ended or self.input.all_taken()

    def read_ahead(self) -> None:
        """Read far enough to know whether the input ends within what every rank could take."""
        self.input.read(self.size * (self.capacity + self.lookahead) + 1 - len(self.input.ahead))

    # -- a tick

    def say(self, quit: str | None = None) -> Said:
        """This rank's frame for the next tick: its events since the last one, what it wants, how it stands.
        ``quit``: the reason it leaves the job now."""
        outbox, self.outbox = self.outbox, []
        frame: Frame = {
            "events": [encode_event(e) for e in outbox],
            "at": {str(i): self.mine_at[i] for i in {e.index for e in outbox}},
            "want": self._want(),
            "eof": self.input.eof,
            "idle": self.finished,
            "stopped": self.stopped,
            "stop": self.stop,
            "quit": quit,
        }
        return Said(frame, [e.index for e in outbox if isinstance(e, FINAL_EVENTS)], self.stopping)

    def apply(self, said: Said, frames: list[Frame]) -> None:
        """One tick's frames, every rank's in rank order (``said``: this rank's), alike on every rank: the
        others' events put in order, stops, the end, the records handed out (to :attr:`handed`). Raises
        :class:`RanksDisagree` (rank 0) where another rank read other records."""
        for index in said.finals:
            del self.mine_at[index]
        if said.frame["quit"] is not None:
            self.ended = True
            return
        for rank, frame in enumerate(frames):
            if rank != self.rank:
                self._take(rank, frame)
        if self._someone_quit(frames):
            return
        halted = said.halted
        if any(f["stopped"] for f in frames):
            self.signal = next((f["stop"] for f in frames if f["stop"]), 0)
            self._stop()
            halted = True
        if self.rank == 0 and not halted:
            self.input.check_ends(frames)
        if all(f["idle"] for f in frames):
            self.ended = True
            if self.rank == 0 and not halted and self.expect:
                rank, number = min(self.expect.items())[1]
                raise RanksDisagree(f"rank {rank} never answered record {number}")
            return
        if not halted:
            self._assign([f["want"] for f in frames])
            self.read_ahead()

    def _someone_quit(self, frames: list[Frame]) -> bool:
        """A rank went (``--fail-fast``, a closed pipe, an error): so does the job."""
        for rank, frame in enumerate(frames):
            if frame["quit"] is not None:
                self.ended = True
                if frame["quit"] != "closed" and rank != 0 and self.error is None:
                    self.error = RankLost(f"rank {rank} failed: {frame['quit']}")
                self._stop()
                return True
        return False

    def _take(self, rank: int, frame: Frame) -> None:
        """Another rank's events: checked against this rank's reading, then put in order."""
        at = {int(i): p for i, p in frame["at"].items()}
        for index, position in at.items():
            if self.expect.get(position) == (rank, index):
                continue
            if self.rank == 0:
                if position in self.expect:
                    read = self.expect[position][1]
                    raise RanksDisagree(f"rank {rank} answered record {index} where rank 0 read {read}")
                raise RanksDisagree(f"rank {rank} answered record {index}, past the end of rank 0's input")
            return  # rank 0 stops the job: its reading is the one that counts
        for obj in frame["events"]:
            event = decode_event(obj)
            if isinstance(event, FINAL_EVENTS):
                del self.expect[at[event.index]]
            self._push(event)

    def _want(self) -> int:
        if self.stopping or self.over():
            return 0
        depth = self.capacity + self.lookahead
        if self.order is not None and len(self.order) >= HOLD * self.size * depth:
            return 0  # an old record is still generating: do not read further ahead of it
        left = None if self.input.eof is None else self.input.eof - self.input.frontier
        if left is not None and left < self.size * depth:
            # Near the end, no lookahead and an equal share of what is left: under --batch the first rank
            # to ask would otherwise take it all and leave the others idle.
            share = -(-left // self.size)
            return max(0, min(self.capacity, share) - self.held)
        return max(0, depth - self.held)

    def _assign(self, wants: list[int]) -> None:
        """Hand out the next positions, in order, to the ranks in rank order: the same on every rank."""
        for rank, want in enumerate(wants):
            for _ in range(want):
                if (taken := self.input.take()) is None:
                    return
                position, record = taken
                if self.order is not None:
                    self.order.admit(record.index)
                if rank != self.rank:
                    self.expect[position] = (rank, record.index)
                    continue
                self.held += 1
                self.mine_at[record.index] = position
                if not self.stopping:  # stopped since its frame: the record is never started
                    self.handed.append(record)

    def _stop(self) -> None:
        """Take no more records; those handed out but not started are left (the output stops before them)."""
        self.stopping = True
        self.handed.clear()

    def _push(self, event: Event) -> None:
        if self.error is not None:
            return  # the run ends with an error: only whole records before it were written
        if self.order is None:
            self.ready.append(event)
        else:
            self.ready.extend(self.order.push(event))
