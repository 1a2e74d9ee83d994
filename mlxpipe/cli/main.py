"""The command line: parse arguments, run the records, render events, map errors to exit codes.

Data goes to stdout, flushed per chunk; everything else goes to stderr. Exit status: 0 every record
done, 1 some record failed, 2 usage error, 3 model could not be loaded, 4 output could not be written
(stdout other than a closed pipe, stderr, or the ``--resume`` FILE: see :mod:`.streams`), 128+signal when
interrupted (as :func:`main` returns it; the command then ends by the signal itself, see :mod:`.signals`).
Under ``mlx.launch`` rank 0 writes and carries the job's status; the other ranks answer their share
(:mod:`mlxpipe.distributed`) and exit 0.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import time
from collections.abc import Generator, Iterator
from typing import TYPE_CHECKING

from .. import launcher
from ..errors import ModelError, UsageError
from ..events import Done, Error, Event
from ..reader import InputFormat, RecordReader, unique_ids
from ..records import BadRecord, Record, one_per_sample
from ..resume import ResumeFile
from . import inputs, interactive
from .advice import advice
from .options import build_parser
from .render import Renderer, Stats
from .signals import Interrupts, reraise_at_exit
from .streams import OutputError, hold_standard_fds, raw_stdout, write_all
from .term import Console, conversion_progress, count_records

if TYPE_CHECKING:
    from ..constrain import Constraint
    from ..distributed import Ranks
    from ..engine import Engine

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_MODEL, EXIT_OUTPUT = 0, 1, 2, 3, 4


def main(argv: list[str] | None = None) -> int:
    """Run mlxpipe with ``argv`` (default ``sys.argv[1:]``); return the exit status."""
    hold_standard_fds()  # before anything is opened: a closed 1 must not become the --resume FILE
    console = Console()
    try:
        status = _main(argv, console)
    finally:
        console.close()
    # A message that could not be said on stderr is output lost, as a failed stdout is.
    return EXIT_OUTPUT if console.lost is not None and status in (EXIT_OK, EXIT_FAILED) else status


def _main(argv: list[str] | None, console: Console) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # argparse has printed help, the version or a usage error
        return int(exc.code or 0)
    # --batch auto is resolved once the model is loaded (its size depends on the backend and memory); until
    # then it counts as 1 for the checks, and only a run that could batch at all gets it.
    batch_auto = args.batch == "auto"
    if batch_auto:
        args.batch = 1
    if args.jsonl:  # with --slurp the input is text whatever the format: --jsonl then means the output
        args.in_format, args.out_format = "lines" if args.slurp else "jsonl", "jsonl"
    if args.out_format == "openai" and args.in_format == "lines" and not args.slurp:
        args.in_format = "jsonl"  # a batch file's requests are known by their fields
    try:
        inputs.check_prompts(args)
        args.interactive = interactive.wanted(args)
        args.conversation = interactive.chat_wanted(args, args.interactive)
        if args.unordered and args.out_format == "text":
            raise UsageError("--unordered needs JSONL output (--out jsonl): text lines carry no id")
        inputs.check(args)
        template = inputs.template(args)
        constraint = inputs.constraint(args)
        if args.resume is not None and args.out_format == "text":
            raise UsageError("--resume needs JSONL output (--out jsonl, --jsonl or --out openai)")
    except UsageError as exc:
        console.say(f"mlxpipe: error: {exc}")
        return EXIT_USAGE
    args.batch_auto = batch_auto and not args.interactive and not args.conversation
    for line in advice(args, args.interactive):
        console.say(line)
    if args.interactive:
        args.batch = 1

    from ..distributed import RankLost, Ranks  # imports mlx: --help and usage errors need not wait for it

    try:
        ranks = Ranks.init()
    except RankLost as exc:
        console.say(f"mlxpipe: error: the ranks of the mlx.launch job could not connect: {exc}")
        return EXIT_FAILED
    if ranks.rank:
        console.name = f"mlxpipe[rank {ranks.rank}]"
    started = _start(args, console, ranks)
    if isinstance(started, int):
        return started
    fmt = InputFormat(
        jsonl=args.in_format in ("jsonl", "openai"),
        openai=args.in_format == "openai",
        null=args.null,
        template=template,
        prompt_key=args.prompt_key,
        max_line_bytes=args.max_line_bytes,
    )
    reader = RecordReader(fmt, inputs.settings(args, constraint))
    reader.notice = console.say
    return _run(args, console, ranks, reader, started.resume, constraint)


class _Started:
    """What the checks before the model loads leave for the run."""

    def __init__(self, resume: ResumeFile | None) -> None:
        self.resume = resume


def _helper_rank_done() -> int:
    """How a rank other than 0 ends: exit 0, since rank 0 carries the job's status.

    mlx.launch stops every rank once one exits non-zero; that SIGTERM is ignored, as rank 0 may still
    be writing.
    """
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    return EXIT_OK


def _start(args: argparse.Namespace, console: Console, ranks: Ranks) -> _Started | int:
    """Check the input files and open ``--resume``'s FILE; under mlx.launch, agree on both with every rank.

    Returns an exit status when the run cannot start (rank 0 says why, for the whole job).
    """
    from ..distributed import RankLost, broadcast, same_input

    if ranks.size > 1 and args.conversation:
        if ranks.rank:
            return _helper_rank_done()
        console.say("mlxpipe: error: --chat cannot be used under mlx.launch: each rank answers its own share")
        return EXIT_USAGE
    if ranks.size > 1 and (not args.files or "-" in args.files):
        if ranks.rank:  # the same arguments on every rank: rank 0 says it, and carries the status
            return _helper_rank_done()
        console.say(
            "mlxpipe: error: under mlx.launch give the input as FILE arguments (every rank reads "
            "them): stdin does not reach the ranks"
        )
        return EXIT_USAGE
    if ranks.size > 1:
        launcher.calm()  # mlx.launch's relay thread would otherwise spin on a core the ranks need
    resume: ResumeFile | None = None
    problem = None
    try:
        inputs.check_files(args.files)
        if args.resume is not None:  # rank 0 reads and writes FILE; under mlx.launch it tells the others
            resume = (
                ResumeFile.open(args.resume, inputs=args.files or ["-"])
                if ranks.rank == 0
                else ResumeFile(args.resume, None)
            )
            if resume.torn_bytes:
                console.say(f"mlxpipe: {args.resume}: cut off a torn last line ({resume.torn_bytes} bytes)")
    except UsageError as exc:
        problem = str(exc)
    if ranks.size > 1:  # each host reads its own copy of the files: they must be the same
        try:
            problem = same_input(ranks, args.files, problem)
        except RankLost as exc:
            problem = f"lost a rank of the mlx.launch job before the start ({exc})"
        if problem and ranks.rank:  # rank 0 says it for the job, and carries the status
            return _helper_rank_done()
    if problem:
        console.say(f"mlxpipe: error: {problem}")
        return EXIT_USAGE
    if resume is not None and ranks.size > 1:  # every rank must skip the same records: rank 0's
        try:
            resume.share(lambda data: broadcast(ranks, data))
        except RankLost as exc:
            console.say(f"mlxpipe: error: lost a rank of the mlx.launch job before the start ({exc})")
            return EXIT_FAILED
    return _Started(resume)


def _reads_terminal(files: list[str]) -> bool:
    """Whether the records come from a terminal (stdin, no FILE but "-"): then --batch auto is 1."""
    if any(f != "-" for f in files):
        return False
    try:
        return os.isatty(0)
    except OSError:
        return False


def _load(args: argparse.Namespace, console: Console, ranks: Ranks) -> Engine | int:
    """The engine, or the exit status when the run ends here (a model error, ``--model-info``)."""
    try:
        from ..engine import Engine  # mlx-lm and transformers: slow; NoBackend when mlx has none here

        engine = Engine.load(
            args.model,
            dtype=args.dtype,
            batch=2 if args.batch_auto else args.batch,  # the dtype depends on batching or not
            trust_remote_code=args.trust_remote_code,
            on_convert=None if args.quiet else conversion_progress(console.stream),
        )
    except ModelError as exc:
        console.say(f"mlxpipe: error: {exc}")
        return EXIT_MODEL
    if not (args.model_info or args.quiet or ranks.rank):  # --model-info carries them as JSON
        for line in engine.slow_paths():  # said once, before the first record: the run will be slow
            console.say(f"mlxpipe: warning: {line}")
    if args.batch_auto:
        args.batch = engine.auto_batch(args.max_tokens, not args.prompt and _reads_terminal(args.files))
    if args.model_info:
        if ranks.rank == 0:
            try:
                write_all(raw_stdout(), (json.dumps(engine.info(), ensure_ascii=False) + "\n").encode())
            except BrokenPipeError:
                pass
            except OSError as exc:
                console.say(f"mlxpipe: error: {OutputError('stdout', exc)}")
                return EXIT_OUTPUT
        return EXIT_OK
    if engine.context_length and args.max_tokens > engine.context_length:
        console.say(
            f"mlxpipe: error: --max-tokens {args.max_tokens} is more than the model's context of "
            f"{engine.context_length} tokens"
        )
        return EXIT_USAGE
    engine.reuse_prefix = not args.no_prefix_cache
    return engine


class _Job:
    """One run's state, shared by the steps of :func:`_run`."""

    def __init__(self, args: argparse.Namespace, console: Console, ranks: Ranks) -> None:
        self.args, self.console, self.ranks = args, console, ranks
        self.interrupts = Interrupts()
        self.stats = Stats()
        self.cut = 0  # records whose done line says "interrupted"
        self.conversation = interactive.Conversation() if args.conversation else None
        self.blanks: dict[int, int] = {}  # record number -> blank input records right before it


