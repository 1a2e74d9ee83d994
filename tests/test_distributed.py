"""Records spread over ranks: the protocol in threads (fast), and `mlx.launch -n 2 --backend ring`."""

from __future__ import annotations

import io as stdio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO, FakeEngine, cli_env, ring_port

from mlxpipe import distributed, link
from mlxpipe.cli.render import Renderer
from mlxpipe.events import FINAL_EVENTS, Chunk, Done, Error, Event
from mlxpipe.pipeline import run
from mlxpipe.reader import InputFormat, RecordReader
from mlxpipe.records import BadRecord, Record, Settings

LAUNCH = Path(sys.executable).with_name("mlx.launch")

# Raw prompts: the chat template's system line would make prompt processing most of the test's time.
SHORT = ["--raw", "-n", "6"]
PROMPTS = [
    "What is the capital of France?",
    "Say hello.",
    "Name a colour.",
    "What is 2+2?",
    "Name a fruit.",
    "What is the largest ocean?",
    "Say goodbye.",
    "Name an animal.",
]


def _records(data: bytes, jsonl: bool = False, name: str = "in") -> list[Record | BadRecord]:
    reader = RecordReader(InputFormat(jsonl=jsonl), Settings(max_tokens=6, raw=True))
    return list(reader.read(name, stdio.BytesIO(data)))


# ---------------------------------------------------------------------------------------------
# The protocol, with ranks as threads and the gather as a barrier


class _Board:
    def __init__(self, size: int) -> None:
        self.slots: list[bytes] = [b""] * size
        self.barrier = threading.Barrier(size)


class ThreadRanks(distributed.Ranks):
    """One rank of an in-process job: ``gather`` meets the other threads at a barrier."""

    def __init__(self, rank: int, board: _Board, threaded: bool = False) -> None:
        super().__init__()
        self.rank, self.size, self.board = rank, len(board.slots), board
        self.gathers = 0
        self.threaded = threaded  # as over the TCP link: an exchange thread ticks

    def gather(self, frame: bytes) -> list[bytes]:
        self.gathers += 1
        self.board.slots[self.rank] = frame
        try:
            self.board.barrier.wait()
            frames = list(self.board.slots)
            self.board.barrier.wait()  # nobody overwrites a slot before everyone has read the round
        except threading.BrokenBarrierError:
            raise distributed.RankLost("a rank went away") from None
        return frames


class TokenEngine(FakeEngine):
    """Answers a record with its prompt's words, one per token, polling ``should_stop`` once per token as
    the real engine does. With a tick at every poll (``TICK_SECONDS`` 0) the ticks are a shared clock: the
    ranks' runs do not depend on the threads' timing. ``--batch``: the same, one word per step."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens = 0

    def generate(self, record: Record, should_stop: Any = lambda: False) -> Any:
        self.history.append(record)
        words = (record.prompt or "").split()
        for n, word in enumerate(words, 1):
            self.tokens += 1
            yield Chunk(record.index, record.id, word, n, 100.0)
            if n < len(words) and should_stop():
                yield Done(record.index, record.id, "", "interrupted", n, 100.0, 3, 300.0, 1, record.input)
                return
        yield Done(
            record.index, record.id, " ".join(words), "stop", len(words), 100.0, 3, 300.0, 1, record.input
        )

    def batch(self, size: int) -> Any:
        return _WordBatch(self)


class _WordBatch:
    def __init__(self, engine: TokenEngine) -> None:
        self.engine = engine
        self.slots: dict[int, tuple[Record, list[str]]] = {}

    def __len__(self) -> int:
        return len(self.slots)

    def add(self, record: Record) -> None:
        self.engine.history.append(record)
        self.slots[record.index] = (record, (record.prompt or "").split())

    def step(self) -> list[Chunk | Done]:
        out: list[Chunk | Done] = []
        for index, (record, words) in list(self.slots.items()):
            self.engine.tokens += 1
            out.append(Chunk(index, record.id, words.pop(0), 1, 1.0))
            if not words:
                out.append(Done(index, record.id, "", "stop", 1, 1.0, 1, 1.0, 1, record.input))
                del self.slots[index]
        return out

    def interrupt(self) -> list[Chunk | Done]:
        out: list[Chunk | Done] = [
            Done(i, r.id, "", "interrupted", 0, 0.0, 1, 1.0, 1, r.input)
            for i, (r, _) in sorted(self.slots.items())
        ]
        self.slots.clear()
        return out

    def close(self) -> None:
        self.slots.clear()


def _job(
    size: int,
    data: bytes | list[bytes],
    stop: Any = None,
    batch: int = 1,
    engine: type[FakeEngine] = FakeEngine,
    threaded: bool = False,
) -> tuple[list[list[Event]], list[Any], list[BaseException | None]]:
    """Run ``distributed.run`` on ``size`` thread ranks; ``data`` per rank or one for all;
    ``stop(rank, engine)`` is each rank's should_stop; ``threaded``: ticks on an exchange thread, as over
    the TCP link. Returns each rank's events, [ranks, engines], and what each rank raised."""
    board = _Board(size)
    ranks = [ThreadRanks(r, board, threaded) for r in range(size)]
    engines = [engine() for _ in range(size)]
    out: list[list[Event]] = [[] for _ in range(size)]
    raised: list[BaseException | None] = [None] * size
    inputs = data if isinstance(data, list) else [data] * size

    def rank_main(r: int) -> None:
        should_stop = (lambda: stop(r, engines[r])) if stop else (lambda: False)
        records = _records(inputs[r], jsonl=True)
        try:
            for event in distributed.run(records, engines[r], ranks[r], should_stop, lambda: 2, batch=batch):
                out[r].append(event)
        except BaseException as exc:
            raised[r] = exc
            board.barrier.abort()  # as a rank that exits closes its sockets

    assert _each_rank(rank_main, range(size))
    return out, [ranks, engines], raised


