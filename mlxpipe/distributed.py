"""Records spread over the ranks of an ``mlx.launch`` job, handed out on demand; rank 0 writes everything.

The protocol's rules (the frames, who is handed which record, what is written, when the job ends, the
checks) are :mod:`mlxpipe.distributed_rules`'s, written down there once. This module is their transport
(:class:`Ranks`) and their glue to the pipeline (:func:`run`).

Transport. This room touches mlx only for transport, and under ``mlx.launch --backend ring`` not at all: the
ranks find each other through the ring's hostfile (:mod:`mlxpipe.link`); under other backends through
``mx.distributed``; generation stays in :mod:`mlxpipe.engine`. A tick is one :meth:`Ranks.gather` that every
rank makes. Over the TCP link (the default: every rank connected to rank 0 by a blocking socket,
:func:`mlxpipe.link.join`), a helper thread of each rank, the *exchange*, ticks every ``EXCHANGE_SECONDS``
whatever the rank computes: the main thread only hands it events and takes records, and a wait sleeps in the
kernel. With ``MLXPIPE_LINK=off`` (or where a rank cannot reach rank 0) the gather is mlx's (an
``all_gather`` of the frames' lengths, then one of the zero-padded frames, on a CPU stream of its own), which
only the main thread may call: the rank ticks where it polls for a stop anyway: once per token while
generating, once per step under ``--batch`` (:func:`mlxpipe.pipeline.run` calls ``should_stop`` there), at
most every ``TICK_SECONDS`` and every ``TICK_POLLS`` polls (timed: a prefill is one long poll); and at once,
again and again, while it waits for work or for the job's end, so a waiting rank never paces the others.
``all_gather`` is used rather than ``send``/``recv`` because the ring backend only sends to its two
neighbours, while a collective reaches every rank from any number of hosts. A rank that dies closes its
sockets: the next gather fails on the others and raises :class:`RankLost`. ``TICK_SECONDS``, ``TICK_POLLS``
and ``LOOKAHEAD`` can be set through ``MLXPIPE_TICK_SECONDS``, ``MLXPIPE_TICK_POLLS`` and
``MLXPIPE_LOOKAHEAD``, for measuring (bench/distributed.py).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import queue
import socket
import sys
import threading
import time
from collections.abc import Callable, Generator, Iterable, Iterator
from typing import Any, cast

from . import link
from .cpu import mlx_core
from .distributed_rules import RankLost, RanksDisagree, Rules, decode_event, encode_event
from .events import Event
from .interface import EngineLike, ShouldStop
from .records import BadRecord, Record
from .switches import OFF, setting

__all__ = [
    "RankLost",
    "Ranks",
    "RanksDisagree",
    "broadcast",
    "decode_event",
    "encode_event",
    "fingerprint",
    "launched",
    "run",
    "same_input",
]


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


def _env_number(name: str, default: float) -> float:
    try:
        return float(os.environ.get(name, default))
    except ValueError:
        return default


# A tick holds every rank until the last one reaches it, and mlx's ring backend busy-polls its sockets
# meanwhile, on the rank's core: so a generating rank ticks at most every TICK_SECONDS and every TICK_POLLS of
# its polls (tokens or steps), which keeps the ticks' cost to a few percent. Waiting ranks tick at once.
TICK_SECONDS = _env_number("MLXPIPE_TICK_SECONDS", 0.1)
TICK_POLLS = _env_number("MLXPIPE_TICK_POLLS", 8)
# Records a rank asks for beyond what it generates at once, so that it starts its next record without
# waiting for a tick (distributed_rules.Rules: more under --batch, none near the end of the input).
LOOKAHEAD = int(_env_number("MLXPIPE_LOOKAHEAD", 1))
GATHER_STREAM = "MLXPIPE_GATHER_STREAM"  # "default": the gather queues behind the token (to measure)
TICK_STATS = "MLXPIPE_TICK_STATS"  # set: each rank says on stderr how many ticks it made, and their time
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
        while not job.rules.ended and job.rules.error is None:
            job.wait_or_tick()
            yield from job.release()
        yield from job.release()
        if job.rules.error is not None:
            raise job.rules.error
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
    """One rank's run of the job: its :class:`~mlxpipe.distributed_rules.Rules` fed with ticks (on the main
    thread at the pipeline's polls, or on the exchange thread), and its pipeline fed with the records they
    hand to this rank. The lock guards what the exchange thread shares with the main thread; without that
    thread it is never contended."""

    def __init__(
        self,
        records: Iterable[Record | BadRecord],
        ranks: Ranks,
        should_stop: ShouldStop,
        signal_number: Callable[[], int | None],
        batch: int,
        ordered: bool,
    ) -> None:
        self.rules = Rules(records, ranks.rank, ranks.size, batch=batch, lookahead=LOOKAHEAD, ordered=ordered)
        self.ranks = ranks
        self.should_stop = should_stop
        self.signal_number = signal_number
        self.batch = batch
        # Under --batch the pipeline reads on a helper thread: the records handed to this rank, then None.
        self.feed: queue.Queue[Record | BadRecord | None] = queue.Queue()
        self.fed_all = False
        self.last = 0.0  # when the last tick's frames came in
        self.polled = 0.0  # when the pipeline last polled
        self.poll_seconds = 0.0  # between two polls, on average (recent ones weigh more)
        self.progressed = False  # an own event since the last poll
        self.busy_ticks = 0  # ticks made while generating (at the pipeline's polls), and their time
        self.busy_seconds = 0.0
        self.threaded = ranks.threaded  # over the TCP link: the exchange thread ticks
        self.lock = threading.Condition(threading.RLock())
        self.exchange: _Exchange | None = None

    # -- hooks for the pipeline

    def start(self) -> None:
        """The first tick: every rank gets its first records before generating."""
        if self.threaded:
            # The input is read on the exchange thread from the start (a read marked as on the main thread
            # would let a signal raise in the middle of a token).
            self.exchange = _Exchange(self)
            self.exchange.start()
        else:
            self.rules.read_ahead()
            self.deliver()
            self.tick()
        if self.rules.error is not None:
            raise self.rules.error

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
            while not self.rules.handed and not self.rules.over():
                if self.threaded:
                    self.lock.wait()  # the exchange thread hands out records
                else:
                    self.tick()  # waiting for work: tick as soon as the others do
            if self.rules.stopping or not self.rules.handed:
                return None
            return self.rules.handed.popleft()

    def poll(self) -> bool:
        """The pipeline's ``should_stop``: once per token (per step under ``--batch``), tick when due."""
        if self.threaded:
            with self.lock:
                self._notice_stop()
                return self.rules.stopping
        self._notice_stop()
        now = time.monotonic()
        # Under --batch the pipeline also polls while it waits for a record (nothing in flight, no events
        # since the last poll): then tick at once, as a waiting rank does.
        waiting = self.batch > 1 and not self.progressed
        if self.polled and not waiting:  # the time between two polls, ticks left out: a token, or a step
            self.poll_seconds += 0.2 * (now - self.polled - self.poll_seconds)
        self.polled, self.progressed = now, False
        every = max(TICK_SECONDS, TICK_POLLS * self.poll_seconds)
        if not self.rules.ended and self.rules.error is None and (waiting or now - self.last >= every):
            self.tick()
            self.busy_ticks += 1
            self.busy_seconds += time.monotonic() - now
            self.polled = time.monotonic()
        return self.rules.stopping

    def own(self, event: Event) -> None:
        """An event of this rank's own records: to send at the next tick, and to write in its turn."""
        with self.lock:
            self.rules.own(event)
            self.progressed = True

    def release(self) -> Iterator[Event]:
        """The events that may be written now."""
        with self.lock:
            ready = self.rules.writable()
        yield from ready

    def finish(self) -> None:
        """This rank's own pipeline has returned: nothing in flight, nothing more to send."""
        with self.lock:
            self.rules.finish()

    def wait_or_tick(self) -> None:
        """After this rank's own records, until the job ends: wait for the others' events."""
        if not self.threaded:
            self.tick()
            return
        with self.lock:
            if not self.rules.ended and self.rules.error is None and not self.rules.ready:
                self.lock.wait()

    def close(self) -> None:
        """The job ends here for this rank: tell the others, unless the job ended for all."""
        self.feed.put(None)  # a helper thread waiting for records goes
        exc = sys.exc_info()[1]
        reason = "closed" if exc is None or isinstance(exc, GeneratorExit) else str(exc) or type(exc).__name__
        if self.exchange is not None:
            self.exchange.quit(reason)
            return
        if not self.rules.ended:
            self.leave(reason)

    def leave(self, reason: str) -> None:
        """The last tick: tell the others that this rank leaves the job (whatever fails, it goes)."""
        with contextlib.suppress(Exception):
            self._tick(quit=reason)

    # -- the ticks

    def tick(self) -> None:
        """One exchange with every rank; an error ends the job here (raised by :func:`run`)."""
        try:
            self._tick()
        except Exception as exc:  # RankLost: the others are gone; RanksDisagree, a failed read: they are told
            with self.lock:  # as this rank quits
                self.rules.fail(exc, ended=isinstance(exc, RankLost))
                self.deliver()
                self.lock.notify_all()

    def _tick(self, quit: str | None = None) -> None:
        with self.lock:  # the frame is made under the lock, the gather waits without it
            self._notice_stop()  # before the frame: a signal may also have cut this rank's input short
            said = self.rules.say(quit)
        frame = json.dumps(said.frame, ensure_ascii=False, separators=(",", ":")).encode()
        frames = [json.loads(f) for f in self.ranks.gather(frame)]
        with self.lock:
            self.last = time.monotonic()
            try:
                self.rules.apply(said, frames)
            finally:
                if self.rules.signal is not None:
                    self.ranks.stop_signal = self.rules.signal
                self.deliver()
            self.lock.notify_all()

    def _notice_stop(self) -> None:
        if not self.rules.stopping and self.should_stop():
            self.rules.halt(self.signal_number() or 0)
            self.deliver()

    def deliver(self) -> None:
        """Under ``--batch``, the records the rules handed to this rank into the feed, and None once no more
        will come (sequential, :meth:`_next` takes them from the rules)."""
        if self.batch <= 1:
            return
        while self.rules.handed:
            self.feed.put(self.rules.handed.popleft())
        if self.rules.over() and not self.fed_all:
            self.fed_all = True
            self.feed.put(None)


