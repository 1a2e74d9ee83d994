"""The command line: parse arguments, render events, map errors to exit codes.

Data goes to stdout, flushed per chunk; everything else goes to stderr. Exit status: 0 every record
done, 1 some record failed, 2 usage error, 3 model could not be loaded, 128+signal when interrupted.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import select
import signal
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from types import FrameType
from typing import IO, TYPE_CHECKING

from . import io
from .events import Chunk, Done, Error, Event
from .options import build_parser
from .resume import ResumeFile
from .term import Console

if TYPE_CHECKING:
    from .constrain import Constraint

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_MODEL = 0, 1, 2, 3

_console: Console | None = None  # this run's stderr (colour, progress); set by main()


_WHO = "mlxpipe:"  # under mlx.launch, ranks other than 0 name themselves: "mlxpipe[rank 2]:"


def _say(message: str) -> None:
    """One line to stderr, above the progress display; an error prefix in colour on a terminal."""
    if message.startswith("mlxpipe:"):
        message = _WHO + message.removeprefix("mlxpipe:")
    (_console or Console()).say(message)


class Interrupts:
    """SIGINT and SIGTERM: the first ends the record in flight cleanly, a second exits at once."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.reading = False  # blocked on input: nothing in flight, so stop right away

    def install(self) -> None:
        signal.signal(signal.SIGINT, self._handle)
        signal.signal(signal.SIGTERM, self._handle)
        self._watch()

    _watching = False

    def _watch(self) -> None:
        """Count signals in a thread, so a second one exits even while mlx holds the main thread.

        Python runs signal handlers only between bytecodes: during a long prompt's prefill (one C call,
        minutes on a CPU) two signals would wait, and merge into one. The C-level handler writes each
        signal's number to the wakeup fd at once; mlx releases the GIL, so this thread sees it.
        A signal can also land on another thread (any thread may take a process's signal). CPython 3.12
        then runs its handler only when the main thread next checks for signals, which a thread blocked
        reading a terminal never does (seen on an H200): until the handler has run, this thread nudges the
        main thread, while it waits for input, with a signal of its own whose interrupted read makes it check.
        """
        cls = type(self)
        if cls._watching or threading.current_thread() is not threading.main_thread():
            return
        try:
            r, w = os.pipe()
            os.set_blocking(w, False)
            signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        except (OSError, ValueError, AttributeError):  # a platform without it keeps the handler alone
            return
        cls._watching = True
        main = threading.main_thread().ident
        nudge = getattr(signal, "SIGWINCH", None)  # ignored by default, so ours to catch
        if nudge is not None:
            signal.signal(nudge, lambda _signum, _frame: None)

        def watch() -> None:
            seen = 0
            while True:
                unhandled = seen == 1 and self.signum is None
                ready, _, _ = select.select([r], [], [], 0.05 if unhandled else None)
                if not ready:
                    if self.reading and self.signum is None and nudge is not None and main is not None:
                        signal.pthread_kill(main, nudge)
                    continue
                data = os.read(r, 64)
                if not data:
                    return
                for signum in data:
                    seen += signum in (signal.SIGINT, signal.SIGTERM)
                    if seen >= 2:
                        os._exit(128 + signum)

        threading.Thread(target=watch, name="mlxpipe-signals", daemon=True).start()

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        if self.signum is not None:
            os._exit(128 + self.signum)
        self.signum = signum
        if self.reading:
            raise KeyboardInterrupt

    def __call__(self) -> bool:
        return self.signum is not None

    def guard(self, records: Iterable[io.Record | io.BadRecord]) -> Iterator[io.Record | io.BadRecord]:
        """Mark the time spent waiting for input, so a signal then needs no record to finish."""
        it = iter(records)
        # Only the main thread can be interrupted this way; --batch reads on a helper thread instead
        # and the pipeline polls the flag while it waits.
        main = threading.current_thread() is threading.main_thread()
        while True:
            record: io.Record | io.BadRecord | None = None
            try:
                try:
                    # `reading` goes up before the check: a signal that lands between the two (its handler
                    # runs at any bytecode) then raises, instead of leaving the read below blocked forever.
                    # Once interrupted, never block on a read: a terminal waits forever.
                    self.reading = main
                    if self.signum is None:
                        record = next(it)
                finally:
                    self.reading = False
            except (StopIteration, KeyboardInterrupt):  # a signal while waiting: the input ends here
                pass
            if record is None:
                return
            yield record  # read just before a signal: it still runs, and ends as interrupted