def _each_rank(rank_main: Callable[[int], None], ranks: Iterable[int]) -> bool:
    """Run ``rank_main(r)`` for every rank in ``ranks`` on threads of its own, started in that order; whether
    every one ended within 30 s."""
    threads = [threading.Thread(target=rank_main, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return not any(t.is_alive() for t in threads)


def _jsonl(n: int, bad: int = 0, prompts: list[str] | None = None) -> bytes:
    lines = [
        json.dumps({"id": f"r{i}", "prompt": prompts[i - 1] if prompts else f"p{i}"})
        if i != bad
        else '{"id": '
        for i in range(1, n + 1)
    ]
    return ("\n".join(lines) + "\n").encode()


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> None:
    """A tick at every poll: with TokenEngine, the ticks are the ranks' shared clock."""
    monkeypatch.setattr(distributed, "TICK_SECONDS", 0.0)
    monkeypatch.setattr(distributed, "TICK_POLLS", 0.0)


@pytest.fixture
def quick(monkeypatch: pytest.MonkeyPatch) -> None:
    """The exchange thread ticks every 2 ms: the threaded tests end sooner."""
    monkeypatch.setattr(distributed, "EXCHANGE_SECONDS", 0.002)


@pytest.mark.usefixtures("quick")
@pytest.mark.parametrize("threaded", [False, True])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("size", [2, 3, 4])
def test_each_record_once_in_input_order_on_every_rank(size: int, batch: int, threaded: bool) -> None:
    data = _jsonl(7, bad=5)
    out, (_, engines), raised = _job(size, data, batch=batch, engine=TokenEngine, threaded=threaded)
    assert raised == [None] * size
    alone = list(run(_records(data, jsonl=True), TokenEngine(), batch=batch))
    assert all(events == alone for events in out)  # same events, same order, chunks included
    finals = [e for e in out[0] if isinstance(e, FINAL_EVENTS)]
    assert [e.index for e in finals] == list(range(1, 8))
    assert isinstance(finals[4], Error) and finals[4].line == 5
    asked = sorted(rec.index for engine in engines for rec in engine.history)
    assert asked == [1, 2, 3, 4, 6, 7]  # each good record generated once, on one rank


@pytest.mark.usefixtures("clock")
def test_a_long_record_does_not_hold_the_other_ranks() -> None:
    # Record 1 is long; record 2 waits behind it on rank 0 (handed out ahead); rank 1 answers all the others
    # meanwhile, and they are written after record 1, in input order.
    prompts = ["w " * 60] + ["w"] * 11
    out, (_, engines), raised = _job(2, _jsonl(12, prompts=prompts), engine=TokenEngine)
    assert raised == [None, None]
    assert [[rec.index for rec in e.history] for e in engines] == [[1, 2], list(range(3, 13))]
    for events in out:
        assert [e.index for e in events if isinstance(e, Done)] == list(range(1, 13))


@pytest.mark.usefixtures("clock")
def test_records_of_mixed_lengths_are_balanced() -> None:
    # Short and long records taking turns: by position (the old split) rank 0 got every short one and rank 1
    # every long one. On demand, the ranks' tokens differ by at most about one long record, and the job takes
    # about half the ticks of one rank doing everything.
    prompts = ["w " * 2 if i % 2 == 0 else "w " * 40 for i in range(16)]
    out, (ranks, engines), raised = _job(2, _jsonl(16, prompts=prompts), engine=TokenEngine)
    assert raised == [None, None]
    tokens = [e.tokens for e in engines]
    assert sum(tokens) == 8 * 2 + 8 * 40
    assert abs(tokens[0] - tokens[1]) <= 40
    assert ranks[0].gathers < 0.6 * sum(tokens)
    for events in out:
        assert [e.index for e in events if isinstance(e, Done)] == list(range(1, 17))


@pytest.mark.usefixtures("quick")
@pytest.mark.parametrize("threaded", [False, True])
def test_under_batch_a_short_input_is_shared_between_the_ranks(threaded: bool) -> None:
    # 16 records and --batch 16 (what --batch auto gives on a CPU): the first rank to ask could take them
    # all and leave the other idle; each takes half.
    out, (_, engines), raised = _job(2, _jsonl(16), batch=16, engine=TokenEngine, threaded=threaded)
    assert raised == [None, None]
    assert [len(e.history) for e in engines] == [8, 8]
    assert [e.index for e in out[0] if isinstance(e, Done)] == list(range(1, 17))


def test_a_rank_stopped_at_the_start_stops_every_rank() -> None:
    out, (ranks, engines), raised = _job(3, _jsonl(9), stop=lambda r, engine: r == 1)
    assert raised == [None] * 3
    assert [e.history for e in engines] == [[], [], []]
    assert out == [[], [], []]
    assert {rk.stop_signal for rk in ranks} == {2}


def _assert_a_stopped_prefix(out: Any, ranks: Any, engines: Any, raised: Any, records: int) -> None:
    """Two ranks stopped by a signal: both wrote records 1..K of ``records``, each once, and asked for none
    twice; every rank carries the signal."""
    assert raised == [None, None]
    assert out[0] == out[1]
    finals = [e for e in out[0] if isinstance(e, FINAL_EVENTS)]
    assert [e.index for e in finals] == list(range(1, len(finals) + 1))  # records 1..K, each once
    assert 0 < len(finals) < records
    asked = sorted(rec.index for engine in engines for rec in engine.history)
    assert len(asked) < records and len(set(asked)) == len(asked)
    assert {rk.stop_signal for rk in ranks} == {2}


@pytest.mark.usefixtures("clock")
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("stopper", [0, 1])
def test_a_rank_stopped_by_a_signal_stops_every_rank_and_the_output_is_a_prefix(
    batch: int, stopper: int
) -> None:
    prompts = ["w " * (3 + 5 * (i % 3)) for i in range(20)]
    out, (ranks, engines), raised = _job(
        2,
        _jsonl(20, prompts=prompts),
        stop=lambda r, engine: r == stopper and engine.tokens >= 12,
        batch=batch,
        engine=TokenEngine,
    )
    _assert_a_stopped_prefix(out, ranks, engines, raised, 20)


@pytest.mark.usefixtures("quick")
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("stopper", [0, 1])
def test_over_an_exchange_thread_a_stop_on_one_rank_stops_every_rank_and_the_output_is_a_prefix(
    batch: int, stopper: int
) -> None:
    # The stopped rank notices its signal at its next poll or the exchange's next tick; the others at the
    # tick after: the output is records 1..K, each once. The signal comes once both ranks generate (an
    # earlier one would leave record 1 unstarted, and the output empty).
    engines: list[TokenEngine] = []

    class Seen(TokenEngine):
        def __init__(self) -> None:
            super().__init__()
            engines.append(self)

    prompts = ["w " * (3 + 5 * (i % 3)) for i in range(40)]
    out, (ranks, _), raised = _job(
        2,
        _jsonl(40, prompts=prompts),
        stop=lambda r, engine: r == stopper and engine.tokens >= 12 and all(e.tokens for e in engines),
        batch=batch,
        engine=Seen,
        threaded=True,
    )
    _assert_a_stopped_prefix(out, ranks, engines, raised, 40)


@pytest.mark.usefixtures("clock")
def test_a_signal_that_cuts_a_rank_s_input_short_is_a_stop_not_a_disagreement() -> None:
    # A signal while a rank reads ends its input there (Interrupts.guard): that rank's input looks shorter.
    board = _Board(2)
    ranks = [ThreadRanks(r, board) for r in range(2)]
    signalled = threading.Event()
    out: list[list[Event]] = [[], []]
    errors: list[BaseException | None] = [None, None]

    def cut(records: list[Record | BadRecord]) -> Iterator[Record | BadRecord]:
        for record in records:
            if record.index == 9:
                signalled.set()
                return
            yield record

    def rank_main(r: int) -> None:
        records = _records(_jsonl(30, prompts=["w " * 3] * 30), jsonl=True)
        feed = cut(records) if r == 1 else iter(records)
        stop = signalled.is_set if r == 1 else (lambda: False)
        try:
            out[r] = list(distributed.run(feed, TokenEngine(), ranks[r], stop, lambda: 15))
        except BaseException as exc:
            errors[r] = exc

    _each_rank(rank_main, range(2))
    assert errors == [None, None]
    assert {rk.stop_signal for rk in ranks} == {15}
    finals = [e.index for e in out[0] if isinstance(e, FINAL_EVENTS)]
    assert out[0] == out[1] and finals == list(range(1, len(finals) + 1)) and len(finals) < 9


def test_records_skipped_on_every_rank_leave_no_rank_idle() -> None:
    # As --resume does after a run that lost rank 1: the records left are every second one.
    board = _Board(2)
    ranks = [ThreadRanks(r, board) for r in range(2)]
    engines = [FakeEngine(), FakeEngine()]
    out: list[list[Event]] = [[], []]

    def rank_main(r: int) -> None:
        left = [rec for rec in _records(_jsonl(8), jsonl=True) if rec.index % 2 == 0]
        out[r] = list(distributed.run(left, engines[r], ranks[r], lambda: False, lambda: None))

    _each_rank(rank_main, range(2))
    assert out[0] == out[1] and [e.index for e in out[0] if isinstance(e, Done)] == [2, 4, 6, 8]
    assert all(len(e.history) == 2 for e in engines)


@pytest.mark.usefixtures("quick")
@pytest.mark.parametrize("threaded", [False, True])
@pytest.mark.parametrize("skip", [2, 5, 6, 7])
def test_rank_0_notices_a_rank_that_read_other_records(skip: int, threaded: bool) -> None:
    # Rank 1 read a stream without record `skip` (another input, or another --resume file).
    full = _records(_jsonl(7), jsonl=True)
    board = _Board(2)
    ranks = [ThreadRanks(r, board, threaded) for r in range(2)]
    errors: list[BaseException | None] = [None, None]

    def rank_main(r: int) -> None:
        records = [rec for rec in full if r == 0 or rec.index != skip]
        try:
            list(distributed.run(records, TokenEngine(), ranks[r], lambda: False, lambda: None))
        except BaseException as exc:  # a rank that raises tells the others as it goes: no abort needed
            errors[r] = exc

    _each_rank(rank_main, range(2))
    assert isinstance(errors[0], distributed.RanksDisagree), errors
    assert "rank 1" in str(errors[0])
    assert errors[1] is None  # rank 0 speaks for the job; rank 1 ends quietly


@pytest.mark.usefixtures("quick")
@pytest.mark.parametrize("threaded", [False, True])
@pytest.mark.parametrize("failing", [0, 1])
def test_closing_the_events_on_one_rank_ends_every_rank(failing: int, threaded: bool) -> None:
    # --fail-fast and a closed stdout close the events on one rank: the others end at the next tick.
    board = _Board(2)
    ranks = [ThreadRanks(r, board, threaded) for r in range(2)]
    seen: list[list[int]] = [[], []]
    errors: list[BaseException | None] = [None, None]

    def rank_main(r: int) -> None:
        events = distributed.run(
            _records(_jsonl(12, bad=5), jsonl=True), FakeEngine(), ranks[r], lambda: False, lambda: None
        )
        try:
            for event in events:
                seen[r].append(event.index)
                if r == failing and isinstance(event, Error):
                    events.close()
                    break
        except BaseException as exc:
            errors[r] = exc

    assert _each_rank(rank_main, range(2))
    assert errors == [None, None]
    assert seen[failing][-1] == 5 and sorted(set(seen[failing])) == [1, 2, 3, 4, 5]
    assert set(seen[1 - failing]) >= {1, 2, 3, 4}


def test_one_rank_alone_gathers_its_own_frame() -> None:
    assert distributed.Ranks().gather(b"x") == [b"x"]


# ---------------------------------------------------------------------------------------------
# The TCP link between ranks, over real sockets (ranks as threads)


def _star(size: int) -> list[distributed.Ranks]:
    """``size`` ranks joined by the TCP link as mlx.launch's ranks join it, each to be used by one thread."""
    server, card = link.listen()
    peers: list[list[Any] | None] = [None] * size

    def join(r: int) -> None:
        sock = link.connect(card, r, seconds=20)
        peers[r] = [sock] if sock else None

    threads = [threading.Thread(target=join, args=(r,)) for r in range(1, size)]
    for t in threads:
        t.start()
    peers[0] = link.accept(server, card, size, seconds=20)
    for t in threads:
        t.join(timeout=30)
    ranks = []
    for r in range(size):
        assert peers[r] is not None
        ranks.append(distributed.Ranks())
        ranks[r].rank, ranks[r].size, ranks[r].threaded = r, size, True
        ranks[r].star = link.Star(r, size, peers[r] or [])
    return ranks


def _each(ranks: list[distributed.Ranks], work: Any) -> list[Any]:
    """``work(rank)`` on a thread per rank: what each returned, or raised."""
    got: list[Any] = [None] * len(ranks)

    def main(r: int) -> None:
        try:
            got[r] = work(ranks[r])
        except BaseException as exc:
            got[r] = exc

    threads = [threading.Thread(target=main, args=(r,)) for r in range(len(ranks))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    return got


def test_the_tcp_link_gathers_every_frame_and_names_a_rank_that_went_away() -> None:
    ranks = _star(3)
    got = _each(ranks, lambda rk: [rk.gather(bytes([65 + rk.rank]) * n * rk.rank) for n in (0, 1, 100_000)])
    for rounds in got:
        assert rounds == [[b"", b"", b""], [b"", b"B", b"CC"], [b"", b"B" * 100_000, b"CC" * 100_000]]
    assert ranks[2].star is not None
    ranks[2].star.close()  # as its process dies: the kernel closes its end
    lost = _each(ranks[:2], lambda rk: rk.gather(b"x"))
    assert isinstance(lost[0], distributed.RankLost) and "rank 2" in str(lost[0])
    assert isinstance(lost[1], distributed.RankLost) and "rank 0" in str(lost[1])  # rank 0 went on to fail


def test_ranks_of_a_ring_job_join_the_link_at_rank_0_s_hostfile_address() -> None:
    hosts = [f"127.0.0.1:{ring_port()}", "127.0.0.1:1", "127.0.0.1:2"]  # only rank 0's address is used
    stars: list[Any] = [None] * 3

    def rank_main(r: int) -> None:
        if r:
            time.sleep(0.3)  # ranks start when they start: the others wait for rank 0, or rank 0 for them
        try:
            stars[r] = link.join(r, hosts, seconds=20)
        except link.Lost as exc:
            stars[r] = exc

    _each_rank(rank_main, (2, 1, 0))
    assert all(isinstance(star, link.Star) for star in stars), stars
    got: list[Any] = [None] * 3
    gathers = [
        threading.Thread(target=lambda r=r: got.__setitem__(r, stars[r].gather(b"%d" % r))) for r in range(3)
    ]
    for t in gathers:
        t.start()
    for t in gathers:
        t.join(timeout=30)
    assert got == [[b"0", b"1", b"2"]] * 3
    for star in stars:
        star.close()
    # A rank alone: rank 0 never comes, so the rank says where it looked.
    with pytest.raises(link.Lost, match=r"rank 1 could not reach rank 0 at 127\.0\.0\.1:\d+ within 2 s"):
        link.join(1, hosts, seconds=2)


def test_the_tcp_link_takes_only_the_ranks_of_its_job() -> None:
    server, card = link.listen()
    with socket.create_connection(("127.0.0.1", card["port"])) as stranger:
        stranger.sendall(b"GET / HTTP/1.0\r\n\r\n")
        wrong = link.connect(dict(card, token="0" * 32), 1, seconds=1)
        assert wrong is None  # the listener did not answer with this job's token
        sock: list[Any] = []
        t = threading.Thread(target=lambda: sock.append(link.connect(card, 1, seconds=20)))
        t.start()
        peers = link.accept(server, card, 2, seconds=20)
        t.join(timeout=30)
    assert peers is not None and sock[0] is not None
    star = [link.Star(0, 2, peers), link.Star(1, 2, sock)]
    got: list[Any] = [None, None]
    threads = [
        threading.Thread(target=lambda r=r: got.__setitem__(r, star[r].gather(b"%d" % r))) for r in (0, 1)
    ]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=30)
    assert got == [[b"0", b"1"], [b"0", b"1"]]


@pytest.mark.usefixtures("quick")
@pytest.mark.parametrize("batch", [1, 3])
def test_records_over_the_tcp_link_each_once_in_input_order(batch: int) -> None:
    data = _jsonl(9, bad=4, prompts=["w " * (1 + 4 * (i % 3)) for i in range(9)])
    engines = [TokenEngine() for _ in range(3)]
    ranks = _star(3)
    got = _each(
        ranks,
        lambda rk: list(
            distributed.run(
                _records(data, jsonl=True), engines[rk.rank], rk, lambda: False, lambda: None, batch
            )
        ),
    )
    alone = list(run(_records(data, jsonl=True), TokenEngine(), batch=batch))
    assert got == [alone] * 3
    assert sorted(rec.index for e in engines for rec in e.history) == [1, 2, 3, 5, 6, 7, 8, 9]


@pytest.mark.usefixtures("quick")
def test_a_rank_whose_link_breaks_ends_the_run_on_the_others_with_a_prefix() -> None:
    data = _jsonl(30, prompts=["w " * 6] * 30)
    ranks = _star(3)

    class Dies(TokenEngine):
        def generate(self, record: Record, should_stop: Any = lambda: False) -> Any:
            if self.tokens >= 12:  # rank 2 dies: its sockets close, nothing more is sent
                assert ranks[2].star is not None
                ranks[2].star.close()
                raise SystemExit
            yield from super().generate(record, should_stop)

    def work(rk: distributed.Ranks) -> list[Event]:
        engine = Dies() if rk.rank == 2 else TokenEngine()
        out: list[Event] = []
        try:
            out.extend(distributed.run(_records(data, jsonl=True), engine, rk, lambda: False, lambda: None))
        except distributed.RankLost as exc:
            out.append(Error(0, None, "", 0, str(exc)))
        return out

    got = _each(ranks, work)
    assert isinstance(got[2], SystemExit)
    for out in got[:2]:
        assert isinstance(out[-1], Error)  # RankLost
        finals = [e.index for e in out[:-1] if isinstance(e, FINAL_EVENTS)]
        assert finals == list(range(1, len(finals) + 1)) and len(finals) < 30


# ---------------------------------------------------------------------------------------------
# The real thing: two ranks on localhost with mlx.launch over the ring backend


def _launch(args: list[str], **kwargs: Any) -> subprocess.Popen[bytes]:
    if not LAUNCH.exists():
        pytest.skip("mlx.launch is not installed next to this python")
    cmd = [str(LAUNCH), "-n", "2", "--backend", "ring", "-p", str(ring_port()), "--python", sys.executable]
    # mlx.launch hands the ranks a stdin that never closes, so ours is /dev/null. Unbuffered: tests read a
    # first line, then communicate() reads the pipe's fd, skipping lines a buffered readline() read ahead.
    return subprocess.Popen(
        [*cmd, "--", "-m", "mlxpipe", *args],
        bufsize=0,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=cli_env(**kwargs.pop("env", {})),
        cwd=REPO,
        **kwargs,
    )


def _finish(p: subprocess.Popen[bytes], timeout: float = 300) -> tuple[bytes, str]:
    out, err = p.communicate(timeout=timeout)
    assert p.returncode == 0  # mlx.launch exits 0 whatever its ranks return; it names them on stderr
    return out, err.decode()


def _single(engine: Any, path: Path, jsonl: bool) -> bytes:
    """What one process writes for ``path``: the same reader, pipeline and renderer as the command."""
    buf = stdio.BytesIO()
    renderer = Renderer(buf, jsonl=jsonl, stream=True, one_line=not jsonl, null=False)
    for event in run(_records(path.read_bytes(), jsonl, str(path)), engine):
        renderer.write(event)
    return buf.getvalue()


def _timeless(line: bytes) -> dict[str, Any]:
    event = json.loads(line)
    for key in ("tps", "prompt_tps", "peak_memory"):
        event.pop(key, None)  # measurements, different in every run
    return dict(event)


@pytest.mark.model
def test_two_ranks_write_what_one_process_writes(tmp_path: Path, engine: Any) -> None:
    data = ("\n".join(PROMPTS) + "\n").encode()
    (tmp_path / "in.txt").write_bytes(data)
    out, err = _finish(_launch([*SHORT, "--one-line", str(tmp_path / "in.txt")]))
    assert out == _single(engine, tmp_path / "in.txt", jsonl=False)
    assert len(out.decode().split("\n")) == 8 + 1  # --one-line: line N answers record N
    assert "mlxpipe" not in err and "exited with code" not in err  # every rank exited 0, quietly


@pytest.mark.model
def test_two_ranks_put_a_malformed_record_in_place(tmp_path: Path, engine: Any) -> None:
    lines = [json.dumps({"id": f"q{i}", "prompt": p}) for i, p in enumerate(PROMPTS, 1)]
    lines[4] = '{"id": "q5", "prompt": '
    data = ("\n".join(lines) + "\n").encode()
    (tmp_path / "in.jsonl").write_bytes(data)
    out, err = _finish(_launch(["--jsonl", *SHORT, str(tmp_path / "in.jsonl")]))
    got = [_timeless(line) for line in out.splitlines()]
    assert got == [
        _timeless(line) for line in _single(engine, tmp_path / "in.jsonl", jsonl=True).splitlines()
    ]
    finals = [e for e in got if e["event"] in ("done", "error")]
    assert [e["id"] for e in finals] == [f"q{i}" if i != 5 else 5 for i in range(1, 9)]
    assert finals[4]["event"] == "error" and finals[4]["line"] == 5
    ours = [line for line in err.splitlines() if "mlxpipe" in line]
    assert len(ours) == 1 and ours[0].startswith(f"mlxpipe: error (at {tmp_path / 'in.jsonl'}:5): ")
    assert "Node with rank 0 exited with code 1" in err  # a record failed: rank 0's status, as alone
    assert "Node with rank 1 exited" not in err


@pytest.mark.parametrize("files", [[], ["-"]])
def test_no_files_under_mlx_launch_is_a_usage_error(files: list[str]) -> None:
    out, err = _finish(_launch(["-n", "6", *files]), timeout=120)
    _assert_usage_error(
        out,
        err,
        "mlxpipe: error: under mlx.launch give the input as FILE arguments (every rank reads them): "
        "stdin does not reach the ranks\n",
    )


def _assert_usage_error(out: bytes, err: str, message: str) -> None:
    """No output, ``message`` once and no other mlxpipe line on stderr, and the job's exit status 2."""
    assert out == b""
    # Counted, not split into lines: mlx.launch's own warnings can land in the middle of a rank's line.
    assert err.count(message) == 1 and err.count("mlxpipe") == 1
    assert "Node with rank 0 exited with code 2" in err


def _launch_each(tmp_path: Path, contents: dict[int, str]) -> tuple[bytes, str]:
    """Two ranks whose FILE argument is the same name on "their own host": in.txt in a folder per rank."""
    for rank, text in contents.items():
        (tmp_path / f"host{rank}").mkdir()
        (tmp_path / f"host{rank}" / "in.txt").write_text(text)
    cmd = [str(LAUNCH), "-n", "2", "--backend", "ring", "-p", str(ring_port()), "--", "sh", "-c"]
    script = f'cd "{tmp_path}/host$MLX_RANK" && exec "{sys.executable}" -m mlxpipe -n 6 in.txt'
    p = subprocess.Popen(
        [*cmd, script],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=cli_env(),
    )
    return _finish(p, timeout=120)


def test_ranks_with_different_input_files_refuse_to_start(tmp_path: Path) -> None:
    if not LAUNCH.exists():
        pytest.skip("mlx.launch is not installed next to this python")
    out, err = _launch_each(tmp_path, {0: "Say hello.\nSay goodbye.\n", 1: "Say goodbye.\nSay hello.\n"})
    _assert_usage_error(
        out,
        err,
        "mlxpipe: error: rank 1 reads different input from rank 0's: every host needs the same copy of "
        "the FILE arguments\n",
    )


def test_a_rank_without_the_input_file_is_named(tmp_path: Path) -> None:
    if not LAUNCH.exists():
        pytest.skip("mlx.launch is not installed next to this python")
    (tmp_path / "host1").mkdir()  # rank 1's host has no in.txt
    out, err = _launch_each(tmp_path, {0: "Say hello.\n"})
    _assert_usage_error(out, err, "mlxpipe: error: rank 1: cannot open in.txt: No such file or directory\n")


# Each rank's line in one write: the launcher may run the ranks unbuffered, and print() writes each argument
# on its own (the two ranks' pieces then interleaved on the launcher's stdout).
GATHER = """
import sys
from mlxpipe.distributed import Ranks, broadcast
ranks = Ranks.init()
fields = (ranks.rank, ranks.size, ranks.gather(b"x" * (3 + 5 * ranks.rank)), ranks.gather(b""),
          broadcast(ranks, b"from 0" if ranks.rank == 0 else b"ignored"), ranks.threaded)
sys.stdout.write(" ".join(map(str, fields)) + "\\n")
sys.stdout.flush()
"""


@pytest.mark.parametrize("mode", ["", "mlx", "off"])
def test_gather_and_broadcast_over_the_ring(mode: str) -> None:
    # By default the ranks gather over their own TCP link, found through the ring's hostfile; with
    # MLXPIPE_LINK=mlx it is set up through mlx's gather (as under other backends); =off keeps mlx's gather.
    tcp = mode != "off"
    if not LAUNCH.exists():
        pytest.skip("mlx.launch is not installed next to this python")
    cmd = [str(LAUNCH), "-n", "2", "--backend", "ring", "-p", str(ring_port()), "--python", sys.executable]
    p = subprocess.Popen(
        [*cmd, "--", "-c", GATHER],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=cli_env(MLXPIPE_LINK=mode),
    )
    out, err = _finish(p, timeout=120)
    assert sorted(out.decode().splitlines()) == [
        f"{rank} 2 [b'xxx', b'xxxxxxxx'] [b'', b''] b'from 0' {tcp}" for rank in (0, 1)
    ], err


def _rank_pid(tag: str, rank: int) -> int | None:
    for entry in Path("/proc").iterdir():
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        mine = f"MLXPIPE_TEST_TAG={tag}".encode() in environ and f"MLX_RANK={rank}".encode() in environ
        if mine and b"mlxpipe" in (entry / "cmdline").read_bytes():
            return int(entry.name)
    return None


def _wait_for_rank_pid(tag: str, rank: int, timeout: float = 60) -> int:
    deadline = time.monotonic() + timeout
    while (pid := _rank_pid(tag, rank)) is None:
        assert time.monotonic() < deadline, f"rank {rank} never started"
        time.sleep(0.05)
    return pid


@pytest.mark.model
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds the rank's process in /proc")
def test_a_rank_that_dies_ends_the_run_with_a_clear_message_and_resume_finishes(tmp_path: Path) -> None:
    # 48 records, more than the two ranks hold at once (up to 20 each under --batch auto), and all but q1 long
    # (40 tokens): the job is still under way when rank 1 is killed. With every record as short as q1, the
    # whole job could end between q1's line and the search for rank 1 (CI, 2026-12-02).
    lines = [
        json.dumps({"id": f"q{i}", "prompt": p, **({} if i == 1 else {"max_tokens": 40})})
        for i, p in enumerate(PROMPTS * 6, 1)
    ]
    count = len(lines)
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    tag = f"{os.getpid()}-{time.time()}"
    p = _launch(["--jsonl", "--no-stream", *SHORT, str(tmp_path / "in.jsonl")], env={"MLXPIPE_TEST_TAG": tag})
    assert p.stdout
    pid = _wait_for_rank_pid(tag, 1)
    first = p.stdout.readline()  # rank 0's first record: the job is under way
    assert json.loads(first)["id"] == "q1"
    os.kill(pid, signal.SIGKILL)
    rest, err = _finish(p)
    finals = [json.loads(line) for line in (first + rest).splitlines()]
    assert [e["id"] for e in finals] == [f"q{i}" for i in range(1, len(finals) + 1)]  # a prefix, in order
    assert len(finals) < count
    assert "Node with rank 1 exited with code -9" in err
    assert "mlxpipe: error: lost a rank of the mlx.launch job" in err
    assert f"the first {len(finals)} records were written" in err
    assert "Traceback" not in err

    # What the user has is the output so far: --resume on it does the rest, on both ranks again.
    out = tmp_path / "out.jsonl"
    out.write_bytes(first + rest)
    more, err = _finish(_launch(["--jsonl", *SHORT, "--resume", str(out), str(tmp_path / "in.jsonl")]))
    assert more == b"" and "mlxpipe" not in err and "exited with code" not in err, err
    done = [json.loads(line) for line in out.read_text().splitlines()]
    # Rank 0's record in flight can end "interrupted" (mlx.launch stops the ranks left with SIGTERM): that
    # line stays, --resume does the record again, so each record is finished once, in input order.
    interrupted = [e["id"] for e in done if e.get("finish_reason") == "interrupted"]
    assert len(interrupted) <= 1
    finished = [e["id"] for e in done if e["event"] == "done" and e["finish_reason"] != "interrupted"]
    assert finished == [f"q{i}" for i in range(1, count + 1)]
    assert len(done) == len(finished) + len(interrupted)


@pytest.mark.model
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds the rank's process in /proc")
def test_sigterm_to_rank_0_stops_every_rank_after_the_round(tmp_path: Path) -> None:
    # 64 records: under --batch auto (16 on a CPU) each rank holds up to 20 at a time, and only records
    # handed out before the stop are answered.
    lines = [json.dumps({"id": f"q{i}", "prompt": p}) for i, p in enumerate(PROMPTS * 8, 1)]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    tag = f"{os.getpid()}-{time.time()}"
    p = _launch(
        ["--jsonl", "--no-stream", "--raw", "-n", "20", "--batch", "1", str(tmp_path / "in.jsonl")],
        env={"MLXPIPE_TEST_TAG": tag},
    )
    assert p.stdout
    first = p.stdout.readline()
    pid = _rank_pid(tag, 0)
    assert pid is not None
    os.kill(pid, signal.SIGTERM)
    rest, err = _finish(p)
    finals = [json.loads(line) for line in (first + rest).splitlines()]
    assert [e["id"] for e in finals] == [
        f"q{i}" for i in range(1, len(finals) + 1)
    ]  # whole records, in order
    assert len(finals) < 64
    assert "Node with rank 0 exited with code 143" in err
    assert "Node with rank 1" not in err and "mlxpipe" not in err


CALM = """
import json, os, select
from mlxpipe import launcher
done = launcher.calm()
pid = launcher._launcher_pid()
def nice(tid):
    with open(f"/proc/{pid}/task/{tid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[16])
nices = sorted({nice(tid) for tid in os.listdir(f"/proc/{pid}/task")})
fd = os.open("/proc/self/fd/0", os.O_WRONLY | os.O_NONBLOCK)
_, writable, _ = select.select([], [fd], [], 0)
report = {"rank": os.environ["MLX_RANK"], "done": done, "nices": nices, "writable": bool(writable)}
with open(os.path.join(os.environ["REPORTS"], os.environ["MLX_RANK"]), "w") as f:
    json.dump(report, f)  # (not stdout: the launcher's relay may join two ranks' lines)
"""


@pytest.mark.skipif(sys.platform != "linux", reason="the launcher is calmed through /proc, on Linux only")
def test_ranks_keep_mlx_launch_from_spinning_on_their_cores(tmp_path: Path) -> None:
    # mlx.launch's relay thread selects for writing on each rank's stdin pipe, which is always writable: it
    # spins. Once the rank has filled its pipe the relay waits, and the launcher's threads run at nice 19.
    if not LAUNCH.exists():
        pytest.skip("mlx.launch is not installed next to this python")
    cmd = [str(LAUNCH), "-n", "2", "--backend", "ring", "-p", str(ring_port()), "--python", sys.executable]
    r = subprocess.run(
        [*cmd, "--", "-c", CALM],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        env=cli_env(REPORTS=str(tmp_path)),
        timeout=120,
    )
    reports = [json.loads(f.read_text()) for f in sorted(tmp_path.iterdir())]
    assert [x["rank"] for x in reports] == ["0", "1"], r.stderr
    for report in reports:
        assert report["done"][0] == "stdin pipe filled"
        assert report["done"][1].endswith("at nice 19")
        assert report["nices"] == [19]
        assert report["writable"] is False


def test_under_mlx_launch_resume_never_skips_a_record_for_another_records_id(tmp_path: Path) -> None:
    # Record 3 has no id, so its number is its id: record 1's explicit 3. Every rank refuses it alike, and
    # --resume (rank 0's done ids, shared) never takes it as done.
    lines = [{"id": 3, "prompt": PROMPTS[0]}, {"prompt": PROMPTS[1]}, {"prompt": PROMPTS[2]}]
    lines += [{"id": f"q{i}", "prompt": p} for i, p in enumerate(PROMPTS[3:], 4)]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "out.jsonl"
    for _ in (1, 2):
        more, err = _finish(_launch(["--jsonl", *SHORT, "--resume", str(out), str(tmp_path / "in.jsonl")]))
        assert more == b"" and "Traceback" not in err
        assert "Node with rank 0 exited with code 1" in err
        assert "id 3 is already the id of the record at" in err
    events = [json.loads(line) for line in out.read_text().splitlines()]
    done = [e["input"]["prompt"] for e in events if e["event"] == "done"]
    assert done == [line["prompt"] for i, line in enumerate(lines, 1) if i != 3]  # each once, in order
    assert [(e["event"], e["line"]) for e in events if e["event"] == "error"] == [("error", 3), ("error", 3)]
