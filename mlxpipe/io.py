"""Records in: lines, NUL-separated records, JSONL objects and prompt templates.

Readers are lazy generators: a record is yielded as soon as its separator has been read, so the
first answer can stream before the input ends, and memory does not grow with the input. Bad input
never raises: it becomes a :class:`BadRecord` that names the file and line.
"""

from __future__ import annotations

import json
import re
import string
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import IO, TYPE_CHECKING, Any

import jsonlines

if TYPE_CHECKING:
    from .constrain import Constraint

STDIN = "<stdin>"
DEFAULT_MAX_LINE_BYTES = 1 << 20  # 1 MiB: far above any prompt a small context holds, far below RAM


class UsageError(Exception):
    """Bad arguments, found before any work is done (exit status 2)."""


@dataclass(frozen=True)
class Settings:
    """How one record is generated: the command line's defaults, overridden per record in JSONL."""

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 0.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    system: str | None = None
    raw: bool = False
    chat_template_args: Mapping[str, Any] = field(default_factory=dict)
    constraint: Constraint | None = None  # structured output (see mlxpipe.constrain)


@dataclass(frozen=True)
class Record:
    """One prompt to answer: either ``prompt`` text or chat ``messages``."""

    index: int  # 1-based number of the record in the whole input
    file: str
    line: int  # line (or NUL-separated record) number within ``file``
    id: Any
    input: Any  # the original record, echoed in the done event
    settings: Settings
    prompt: str | None = None
    messages: tuple[Mapping[str, str], ...] | None = None
    lead: str = ""  # start of ``prompt`` shared by all records: a template's text before its first field


@dataclass(frozen=True)
class BadRecord:
    """An input record that could not be turned into a :class:`Record`."""

    index: int
    file: str
    line: int
    id: Any
    error: str


# ---------------------------------------------------------------------------------------------
# Templates


_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


@dataclass(frozen=True)
class Template:
    """A prompt template: ``{name}`` is replaced by the record's field, ``{{`` and ``}}`` are braces.

    Only plain names are allowed, so a template can never reach attributes or items
    (``{x.__class__}``, ``{x[0]}``) the way ``str.format`` would.
    """

    parts: tuple[tuple[str, str | None], ...]

    @classmethod
    def parse(cls, text: str) -> Template:
        try:
            pieces = list(string.Formatter().parse(text))
        except ValueError as exc:
            raise UsageError(f"bad template: {exc}") from None
        parts: list[tuple[str, str | None]] = []
        for literal, name, spec, conversion in pieces:
            if name is not None and (not _NAME.match(name) or spec or conversion):
                shown = name + (f"!{conversion}" if conversion else "") + (f":{spec}" if spec else "")
                raise UsageError(
                    f"bad template field {{{shown}}}: only plain names like {{text}} are allowed"
                )
            parts.append((literal, name))
        return cls(tuple(parts))

    @property
    def lead(self) -> str:
        """The literal text before the first field: the same at the start of every rendered prompt."""
        out = []
        for literal, name in self.parts:
            out.append(literal)
            if name is not None:
                break
        return "".join(out)

    @property
    def fields(self) -> list[str]:
        return [name for _, name in self.parts if name is not None]

    def render(self, values: Mapping[str, Any]) -> str:
        """Fill the template; a missing field raises ``KeyError`` with its name."""
        out = []
        for literal, name in self.parts:
            out.append(literal)
            if name is not None:
                value = values[name]
                out.append(value if isinstance(value, str) else json.dumps(value, ensure_ascii=False))
        return "".join(out)


# ---------------------------------------------------------------------------------------------
# Splitting a byte stream into records


def split_records(stream: IO[bytes], sep: bytes, max_bytes: int) -> Iterator[tuple[int, bytes | None]]:
    """Yield ``(number, record)`` for each ``sep``-terminated record; ``None`` for one over ``max_bytes``.

    Reads with ``read1`` so that a record is yielded as soon as it arrives (pipes, terminals).
    """
    read = getattr(stream, "read1", stream.read)
    buf = bytearray()
    number = 0
    overlong = False
    while True:
        chunk = read(1 << 16)
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


# ---------------------------------------------------------------------------------------------
# Records from lines and JSONL

_INT_FIELDS = {"max_tokens": 1, "top_k": 0, "seed": 0}  # name -> smallest value allowed
_FLOAT_FIELDS = {"temperature": (0.0, 100.0), "top_p": (0.0, 1.0), "min_p": (0.0, 1.0)}


