"""The wire format: every event mlxpipe emits, defined in this one place.

With ``--out jsonl`` each event is written as one compact UTF-8 JSON object per line. The
``event`` field names its kind; the set of kinds and of fields may grow, so consumers should
ignore what they do not know.

``chunk``  a fragment of a record's completion, as it streams::

    {"event": "chunk", "id": ..., "sample": int, "text": str, "tokens": int, "tps": float}

``done``   a record's final result (exactly one per successful record)::

    {"event": "done", "id": ..., "sample": int, "text": str,
     "finish_reason": "stop" | "length" | "context" | "interrupted", "tokens": int, "tps": float,
     "prompt_tokens": int, "prompt_tps": float, "peak_memory": int (bytes), "input": <the original record>,
     "json": <the parsed answer>,            # only with a JSON schema (--json-schema, "json_schema")
     "choices": {label: float, ...}}         # only with --choices or "choices"

``error``  a record that could not be processed (exactly one per failed record)::

    {"event": "error", "id": ..., "sample": int, "file": str, "line": int, "error": str}

``sample`` is there only when the record asks for several answers (``--samples N``, a record's ``n``, an
OpenAI request's ``body.n``): each answer is one sample, 0 to N-1, with its own chunks and its own final
``done`` or ``error`` line, in order (the record's samples, then the next record's). Each sample is drawn
with its own seed, derived from the record's alone (sample 0 keeps the record's seed, so it is the answer
the record would get alone), so a record's samples do not depend on its neighbours or the batch size; at
temperature 0 every sample is the same greedy answer (mlxpipe says so once on stderr). A record that could
not be read at all (a bad line) is one ``error`` line without ``sample``. In text output each sample is an
answer of its own: with ``--one-line`` (or ``-z``) a record's N answers are N lines (records) in a row, and a
blank input line is N empty ones, so output line ``i*N + s`` is input line ``i``'s sample ``s``.

``id`` is the record's own ``id`` field when it has one, else its 1-based record number. In JSONL output
no two records share one: a record whose id an earlier record has (``{"id": 4}`` and the fourth record
without an ``id``) is an ``error`` line saying so (:func:`mlxpipe.reader.unique_ids`).
``tokens`` counts generated tokens so far (the EOS token included, as mlx-lm counts them);
``tps`` is generation tokens per second: the tokens after the first over the time since the first came
(:func:`decode_tps`), so 0.0 until a second token has come (one token alone has no rate), the same one at a
time and under ``--batch``. ``prompt_tokens`` is the whole prompt; ``prompt_tps`` is
``prompt_tokens`` over the time to the first token (a reused shared prefix counts as processed, so it
shows the saving; under ``--batch`` the time includes waiting for the batch's step).
``file`` is the input's name as given (``<stdin>`` for standard input). A name's bytes that are not UTF-8
are written as the escapes ``\\udc80`` to ``\\udcff`` (Python's "surrogateescape": byte 0xNN is
``\\udcNN``), so every line stays valid UTF-8 and the name round-trips:
``os.fsencode(json.loads(line)["file"])`` gives back its bytes. An input FILE that cannot be read (an
I/O error, removed before its turn) is one ``error`` line with ``error`` "cannot read FILE: REASON" at the
line where reading stopped, and the run goes on.
``finish_reason`` is "stop" on EOS or a stop string, "length" at max tokens, "context" when the model's
context was full first (the prompt left fewer tokens of it than max tokens: generation never runs past it),
"interrupted" when SIGINT, SIGTERM or SIGHUP ended the record early.

Structured output (``--json-schema``, ``--choices``, ``--regex``, ``--grammar``, or a record's own
``json_schema`` / ``choices``): a ``done`` event always holds a complete answer of the constraint. With a
JSON schema, ``json`` is the answer parsed (``text`` is the same answer as compact JSON text). With choices,
``choices`` maps every label to its probability under the model, scored from its log probabilities: the
sum of the log probabilities of the label's tokens (as the tokenizer encodes the label alone) right after
the prompt, then normalised over the labels (a softmax), so the values add up to 1; ``text`` is the most
probable label (at temperature T > 0, one drawn from those log probabilities divided by T), so the
answer always agrees with its probabilities; ``tokens`` is the chosen label's token count. An answer that
max tokens, a stop string or an interrupt cut short is an ``error`` ("answer incomplete: max tokens
reached", …), never a ``done``. An answer that reached max tokens is complete only when the constraint
could not have continued it (llguidance's matcher is *stopped*): ``-12`` of a number schema is accepted
by the grammar but not complete. A constraint that admits no answer at all is a usage error before the
model loads (or, for a record's own, that record's error line).

``summary``  with ``--stats`` and ``--out jsonl``, the last line on stdout (after every record's; never in
``--resume``'s FILE)::

    {"event": "summary", "records": int, "failed": int, "prompt_tokens": int, "tokens": int,
     "seconds": float, "tps": float, "decode_tps": float, "peak_memory": int (bytes), "batch": str}

``records`` counts the final lines written (``failed`` of them errors), ``tokens`` the generated tokens,
``seconds`` the wall time since the model was loaded; ``tps`` is ``tokens`` over ``seconds`` (prompts
included: a job's throughput), ``decode_tps`` the rate a record decodes at (its tokens after the first over
their time, as a ``done`` event's ``tps``) over all records, ``peak_memory`` the highest of the records'.
``batch`` says how many records generated together (and why, when ``--batch auto`` chose). It is the
``--stats`` line on stderr, which is written too, for machines.

Every record of the input gets exactly one ``done`` or ``error`` line (one per sample), in input order
(``--unordered`` keeps the one line, not the order). ``id`` is a string or an integer, and ``file`` and
``line`` name where an error's record came from (see :mod:`mlxpipe.reader` for what input is refused). Each
line is written with one write and flushed. With ``--resume FILE`` the ``done`` and ``error`` lines are
appended to FILE instead of stdout, except ``done`` lines of interrupted records (see
:mod:`mlxpipe.resume`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def dumps(obj: dict[str, Any]) -> str:
    """``obj`` as one compact line of UTF-8 JSON, as every event is written."""
    text = json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    # A lone surrogate (a name's byte that was not UTF-8) cannot be encoded: write it as its JSON escape.
    # Outside strings JSON has no such character, so every match is inside one.
    return _LONE_SURROGATE.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


def decode_tps(tokens: int, first: float, now: float) -> float:
    """Generation tokens per second: the ``tokens - 1`` after the first over the seconds since the first
    came (at ``first``); 0.0 until there are two."""
    if tokens < 2 or now <= first:
        return 0.0
    return (tokens - 1) / (now - first)


def _sample(sample: int | None) -> dict[str, int]:
    """The ``sample`` field of a record's events, there only when it has several answers."""
    return {} if sample is None else {"sample": sample}


