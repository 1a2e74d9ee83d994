"""The protocol's rules (distributed_rules.Rules) driven by hand-made frames: no processes, sockets, threads.

A job here is a list of Rules, one per rank; a tick is every rank saying its frame, the frames going through
JSON as over the wire, and every rank applying them all."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

import pytest

from mlxpipe.distributed_rules import (
    HOLD,
    Frame,
    RankLost,
    RanksDisagree,
    Rules,
    Said,
    decode_event,
    encode_event,
)
from mlxpipe.events import FINAL_EVENTS, Chunk, Done, Error, Event
from mlxpipe.records import BadRecord, Record, Settings


def _records(numbers: Iterable[int]) -> list[Record | BadRecord]:
    """Records numbered ``numbers`` (gaps: those an earlier ``--resume`` file holds); every third one bad."""
    return [
        BadRecord(n, "in", n, f"r{n}", "invalid json")
        if n % 3 == 0
        else Record(n, "in", n, f"r{n}", None, Settings(), prompt=f"p{n}")
        for n in numbers
    ]


def _job(size: int, numbers: Iterable[int], **kw: Any) -> list[Rules]:
    numbers = list(numbers)
    job = [Rules(_records(numbers), rank, size, **kw) for rank in range(size)]
    for rules in job:
        rules.read_ahead()  # as the glue does before the first tick
    return job


def _tick(job: list[Rules], quit: dict[int, str] | None = None) -> list[Frame]:
    said = [rules.say((quit or {}).get(rank)) for rank, rules in enumerate(job)]
    frames = [json.loads(json.dumps(s.frame)) for s in said]
    for rules, s in zip(job, said, strict=True):
        rules.apply(s, frames)
    return frames


def _taken(rules: Rules) -> list[int]:
    """The numbers of the records handed to ``rules``' rank, as its pipeline takes them."""
    numbers = [r.index for r in rules.handed]
    rules.handed.clear()
    return numbers


def _done(n: int) -> Done:
    return Done(n, f"r{n}", f"answer {n}", "stop", 1, 1.0, 1, 1.0, 1, None)


def _chunk(n: int) -> Chunk:
    return Chunk(n, f"r{n}", "word", 1, 1.0)


def _frame(**fields: Any) -> Frame:
    """Another rank's frame: nothing to say unless ``fields`` says it."""
    frame: Frame = {
        "events": [],
        "at": {},
        "want": 0,
        "eof": None,
        "idle": False,
        "stopped": False,
        "stop": 0,
        "quit": None,
    }
    return {**frame, **fields}


def _answer(rules: Rules, numbers: list[int]) -> None:
    for n in numbers:
        rules.own(_chunk(n))
        rules.own(_done(n))


def _play(job: list[Rules], ticks: int = 100) -> tuple[list[list[int]], list[list[Event]]]:
    """Every rank answers what it was handed at once, and finishes once nothing more will come; returns what
    each rank was handed and what each may write, until the job ends."""
    handed: list[list[int]] = [[] for _ in job]
    written: list[list[Event]] = [[] for _ in job]
    for _ in range(ticks):
        _tick(job)
        for rank, rules in enumerate(job):
            mine = _taken(rules)
            handed[rank] += mine
            _answer(rules, mine)
            if rules.over() and rules.held == 0:
                rules.finish()
            written[rank] += rules.writable()
        if all(rules.ended for rules in job):
            return handed, written
    raise AssertionError("the job never ended")


def test_positions_are_handed_out_in_input_order_to_the_ranks_in_rank_order() -> None:
    job = _job(2, range(1, 9))  # one record at a time, one more ahead: each rank asks for 2
    frames = _tick(job)
    assert [f["want"] for f in frames] == [2, 2]
    assert [_taken(rules) for rules in job] == [[1, 2], [3, 4]]
    assert job[0].expect == {2: (1, 3), 3: (1, 4)}  # rank 0 knows what rank 1 must answer, and where
    assert job[0].input.eof == 8  # read ahead far enough to see the end


@pytest.mark.parametrize("size", [1, 2, 3])
@pytest.mark.parametrize("batch", [1, 4])
def test_every_record_is_handed_out_once_and_every_rank_writes_them_all_in_input_order(
    size: int, batch: int
) -> None:
    job = _job(size, range(1, 15), batch=batch)
    handed, written = _play(job)
    assert sorted(n for mine in handed for n in mine) == list(range(1, 15))
    expected = [e for n in range(1, 15) for e in (_chunk(n), _done(n))]
    assert all(events == expected for events in written)
    assert all(rules.error is None for rules in job)


