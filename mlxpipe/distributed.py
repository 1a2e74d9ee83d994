"""Records spread over the ranks of an ``mlx.launch`` job, handed out on demand; rank 0 writes everything.

This room touches mlx only for transport, and under ``mlx.launch --backend ring`` not at all: the ranks find
each other through the ring's hostfile (:mod:`mlxpipe.link`); under other backends through ``mx.distributed``;
generation stays in :mod:`mlxpipe.engine`.

Input: every rank reads the same FILE arguments, so every rank sees the same records in the same order and
can name a record by its *position* (0-based, bad records included; records ``--resume`` skips are not in
the stream, on any rank). Before anything else the ranks compare a digest of the files' contents
(:func:`same_input`); what decides which records are skipped must be the same on every rank too (rank 0
shares it with :func:`broadcast`).

Ticks. The ranks exchange frames in *ticks*: one :meth:`Ranks.gather` that every rank makes. Over the TCP
link (the default: every rank connected to rank 0 by a blocking socket, :func:`mlxpipe.link.join`), a helper
thread of each rank, the *exchange*, ticks every ``EXCHANGE_SECONDS`` whatever the rank computes: the main
thread only hands it events and takes records, and a wait sleeps in the kernel. With ``MLXPIPE_LINK=off``
(or where a rank cannot reach rank 0) the gather is mlx's (an ``all_gather`` of the frames' lengths, then
one of the zero-padded frames, on a CPU stream of its own), which only the main thread may call: the rank
ticks where it polls for a stop anyway: once per token while generating, once per step under ``--batch``
(:func:`mlxpipe.pipeline.run` calls ``should_stop`` there), at most every ``TICK_SECONDS`` and every
``TICK_POLLS`` polls (timed: a prefill is one long poll); and at once, again and again, while it waits for
work or for the job's end, so a waiting rank never paces the others. A frame is UTF-8 JSON::

    {"events": [...], "at": {"<record number>": position}, "want": int, "eof": int | null,
     "idle": bool, "stopped": bool, "stop": int, "quit": str | null}

``events``: the rank's chunk and final events since its last tick (:func:`encode_event`), ``at`` their
records' positions; ``want``: how many more records it asks for (``--batch`` N, or 1, plus ``LOOKAHEAD``,
N/4 under ``--batch``, so that it starts its next record without waiting for a tick, minus what it holds;
no lookahead, and at most an equal share of what is left, once fewer records are left than the ranks could
hold, where it would leave a rank idle at the end; 0 while more than ``HOLD`` * ranks * that depth records
are read but not yet written, behind one old record still generating);
``eof``: the number of records in its input once it has read the end; ``idle``: its own pipeline has
finished (the end of input, or a stop); ``stopped``/``stop``: a signal stopped it (the signal's number);
``quit``: it leaves the job now (``closed`` when its events were closed: ``--fail-fast``, a closed stdout;
otherwise the error it raises).

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
job at once; a rank that quits with an error is reported by rank 0 as :class:`RankLost`.

Checks. Each rank knows which record every position holds; rank 0 raises :class:`RanksDisagree` when a rank
answers a record other than the one rank 0 read at that position, past the end of rank 0's input, reports an
input of another length, or never answers a record handed to it. ``all_gather`` is used rather than
``send``/``recv`` because the ring backend only sends to its two neighbours, while a collective reaches every
rank from any number of hosts. A rank that dies closes its sockets: the next gather fails on the others and
raises :class:`RankLost`. ``TICK_SECONDS``, ``TICK_POLLS`` and ``LOOKAHEAD`` can be set through
``MLXPIPE_TICK_SECONDS``, ``MLXPIPE_TICK_POLLS`` and ``MLXPIPE_LOOKAHEAD``, for measuring
(bench/distributed.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import queue
import socket
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Generator, Iterable, Iterator
from typing import Any, cast

from . import link
from .cpu import mlx_core
from .events import FINAL_EVENTS, Chunk, Done, Error, Event
from .interface import EngineLike, ShouldStop
from .records import BadRecord, Record
from .switches import OFF, setting

_KINDS: dict[str, type[Chunk] | type[Done] | type[Error]] = {"chunk": Chunk, "done": Done, "error": Error}


class RankLost(Exception):
    """Another rank of the job went away (it died, or its host dropped off): the run cannot go on."""


class RanksDisagree(Exception):
    """Another rank read a different stream of records (another input, another ``--resume`` file)."""


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
        self.gathers = 0
        self.gather_seconds = 0.0  # waiting for the slowest rank included
        self.star: link.Star | None = None  # the ranks' own TCP link, once every rank has joined it
        self.threaded = False  # gather may be called from a helper thread (not through mlx)
        self._stream: Any = None

    @classmethod
    def init(cls) -> Ranks:
        """Join the job ``mlx.launch`` started, if any (``mx.distributed.init``), and its TCP link (unless
        ``MLXPIPE_LINK=off``); else one rank alone."""
        if not launched():
            return cls()  # skip init: a single process needs no backend at all
        mode = setting(LINK).lower()
        hosts = link.ring_hosts() if mode not in OFF and mode != "mlx" else None
        rank = int(os.environ.get("MLX_RANK", "-1")) if os.environ.get("MLX_RANK", "").isdigit() else -1
        if hosts is not None and 0 <= rank < len(hosts):
            # mlx.launch --backend ring: the link alone, mlx's ring is never set up
            ranks = cls()
            try:
                ranks.star = link.join(rank, hosts)
            except link.Lost as exc:
                raise RankLost(str(exc)) from None
            ranks.rank, ranks.size, ranks.threaded = rank, len(hosts), True
            return ranks
        ranks = cls(mlx_core().distributed.init())
        if ranks.size > 1 and mode not in OFF:
            ranks.connect()
        return ranks

    def connect(self) -> bool:
        """Set up the TCP link (:mod:`mlxpipe.link`) through two gathers over mlx; True when every rank
        joined it. Where some rank cannot reach rank 0 the job stays on mlx's gather."""
        server, card = None, None
        if self.rank == 0:
            with contextlib.suppress(OSError):
                server, card = link.listen()
        card = json.loads(self._gather(json.dumps(card).encode())[0])
        peers: list[socket.socket] | None = None
        if card is not None:
            if self.rank == 0 and server is not None:
                peers = link.accept(server, card, self.size)
            elif self.rank:
                sock = link.connect(card, self.rank)
                peers = [sock] if sock is not None else None
        joined = all(f == b"1" for f in self._gather(b"1" if peers else b"0"))
        if joined and peers:
            self.star, self.threaded = link.Star(self.rank, self.size, peers), True
        else:
            for sock in peers or []:
                sock.close()
        return joined

    def gather(self, frame: bytes) -> list[bytes]:
        """Every rank's ``frame``, in rank order, on every rank: over the TCP link, else two ``all_gather``
        calls (on the main thread only)."""
        if self.size == 1:
            return [frame]
        started = time.perf_counter()
        try:
            if self.star is not None:
                try:
                    return self.star.gather(frame)
                except link.Lost as exc:
                    raise RankLost(str(exc)) from None
            return self._gather(frame)
        finally:
            self.gathers += 1
            self.gather_seconds += time.perf_counter() - started

    def _gather(self, frame: bytes) -> list[bytes]:
        mx = mlx_core()
        if self._stream is None:
            # A CPU stream of its own (the ring and MPI backends move host memory): mlx runs each stream on
            # its own thread, so the exchange does not queue behind the token being computed meanwhile.
            own = os.environ.get(GATHER_STREAM, "own") != "default"
            self._stream = mx.new_stream(mx.cpu) if own else mx.cpu
        try:
            lengths = mx.distributed.all_gather(mx.array([len(frame)], mx.int32), stream=self._stream)
            sizes = [int(n) for n in cast("list[int]", lengths.tolist())]
            if not max(sizes):
                return [b""] * self.size
            padded = frame + bytes(max(sizes) - len(frame))
            # mx.array reads and exposes the buffer protocol; its type stubs do not say so.
            data = mx.distributed.all_gather(mx.array(cast(Any, memoryview(padded))), stream=self._stream)
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


