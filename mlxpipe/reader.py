"""Bytes in, records out: lines, NUL-separated records, JSONL objects and prompt templates.

Readers are lazy generators: a record is yielded as soon as its separator has been read, so the
first answer can stream before the input ends, and memory does not grow with the input. Bad input
never raises: it becomes a :class:`BadRecord` that names the file and line.

What is accepted, and what is not (each refused record becomes one error line; the run goes on):

- Records end at ``\n`` (``\0`` with ``-z``); a last record without a separator counts. One ``\r``
  before the separator is dropped (CRLF files), and so is a UTF-8 byte order mark at the start of each
  input file (in JSONL mode, as jsonlines reads it, at the start of any line). Records whose bytes are
  all whitespace are skipped but counted for line numbers; the next record carries how many came right
  before it (``blanks``), so text output with ``--one-line`` or ``-z`` gives each its empty line.
- Lines mode: the line is the prompt verbatim (surrounding whitespace kept). It must be UTF-8 and hold
  no NUL byte (use ``-z`` for NUL-separated records).
- JSONL mode: one JSON value per line, surrounding whitespace ignored. It must be UTF-8 without NUL
  bytes, a single object or string with nothing after it, standard JSON (no NaN or Infinity, no
  unpaired ``\ud800``-style surrogate escapes, integers of at most 4300 digits) nested at most
  :data:`MAX_DEPTH` levels. ``id`` is a string or an integer (default: the record number); the prompt
  is a non-blank string, or ``messages`` a non-empty list of ``{role, content}`` string objects.
  Settings are checked by :func:`settings_from_object`; unknown fields are kept for ``--template``
  and echoed in ``input``, never interpreted or evaluated.
- A record longer than ``--max-line-bytes`` (default 1 MiB) is an error without being read into memory.
- An input that fails while it is read (an I/O error, a FILE removed before its turn, a closed stdin)
  becomes one error line for that input, at the line where reading stopped: ``"error": "cannot read FILE:
  REASON"``; its ``id`` is the next record number. The run goes on with the next input. A non-blocking
  input (a parent may set stdin so) is waited on when it has nothing yet, never taken as its end.
- Lines mode with ``--template``: a prompt that is blank once the template is filled is refused, as in
  JSONL.
"""

from __future__ import annotations

import functools
import json
import math
import re
import select
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import IO, TYPE_CHECKING, Any

from . import batchapi
from .records import MAX_SAMPLES, BadRecord, Record, Settings, Template

if TYPE_CHECKING:
    import jsonlines

STDIN = "<stdin>"
DEFAULT_MAX_LINE_BYTES = 1 << 20  # 1 MiB: far above any prompt a small context holds, far below RAM
MAX_DEPTH = 64  # JSON nesting; deeper records are refused long before Python's recursion limit
MAX_TOKENS_LIMIT = 1 << 20  # no model's context comes near; the engine also caps at the model's context
MAX_SEED = (1 << 64) - 1  # mlx's random seed is an unsigned 64-bit integer
MAX_STOPS = 64


def split_records(stream: IO[bytes], sep: bytes, max_bytes: int) -> Iterator[tuple[int, bytes | None]]:
    """Yield ``(number, record)`` for each ``sep``-terminated record; ``None`` for one over ``max_bytes``.

    Reads with ``read1`` (or one ``read`` of a raw stream) so that a record is yielded as soon as it
    arrives (pipes, terminals). A non-blocking stream with nothing yet (``None``) is waited on. An
    ``OSError`` of the stream is raised, with ``number`` records yielded before it.
    """
    read = getattr(stream, "read1", stream.read)
    buf = bytearray()
    number = 0
    overlong = False
    while True:
        chunk = read(1 << 16)
        if chunk is None:  # non-blocking and nothing there yet: not the end
            _wait_readable(stream.fileno())
            continue
        if not chunk:
            break
        start = 0
        while (end := chunk.find(sep, start)) >= 0:
            number += 1
            if overlong or len(buf) + end - start > max_bytes:
                yield number, None
            else:
                buf += chunk[start:end]
                yield number, bytes(buf)
            buf.clear()
            overlong = False
            start = end + 1
        if not overlong:
            buf += chunk[start:]
            if len(buf) > max_bytes:  # drop the rest of this record; only its number is kept
                overlong = True
                buf.clear()
    if buf or overlong:
        yield number + 1, None if overlong else bytes(buf)


