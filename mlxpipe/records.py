"""What a record is: its text or messages, where it came from, and how it is to be answered.

Made by :mod:`mlxpipe.reader` (bytes in) and :func:`mlxpipe.reader.records_from_objects` (the Python API);
read by the pipeline and the engine. A record that could not be made is a :class:`BadRecord`.
"""

from __future__ import annotations

import hashlib
import json
import re
import string
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from .errors import UsageError

if TYPE_CHECKING:
    from .constrain import Constraint

__all__ = ["MAX_SAMPLES", "BadRecord", "Record", "Settings", "Template", "one_per_sample", "sample_seed"]


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
    samples: int = 1  # answers wanted (--samples, a record's "n"): see one_per_sample


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
    sample: int | None = None  # which of its settings.samples answers this is (None: the only one)

    @property
    def samples(self) -> int:
        """How many answers the record this one is a sample of has (1 for a record answered once)."""
        return 1 if self.sample is None else self.settings.samples


@dataclass(frozen=True)
class BadRecord:
    """An input record that could not be turned into a :class:`Record`."""

    index: int
    file: str
    line: int
    id: Any
    error: str
    blanks: int = 0  # as Record's
    sample: int | None = None  # a record that could not be made has one error line, no samples
    samples: int = 1


# ---------------------------------------------------------------------------------------------
# Several samples per record

MAX_SAMPLES = 128  # answers per record at most (OpenAI's limit of ``n``)


def sample_seed(seed: int, sample: int) -> int:
    """The seed of a record's sample ``sample``: the record's own for the first, then one derived from it
    alone, so a record's samples do not depend on its neighbours, its position or the batch size."""
    if sample == 0:
        return seed
    digest = hashlib.sha256(f"mlxpipe sample {seed} {sample}".encode()).digest()
    return int.from_bytes(digest[:8], "little")  # mlx's seeds are unsigned 64-bit integers


def one_per_sample(records: Iterable[Record | BadRecord]) -> Iterator[Record | BadRecord]:
    """``records`` with each record that asks for N > 1 answers (``settings.samples``) as N records, one
    per sample, in order: ``sample`` 0 to N-1, each with its own seed (:func:`sample_seed`; unseeded stays
    unseeded). Records are numbered again so every answer has its own ``index`` (the order events are
    written in: record, then sample); ids and everything else stay the record's. A record already split (its
    ``sample`` set) passes as it is, so splitting twice changes nothing."""
    shift = 0
    for record in records:
        if isinstance(record, BadRecord) or record.sample is not None or record.settings.samples == 1:
            yield replace(record, index=record.index + shift) if shift else record
            continue
        s = record.settings
        for k in range(s.samples):
            seed = None if s.seed is None else sample_seed(s.seed, k)
            yield replace(
                record,
                index=record.index + shift + k,
                settings=replace(s, seed=seed) if seed != s.seed else s,
                blanks=record.blanks if k == 0 else 0,
                sample=k,
            )
        shift += s.samples - 1


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