def _run(
    args: argparse.Namespace,
    console: Console,
    ranks: Ranks,
    reader: RecordReader,
    resume: ResumeFile | None,
    constraint: Constraint | None,
) -> int:
    job = _Job(args, console, ranks)
    records = _records(job, reader, resume)
    if ranks.size == 1 and not (args.interactive or args.model_info) and inputs.ready(args.files):
        # The input has arrived (or ended): an empty one (or one --resume has done) needs no model.
        first = next(records, None)
        if first is None:
            try:  # blank lines only: each still gets its empty line with --one-line or -z
                _renderer(args, resume, constraint).blank_lines(reader.blanks)
            except BrokenPipeError:
                pass
            except OutputError as exc:
                console.say(f"mlxpipe: error: {exc}")
                return EXIT_OUTPUT
            return _stats(job, 0.0) or EXIT_OK
        records = itertools.chain([first], records)
    try:
        engine = _load(args, console, ranks)
        if isinstance(engine, int):
            return engine
        # Only now is there something to finish cleanly; until here a signal ends the process at once.
        job.interrupts.install()
        choice = engine.batch_choice
        job.stats.batch = f"batch {args.batch}" + (f" (auto: {choice['reason']})" if choice else "")
        renderer = _renderer(args, resume, constraint)
        if args.interactive:
            return _interactive(job, engine, reader, renderer)
        if ranks.rank == 0:
            console.start_progress(
                args.files, args.null, args.max_line_bytes, args.quiet, total=total_records(args, None)
            )
        started = time.perf_counter()
        status = _write(job, _events(job, engine, records), renderer, resume, reader)
        if status is not None:
            return status
        if ranks.rank:  # rank 0 carries the job's status, a stop included
            return _helper_rank_done()
        console.close()
        failed = _stats(job, time.perf_counter() - started)
        if failed:
            return failed
    except KeyboardInterrupt:
        pass
    return _status(job)