def test_records_skipped_by_resume_keep_their_numbers_and_leave_no_rank_idle() -> None:
    # Positions count the records in the stream; their numbers are those of the whole input.
    job = _job(2, [2, 4, 6, 8])
    handed, written = _play(job)
    assert handed == [[2, 4], [6, 8]]
    assert [e.index for e in written[0] if isinstance(e, FINAL_EVENTS)] == [2, 4, 6, 8]
    job = _job(2, [2, 4, 6, 8])
    _tick(job)
    assert job[0].expect == {2: (1, 6), 3: (1, 8)}


def test_rank_0_writes_its_oldest_record_live_and_holds_a_later_one_until_its_turn() -> None:
    job = _job(2, range(1, 9))
    _tick(job)
    assert [_taken(rules) for rules in job] == [[1, 2], [3, 4]]
    job[1].own(_chunk(3))
    job[1].own(_done(3))
    _tick(job)
    assert job[0].writable() == []  # record 3 waits for records 1 and 2
    job[0].own(_chunk(1))
    assert job[0].writable() == [_chunk(1)]  # the oldest unwritten record streams live
    job[0].own(_done(1))
    job[0].own(_chunk(2))
    job[0].own(_done(2))
    assert job[0].writable() == [_done(1), _chunk(2), _done(2), _chunk(3), _done(3)]
    assert job[1].writable() == []  # rank 1 sees the same stream: records 1 and 2 reach it at the next tick
    _tick(job)
    assert [e.index for e in job[1].writable()] == [1, 1, 2, 2, 3, 3]


def test_unordered_events_pass_as_they_arrive() -> None:
    job = _job(2, range(1, 9), ordered=False)
    _tick(job)
    _answer(job[1], _taken(job[1]))
    _tick(job)
    assert [e.index for e in job[0].writable()] == [3, 3, 4, 4]


def test_near_the_end_a_short_input_is_shared_instead_of_taken_by_the_first_rank() -> None:
    # --batch 16 and 16 records: the first rank would take them all; each asks for its share instead.
    job = _job(2, range(1, 17), batch=16)
    frames = _tick(job)
    assert [f["want"] for f in frames] == [8, 8]
    assert [len(_taken(rules)) for rules in job] == [8, 8]


def test_a_rank_asks_for_nothing_while_an_old_record_holds_too_many_unwritten() -> None:
    job = _job(1, range(1, 100))  # depth 2: at most HOLD * 1 * 2 read but not yet written
    _tick(job)
    mine = _taken(job[0])
    old = mine[0]
    for _ in range(HOLD * 2):
        _answer(job[0], [n for n in mine if n != old])
        _tick(job)
        mine = _taken(job[0])
    _answer(job[0], mine)
    assert job[0].say().frame["want"] == 0
    _answer(job[0], [old])
    assert job[0].say().frame["want"] == 2


def test_the_job_ends_at_the_tick_in_which_every_rank_is_idle() -> None:
    job = _job(2, [1, 2])
    _tick(job)
    _answer(job[0], _taken(job[0]))
    job[0].finish()
    _tick(job)
    assert not any(rules.ended for rules in job)  # rank 1 is not idle yet
    assert all(rules.over() for rules in job)  # but no record is left to hand out
    _answer(job[1], _taken(job[1]))
    job[1].finish()
    _tick(job)
    assert all(rules.ended for rules in job)
    assert job[0].error is None


def test_rank_0_names_a_record_a_rank_never_answered() -> None:
    job = _job(2, range(1, 5))
    _tick(job)
    _taken(job[1])  # rank 1 takes records 3 and 4, answers neither, and says it is idle
    _answer(job[0], _taken(job[0]))
    job[0].finish()
    job[1].finish()
    with pytest.raises(RanksDisagree, match="rank 1 never answered record 3"):
        _tick(job)


@pytest.mark.parametrize(
    ("at", "message"),
    [
        ({"4": 2}, "rank 1 answered record 4 where rank 0 read 3"),
        ({"9": 9}, "past the end of rank 0's input"),
    ],
)
def test_rank_0_refuses_a_record_other_than_the_one_it_read_there(at: dict[str, int], message: str) -> None:
    rules = _job(2, range(1, 5))[0]
    rules.apply(rules.say(), [_frame(want=2), _frame(want=2)])
    event = encode_event(_done(int(next(iter(at)))))
    with pytest.raises(RanksDisagree, match=message):
        rules.apply(rules.say(), [_frame(), _frame(events=[event], at=at)])


