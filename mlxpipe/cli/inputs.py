"""The command line's arguments → what the run reads: the input streams, the template, the constraint and
the default settings of every record."""

from __future__ import annotations

import argparse
import json
import os
import select
import stat
from collections.abc import Iterator
from typing import IO, TYPE_CHECKING, Any

from ..errors import UsageError
from ..reader import STDIN, RecordReader, read_whole, settings_from_object
from ..records import BadRecord, Record, Settings, Template

if TYPE_CHECKING:
    from ..constrain import Constraint

__all__ = [
    "PROMPT",
    "check",
    "check_files",
    "check_prompts",
    "constraint",
    "ready",
    "records",
    "settings",
    "template",
]

PROMPT = "<prompt>"  # where a -p record comes from, in its error line: "(at <prompt>:2)" is the second -p
MAX_TEXT_FILE_BYTES = 1 << 20  # --template-file: far above any template, far below what /dev/zero would fill

# Options whose value names a file: any bytes (a name that is not UTF-8 arrives surrogate-escaped).
_PATH_OPTIONS = frozenset({"files", "resume", "template_file", "grammar", "model"})

# The command line's settings and the record fields they default: checked by the same code, to one set of
# bounds (mlxpipe.reader.settings_from_object).
_SETTING_FLAGS = {
    "max_tokens": "--max-tokens",
    "temperature": "--temp",
    "top_p": "--top-p",
    "top_k": "--top-k",
    "min_p": "--min-p",
    "seed": "--seed",
    "stop": "--stop",
    "n": "--samples",
}
MAX_REPETITION_PENALTY = 100.0


def check(args: argparse.Namespace) -> None:
    """Refuse, as a usage error, text options that are not UTF-8 and settings out of the bounds a record's
    own settings have (``--temp inf``, ``--stop ''``)."""
    for dest, value in vars(args).items():
        inline_schema = dest == "json_schema" and isinstance(value, str) and value.lstrip().startswith("{")
        if dest in _PATH_OPTIONS or (dest == "json_schema" and not inline_schema):
            continue
        byte = _undecodable(value)
        if byte is not None:
            flag = "FILE" if dest == "files" else "--" + dest.replace("_", "-")
            raise UsageError(f"{flag} is not valid UTF-8 text (it holds the byte \\x{byte:02x})")
    given = {"max_tokens": args.max_tokens, "temperature": args.temp, "top_p": args.top_p}
    given |= {"top_k": args.top_k, "min_p": args.min_p, "n": args.samples}
    if args.seed is not None:
        given["seed"] = args.seed
    if args.stop is not None:
        given["stop"] = list(args.stop)
    try:
        settings_from_object(given, Settings())
    except ValueError as exc:
        message = str(exc)
        for field, flag in _SETTING_FLAGS.items():
            message = message.replace(repr(field), flag)
        raise UsageError(message) from None
    penalty = args.repetition_penalty
    # mlx-lm divides a repeated token's positive logits by it: 0 would make them infinite (1 is off).
    if penalty is not None and not 0 < penalty <= MAX_REPETITION_PENALTY:
        raise UsageError(
            f"--repetition-penalty must be a number above 0 and at most {MAX_REPETITION_PENALTY:g} "
            f"(1 is off), got {penalty:g}"
        )