def _stats(job: _Job, seconds: float) -> int | None:
    """--stats: the summary line on stderr and, with JSONL output, the ``summary`` event last on stdout
    (never in --resume's FILE); an exit status when stdout fails."""
    if not job.args.stats:
        return None
    job.console.say(job.stats.line(seconds))
    if job.args.out_format != "jsonl":
        return None
    try:
        write_all(raw_stdout(), job.stats.summary(seconds).to_json().encode() + b"\n")
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
    except OSError as exc:
        job.console.say(f"mlxpipe: error: {OutputError('stdout', exc)}")
        return EXIT_OUTPUT
    return None


def _records(job: _Job, reader: RecordReader, resume: ResumeFile | None) -> Iterator[Record | BadRecord]:
    """The run's records: -p prompts, --slurp documents or the inputs' records; turns of a conversation
    with --chat; one per sample; less those --resume has done."""
    args = job.args
    records = inputs.records(
        args.files, reader, private_stdin=args.batch > 1, prompts=args.prompt, slurp=args.slurp
    )
    if args.out_format != "text":  # where ids are written: a record is never mistaken for another
        records = unique_ids(records)
    if job.conversation is not None:
        records = job.conversation.turns(records)
    records = one_per_sample(records)  # here, so --resume skips a done sample and every rank splits alike
    if resume is not None:  # an error line is never skipped: it may be a refused duplicate of a done id
        records = (r for r in records if isinstance(r, BadRecord) or not resume.is_done(r.id, r.sample))
    return _noting_blanks(job, records)


