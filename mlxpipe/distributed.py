"""Records spread over the ranks of an ``mlx.launch`` job; rank 0 writes everything, in input order.

This room touches mlx only for transport (``mx.distributed``); generation stays in :mod:`mlxpipe.engine`.

Split: every rank reads the same FILE arguments, so every rank sees the same records in the same order;
the ``n``-th of them (0-based, bad records included) belongs to rank ``n % size``. Positions, not record
numbers, so that records skipped on every rank alike (``--resume``) still leave no rank idle. A rank
answers only its own records, through :func:`mlxpipe.pipeline.run`, so each is generated exactly once.
Before anything else the ranks compare a digest of the files' contents (:func:`same_input`): a host with a
different copy would number the records differently, and its answers would land on the wrong records.
Whatever decides which records are skipped must likewise be the same on every rank: rank 0 can share it
with :func:`broadcast`.

Protocol, in lockstep rounds: in round ``k`` every rank answers its next own record (the one at
position ``k * size + rank``), then all ranks call :meth:`Ranks.gather` with one frame each:

1. ``all_gather`` of one int32 per rank: the byte length of each rank's frame;
2. ``all_gather`` of a uint8 buffer as long as the longest frame (shorter frames zero-padded).

A frame is UTF-8 JSON ``{"events": [...], "end": bool, "stop": int, "at": int | null}``: the record's
chunk events and its one final event (see :func:`encode_event`), ``end`` once the rank has no record left,
``stop`` the signal number that interrupted it (0 if none), and ``at`` the record's position, which rank 0
checks against its own reading (a mismatch raises :class:`RanksDisagree`).

After the gather every rank holds the round's records in rank order, which is input order, and takes them
up to the first rank that sent no record: at the end of the input that is where the records run out; when
a rank was stopped before its next record, the later ranks' records of that round are dropped, so the
output is always records 1..K, whole and in order, and a rerun with ``--resume`` does the rest. The run
ends after the round in which every rank says ``end``, or any rank says ``stop``. Rank 0's own record is
first in every round, so it streams live; the other ranks' records follow when the round's gather returns.

``all_gather`` is used rather than ``send``/``recv`` because the ring backend only sends to its two
neighbours, while a collective reaches rank 0 from any number of hosts. A rank that dies closes its
sockets: the next gather fails on the others and raises :class:`RankLost`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Callable, Generator, Iterable, Iterator
from typing import Any, cast

from .cpu import mlx_core
from .events import FINAL_EVENTS, Chunk, Done, Error, Event
from .interface import EngineLike, ShouldStop
from .records import BadRecord, Record

_KINDS: dict[str, type[Chunk] | type[Done] | type[Error]] = {"chunk": Chunk, "done": Done, "error": Error}


class RankLost(Exception):
    """Another rank of the job went away (it died, or its host dropped off): the run cannot go on."""


class RanksDisagree(Exception):
    """Another rank read a different stream of records (another input, another ``--resume`` file)."""


class _Ledger:
    """Rank 0's check that every rank answers the record rank 0 read at that rank's positions.

    Rank 0's reader notes the record number at each position another rank owns; each record gathered
    from a rank is a claim (position, number), settled once rank 0's reader has passed that position.
    Only unsettled positions are kept: about one round's worth.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self.seen: dict[int, int] = {}  # position -> record number, as rank 0 read it
        self.claims: dict[int, int] = {}  # position -> record number, as its rank answered it

    def settle(self, final: bool) -> None:
        """Compare what can be compared; at the end, every position must have been both read and answered."""
        for position, number in list(self.claims.items()):
            if position in self.seen:
                read = self.seen.pop(position)
                del self.claims[position]
                if read != number:
                    rank = position % self.size
                    raise RanksDisagree(
                        f"rank {rank} answered record {number} where rank 0 read record {read}"
                    )
        if final and self.claims:
            position, number = next(iter(self.claims.items()))
            raise RanksDisagree(
                f"rank {position % self.size} answered record {number}, past the end of rank 0's input"
            )
        if final and self.seen:
            position, read = next(iter(self.seen.items()))
            raise RanksDisagree(f"rank {position % self.size} never answered record {read}")


def launched() -> bool:
    """True when some MLX launcher started this process (its rank variables are set)."""
    return any(k in os.environ for k in ("MLX_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK"))


class Ranks:
    """This process's place in the job: ``rank`` of ``size``; ``size`` is 1 when not launched."""

    def __init__(self, group: Any = None) -> None:
        self.group = group
        self.rank = group.rank() if group is not None else 0
        self.size = group.size() if group is not None else 1
        self.stop_signal = 0  # set by :func:`run` when some rank was interrupted by a signal

    @classmethod
    def init(cls) -> Ranks:
        """Join the job ``mlx.launch`` started, if any (``mx.distributed.init``); else one rank alone."""
        if not launched():
            return cls()  # skip init: a single process needs no backend at all
        return cls(mlx_core().distributed.init())

    def gather(self, frame: bytes) -> list[bytes]:
        """Every rank's ``frame``, in rank order, on every rank (two ``all_gather`` calls)."""
        if self.size == 1:
            return [frame]
        mx = mlx_core()
        try:
            # The CPU stream: the ring and MPI backends move host memory.
            lengths = mx.distributed.all_gather(mx.array([len(frame)], mx.int32), stream=mx.cpu)
            sizes = [int(n) for n in cast("list[int]", lengths.tolist())]
            if not max(sizes):
                return [b""] * self.size
            padded = frame + bytes(max(sizes) - len(frame))
            # mx.array reads and exposes the buffer protocol; its type stubs do not say so.
            data = mx.distributed.all_gather(mx.array(cast(Any, memoryview(padded))), stream=mx.cpu)
            mx.eval(data)
        except RuntimeError as exc:
            raise RankLost(str(exc)) from None
        raw = bytes(cast(Any, data))
        width = max(sizes)
        return [raw[r * width : r * width + n] for r, n in enumerate(sizes)]


