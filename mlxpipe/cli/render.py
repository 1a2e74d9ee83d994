"""Events → stdout (text or JSONL, one write per line, flushed) and the totals of ``--stats``."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import IO, Any

from .. import batchapi
from ..events import Chunk, Done, Error, Event, Summary, dumps
from .streams import OutputError, write_all

__all__ = ["Renderer", "Stats"]


@dataclass
class Stats:
    """Totals for --stats."""

    records: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    tokens: int = 0
    peak_memory: int = 0
    decode_tokens: int = 0  # each record's tokens after its first ...
    decode_seconds: float = 0.0  # ... and the time they took (from its done event's tps)
    batch: str = ""  # how many records generated together, and why when --batch auto chose it

    def add(self, event: Event) -> None:
        if isinstance(event, Done):
            self.records += 1
            self.prompt_tokens += event.prompt_tokens
            self.tokens += event.tokens
            self.peak_memory = max(self.peak_memory, event.peak_memory)
            if event.tps > 0:
                self.decode_tokens += event.tokens - 1
                self.decode_seconds += (event.tokens - 1) / event.tps
        elif isinstance(event, Error):
            self.records += 1
            self.failed += 1

    def summary(self, seconds: float) -> Summary:
        """The totals as the ``summary`` event, with two rates (they differ most under --batch): generated
        tokens over the wall time since the model was loaded (prompts included), and the rate a record
        decodes at (its tokens after the first over their time, as a done event's ``tps``), over all
        records."""
        tps = self.tokens / seconds if seconds > 0 else 0.0
        decode = self.decode_tokens / self.decode_seconds if self.decode_seconds > 0 else 0.0
        return Summary(
            self.records,
            self.failed,
            self.prompt_tokens,
            self.tokens,
            seconds,
            tps,
            decode,
            self.peak_memory,
            self.batch,
        )

    def line(self, seconds: float) -> str:
        """The summary line for stderr (see :meth:`summary`)."""
        summary = self.summary(seconds)
        tps, decode = summary.tps, summary.decode_tps
        return (
            f"mlxpipe: {self.records} {_plural(self.records, 'record')}, {self.failed} failed, "
            f"{self.prompt_tokens} prompt tokens, {self.tokens} generated tokens, "
            f"{tps:.1f} tok/s generated over the wall time, {decode:.1f} tok/s a record decodes, peak memory "
            f"{self.peak_memory / 1e6:.1f} MB, {seconds:.1f} s" + (f", {self.batch}" if self.batch else "")
        )


def _plural(count: int, noun: str) -> str:
    return noun if count == 1 else noun + "s"


_NEWLINES = re.compile(r"[\r\n]+")


class _Samples:
    """A record's final events, one per sample, gathered for its one OpenAI output line (by id: ids are
    unique there). A failed or interrupted sample makes the line an error at once; the record's later
    samples are then dropped."""

    def __init__(self) -> None:
        self._held: dict[Any, list[Done | Error]] = {}
        self._seen: dict[Any, int] = {}  # samples ended, of records whose error line is written

    def add(self, event: Done | Error) -> list[Done | Error] | None:
        """Take one final event; the record's events, sample 0 first, once its line is to be written."""
        if event.sample is None:
            return [event]
        rid = event.id
        if rid in self._seen:  # its line is written
            self._seen[rid] += 1
            if self._seen[rid] == event.samples:
                del self._seen[rid]
            return None
        held = self._held.setdefault(rid, [])
        held.append(event)
        failed = isinstance(event, Error) or event.finish_reason == "interrupted"
        if failed or len(held) == event.samples:
            del self._held[rid]
            if len(held) < event.samples:
                self._seen[rid] = len(held)
            return [event] if failed else sorted(held, key=lambda e: e.sample or 0)
        return None


class Renderer:
    """Writes events to stdout (or ``--resume``'s FILE, named ``name``) as text or JSONL.

    A write that fails raises :class:`.streams.OutputError`, except a broken pipe (the reader went away),
    which stays ``BrokenPipeError``.
    """

    def __init__(
        self,
        out: IO[bytes],
        *,
        jsonl: bool,
        stream: bool,
        one_line: bool,
        null: bool,
        name: str = "stdout",
        openai_model: str | None = None,
        samples: int = 1,
    ) -> None:
        self.out = out
        self.openai_model = openai_model  # OpenAI Batch API output lines, naming this model
        self._gathered = _Samples()  # OpenAI output: a record's samples, until its one line can be written
        self.samples = samples  # --samples: answers per record, so per blank input line in aligned text
        self.name = name
        self.jsonl = jsonl
        self.stream = stream
        self.one_line = one_line
        self.end = b"\0" if null else b"\n"

    def write(self, event: Event) -> None:
        if self.openai_model is not None:
            answers = None if isinstance(event, Chunk) else self._gathered.add(event)
            if answers:
                self._emit(dumps(self._openai(answers)).encode() + b"\n")
        elif self.jsonl:
            if self.stream or not isinstance(event, Chunk):
                self._emit(event.to_json().encode() + b"\n")
        elif isinstance(event, Chunk):
            if self.stream:
                self._emit(self._text(event.text).encode())
        elif isinstance(event, Done):
            self._emit((b"" if self.stream else self._text(event.text).encode()) + self.end)
        else:  # a failed record still gets its (empty) line, so output line N answers input line N
            self._emit(self.end)

    def _openai(self, answers: list[Done | Error]) -> dict[str, Any]:
        """A record's final events (one per sample) as a Batch API output line: an error when one failed or
        was interrupted (an answer cut short is not whole)."""
        assert self.openai_model is not None
        event = answers[-1]
        if isinstance(event, Error):
            message = f"{event.error} (at {event.file}:{event.line})"
            return batchapi.error_line(event.id, "mlxpipe_error", message, event.index)
        if event.finish_reason == "interrupted":
            message = "interrupted: SIGINT, SIGTERM or SIGHUP ended the answer early"
            return batchapi.error_line(event.id, "interrupted", message, event.index)
        return batchapi.response_line(answers, self.openai_model, answers[0].index)

    @property
    def aligned(self) -> bool:
        """Whether output line (or NUL record) N answers input line N: text with --one-line or -z."""
        return not self.jsonl and (self.one_line or self.end == b"\0")

    def blank_lines(self, count: int) -> None:
        """The empty lines of ``count`` blank input records (not records), when output is :attr:`aligned`."""
        if count and self.aligned:
            self._emit(self.end * count * self.samples)  # output line i*N + s: input line i's sample s

    def _text(self, text: str) -> str:
        if self.end == b"\0":  # a NUL in an answer would split its record in two
            text = text.replace("\0", " ")
        return _NEWLINES.sub(" ", text) if self.one_line else text

    def _emit(self, data: bytes) -> None:
        # Whole lines in one write each (a raw file may take less, or nothing when non-blocking: the rest
        # follows once it has room).
        try:
            write_all(self.out, data)
        except BrokenPipeError:
            raise
        except OSError as exc:
            raise OutputError(self.name, exc) from None
