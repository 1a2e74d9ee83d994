"""What a record is: its text or messages, where it came from, and how it is to be answered.

Made by :mod:`mlxpipe.reader` (bytes in) and :func:`mlxpipe.reader.records_from_objects` (the Python API);
read by the pipeline and the engine. A record that could not be made is a :class:`BadRecord`.
"""

from __future__ import annotations

import json
import re
import string
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .errors import UsageError

if TYPE_CHECKING:
    from .constrain import Constraint

__all__ = ["BadRecord", "Record", "Settings", "Template"]


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
    blanks: int = 0  # blank records (skipped) right before this one: text output keeps their empty lines


@dataclass(frozen=True)
class BadRecord:
    """An input record that could not be turned into a :class:`Record`."""

    index: int
    file: str
    line: int
    id: Any
    error: str
    blanks: int = 0  # as Record's


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