def fingerprint(files: list[str]) -> str:
    """A digest of the input files' contents (not their names), to check that every rank reads the same."""
    digest = hashlib.sha256()
    for name in files:
        with open(name, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
        digest.update(b"\0end of file\0")
    return digest.hexdigest()


def same_input(ranks: Ranks, files: list[str], problem: str | None) -> str | None:
    """Compare the input on every rank (one gather before any model is loaded).

    ``problem`` is this rank's own reason it cannot start (a file it cannot open), or None. Returns
    the job's first problem, the same on every rank: one rank's ``problem`` or a file mismatch.
    """
    mine = {"problem": problem} if problem else {"digest": fingerprint(files)}
    views = [json.loads(v) for v in ranks.gather(json.dumps(mine).encode())]
    for rank, view in enumerate(views):
        if "problem" in view:
            return view["problem"] if rank == 0 else f"rank {rank}: {view['problem']}"
    for rank, view in enumerate(views):
        if view["digest"] != views[0]["digest"]:
            return (
                f"rank {rank} reads different input from rank 0's: every host needs the same copy of "
                "the FILE arguments"
            )
    return None


def broadcast(ranks: Ranks, data: bytes) -> bytes:
    """Rank 0's ``data`` on every rank (what the others pass is ignored): e.g. what ``--resume`` skips."""
    return ranks.gather(data if ranks.rank == 0 else b"")[0]


def encode_event(event: Event) -> dict[str, Any]:
    """An event as a JSON object with every field (``index`` and unrounded rates included)."""
    return {"kind": event.kind, **dataclasses.asdict(event)}


def decode_event(obj: dict[str, Any]) -> Event:
    """The inverse of :func:`encode_event`."""
    fields = dict(obj)
    return _KINDS[fields.pop("kind")](**fields)


def _frame(events: list[Event], end: bool, stop: int, at: int | None) -> bytes:
    body = {"events": [encode_event(e) for e in events], "end": end, "stop": stop, "at": at}
    return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()


def run(
    records: Iterable[Record | BadRecord],
    engine: EngineLike,
    ranks: Ranks,
    should_stop: ShouldStop,
    signal_number: Callable[[], int | None],
    batch: int = 1,
    ordered: bool = True,
) -> Generator[Event, None, None]:
    """Answer this rank's share of ``records``; yield every rank's events, in input order, on every rank.

    ``batch`` and ``ordered`` are :func:`mlxpipe.pipeline.run`'s, applied to this rank's own records.
    Rank 0 yields its own record's events as they stream, then the other ranks' records of the round.
    Other ranks yield the same events once each round is gathered (for the exit status; they write
    nothing). ``signal_number`` names the signal behind ``should_stop``; when any rank was stopped,
    ``ranks.stop_signal`` holds its number afterwards. Raises :class:`RankLost` when a rank goes away.
    """
    from .pipeline import run as run_pipeline

    ledger = _Ledger(ranks.size) if ranks.rank == 0 else None
    positions: dict[int, int] = {}  # record number -> position, for this rank's records in flight

    def mine() -> Iterator[Record | BadRecord]:
        for n, record in enumerate(records):
            if n % ranks.size == ranks.rank:
                positions[record.index] = n
                yield record
            elif ledger is not None:
                ledger.seen[n] = record.index

    own = run_pipeline(mine(), engine, should_stop, batch=batch, ordered=ordered)
    try:
        while True:
            events: list[Event] = []
            end, at = True, None
            for event in own:
                events.append(event)
                if ranks.rank == 0:
                    yield event
                if isinstance(event, FINAL_EVENTS):
                    end, at = False, positions.pop(event.index, None)
                    break
            stop = (signal_number() or 0) if should_stop() else 0
            frames = [json.loads(f) for f in ranks.gather(_frame(events, end, stop, at))]
            for rank, frame in enumerate(frames):
                finals = [e for e in frame["events"] if e["kind"] in ("done", "error")]
                if not finals:
                    break  # a rank without a record ends the round: the output stays a prefix of the input
                if ledger is not None and rank:
                    ledger.claims[frame["at"]] = finals[-1]["index"]
                if rank != 0 or ranks.rank != 0:
                    yield from (decode_event(e) for e in frame["events"])
            ranks.stop_signal = next((f["stop"] for f in frames if f["stop"]), 0)
            last = ranks.stop_signal or all(f["end"] for f in frames)
            if ledger is not None:
                ledger.settle(final=bool(last) and not ranks.stop_signal)
            if last:
                return
    finally:
        own.close()