def test_only_rank_0_speaks_for_the_job_when_the_readings_differ() -> None:
    rules = _job(2, range(1, 5))[1]
    rules.apply(rules.say(), [_frame(want=2), _frame(want=2)])
    odd = _frame(events=[encode_event(_done(2))], at={"2": 3})  # rank 0 says it answered 2 where 4 was read
    rules.apply(rules.say(), [odd, _frame()])
    assert rules.writable() == []


def test_rank_0_refuses_an_input_that_ends_elsewhere() -> None:
    rules = _job(2, range(1, 5))[0]
    with pytest.raises(RanksDisagree, match="rank 1's input ends after 3 records, rank 0's after 4"):
        rules.apply(rules.say(), [_frame(), _frame(eof=3)])


def test_a_stop_on_one_rank_stops_every_rank_and_hands_out_nothing_more() -> None:
    job = _job(2, range(1, 20))
    _tick(job)
    job[1].halt(15)
    frames = _tick(job)
    assert frames[1]["stopped"] and frames[1]["stop"] == 15
    assert [rules.signal for rules in job] == [15, 15]
    assert all(rules.stopping and not rules.handed for rules in job)
    frontier = job[0].input.frontier
    _tick(job)
    assert [rules.input.frontier for rules in job] == [frontier, frontier]
    assert all(f["want"] == 0 for f in _tick(job))


def test_a_stop_noticed_after_the_frame_changes_nothing_decided_at_that_tick() -> None:
    # The others do not know of it: the rank hands out records as they do, then stops at the next tick.
    job = _job(2, range(1, 20))
    said = [rules.say() for rules in job]
    frames = [json.loads(json.dumps(s.frame)) for s in said]
    job[0].halt(2)
    for rules, s in zip(job, said, strict=True):
        rules.apply(s, frames)
    assert [rules.input.frontier for rules in job] == [4, 4]
    assert not job[0].handed  # handed to a stopped rank: never started
    _tick(job)
    assert job[1].stopping and job[1].signal == 2


def test_a_rank_that_fails_ends_the_job_and_rank_0_reports_it() -> None:
    job = _job(3, range(1, 20))
    _tick(job)
    _tick(job, quit={2: "out of memory"})
    assert all(rules.ended for rules in job) and job[0].stopping and job[1].stopping
    assert isinstance(job[0].error, RankLost) and str(job[0].error) == "rank 2 failed: out of memory"
    job[0].own(_done(1))
    assert job[0].writable() == []  # nothing more is written once the job has an error


def test_a_rank_that_closed_its_events_ends_the_job_without_an_error() -> None:
    job = _job(2, range(1, 20))
    _tick(job)
    _tick(job, quit={1: "closed"})
    assert all(rules.ended for rules in job)
    assert [rules.error for rules in job] == [None, None]


def test_a_failure_here_stops_this_rank_and_keeps_what_was_written() -> None:
    rules = _job(1, range(1, 5))[0]
    said = rules.say()
    rules.apply(said, [said.frame])
    _answer(rules, [1])
    rules.fail(RanksDisagree("x"))
    assert rules.stopping and not rules.ended and [e.index for e in rules.writable()] == [1, 1]
    rules.fail(RankLost("gone"), ended=True)
    assert rules.ended


def test_what_a_rank_says_names_the_positions_of_its_answered_records() -> None:
    job = _job(2, [5, 7, 8, 10])
    _tick(job)
    assert _taken(job[1]) == [8, 10]
    job[1].own(_done(10))
    said = job[1].say()
    assert isinstance(said, Said) and said.finals == [10] and said.frame["at"] == {"10": 3}
    assert [decode_event(e) for e in said.frame["events"]] == [_done(10)]


def test_events_survive_the_wire() -> None:
    events: list[Event] = [
        Chunk(3, "a", "Bonjour ✓", 2, 12.3456789),
        Done(3, "a", "Bonjour ✓", "stop", 2, 12.3456789, 9, 100.5, 123456, {"prompt": "x", "n": [1, None]}),
        Error(4, 4, "in", 7, "invalid json"),
    ]
    assert [decode_event(json.loads(json.dumps(encode_event(e)))) for e in events] == events