def read_whole(stream: IO[bytes], max_bytes: int) -> bytes | None:
    """All of ``stream`` (``--slurp``), waiting on a non-blocking one as :func:`split_records` does; None when
    it holds more than ``max_bytes`` (the rest is still read, so its writer is not cut off)."""
    read = getattr(stream, "read1", stream.read)
    chunks: list[bytes] = []
    size = 0
    while True:
        chunk = read(1 << 16)
        if chunk is None:
            _wait_readable(stream.fileno())
            continue
        if not chunk:
            return None if size > max_bytes else b"".join(chunks)
        size += len(chunk)
        if size <= max_bytes:
            chunks.append(chunk)
        else:
            chunks.clear()


def _wait_readable(fd: int) -> None:
    if hasattr(select, "poll"):
        waiter = select.poll()
        waiter.register(fd, select.POLLIN)
        waiter.poll()  # an error or hang-up ends the wait too: the next read says which
    else:  # pragma: no cover
        select.select([fd], [], [])


# ---------------------------------------------------------------------------------------------
# Records from lines and JSONL

_INT_FIELDS = {"max_tokens": (1, MAX_TOKENS_LIMIT), "top_k": (0, MAX_TOKENS_LIMIT), "seed": (0, MAX_SEED)}
_FLOAT_FIELDS = {"temperature": (0.0, 100.0), "top_p": (0.0, 1.0), "min_p": (0.0, 1.0)}


def settings_from_object(obj: Mapping[str, Any], base: Settings) -> Settings:
    """Apply a JSONL record's own settings on top of ``base``; raise ``ValueError`` when one is bad."""
    changes: dict[str, Any] = {}
    for name, (low, high) in _INT_FIELDS.items():
        if name in obj:
            value = obj[name]
            if isinstance(value, float) and value.is_integer():  # 4.0 is the integer 4 in JSON's eyes
                value = int(value)
            if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
                raise ValueError(f"{name!r} must be an integer in [{low}, {high}], got {_shown(obj[name])}")
            changes[name] = value
    if "n" in obj:  # several answers (one_per_sample)
        value = obj["n"]
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_SAMPLES:
            raise ValueError(f"'n' must be an integer in [1, {MAX_SAMPLES}], got {_shown(obj['n'])}")
        changes["samples"] = value
    for name, (lo, hi) in _FLOAT_FIELDS.items():
        if name in obj:
            value = obj[name]
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not lo <= value <= hi:
                raise ValueError(f"{name!r} must be a number in [{lo:g}, {hi:g}], got {_shown(value)}")
            changes[name] = float(value)
    if "system" in obj:
        if not isinstance(obj["system"], str):
            raise ValueError("'system' must be a string")
        changes["system"] = obj["system"]
    if "stop" in obj:
        stop = obj["stop"]
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
            raise ValueError("'stop' must be a non-empty string or a list of them")
        if len(stops) > MAX_STOPS:
            raise ValueError(f"'stop' has {len(stops)} strings, more than {MAX_STOPS}")
        changes["stop"] = tuple(stops)
    if "json_schema" in obj or "choices" in obj:
        from .constrain import from_record  # llguidance is imported only when a record asks for it

        changes["constraint"] = from_record(obj)
    return replace(base, **changes) if changes else base


def _shown(value: Any, limit: int = 40) -> str:
    """A JSON value as shown in an error message: short, on one line."""
    if isinstance(value, float) and not math.isfinite(value):  # from the command line: JSON has no inf
        return repr(value)
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e999 parses as infinity, which JSON output cannot carry
        raise ValueError("a number is out of range")
    return value