@dataclass(frozen=True)
class Chunk:
    """A streamed fragment of one record's completion."""

    kind: ClassVar[str] = "chunk"
    index: int = field(repr=False)  # record number, for ordering; not on the wire
    id: Any
    text: str
    tokens: int
    tps: float
    sample: int | None = None  # which of the record's answers (None: its only one)
    samples: int = field(default=1, repr=False)  # how many it has; not on the wire

    def to_dict(self) -> dict[str, Any]:
        return {
            "event": self.kind,
            "id": self.id,
            **_sample(self.sample),
            "text": self.text,
            "tokens": self.tokens,
            "tps": round(self.tps, 3),
        }

    def to_json(self) -> str:
        return dumps(self.to_dict())


@dataclass(frozen=True)
class Done:
    """The final result of one record."""

    kind: ClassVar[str] = "done"
    index: int = field(repr=False)
    id: Any
    text: str
    finish_reason: str
    tokens: int
    tps: float
    prompt_tokens: int
    prompt_tps: float
    peak_memory: int
    input: Any
    json: Any = None  # the parsed answer under a JSON schema (when has_json: null is a valid answer)
    has_json: bool = False
    choices: dict[str, float] | None = None  # each choice's probability, under --choices
    sample: int | None = None  # as Chunk's
    samples: int = field(default=1, repr=False)

    def to_dict(self) -> dict[str, Any]:
        extra: dict[str, Any] = {}
        if self.has_json:
            extra["json"] = self.json
        if self.choices is not None:
            extra["choices"] = self.choices
        return {
            "event": self.kind,
            "id": self.id,
            **_sample(self.sample),
            "text": self.text,
            "finish_reason": self.finish_reason,
            "tokens": self.tokens,
            "tps": round(self.tps, 3),
            "prompt_tokens": self.prompt_tokens,
            "prompt_tps": round(self.prompt_tps, 3),
            "peak_memory": self.peak_memory,
            "input": self.input,
            **extra,
        }

    def to_json(self) -> str:
        return dumps(self.to_dict())


class _Located(Protocol):
    """Where a record came from: a record or a bad record (see :mod:`mlxpipe.records`)."""

    @property
    def index(self) -> int: ...
    @property
    def id(self) -> Any: ...
    @property
    def file(self) -> str: ...
    @property
    def line(self) -> int: ...
    @property
    def sample(self) -> int | None: ...
    @property
    def samples(self) -> int: ...


@dataclass(frozen=True)
class Error:
    """A record that could not be processed; the run goes on with the next one."""

    kind: ClassVar[str] = "error"
    index: int = field(repr=False)
    id: Any
    file: str
    line: int
    error: str
    sample: int | None = None  # as Chunk's
    samples: int = field(default=1, repr=False)

    @classmethod
    def about(cls, record: _Located, error: str) -> Error:
        """The error event of ``record``."""
        return cls(record.index, record.id, record.file, record.line, error, record.sample, record.samples)

    def to_dict(self) -> dict[str, Any]:
        where = {"file": self.file, "line": self.line, "error": self.error}
        return {"event": self.kind, "id": self.id, **_sample(self.sample), **where}

    def to_json(self) -> str:
        return dumps(self.to_dict())

    def message(self) -> str:
        """The one-line form for stderr, in the style of jq: ``mlxpipe: error (at FILE:LINE): …``."""
        return f"mlxpipe: error (at {self.file}:{self.line}): {self.error}"


@dataclass(frozen=True)
class Summary:
    """The run's totals (``--stats`` with JSONL output): not a record's event, the last line of the run."""

    kind: ClassVar[str] = "summary"
    records: int
    failed: int
    prompt_tokens: int
    tokens: int
    seconds: float
    tps: float
    decode_tps: float
    peak_memory: int
    batch: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "event": self.kind,
            "records": self.records,
            "failed": self.failed,
            "prompt_tokens": self.prompt_tokens,
            "tokens": self.tokens,
            "seconds": round(self.seconds, 3),
            "tps": round(self.tps, 3),
            "decode_tps": round(self.decode_tps, 3),
            "peak_memory": self.peak_memory,
            "batch": self.batch,
        }

    def to_json(self) -> str:
        return dumps(self.to_dict())


Event = Chunk | Done | Error
"""Any event the pipeline yields."""

FINAL_EVENTS = (Done, Error)
"""The kinds that end a record: every record gets exactly one of them."""