@dataclass
class Stats:
    """Totals for --stats."""

    records: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    tokens: int = 0
    peak_memory: int = 0

    def add(self, event: Event) -> None:
        if isinstance(event, Done):
            self.records += 1
            self.prompt_tokens += event.prompt_tokens
            self.tokens += event.tokens
            self.peak_memory = max(self.peak_memory, event.peak_memory)
        elif isinstance(event, Error):
            self.records += 1
            self.failed += 1

    def line(self, seconds: float) -> str:
        tps = self.tokens / seconds if seconds > 0 else 0.0
        return (
            f"mlxpipe: {self.records} records, {self.failed} failed, {self.prompt_tokens} prompt tokens, "
            f"{self.tokens} generated tokens, {tps:.1f} tok/s, peak memory "
            f"{self.peak_memory / 1e6:.1f} MB, {seconds:.1f} s"
        )


_NEWLINES = re.compile(r"[\r\n]+")


class Renderer:
    """Writes events to stdout as text or JSONL."""

    def __init__(self, out: IO[bytes], *, jsonl: bool, stream: bool, one_line: bool, null: bool) -> None:
        self.out = out
        self.jsonl = jsonl
        self.stream = stream
        self.one_line = one_line
        self.end = b"\0" if null else b"\n"

    def write(self, event: Event) -> None:
        if self.jsonl:
            if self.stream or not isinstance(event, Chunk):
                self._emit(event.to_json().encode() + b"\n")
        elif isinstance(event, Chunk):
            if self.stream:
                self._emit(self._text(event.text).encode())
        elif isinstance(event, Done):
            self._emit((b"" if self.stream else self._text(event.text).encode()) + self.end)
        else:  # a failed record still gets its (empty) line, so output line N answers input line N
            self._emit(self.end)

    def _text(self, text: str) -> str:
        return _NEWLINES.sub(" ", text) if self.one_line else text

    def _emit(self, data: bytes) -> None:
        # Whole lines in one write each (a raw file may take less; then the rest follows at once).
        view = memoryview(data)
        while view:
            written = self.out.write(view)
            view = view[written if written is not None else len(view) :]
        self.out.flush()


def _inputs(files: list[str], private_stdin: bool = False) -> Iterator[tuple[str, IO[bytes]]]:
    for name in files or ["-"]:
        if name == "-" and private_stdin:
            # A reader thread still blocked on sys.stdin at exit makes Python abort at shutdown
            # ("could not acquire lock"); a private reader of the same descriptor is not finalized.
            with open(sys.stdin.fileno(), "rb", closefd=False) as stdin:
                yield io.STDIN, stdin
        elif name == "-":
            yield io.STDIN, sys.stdin.buffer
        else:
            with open(name, "rb") as f:
                yield name, f


def _records(
    files: list[str], reader: io.RecordReader, private_stdin: bool = False
) -> Iterator[io.Record | io.BadRecord]:
    for name, stream in _inputs(files, private_stdin):
        yield from reader.read(name, stream)


def _template(args: argparse.Namespace) -> io.Template | None:
    if args.template is not None and args.template_file is not None:
        raise io.UsageError("--template and --template-file cannot be used together")
    text = args.template
    if args.template_file is not None:
        try:
            with open(args.template_file, encoding="utf-8") as f:
                text = f.read().rstrip("\n")
        except OSError as exc:
            raise io.UsageError(f"cannot read template file: {exc}") from None
    if text is None:
        return None
    template = io.Template.parse(text)
    if args.in_format == "lines" and set(template.fields) - {"line"}:
        raise io.UsageError("in lines mode a template can only use {line}")
    return template