def _noting_blanks(job: _Job, records: Iterator[Record | BadRecord]) -> Iterator[Record | BadRecord]:
    """``records``, each one's blank lines before it noted for :func:`_write` (which may run ahead of it)."""
    for record in records:
        if record.blanks:
            job.blanks[record.index] = record.blanks
        yield record


def _renderer(args: argparse.Namespace, resume: ResumeFile | None, constraint: Constraint | None) -> Renderer:
    jsonl_out = args.out_format != "text"  # JSONL events or OpenAI lines: no blank lines, no cut marks
    return Renderer(
        resume.out if resume is not None and resume.out is not None else raw_stdout(),
        jsonl=jsonl_out,
        # Constrained text is printed whole once complete: a cut-short answer never reaches stdout.
        stream=not args.no_stream and resume is None and (jsonl_out or constraint is None),
        one_line=args.one_line,
        null=args.null,
        name="stdout" if resume is None else f"--resume file {args.resume}",
        openai_model=_model_name(args) if args.out_format == "openai" else None,
        samples=args.samples,
    )


def _model_name(args: argparse.Namespace) -> str:
    """The model named in OpenAI output lines: as given, else the embedded one."""
    return str(args.model or os.environ.get("MLXPIPE_MODEL") or "SmolLM2-135M-Instruct")


def _interactive(job: _Job, engine: Engine, reader: RecordReader, renderer: Renderer) -> int:
    started = time.perf_counter()
    name = str(engine.info().get("spec") or "the model")
    status = interactive.session(
        engine,
        reader,
        renderer,
        job.console,
        job.interrupts,
        job.stats,
        chat=job.args.conversation,
        name=name,
    )
    if job.args.stats:
        job.console.say(job.stats.line(time.perf_counter() - started))
    if status > 128:
        reraise_at_exit(status - 128)
    return status


def _events(job: _Job, engine: Engine, records: Iterator[Record | BadRecord]) -> Generator[Event, None, None]:
    """Every record's events, in input order: through the pipeline, or under mlx.launch through the ranks."""
    from ..distributed import run as run_ranks
    from ..pipeline import run

    args, interrupts = job.args, job.interrupts
    guarded = interrupts.guard(records)
    ordered = not args.unordered
    if job.ranks.size > 1:  # under mlx.launch: --batch applies on each rank, to its own share
        return run_ranks(
            guarded,
            engine,
            job.ranks,
            interrupts,
            interrupts.signal_number,
            batch=args.batch,
            ordered=ordered,
        )
    return run(guarded, engine, interrupts, batch=args.batch, ordered=ordered)


