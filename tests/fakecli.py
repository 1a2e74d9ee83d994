"""The real command line with conftest's FakeEngine in place of the model, for fast subprocess tests.

    python tests/fakecli.py ARGS...        (PYTHONPATH = the checkout)

Everything but the engine is the real thing: argument parsing, readers, pipeline, renderer, signals,
exit codes. ``FAKE_DELAY`` (seconds, default 0) is slept before each record's answer, so that a test
can kill the process in the middle of a run; ``--batch N`` steps the records in flight one event each.
With ``FAKE_SINK=1`` stdout goes to a sink that only counts lines (said on stderr at exit): a
quarter-million-record run then measures mlxpipe, not write(2).
"""

from __future__ import annotations

import collections
import io
import os
import sys
import time
import types
from collections.abc import Callable, Iterator
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from conftest import FakeEngine

from mlxpipe.records import Record

DELAY = float(os.environ.get("FAKE_DELAY", "0"))


class Engine(FakeEngine):
    """FakeEngine with the real Engine's class interface; keeps no history, so memory stays flat."""

    context_length = 8192

    def __init__(self) -> None:
        super().__init__()
        self.history = collections.deque(maxlen=1)  # type: ignore[assignment]

    @classmethod
    def load(cls, spec: str | None = None, *args: Any, **kwargs: Any) -> Engine:
        return cls()  # whatever the real Engine.load is given (dtype, trust_remote_code, …)

    def info(self) -> dict[str, Any]:
        return {"spec": "fake"}

    def slow_paths(self) -> list[str]:
        return []  # no CPU path to miss

    batch_choice = None

    def auto_batch(self, max_tokens: int, interactive: bool) -> int:
        return 1  # --batch auto: one at a time, so tests without --batch keep testing the sequential path

    def generate(self, record: Record, should_stop: Callable[[], bool] = lambda: False) -> Iterator[Any]:
        if DELAY:
            time.sleep(DELAY)
        return super().generate(record, should_stop)

    def batch(self, size: int) -> Batch:
        return Batch(self)


class Batch:
    """``--batch``: each record in flight advances by one event of its generate() per step."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.slots: dict[int, Iterator[Any]] = {}

    def __len__(self) -> int:
        return len(self.slots)

    def add(self, record: Record) -> None:
        self.slots[record.index] = iter(self.engine.generate(record))

    def step(self) -> list[Any]:
        out = []
        for index, events in list(self.slots.items()):
            event = next(events)
            out.append(event)
            if event.kind != "chunk":
                del self.slots[index]
        return out

    def interrupt(self) -> list[Any]:
        out = []
        for events in self.slots.values():
            out.extend(e for e in events if e.kind != "chunk")
        self.slots.clear()
        return out

    def close(self) -> None:
        self.slots.clear()


fake = types.ModuleType("mlxpipe.engine")
fake.Engine = Engine  # type: ignore[attr-defined]
sys.modules["mlxpipe.engine"] = fake

from mlxpipe.cli.main import main  # noqa: E402
from mlxpipe.cli.signals import exit_process  # noqa: E402


class Sink(io.RawIOBase):
    """A stdout that keeps nothing and counts newlines."""

    lines = 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        Sink.lines += bytes(data).count(b"\n")
        return len(data)


if __name__ == "__main__":
    if os.environ.get("FAKE_SINK"):
        sys.stdout = io.TextIOWrapper(io.BufferedWriter(Sink()))
        status = main()
        print(f"fakecli: {Sink.lines} lines", file=sys.stderr)
        exit_process(status)
    exit_process(main())