def _undecodable(value: Any) -> int | None:
    """The first byte of ``value`` (a string, or strings in lists and dicts) that was not UTF-8."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            for char in item:
                if "\udc80" <= char <= "\udcff":  # surrogateescape: how argv carries a byte that is not UTF-8
                    return ord(char) - 0xDC00
                if "\ud800" <= char <= "\udfff":
                    return 0x3F
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return None


def records(
    files: list[str],
    reader: RecordReader,
    private_stdin: bool = False,
    *,
    prompts: list[str] | None = None,
    slurp: bool = False,
) -> Iterator[Record | BadRecord]:
    """The records of the run: each -p TEXT (then stdin is not read), or each FILE (or stdin) whole with
    ``slurp``, or the records of each FILE (or stdin) in turn. A FILE that cannot be opened at its turn
    (removed since the start, say) is one error line, and the run goes on with the next.

    Inputs are read unbuffered, one ``read`` at a time: a record is taken as soon as it arrives, and a
    non-blocking descriptor says "nothing yet" instead of looking like its end. Descriptor 0 is read
    directly (``sys.stdin`` is None when it was closed); ``private_stdin`` is kept for callers that read
    from a helper thread, which this always allows.
    """
    del private_stdin  # always private: a thread blocked on sys.stdin at exit made Python abort at shutdown
    if prompts and not slurp:
        for number, text in enumerate(prompts, 1):
            raw = os.fsencode(text)  # as given: bytes that are not UTF-8 become the record's error
            if reader.fmt.jsonl:  # a JSONL reader takes a JSON string as the prompt (and --template's field)
                raw = json.dumps(text, ensure_ascii=False).encode("utf-8", "surrogateescape")
            reader.count += 1
            yield reader.parse(PROMPT, number, raw)
        return
    for name in files or ["-"]:
        shown = STDIN if name == "-" else name
        try:
            stream = open(0 if name == "-" else name, "rb", buffering=0, closefd=name != "-")  # noqa: SIM115
        except OSError as exc:
            yield reader.unreadable(shown, 1, exc)
            continue
        with stream:
            if slurp:
                yield from _slurp(shown, stream, reader)
            else:
                yield from reader.read(shown, stream)


def ready(files: list[str]) -> bool:
    """Whether the first input can be read without waiting: a regular file, or stdin holding data or at its
    end. (A producer that has not written yet is not waited for: the model loads meanwhile.)"""
    name = files[0] if files else "-"
    if name != "-":
        return os.path.isfile(name)
    try:
        readable, _, _ = select.select([0], [], [], 0)
    except (OSError, ValueError):  # no stdin, or one select cannot watch
        return False
    return bool(readable)


def _slurp(name: str, stream: IO[bytes], reader: RecordReader) -> Iterator[Record | BadRecord]:
    """All of ``stream`` as one record: trailing newlines dropped; a blank input is that record's error."""
    limit = reader.fmt.max_line_bytes
    try:
        data = read_whole(stream, limit)
    except OSError as exc:
        yield reader.unreadable(name, 1, exc)
        return
    if data is None:
        reader.count += 1
        error = f"input longer than --max-line-bytes ({limit} bytes)"
        yield BadRecord(reader.count, name, 1, reader.count, error)
        return
    data = data.removeprefix(b"\xef\xbb\xbf").rstrip(b"\r\n")
    reader.count += 1
    if not data.strip():  # still a record (one line of output a document), never silence
        yield BadRecord(reader.count, name, 1, reader.count, "the input is empty: no document to read")
        return
    yield reader.parse(name, 1, data)


def template(args: argparse.Namespace) -> Template | None:
    if args.template is not None and args.template_file is not None:
        raise UsageError("--template and --template-file cannot be used together")
    text = args.template
    if args.template_file is not None:
        name = args.template_file
        try:
            with open(name, "rb") as f:
                data = f.read(MAX_TEXT_FILE_BYTES + 1)
        except OSError as exc:
            raise UsageError(f"cannot read template file {name}: {exc.strerror}") from None
        if len(data) > MAX_TEXT_FILE_BYTES:
            raise UsageError(f"template file {name} is larger than {MAX_TEXT_FILE_BYTES} bytes")
        try:
            text = data.decode("utf-8").rstrip("\n")
        except UnicodeDecodeError as exc:
            raise UsageError(
                f"template file {name} is not UTF-8 text (invalid byte at {exc.start})"
            ) from None
        if "\0" in text:
            raise UsageError(f"template file {name} is not text (it holds a NUL byte)")
    if text is None and args.slurp and args.prompt:
        # -p TEXT --slurp: the instruction, a blank line, the document. Its braces are its own.
        text = args.prompt[0].replace("{", "{{").replace("}", "}}") + "\n\n{text}"
    if text is None:
        return None
    template = Template.parse(text)
    if args.in_format == "lines" and set(template.fields) - {"line", "text"}:
        raise UsageError("in lines mode a template can only use {text} (or {line}): the record's text")
    if not template.fields and not text.strip():
        raise UsageError("the template gives an empty prompt")
    return template


def check_prompts(args: argparse.Namespace) -> None:
    """-p and --slurp: what goes together (see their help)."""
    prompts: list[str] = args.prompt or []
    if args.slurp:
        if args.in_format != "lines":
            raise UsageError(f"--slurp reads text: it cannot be used with --in {args.in_format}")
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
        samples=args.samples,
    )


def check_files(files: list[str]) -> None:
    """Refuse (a usage error) a FILE that cannot be read at the start: missing, unreadable, a directory or
    a socket. A FIFO or device is only looked at, never opened here: opening a FIFO waits for its writer."""
    for name in files:
        if name == "-":
            continue
        try:
            st = os.stat(name)
            if stat.S_ISDIR(st.st_mode):
                raise IsADirectoryError(21, "Is a directory")
            if stat.S_ISSOCK(st.st_mode):
                raise OSError(6, "is a socket, not a file")
            if stat.S_ISREG(st.st_mode):
                with open(name, "rb"):
                    pass
            elif not os.access(name, os.R_OK):
                raise PermissionError(13, "Permission denied")
        except OSError as exc:
            raise UsageError(f"cannot open {name}: {exc.strerror}") from None