def _env_number(name: str, default: float) -> float:
    try:
        return float(os.environ.get(name, default))
    except ValueError:
        return default


# A tick holds every rank until the last one reaches it (about half a token, or half a --batch step, each:
# measured), and mlx's ring backend busy-polls its sockets meanwhile, on the core the rank computes on. So a
# rank that generates ticks at most every TICK_SECONDS, and at most every TICK_POLLS of its polls (tokens or
# steps): the ticks then cost a few percent, whatever a token costs (bench/RESULTS.md, issue 23). Waiting
# ranks tick at once.
TICK_SECONDS = _env_number("MLXPIPE_TICK_SECONDS", 0.1)
TICK_POLLS = _env_number("MLXPIPE_TICK_POLLS", 8)
# Records a rank holds beyond what it generates at once (1 sequential, --batch N; N/4 more under --batch,
# where records end more often between two ticks), so that it starts its next record without waiting for a
# tick; none near the end of the input, where it would unbalance the ranks.
LOOKAHEAD = int(_env_number("MLXPIPE_LOOKAHEAD", 1))
GATHER_STREAM = "MLXPIPE_GATHER_STREAM"  # "default": the gather queues behind the token (to measure)
TICK_STATS = "MLXPIPE_TICK_STATS"  # set: each rank says on stderr how many ticks it made, and their time
HOLD = 4  # records read but not yet written, at most HOLD * ranks * depth: then no rank asks for more
# Over the TCP link the ticks run on a helper thread, every EXCHANGE_SECONDS, whatever the rank computes: a
# tick then costs its rank only the frame's encoding (the wait sleeps in the kernel), and a waiting rank
# gets work within one period.
EXCHANGE_SECONDS = _env_number("MLXPIPE_EXCHANGE_SECONDS", 0.02)
# "off": the ticks go through mlx's gather on the main thread (to measure); "mlx": the link is set up through
# mlx even under the ring backend (to test that path).
LINK = "MLXPIPE_LINK"