def settings_from_object(obj: Mapping[str, Any], base: Settings) -> Settings:
    """Apply a JSONL record's own settings on top of ``base``; raise ``ValueError`` when one is bad."""
    changes: dict[str, Any] = {}
    for name, low in _INT_FIELDS.items():
        if name in obj:
            value = obj[name]
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"{name!r} must be an integer >= {low}, got {json.dumps(value)}")
            changes[name] = value
    for name, (lo, hi) in _FLOAT_FIELDS.items():
        if name in obj:
            value = obj[name]
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not lo <= value <= hi:
                raise ValueError(f"{name!r} must be a number in [{lo:g}, {hi:g}], got {json.dumps(value)}")
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
        changes["stop"] = tuple(stops)
    if "json_schema" in obj or "choices" in obj:
        from .constrain import from_record  # llguidance is imported only when a record asks for it

        changes["constraint"] = from_record(obj)
    return replace(base, **changes) if changes else base


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


class RecordReader:
    """Turns input streams into records, numbering them across all inputs."""

    def __init__(self, fmt: InputFormat, settings: Settings) -> None:
        self.fmt = fmt
        self.settings = settings
        self.count = 0

    def read(self, name: str, stream: IO[bytes]) -> Iterator[Record | BadRecord]:
        """Yield one :class:`Record` or :class:`BadRecord` per non-blank record of ``stream``."""
        sep = b"\0" if self.fmt.null else b"\n"
        for line, raw in split_records(stream, sep, self.fmt.max_line_bytes):
            if raw is not None:
                raw = raw[:-1] if raw.endswith(b"\r") else raw
                if line == 1 and raw.startswith(b"\xef\xbb\xbf"):  # a UTF-8 byte order mark
                    raw = raw[3:]
                if not raw.strip():
                    continue  # blank lines are skipped, but still counted
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

    def parse(self, name: str, line: int, raw: bytes) -> Record | BadRecord:
        """Turn one record's bytes (separator stripped) into a record numbered ``self.count``."""
        index = self.count
        try:
            if self.fmt.jsonl:
                return self._from_json(name, line, raw)
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            return BadRecord(index, name, line, index, f"invalid UTF-8 at byte {exc.start}")
        except ValueError as exc:
            return BadRecord(index, name, line, index, str(exc))
        lead = ""
        if self.fmt.template is not None:
            try:
                text = self.fmt.template.render({"line": text})
                lead = self.fmt.template.lead
            except KeyError as exc:
                return BadRecord(
                    index, name, line, index, f"template field {exc} is not available in lines mode"
                )
        return Record(index, name, line, index, text, self.settings, prompt=text, lead=lead)

    def _from_json(self, name: str, line: int, raw: bytes) -> Record | BadRecord:
        index = self.count
        try:
            obj = jsonlines.Reader((raw,)).read()
        except jsonlines.InvalidLineError as exc:
            # jsonlines appends "(line 1)" since it saw a single line; we name the real line ourselves.
            return BadRecord(index, name, line, index, str(exc).removesuffix(" (line 1)"))
        except RecursionError:
            return BadRecord(index, name, line, index, "JSON nested too deeply")
        if isinstance(obj, str):
            obj_fields: dict[str, Any] = {self.fmt.prompt_key: obj}
        elif isinstance(obj, dict):
            obj_fields = obj
        else:
            return BadRecord(
                index,
                name,
                line,
                index,
                f"a record must be a JSON object or string, not {type(obj).__name__}",
            )
        rid = obj_fields.get("id", index)
        try:
            settings = settings_from_object(obj_fields, self.settings)
            if self.fmt.template is not None:
                try:
                    rendered = self.fmt.template.render(obj_fields)
                    return Record(
                        index, name, line, rid, obj, settings, prompt=rendered, lead=self.fmt.template.lead
                    )
                except KeyError as exc:
                    raise ValueError(f"record has no field {exc} for the template") from None
            if "messages" in obj_fields and self.fmt.prompt_key not in obj_fields:
                return Record(
                    index, name, line, rid, obj, settings, messages=_messages(obj_fields["messages"])
                )
            prompt = obj_fields.get(self.fmt.prompt_key)
            if prompt is None:
                raise ValueError(f"record has no {self.fmt.prompt_key!r} (string) or 'messages' (list)")
            if not isinstance(prompt, str):
                raise ValueError(f"{self.fmt.prompt_key!r} must be a string, not {type(prompt).__name__}")
            return Record(index, name, line, rid, obj, settings, prompt=prompt)
        except ValueError as exc:
            return BadRecord(index, name, line, rid, str(exc))


def records_from_objects(
    items: Iterable[str | Mapping[str, Any]],
    settings: Settings | None = None,
) -> Iterator[Record | BadRecord]:
    """Records for the Python API: each item is a prompt string or a JSONL-style object."""
    reader = RecordReader(InputFormat(jsonl=True), settings or Settings())
    for number, item in enumerate(items, 1):
        reader.count = number
        yield reader.parse("<api>", number, json.dumps(item, ensure_ascii=False).encode())