def _check_value(obj: Any) -> None:
    """Refuse what JSON parsing lets through but nothing downstream can use: deep nesting, lone surrogates.

    Iterative, so that checking a deep value cannot itself hit the recursion limit.
    """
    stack = [(obj, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, str):
            if _SURROGATE.search(value):
                raise ValueError("invalid JSON: a string holds an unpaired surrogate (like \\ud800)")
        elif isinstance(value, (dict, list)):
            if depth > MAX_DEPTH:
                raise ValueError(f"JSON nested deeper than {MAX_DEPTH} levels")
            items = value.items() if isinstance(value, dict) else ((None, v) for v in value)
            for key, item in items:
                if key is not None:
                    stack.append((key, depth))
                stack.append((item, depth + 1))


_SURROGATE = re.compile("[\ud800-\udfff]")
_loads = functools.partial(json.loads, parse_constant=_refuse_constant, parse_float=_finite)


def _reason(exc: jsonlines.InvalidLineError) -> str:
    """jsonlines' error, reworded for one line that names no internals."""
    cause = exc.__cause__
    if isinstance(cause, UnicodeDecodeError):
        return f"invalid UTF-8 at byte {cause.start}"
    if isinstance(cause, json.JSONDecodeError):
        msg = (
            "text after the JSON value"
            if cause.msg == "Extra data"
            else cause.msg[:1].lower() + cause.msg[1:]
        )
        return f"invalid JSON: {msg} at column {cause.colno}"
    if cause is not None:  # NaN and friends, 1e999, integers of more than 4300 digits
        return f"invalid JSON: {str(cause).split(';')[0]}"
    return "a record must be a JSON object or string, not null"


def parse_json(raw: bytes) -> Any:
    """Parse one JSONL record's bytes (see the module docstring); raise ``ValueError`` with a short reason.

    jsonlines does the reading (UTF-8 decoding, a BOM or RS at the line's start, the null check); our
    ``loads`` refuses NaN, infinities and out-of-range numbers, which JSON output could not carry.
    """
    import jsonlines  # here: JSONL input only (its attrs import is ~20 ms of every start)

    try:
        obj = jsonlines.Reader((raw,), loads=_loads).read()
    except jsonlines.InvalidLineError as exc:
        raise ValueError(_reason(exc)) from None
    except RecursionError:
        raise ValueError(f"JSON nested deeper than {MAX_DEPTH} levels") from None
    # Most records have no \u escape and few brackets: for them the walk can find nothing.
    if b"\\u" in raw or raw.count(b"[") + raw.count(b"{") > MAX_DEPTH:
        _check_value(obj)
    return obj


def _messages(value: Any) -> tuple[Mapping[str, str], ...]:
    if not isinstance(value, list) or not value:
        raise ValueError("'messages' must be a non-empty list of {role, content} objects")
    for m in value:
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise ValueError("each message must be an object with string 'role' and 'content'")
    return tuple(value)


@dataclass(frozen=True)
class InputFormat:
    """How records are read: ``jsonl`` or ``lines``, NUL separators, template and prompt key."""

    jsonl: bool = False
    null: bool = False
    template: Template | None = None
    prompt_key: str = "prompt"
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES
    openai: bool = False  # every record is an OpenAI Batch API request (else one is known by its fields)


class RecordReader:
    """Turns input streams into records, numbering them across all inputs."""

    def __init__(self, fmt: InputFormat, settings: Settings) -> None:
        self.fmt = fmt
        self.settings = settings
        self.count = 0
        # Blank records read since the last record: not records, but line N of text output answers line N,
        # so each is carried by the next record (:attr:`Record.blanks`); those left at the end are trailing.
        self.blanks = 0
        self._utf16_input: str | None = None  # the input found to be UTF-16
        # Told once each that a Batch API request's 'model' is ignored and that several samples at
        # temperature 0 repeat one answer (the CLI sets it to write on stderr).
        self.notice: Callable[[str], None] | None = None
        self._noticed: set[str] = set()

    def _say_once(self, kind: str, text: str) -> None:
        if self.notice is not None and kind not in self._noticed:
            self._noticed.add(kind)
            self.notice(text)

    def read(self, name: str, stream: IO[bytes]) -> Iterator[Record | BadRecord]:
        """Yield one :class:`Record` or :class:`BadRecord` per non-blank record of ``stream``.

        A read that fails ends ``stream`` with one :class:`BadRecord` saying why (:meth:`unreadable`).
        """
        for record in self._read(name, stream):
            if self.blanks:
                record = replace(record, blanks=self.blanks)
                self.blanks = 0
            yield record

    def _read(self, name: str, stream: IO[bytes]) -> Iterator[Record | BadRecord]:
        sep = b"\0" if self.fmt.null else b"\n"
        lines = split_records(stream, sep, self.fmt.max_line_bytes)
        line = 0
        while True:
            try:
                line, raw = next(lines)
            except StopIteration:
                return
            except OSError as exc:
                yield self.unreadable(name, line + 1, exc)
                return
            if raw is not None:
                raw = raw[:-1] if raw.endswith(b"\r") else raw
                if line == 1 and raw.startswith(b"\xef\xbb\xbf"):  # a UTF-8 byte order mark
                    raw = raw[3:]
                if not raw.strip():
                    self.blanks += 1  # skipped, but still counted
                    continue
            self.count += 1
            if raw is None:
                yield BadRecord(
                    self.count,
                    name,
                    line,
                    self.count,
                    f"record longer than --max-line-bytes ({self.fmt.max_line_bytes} bytes)",
                )
                continue
            yield self.parse(name, line, raw)

    def unreadable(self, name: str, line: int, exc: OSError) -> BadRecord:
        """The error line of input ``name`` that could not be opened or read on from ``line`` on."""
        self.count += 1
        reason = exc.strerror or type(exc).__name__
        blanks, self.blanks = self.blanks, 0  # an earlier input's trailing blank lines come before it
        return BadRecord(self.count, name, line, self.count, f"cannot read {name}: {reason}", blanks)

    def parse(self, name: str, line: int, raw: bytes) -> Record | BadRecord:
        """Turn one record's bytes (separator stripped) into a record numbered ``self.count``."""
        record = self._parse(name, line, raw)
        if isinstance(record, Record) and record.settings.samples > 1 and record.settings.temperature == 0:
            self._say_once(
                "greedy samples",
                "mlxpipe: note: several samples at temperature 0 repeat one answer (greedy decoding): give "
                "--temp (or the record's temperature) above 0 for different ones",
            )
        return record

    def _parse(self, name: str, line: int, raw: bytes) -> Record | BadRecord:
        index = self.count
        if _utf16(raw) or (self._utf16_input == name and b"\0" in raw):  # (its last newline's NUL half)
            self._utf16_input = name
            return BadRecord(
                index,
                name,
                line,
                index,
                "the input is UTF-16, not UTF-8 (convert it: iconv -f UTF-16 -t UTF-8)",
            )
        if (nul := raw.find(b"\0")) >= 0:
            return BadRecord(
                index, name, line, index, f"NUL byte at byte {nul} (NUL-separated input needs -z)"
            )
        try:
            if self.fmt.jsonl:
                return self._from_json(name, line, raw)
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            return BadRecord(index, name, line, index, f"invalid UTF-8 at byte {exc.start}")
        lead = ""
        if self.fmt.template is not None:
            try:
                text = self.fmt.template.render({"line": text, "text": text})
                lead = self.fmt.template.lead
            except KeyError as exc:
                return BadRecord(
                    index, name, line, index, f"template field {exc} is not available in lines mode"
                )
            if not text.strip():
                return BadRecord(index, name, line, index, "the template gave an empty prompt")
        return Record(index, name, line, index, text, self.settings, prompt=text, lead=lead)

    def _from_json(self, name: str, line: int, raw: bytes) -> Record | BadRecord:
        index = self.count
        try:
            obj = parse_json(raw)
        except ValueError as exc:
            return BadRecord(index, name, line, index, str(exc))
        if isinstance(obj, str):
            obj_fields: dict[str, Any] = {self.fmt.prompt_key: obj}
        elif isinstance(obj, dict):
            obj_fields = obj
        else:
            return BadRecord(
                index, name, line, index, f"a record must be a JSON object or string, not {_json_type(obj)}"
            )
        raw_prompt = False
        if self.fmt.openai or batchapi.is_request(obj_fields):
            try:
                obj_fields, raw_prompt = self._from_request(obj_fields)
            except ValueError as exc:
                rid = obj_fields.get("custom_id", index)
                rid = rid if isinstance(rid, (str, int)) and not isinstance(rid, bool) else index
                return BadRecord(index, name, line, rid, str(exc))
        rid = obj_fields.get("id", index)
        if not isinstance(rid, (str, int)) or isinstance(rid, bool):
            return BadRecord(
                index, name, line, index, f"'id' must be a string or an integer, not {_shown(rid)}"
            )
        try:
            settings = settings_from_object(obj_fields, self.settings)
            if raw_prompt:
                settings = replace(settings, raw=True)
            if self.fmt.template is not None:
                try:
                    rendered = self.fmt.template.render(obj_fields)
                except KeyError as exc:
                    raise ValueError(f"record has no field {exc} for the template") from None
                if not rendered.strip():
                    raise ValueError("the template gave an empty prompt")
                lead = self.fmt.template.lead
                return Record(index, name, line, rid, obj, settings, prompt=rendered, lead=lead)
            if "messages" in obj_fields and self.fmt.prompt_key not in obj_fields:
                return Record(
                    index, name, line, rid, obj, settings, messages=_messages(obj_fields["messages"])
                )
            prompt: Any = obj_fields.get(self.fmt.prompt_key)
            if prompt is None:
                raise ValueError(f"record has no {self.fmt.prompt_key!r} (string) or 'messages' (list)")
            if not isinstance(prompt, str):
                raise ValueError(f"{self.fmt.prompt_key!r} must be a string, not {_json_type(prompt)}")
            if not prompt.strip():
                raise ValueError(f"empty prompt: {self.fmt.prompt_key!r} is blank")
            return Record(index, name, line, rid, obj, settings, prompt=prompt)
        except ValueError as exc:
            return BadRecord(index, name, line, rid, str(exc))

    def _from_request(self, obj: Mapping[str, Any]) -> tuple[dict[str, Any], bool]:
        """An OpenAI Batch API request line → a record's fields (see :mod:`mlxpipe.batchapi`)."""
        fields, raw_prompt = batchapi.request_fields(obj)
        if "prompt" in fields:  # where the rest of the reader looks for it
            fields[self.fmt.prompt_key] = fields.pop("prompt")
        body = obj.get("body")
        if isinstance(body, dict) and "model" in body:
            self._say_once(
                "model",
                f"mlxpipe: note: the requests' 'model' ({batchapi.short(body['model'])}) is ignored: "
                "they are answered by the model loaded",
            )
        return fields, raw_prompt


def _utf16(raw: bytes) -> bool:
    """Whether a record's bytes look like UTF-16: its byte order mark, or a NUL byte in every other place
    (ASCII text in UTF-16; a line of it after the first begins with the NUL half of the newline)."""
    if raw.startswith((b"\xff\xfe", b"\xfe\xff")):
        return True
    if len(raw) < 4 or b"\0" not in raw:
        return False
    return any(half.count(0) * 4 >= len(half) * 3 for half in (raw[0::2], raw[1::2]))


def _json_type(value: Any) -> str:
    """The JSON name of a parsed value's type, for error messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, dict):
        return "an object"
    return "an array" if isinstance(value, list) else "a string"


def records_from_objects(
    items: Iterable[str | Mapping[str, Any]],
    settings: Settings | None = None,
) -> Iterator[Record | BadRecord]:
    """Records for the Python API: each item is a prompt string or a JSONL-style object."""
    reader = RecordReader(InputFormat(jsonl=True), settings or Settings())
    for number, item in enumerate(items, 1):
        reader.count = number
        yield reader.parse("<api>", number, json.dumps(item, ensure_ascii=False).encode())


def unique_ids(records: Iterable[Record | BadRecord]) -> Iterator[Record | BadRecord]:
    """``records``, each whose id an earlier record already has turned into a :class:`BadRecord` saying so.

    A record without ``id`` is known by its number, so ``{"id": 4}`` and the fourth record without one
    would share an id, and ``--resume`` would skip whichever came second. The later of the two is refused
    (its error line carries the id; ``--resume`` never skips an error), on every rank alike. Memory grows
    only with the records whose id is not their number.
    """
    moved: set[int] = set()  # numbers of records whose id is not their number
    where: dict[Any, tuple[str, int]] = {}  # those ids, and where their record was
    for record in records:
        rid = record.id
        own = type(rid) is int and rid == record.index
        earlier = None
        if rid in where:
            earlier = "the record at {}:{}".format(*where[rid])
        elif type(rid) is int and 1 <= rid < record.index and rid not in moved:
            earlier = f"record {rid}, which has no 'id' and is known by its number"
        if earlier is not None:
            yield BadRecord(
                record.index,
                record.file,
                record.line,
                rid,
                f"id {_shown(rid)} is already the id of {earlier}; ids must be unique",
            )
        else:
            yield record
        if not own:
            moved.add(record.index)
            where.setdefault(rid, (record.file, record.line))