class _Exchange:
    """Over the TCP link: the thread that ticks for a job's rank every ``EXCHANGE_SECONDS``, whatever the rank
    computes, until the job ends or the rank quits."""

    def __init__(self, job: _Job) -> None:
        self.job = job
        self.begun = False  # the first tick is over
        self.quitting: str | None = None  # the reason the rank leaves, for the last tick
        self.thread = threading.Thread(target=self._run, name="mlxpipe-exchange", daemon=True)

    def start(self) -> None:
        """Start ticking; return once the first tick is over (or the job failed)."""
        job = self.job
        self.thread.start()
        with job.lock:
            while not self.begun and job.rules.error is None:
                job.lock.wait()

    def quit(self, reason: str) -> None:
        """The rank leaves the job: the last tick tells the others, unless the job ended for all."""
        job = self.job
        with job.lock:
            if not job.rules.ended:
                self.quitting = reason
                job.lock.notify_all()
        self.thread.join(timeout=60)  # a rank that hangs is the launcher's to end

    def _run(self) -> None:
        job = self.job
        try:
            self._ticks()
        except BaseException as exc:  # not raised by a tick: a bug, or the interpreter going away
            with job.lock:
                job.rules.fail(
                    job.rules.error or RankLost(f"the exchange with the other ranks failed: {exc!r}")
                )
                job.deliver()
        finally:
            with job.lock:  # whatever happened, nobody waits for this thread any more
                self.begun = job.rules.ended = True
                job.lock.notify_all()

    def _ticks(self) -> None:
        job = self.job
        with job.lock:
            try:
                job.rules.read_ahead()
            except Exception as exc:
                job.rules.fail(exc)
            job.deliver()
        job.tick()
        with job.lock:
            self.begun = True
            job.lock.notify_all()
        while True:
            with job.lock:
                due = job.last + EXCHANGE_SECONDS
                while not job.rules.ended and self.quitting is None and (now := time.monotonic()) < due:
                    job.lock.wait(due - now)
                if job.rules.ended:
                    return
                quit = self.quitting
            if quit is not None:
                job.leave(quit)
                return
            job.tick()