def _constraint(args: argparse.Namespace) -> Constraint | None:
    given = [(flag, v) for flag, v in _constraint_flags(args) if v is not None]
    if not given:
        return None
    if len(given) > 1:
        raise io.UsageError(f"{given[0][0]} and {given[1][0]} cannot be used together")
    from . import constrain  # llguidance is imported only when asked for

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
        raise io.UsageError(f"{flag}: {exc}") from None


def _constraint_flags(args: argparse.Namespace) -> list[tuple[str, str | None]]:
    return [
        ("--json-schema", args.json_schema),
        ("--choices", args.choices),
        ("--regex", args.regex),
        ("--grammar", args.grammar),
    ]


def _settings(args: argparse.Namespace, constraint: Constraint | None) -> io.Settings:
    return io.Settings(
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


def _check_files(files: list[str]) -> None:
    for name in files:
        if name != "-":
            try:
                with open(name, "rb"):
                    pass
            except OSError as exc:
                raise io.UsageError(f"cannot open {name}: {exc.strerror}") from None


def _helper_rank_done() -> int:
    """How a rank other than 0 ends: exit 0, since rank 0 carries the job's status.

    mlx.launch stops every rank once one exits non-zero; that SIGTERM is ignored, as rank 0 may still
    be writing.
    """
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    """Run mlxpipe with ``argv`` (default ``sys.argv[1:]``); return the exit status."""
    global _console
    _console = console = Console()
    try:
        return _main(argv, console)
    finally:
        console.close()
        _console = None


def _main(argv: list[str] | None, console: Console) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse has printed help, the version or a usage error
        return int(exc.code or 0)
    if args.jsonl:
        args.in_format = args.out_format = "jsonl"
    try:
        if args.unordered and args.out_format != "jsonl":
            raise io.UsageError("--unordered needs JSONL output (--out jsonl): text lines carry no id")
        template = _template(args)
        constraint = _constraint(args)
        if args.resume is not None and args.out_format != "jsonl":
            raise io.UsageError("--resume needs JSONL output (--out jsonl or --jsonl)")
    except io.UsageError as exc:
        _say(f"mlxpipe: error: {exc}")
        return EXIT_USAGE

    # Imported late: mlx takes a while to import, and --help need not wait.
    from .distributed import RankLost, Ranks, RanksDisagree, broadcast, same_input
    from .distributed import run as run_ranks

    global _WHO
    ranks = Ranks.init()
    if ranks.rank:
        _WHO = f"mlxpipe[rank {ranks.rank}]:"
    if ranks.size > 1 and (not args.files or "-" in args.files):
        if ranks.rank:  # the same arguments on every rank: rank 0 says it, and carries the status
            return _helper_rank_done()
        _say(
            "mlxpipe: error: under mlx.launch give the input as FILE arguments (every rank reads "
            "them): stdin does not reach the ranks"
        )
        return EXIT_USAGE
    resume: ResumeFile | None = None
    try:
        _check_files(args.files)
        problem = None
        if args.resume is not None:  # rank 0 reads and writes FILE; under mlx.launch it tells the others
            resume = ResumeFile.open(args.resume) if ranks.rank == 0 else ResumeFile(args.resume, None)
            if resume.torn_bytes:
                _say(f"mlxpipe: {args.resume}: cut off a torn last line ({resume.torn_bytes} bytes)")
    except io.UsageError as exc:
        problem = str(exc)
    if ranks.size > 1:  # each host reads its own copy of the files: they must be the same
        try:
            problem = same_input(ranks, args.files, problem)
        except RankLost as exc:
            problem = f"lost a rank of the mlx.launch job before the start ({exc})"
        if problem and ranks.rank:  # rank 0 says it for the job, and carries the status
            return _helper_rank_done()
    if problem:
        _say(f"mlxpipe: error: {problem}")
        return EXIT_USAGE
    if resume is not None and ranks.size > 1:  # every rank must skip the same records: rank 0's
        try:
            resume.done = set(json.loads(broadcast(ranks, json.dumps(sorted(resume.done)).encode())))
        except RankLost as exc:
            _say(f"mlxpipe: error: lost a rank of the mlx.launch job before the start ({exc})")
            return EXIT_FAILED

    from .engine import Engine  # mlx-lm and transformers: slower still
    from .models import ModelError
    from .pipeline import run

    interrupts = Interrupts()
    interrupts.install()
    stats = Stats()
    try:
        try:
            engine = Engine.load(
                args.model, dtype=args.dtype, batch=args.batch, trust_remote_code=args.trust_remote_code
            )
        except ModelError as exc:
            _say(f"mlxpipe: error: {exc}")
            return EXIT_MODEL
        if args.model_info:
            if ranks.rank == 0:
                sys.stdout.write(json.dumps(engine.info(), ensure_ascii=False) + "\n")
            return EXIT_OK
        if engine.context_length and args.max_tokens > engine.context_length:
            _say(
                f"mlxpipe: error: --max-tokens {args.max_tokens} is more than the model's context of "
                f"{engine.context_length} tokens"
            )
            return EXIT_USAGE
        fmt = io.InputFormat(
            jsonl=args.in_format == "jsonl",
            null=args.null,
            template=template,
            prompt_key=args.prompt_key,
            max_line_bytes=args.max_line_bytes,
        )
        reader = io.RecordReader(fmt, _settings(args, constraint))
        jsonl_out = args.out_format == "jsonl"
        renderer = Renderer(
            resume.out if resume is not None and resume.out is not None else sys.stdout.buffer,
            jsonl=jsonl_out,
            # Constrained text is printed whole once complete: a cut-short answer never reaches stdout.
            stream=not args.no_stream and resume is None and (jsonl_out or constraint is None),
            one_line=args.one_line,
            null=args.null,
        )
        if ranks.rank == 0:
            console.start_progress(args.files, args.null, args.max_line_bytes, args.quiet)
        started = time.perf_counter()
        engine.reuse_prefix = not args.no_prefix_cache
        records = _records(args.files, reader, private_stdin=args.batch > 1)
        if resume is not None:
            records = (r for r in records if not resume.is_done(r.id))
        records = interrupts.guard(records)
        if ranks.size > 1:  # under mlx.launch: --batch applies on each rank, to its own share
            events = run_ranks(
                records,
                engine,
                ranks,
                interrupts,
                lambda: interrupts.signum,
                batch=args.batch,
                ordered=not args.unordered,
            )
        else:
            events = run(records, engine, interrupts, batch=args.batch, ordered=not args.unordered)
        try:
            for event in events:
                stats.add(event)
                if ranks.rank == 0:  # under mlx.launch only rank 0 writes; the others count, for the status
                    console.track(event)
                    if isinstance(event, Error):
                        _say(event.message())
                    if (
                        resume is not None
                        and isinstance(event, Done)
                        and event.finish_reason == "interrupted"
                    ):
                        continue  # not done: the next --resume redoes it; FILE keeps one done per record
                    renderer.write(event)
                if args.fail_fast and isinstance(event, Error):  # every rank sees every event: all stop here
                    events.close()
                    break
        except BrokenPipeError:
            # The reader went away (`| head`): stop generating, say nothing, succeed.
            events.close()
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return EXIT_OK
        except RanksDisagree as exc:
            _say(
                f"mlxpipe: error: the ranks of the mlx.launch job read different records ({exc}); every rank "
                f"needs the same input (and --resume file); the first {stats.records} records were written"
            )
            return EXIT_FAILED
        except RankLost as exc:
            _say(
                f"mlxpipe: error: lost a rank of the mlx.launch job ({exc}); the first {stats.records} "
                "records were written, the rest were not: run the job again with --resume to finish it"
            )
            return 128 + interrupts.signum if interrupts.signum is not None else EXIT_FAILED
        if ranks.rank:  # rank 0 carries the job's status, a stop included
            return _helper_rank_done()
        console.close()
        if args.stats:
            _say(stats.line(time.perf_counter() - started))
    except KeyboardInterrupt:
        pass
    signum = interrupts.signum or ranks.stop_signal
    if signum:
        return 128 + signum
    return EXIT_FAILED if stats.failed else EXIT_OK