def _write(
    job: _Job,
    events: Generator[Event, None, None],
    renderer: Renderer,
    resume: ResumeFile | None,
    reader: RecordReader,
) -> int | None:
    """Render ``events`` (rank 0 writes; every rank counts); an exit status when the run ends early."""
    from ..distributed import RankLost, RanksDisagree

    args, console, stats = job.args, job.console, job.stats
    try:
        for event in events:
            stats.add(event)
            blanks = job.blanks.pop(event.index, 0) if job.blanks else 0  # at a record's first event
            if job.ranks.rank == 0:  # under mlx.launch only rank 0 writes; the others count, for the status
                renderer.blank_lines(blanks)
                console.track(event)
                if isinstance(event, Error):
                    console.say(event.message())
                interrupted = isinstance(event, Done) and event.finish_reason == "interrupted"
                job.cut += interrupted
                console.mark_cut(event, inline=not renderer.jsonl and renderer.stream)
                if not (resume is not None and interrupted):  # FILE keeps one done per record: redo it
                    renderer.write(event)
            if job.conversation is not None:
                job.conversation.saw(event)
            if args.fail_fast and isinstance(event, Error):  # every rank sees every event: all stop here
                events.close()
                break
        else:
            stopped = job.interrupts.signum or job.ranks.stop_signal
            if job.ranks.rank == 0 and not stopped:  # the input's trailing blank lines
                renderer.blank_lines(reader.blanks)
    except BrokenPipeError:
        # The reader went away (`| head`): stop generating, say nothing, succeed.
        events.close()
        os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
        return EXIT_OK
    except OutputError as exc:  # the records written before are whole lines; the rest are not written
        events.close()
        console.say(f"mlxpipe: error: {exc}; the records after the last whole line were not written")
        return EXIT_OUTPUT
    except RanksDisagree as exc:
        console.say(
            f"mlxpipe: error: the ranks of the mlx.launch job read different records ({exc}); every rank "
            f"needs the same input (and --resume file); the first {stats.records} records were written"
        )
        return EXIT_FAILED
    except RankLost as exc:
        console.say(
            f"mlxpipe: error: lost a rank of the mlx.launch job ({exc}); the first {stats.records} "
            "records were written, the rest were not: run the job again with --resume to finish it"
        )
        signum = job.interrupts.signum
        return 128 + signum if signum is not None else EXIT_FAILED
    return None


def _status(job: _Job) -> int:
    """The exit status of a run that went to its end or was stopped by a signal (said on stderr)."""
    args, console, interrupts = job.args, job.console, job.interrupts
    total = total_records(args, console)
    console.close()  # the progress line erased
    if interrupts.signum and job.ranks.size == 1:
        # Under mlx.launch the launcher, not a shell, reads the status (and rank 0 says nothing more).
        console.say(_interrupted(job, total))
        reraise_at_exit(interrupts.signum)
    signum = interrupts.signum or job.ranks.stop_signal
    if signum:
        return 128 + signum
    return EXIT_FAILED if job.stats.failed else EXIT_OK


def _interrupted(job: _Job, total: int | None) -> str:
    """What an interrupted run says: the final lines it wrote (those cut short among them), of how many."""
    args, signum = job.args, job.interrupts.signum
    assert signum is not None
    written, cut = job.stats.records, job.cut
    if args.resume is not None:  # interrupted records are not written to FILE: the next run does them
        written, cut = written - cut, 0
    elif total is None and not args.interactive:  # regular files can be counted again
        total = count_records(args.files, args.null, args.max_line_bytes)
    how = "" if signum == signal.SIGINT else f" by {signal.Signals(signum).name}"
    of = f" of {total}" if total is not None and args.resume is None else ""
    noun = "record" if (total if of else written) == 1 else "records"
    return f"mlxpipe: interrupted{how} after {written}{of} {noun}" + (f" ({cut} cut short)" if cut else "")


def total_records(args: argparse.Namespace, console: Console | None) -> int | None:
    """How many records the run has, when that is known without reading the input (again): one per -p or,
    with --slurp, per input; else what the progress display counted."""
    if args.prompt and not args.slurp:
        return len(args.prompt)
    if args.slurp:
        return len(args.files) or 1
    return console.total if console is not None else None
