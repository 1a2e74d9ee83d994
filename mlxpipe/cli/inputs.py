"""The command line's arguments → what the run reads: the input streams, the template, the constraint and
the default settings of every record."""

from __future__ import annotations

import argparse
import json
import os
import select
import sys
from collections.abc import Iterator
from typing import IO, TYPE_CHECKING

from ..errors import UsageError
from ..reader import STDIN, RecordReader
from ..records import BadRecord, Record, Settings, Template

if TYPE_CHECKING:
    from ..constrain import Constraint

__all__ = [
    "PROMPT",
    "check_files",
    "check_prompts",
    "constraint",
    "ready",
    "records",
    "settings",
    "template",
]

PROMPT = "<prompt>"  # where a -p record comes from, in its error line: "(at <prompt>:2)" is the second -p


def _inputs(files: list[str], private_stdin: bool = False) -> Iterator[tuple[str, IO[bytes]]]:
    for name in files or ["-"]:
        if name == "-" and private_stdin:
            # A reader thread still blocked on sys.stdin at exit makes Python abort at shutdown
            # ("could not acquire lock"); a private reader of the same descriptor is not finalized.
            with open(sys.stdin.fileno(), "rb", closefd=False) as stdin:
                yield STDIN, stdin
        elif name == "-":
            yield STDIN, sys.stdin.buffer
        else:
            with open(name, "rb") as f:
                yield name, f


def records(
    files: list[str],
    reader: RecordReader,
    private_stdin: bool = False,
    *,
    prompts: list[str] | None = None,
    slurp: bool = False,
) -> Iterator[Record | BadRecord]:
    """The records of the run: each -p TEXT (then stdin is not read), or each FILE (or stdin) whole with
    ``slurp``, or the records of each FILE (or stdin) in turn."""
    if prompts and not slurp:
        for number, text in enumerate(prompts, 1):
            raw = os.fsencode(text)  # as given: bytes that are not UTF-8 become the record's error
            if reader.fmt.jsonl:  # a JSONL reader takes a JSON string as the prompt (and --template's field)
                raw = json.dumps(text, ensure_ascii=False).encode("utf-8", "surrogateescape")
            reader.count += 1
            yield reader.parse(PROMPT, number, raw)
        return
    for name, stream in _inputs(files, private_stdin):
        if slurp:
            yield from _slurp(name, stream, reader)
        else:
            yield from reader.read(name, stream)


def ready(files: list[str]) -> bool:
    """Whether the first input can be read without waiting: a regular file, or stdin holding data or at its
    end. (A producer that has not written yet is not waited for: the model loads meanwhile.)"""
    name = files[0] if files else "-"
    if name != "-":
        return os.path.isfile(name)
    try:
        readable, _, _ = select.select([sys.stdin.fileno()], [], [], 0)
    except (OSError, ValueError, AttributeError):  # no stdin, or one select cannot watch
        return False
    return bool(readable)


def _slurp(name: str, stream: IO[bytes], reader: RecordReader) -> Iterator[Record | BadRecord]:
    """All of ``stream`` as one record: trailing newlines dropped, nothing for blank input."""
    limit = reader.fmt.max_line_bytes
    data = stream.read(limit + 1)
    if len(data) > limit:
        while stream.read(1 << 16):  # the rest is read, so the writer is not cut off
            pass
        reader.count += 1
        error = f"input longer than --max-line-bytes ({limit} bytes)"
        yield BadRecord(reader.count, name, 1, reader.count, error)
        return
    data = data.removeprefix(b"\xef\xbb\xbf").rstrip(b"\r\n")
    if data.strip():
        reader.count += 1
        yield reader.parse(name, 1, data)


def template(args: argparse.Namespace) -> Template | None:
    if args.template is not None and args.template_file is not None:
        raise UsageError("--template and --template-file cannot be used together")
    text = args.template
    if args.template_file is not None:
        try:
            with open(args.template_file, encoding="utf-8") as f:
                text = f.read().rstrip("\n")
        except OSError as exc:
            raise UsageError(f"cannot read template file: {exc}") from None
    if text is None and args.slurp and args.prompt:
        # -p TEXT --slurp: the instruction, a blank line, the document. Its braces are its own.
        text = args.prompt[0].replace("{", "{{").replace("}", "}}") + "\n\n{text}"
    if text is None:
        return None
    template = Template.parse(text)
    if args.in_format == "lines" and set(template.fields) - {"line", "text"}:
        raise UsageError("in lines mode a template can only use {text} (or {line}): the record's text")
    return template


def check_prompts(args: argparse.Namespace) -> None:
    """-p and --slurp: what goes together (see their help)."""
    prompts: list[str] = args.prompt or []
    if args.slurp:
        if args.in_format == "jsonl":
            raise UsageError("--slurp reads text: it cannot be used with --in jsonl")
        if len(prompts) > 1:
            raise UsageError("--slurp takes one -p: the instruction put before the document")
        if prompts and (args.template is not None or args.template_file is not None):
            raise UsageError(
                "with --slurp, give -p or --template, not both: put the instruction in the template, "
                "where {text} is the document"
            )
    elif prompts and args.files:
        raise UsageError(
            "-p and FILE cannot be used together: the prompts are the input (add --slurp to put the "
            "prompt before each FILE's text)"
        )
    if any(not p.strip() for p in prompts):
        raise UsageError("-p: empty prompt")


def constraint(args: argparse.Namespace) -> Constraint | None:
    given = [(flag, v) for flag, v in _constraint_flags(args) if v is not None]
    if not given:
        return None
    if len(given) > 1:
        raise UsageError(f"{given[0][0]} and {given[1][0]} cannot be used together")
    from .. import constrain  # llguidance is imported only when asked for

    flag, value = given[0]
    build = {
        "--json-schema": constrain.json_schema_argument,
        "--choices": constrain.choices_argument,
        "--regex": constrain.regex,
        "--grammar": constrain.lark_file,
    }[flag]
    try:
        return build(value)
    except constrain.ConstraintError as exc:
        raise UsageError(f"{flag}: {exc}") from None


def _constraint_flags(args: argparse.Namespace) -> list[tuple[str, str | None]]:
    return [
        ("--json-schema", args.json_schema),
        ("--choices", args.choices),
        ("--regex", args.regex),
        ("--grammar", args.grammar),
    ]


def settings(args: argparse.Namespace, constraint: Constraint | None) -> Settings:
    return Settings(
        max_tokens=args.max_tokens,
        temperature=args.temp,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        seed=args.seed,
        stop=tuple(args.stop or ()),
        system=args.system,
        raw=args.raw,
        chat_template_args=args.chat_template_args or {},
        constraint=constraint,
    )


def check_files(files: list[str]) -> None:
    for name in files:
        if name != "-":
            try:
                with open(name, "rb"):
                    pass
            except OSError as exc:
                raise UsageError(f"cannot open {name}: {exc.strerror}") from None