def run(
    records: Iterable[Record | BadRecord],
    engine: EngineLike,
    ranks: Ranks,
    should_stop: ShouldStop,
    signal_number: Callable[[], int | None],
    batch: int = 1,
    ordered: bool = True,
) -> Generator[Event, None, None]:
    """Answer the records handed to this rank; yield every rank's events, in input order, on every rank.

    ``batch`` and ``ordered`` are :func:`mlxpipe.pipeline.run`'s: each rank generates up to ``batch``
    records at once, and the events of all ranks are put back into input order unless ``ordered`` is
    false. Rank 0's own records stream live when they are the oldest unwritten one; the others' events
    arrive at the ticks. Every rank yields the same events (the others count them, for the exit status).
    ``signal_number`` names the signal behind ``should_stop``; when any rank was stopped,
    ``ranks.stop_signal`` holds its number afterwards. Raises :class:`RankLost` when a rank goes away, and
    (rank 0) :class:`RanksDisagree` when a rank answered a record other than the one rank 0 read there.
    """
    from .pipeline import run as run_pipeline

    job = _Job(records, ranks, should_stop, signal_number, batch, ordered)
    own: Generator[Event, None, None] | None = None
    try:
        job.start()
        # A rank's share arrives record by record: one record so far is no lone input.
        own = run_pipeline(job.mine(), engine, job.poll, batch=batch, ordered=False, lone_alone=False)
        for event in own:
            job.own(event)
            yield from job.release()
        job.finish()
        while not job.ended and job.error is None:
            job.wait_or_tick()
            yield from job.release()
        yield from job.release()
        if job.error is not None:
            raise job.error
    finally:
        job.close()
        if own is not None:
            own.close()
        if os.environ.get(TICK_STATS):
            sys.stderr.write(
                f"mlxpipe[rank {ranks.rank}]: {ranks.gathers} ticks ({ranks.gather_seconds:.2f} s in the "
                f"gathers), {job.busy_ticks} of them while generating ({job.busy_seconds:.2f} s)\n"
            )


