"""The command line's arguments → what the run reads: the input streams, the template, the constraint and
the default settings of every record."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from typing import IO, TYPE_CHECKING

from ..errors import UsageError
from ..reader import STDIN, RecordReader
from ..records import BadRecord, Record, Settings, Template

if TYPE_CHECKING:
    from ..constrain import Constraint

__all__ = ["check_files", "constraint", "records", "settings", "template"]


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
    files: list[str], reader: RecordReader, private_stdin: bool = False
) -> Iterator[Record | BadRecord]:
    for name, stream in _inputs(files, private_stdin):
        yield from reader.read(name, stream)


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
    if text is None:
        return None
    template = Template.parse(text)
    if args.in_format == "lines" and set(template.fields) - {"line"}:
        raise UsageError("in lines mode a template can only use {line}")
    return template


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