class _Job:
    """One rank's side of the protocol (see the module docstring): what it holds, reads, sends, writes."""

    def __init__(
        self,
        records: Iterable[Record | BadRecord],
        ranks: Ranks,
        should_stop: ShouldStop,
        signal_number: Callable[[], int | None],
        batch: int,
        ordered: bool,
    ) -> None:
        from .pipeline import _InputOrder

        self.records = iter(records)
        self.ranks = ranks
        self.should_stop = should_stop
        self.signal_number = signal_number
        self.batch = batch
        self.capacity = batch  # records this rank generates at once
        self.lookahead = max(LOOKAHEAD, batch // 4) if LOOKAHEAD > 0 else 0
        self.order = _InputOrder() if ordered else None
        self.ahead: deque[Record | BadRecord] = deque()  # read, not yet handed out
        self.eof: int | None = None  # how many records the input has, once its end was read
        self.frontier = 0  # positions handed out so far
        self.held = 0  # records handed to this rank and not yet finished
        self.inbox: deque[Record | BadRecord] = deque()  # handed to this rank, not yet started (sequential)
        self.feed: queue.Queue[Record | BadRecord | None] = queue.Queue()  # the same under --batch
        self.fed_all = False
        self.mine_at: dict[int, int] = {}  # record number -> position, for this rank's records
        self.expect: dict[int, tuple[int, int]] = {}  # position -> (rank, record number), the others' records
        self.outbox: list[Event] = []  # own events not yet sent
        self.ready: deque[Event] = deque()  # events that may be yielded now
        self.stopping = False
        self.stop = 0  # the signal that stopped this rank (0: none, or no number)
        self.stopped = False
        self.finished = False  # the own pipeline has returned: nothing in flight, nothing to send
        self.ended = False  # the job is over: no more ticks
        self.error: Exception | None = None
        self.last = 0.0
        self.polled = 0.0  # when the pipeline last polled
        self.poll_seconds = 0.0  # between two polls, on average (recent ones weigh more)
        self.progressed = False  # an own event since the last poll
        self.busy_ticks = 0  # ticks made while generating (at the pipeline's polls), and their time
        self.busy_seconds = 0.0
        # Over the TCP link a helper thread ticks (the exchange); the lock guards what it shares with the
        # main thread. Without it the main thread ticks, and the lock is never contended.
        self.threaded = ranks.threaded
        self.lock = threading.Condition(threading.RLock())
        self.exchange: threading.Thread | None = None
        self.begun = False  # the first tick is over
        self.quitting: str | None = None  # the reason this rank leaves, for the exchange's last tick

    # -- hooks for the pipeline

    def start(self) -> None:
        """The first tick: every rank gets its first records before generating."""
        if self.threaded:
            # The input is read on the exchange thread from the start (a read marked as on the main thread
            # would let a signal raise in the middle of a token).
            self.exchange = threading.Thread(target=self._exchange, name="mlxpipe-exchange", daemon=True)
            self.exchange.start()
            with self.lock:
                while not self.begun and self.error is None:
                    self.lock.wait()
        else:
            self._read_ahead()
            self.tick()
        if self.error is not None:
            raise self.error

    def _exchange(self) -> None:
        """The exchange thread: a tick every ``EXCHANGE_SECONDS`` until the job ends or this rank quits."""
        try:
            self._exchanges()
        except BaseException as exc:  # not raised by a tick: a bug, or the interpreter going away
            with self.lock:
                self.error = self.error or RankLost(f"the exchange with the other ranks failed: {exc!r}")
                self._stop()
        finally:
            with self.lock:  # whatever happened, nobody waits for this thread any more
                self.begun = self.ended = True
                self.lock.notify_all()

    def _exchanges(self) -> None:
        with self.lock:
            try:
                self._read_ahead()
            except Exception as exc:
                self.error = exc
                self._stop()
        self.tick()
        with self.lock:
            self.begun = True
            self.lock.notify_all()
        while True:
            with self.lock:
                due = self.last + EXCHANGE_SECONDS
                while not self.ended and self.quitting is None and (now := time.monotonic()) < due:
                    self.lock.wait(due - now)
                if self.ended:
                    return
                quit = self.quitting
            if quit is not None:
                with contextlib.suppress(Exception):
                    self._tick(quit=quit)
                return
            self.tick()

    def mine(self) -> Iterator[Record | BadRecord]:
        """The records handed to this rank, as the pipeline takes them.

        Sequential, the pipeline asks on the main thread: wait for work there, ticking. Under ``--batch``
        it reads on a helper thread, which must not touch mlx: it only takes what the ticks put in the feed.
        """
        if self.batch > 1:
            while (item := self.feed.get()) is not None:
                yield item
            return
        while (record := self._next()) is not None:
            yield record

    def _next(self) -> Record | BadRecord | None:
        with self.lock:
            while not self.inbox and not self._over() and not self.ended:
                if self.threaded:
                    self.lock.wait()  # the exchange thread hands out records
                else:
                    self.tick()  # waiting for work: tick as soon as the others do
            if self.stopping or not self.inbox:
                return None
            return self.inbox.popleft()

    def poll(self) -> bool:
        """The pipeline's ``should_stop``: once per token (per step under ``--batch``), tick when due."""
        if self.threaded:
            with self.lock:
                self._notice_stop()
                return self.stopping
        self._notice_stop()
        now = time.monotonic()
        # Under --batch the pipeline also polls while it waits for a record (nothing in flight, no events
        # since the last poll): then tick at once, as a waiting rank does.
        waiting = self.batch > 1 and not self.progressed
        if self.polled and not waiting:  # the time between two polls, ticks left out: a token, or a step
            self.poll_seconds += 0.2 * (now - self.polled - self.poll_seconds)
        self.polled, self.progressed = now, False
        every = max(TICK_SECONDS, TICK_POLLS * self.poll_seconds)
        if not self.ended and self.error is None and (waiting or now - self.last >= every):
            self.tick()
            self.busy_ticks += 1
            self.busy_seconds += time.monotonic() - now
            self.polled = time.monotonic()
        return self.stopping

    def own(self, event: Event) -> None:
        """An event of this rank's own records: to send at the next tick, and to write in its turn."""
        with self.lock:
            self.outbox.append(event)
            self.progressed = True
            if isinstance(event, FINAL_EVENTS):
                self.held -= 1
            self._push(event)

    def release(self) -> Iterator[Event]:
        """The events that may be written now."""
        with self.lock:
            ready, self.ready = self.ready, deque()
        yield from ready

    def finish(self) -> None:
        """This rank's own pipeline has returned: nothing in flight, nothing more to send."""
        with self.lock:
            self.finished = True

    def wait_or_tick(self) -> None:
        """After this rank's own records, until the job ends: wait for the others' events."""
        if not self.threaded:
            self.tick()
            return
        with self.lock:
            if not self.ended and self.error is None and not self.ready:
                self.lock.wait()

    def close(self) -> None:
        """The job ends here for this rank: tell the others, unless the job ended for all."""
        self.feed.put(None)  # a helper thread waiting for records goes
        exc = sys.exc_info()[1]
        reason = "closed" if exc is None or isinstance(exc, GeneratorExit) else str(exc) or type(exc).__name__
        if self.exchange is not None:
            with self.lock:
                if not self.ended:
                    self.quitting = reason
                    self.lock.notify_all()
            # The exchange's last tick tells the others; a rank that hangs is the launcher's to end.
            self.exchange.join(timeout=60)
            return
        if self.ended:
            return
        with contextlib.suppress(Exception):
            self._tick(quit=reason)

    # -- the protocol

    def tick(self) -> None:
        """One exchange with every rank; an error ends the job here (raised by :func:`run`)."""
        try:
            self._tick()
        except RankLost as exc:
            with self.lock:
                self.error, self.ended = exc, True
                self._stop()
                self.lock.notify_all()
        except Exception as exc:  # RanksDisagree, a failed read: the others are told as this rank quits
            with self.lock:
                self.error = exc
                self._stop()
                self.lock.notify_all()

    def _notice_stop(self) -> None:
        if not self.stopping and self.should_stop():
            self.stop, self.stopped = self.signal_number() or 0, True
            self._stop()

    def _tick(self, quit: str | None = None) -> None:
        with self.lock:  # the frame is built under the lock, the gather waits without it
            self._notice_stop()  # before the frame: a signal may also have cut this rank's input short
            outbox, self.outbox = self.outbox, []
            # Whether this rank had stopped when it wrote its frame: what it decides after the gather must not
            # depend on a stop its main thread noticed meanwhile, which the others do not know of.
            halted = self.stopping
            body = {
                "events": [encode_event(e) for e in outbox],
                "at": {str(i): self.mine_at[i] for i in {e.index for e in outbox}},
                "want": self._want(),
                "eof": self.eof,
                "idle": self.finished,
                "stopped": self.stopped,
                "stop": self.stop,
                "quit": quit,
            }
        frame = json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()
        frames = [json.loads(f) for f in self.ranks.gather(frame)]
        with self.lock:
            self._apply(frames, [e.index for e in outbox if isinstance(e, FINAL_EVENTS)], quit, halted)
            self.lock.notify_all()

    def _apply(self, frames: list[dict[str, Any]], finals: list[int], quit: str | None, halted: bool) -> None:
        """One tick's frames, alike on every rank: events, stops, the end, the records handed out."""
        self.last = time.monotonic()
        for index in finals:
            del self.mine_at[index]
        if quit is not None:
            self.ended = True
            return
        for rank, f in enumerate(frames):
            if rank != self.ranks.rank:
                self._take(rank, f)
        for rank, f in enumerate(frames):
            if f["quit"] is not None:  # a rank went (--fail-fast, a closed pipe, an error): so does the job
                self.ended = True
                if f["quit"] != "closed" and rank != 0 and self.error is None:
                    self.error = RankLost(f"rank {rank} failed: {f['quit']}")
                self._stop()
                return
        if any(f["stopped"] for f in frames):
            self.ranks.stop_signal = next((f["stop"] for f in frames if f["stop"]), 0)
            self._stop()
            halted = True
        if self.ranks.rank == 0 and not halted:
            self._check_ends(frames)
        if all(f["idle"] for f in frames):
            self.ended = True
            if self.ranks.rank == 0 and not halted and self.expect:
                rank, number = min(self.expect.items())[1]
                raise RanksDisagree(f"rank {rank} never answered record {number}")
            return
        if not halted:
            self._assign([f["want"] for f in frames])
            self._read_ahead()

    def _take(self, rank: int, frame: dict[str, Any]) -> None:
        """Another rank's events: checked against this rank's reading, then put in order."""
        at = {int(i): p for i, p in frame["at"].items()}
        for index, position in at.items():
            if self.expect.get(position) == (rank, index):
                continue
            if self.ranks.rank == 0:
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

    def _check_ends(self, frames: list[dict[str, Any]]) -> None:
        """Rank 0: every rank's input ends where rank 0's does."""
        for rank, f in enumerate(frames):
            end = f["eof"]
            if end is None or end == self.eof:
                continue
            if self.eof is not None or self.frontier + len(self.ahead) > end:
                mine = "after " + str(self.eof) if self.eof is not None else "later"
                raise RanksDisagree(f"rank {rank}'s input ends after {end} records, rank 0's {mine}")

    def _want(self) -> int:
        if self.stopping or self._over():
            return 0
        depth = self.capacity + self.lookahead
        if self.order is not None and len(self.order) >= HOLD * self.ranks.size * depth:
            return 0  # an old record is still generating: do not read further ahead of it
        if self.eof is not None and self.eof - self.frontier < self.ranks.size * depth:
            # Near the end, no lookahead and an equal share of what is left: under --batch the first rank
            # to ask would otherwise take it all and leave the others idle.
            share = -(-(self.eof - self.frontier) // self.ranks.size)
            return max(0, min(self.capacity, share) - self.held)
        return max(0, depth - self.held)

    def _assign(self, wants: list[int]) -> None:
        """Hand out the next positions, in order, to the ranks in rank order: the same on every rank."""
        for rank, want in enumerate(wants):
            for _ in range(want):
                if not self.ahead:
                    self._read(1)
                if not self.ahead:
                    return
                record = self.ahead.popleft()
                position, self.frontier = self.frontier, self.frontier + 1
                if self.order is not None:
                    self.order.admit(record.index)
                if rank != self.ranks.rank:
                    self.expect[position] = (rank, record.index)
                    continue
                self.held += 1
                self.mine_at[record.index] = position
                if self.batch > 1:
                    self.feed.put(record)
                else:
                    self.inbox.append(record)
        if self.batch > 1 and self._over() and not self.fed_all:
            self.fed_all = True
            self.feed.put(None)

    def _read_ahead(self) -> None:
        """Read far enough to know whether the input ends within what every rank could take."""
        depth = self.capacity + self.lookahead
        self._read(self.ranks.size * depth + 1 - len(self.ahead))
        if self.batch > 1 and self._over() and not self.fed_all:
            self.fed_all = True
            self.feed.put(None)

    def _read(self, n: int) -> None:
        for _ in range(n):
            if self.eof is not None:
                return
            try:
                self.ahead.append(next(self.records))
            except StopIteration:
                self.eof = self.frontier + len(self.ahead)

    def _over(self) -> bool:
        """No record will be handed to this rank any more."""
        return self.stopping or self.ended or (self.eof is not None and not self.ahead)

    def _stop(self) -> None:
        """Take no more records; those handed out but not started are left (the output stops before them)."""
        self.stopping = True
        self.inbox.clear()
        if self.batch > 1 and not self.fed_all:
            self.fed_all = True
            self.feed.put(None)

    def _push(self, event: Event) -> None:
        if self.error is not None:
            return  # the run ends with an error: only whole records before it were written
        if self.order is None:
            self.ready.append(event)
        else:
            self.ready.extend(self.order.push(event))
