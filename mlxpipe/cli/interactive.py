"""Interactive mode and conversations.

mlxpipe is interactive when stdin and stderr are terminals and the input is neither a FILE nor ``-p``
(:func:`wanted`): a banner on stderr once the model is ready, a prompt with line editing and history (the
standard library's ``readline``; history in ``$XDG_STATE_HOME/mlxpipe/history``), answers streamed to
stdout. Ctrl-C stops the answer in flight and gives the prompt back; Ctrl-C at an empty prompt right after
another Ctrl-C, or Ctrl-D, quits (a Ctrl-C quit ends the process by SIGINT, Ctrl-D exits 0). SIGTERM ends
the answer in flight, then the session.

A :class:`Conversation` (``--chat``, the default in interactive mode) makes each record the next user turn of
one conversation: the record sent to the model carries every earlier turn and answer as ``messages``, and
the model's chat template is applied to that whole history. A turn whose answer was interrupted or failed is
left out of the history.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
from collections.abc import Iterable, Iterator
from dataclasses import replace
from typing import TYPE_CHECKING

from ..errors import UsageError
from ..events import Chunk, Done, Error, Event
from ..paths import state_dir
from ..records import BadRecord, Record

if TYPE_CHECKING:
    from ..interface import EngineLike
    from ..reader import RecordReader
    from .render import Renderer, Stats
    from .signals import Interrupts
    from .term import Console

__all__ = ["TERMINAL", "Conversation", "chat_wanted", "session", "wanted"]

TERMINAL = "<terminal>"  # where a typed line comes from, in its error line
PROMPT = "> "
HISTORY_LINES = 1000


def wanted(args: argparse.Namespace) -> bool:
    """Interactive mode: stdin and stderr are terminals and the input is the terminal's lines."""
    if args.prompt or args.slurp or any(f != "-" for f in args.files) or args.in_format != "lines":
        return False
    if args.null or args.model_info:
        return False
    return _isatty(sys.stdin) and _isatty(sys.stderr)


def _isatty(stream: object) -> bool:
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty is not None and isatty())
    except ValueError:  # a closed stream
        return False


def chat_wanted(args: argparse.Namespace, interactive: bool) -> bool:
    """Whether records are the turns of one conversation: ``--chat`` / ``--no-chat``, else interactive mode
    (unless ``--raw``: a conversation needs the chat template). Raises :class:`UsageError` for what cannot go
    with one."""
    if args.chat is None:
        return interactive and not args.raw and args.samples == 1
    if not args.chat:
        return False
    if args.samples > 1:
        raise UsageError("--chat answers each turn once: it cannot be used with --samples")
    if args.raw:
        raise UsageError("--chat needs the model's chat template: it cannot be used with --raw")
    if args.in_format != "lines":
        raise UsageError(
            f"--chat reads lines, each the next user turn: it cannot be used with --in {args.in_format}"
        )
    if args.batch > 1 and not interactive:
        raise UsageError("--chat answers one turn after another: it cannot be used with --batch")
    if args.resume is not None:
        raise UsageError("--chat cannot be used with --resume: a skipped turn leaves a gap in the history")
    return True


class Conversation:
    """Records as the turns of one conversation (see the module docstring)."""

    def __init__(self) -> None:
        self.history: list[dict[str, str]] = []
        self._asked: tuple[int, str] | None = None  # the record in flight: its index and its user text

    def turn(self, record: Record | BadRecord) -> Record | BadRecord:
        """``record`` as the next user turn: its prompt the last of its ``messages``, after the history."""
        if isinstance(record, BadRecord) or record.prompt is None:
            return record
        self._asked = (record.index, record.prompt)
        messages = (*self.history, {"role": "user", "content": record.prompt})
        return replace(record, prompt=None, messages=tuple(messages))

    def turns(self, records: Iterable[Record | BadRecord]) -> Iterator[Record | BadRecord]:
        """Each record as a turn; the next is made only once the previous answer is in (see :meth:`saw`)."""
        for record in records:
            yield self.turn(record)

    def saw(self, event: Event) -> None:
        """Keep a finished answer, and the turn it answers, in the history."""
        if self._asked is None or isinstance(event, Chunk) or event.index != self._asked[0]:
            return
        if isinstance(event, Done) and event.finish_reason != "interrupted":
            self.history += [
                {"role": "user", "content": self._asked[1]},
                {"role": "assistant", "content": event.text},
            ]
        self._asked = None


# ---------------------------------------------------------------------------------------------
# The session


class _LineEditor:
    """readline for ``input()``: line editing, and the history file."""

    def __init__(self) -> None:
        self.path = state_dir() / "history"
        self.last: str | None = None
        try:
            import readline
        except ImportError:  # a Python built without it: plain input() still works
            self.readline = None
            return
        self.readline = readline
        if "libedit" in (readline.__doc__ or ""):
            readline.parse_and_bind("bind ^I ed-insert")
        else:
            readline.parse_and_bind("tab: tab-insert")  # no file-name completion inside a prompt
        readline.set_history_length(HISTORY_LINES)
        with contextlib.suppress(OSError):
            readline.read_history_file(self.path)

    def add(self, line: str) -> None:
        """Keep ``line`` in the history file at once, so a killed session loses none (input() has put it
        in readline's history, unless it repeats the line before, as bash's ignoredups)."""
        if self.readline is None or line == self.last:
            return
        self.last = line
        with contextlib.suppress(OSError):
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if not self.path.exists():
                self.path.touch(0o600)
            self.readline.append_history_file(1, self.path)

    def close(self) -> None:
        """Write the history back, cut to its last :data:`HISTORY_LINES` lines."""
        if self.readline is not None and self.path.exists():
            with contextlib.suppress(OSError):
                self.readline.write_history_file(self.path)

    def empty(self) -> bool:
        """Whether the line being edited was empty (when Ctrl-C interrupted it)."""
        return self.readline is None or not self.readline.get_line_buffer()


def _read_line(prompt: str) -> str:
    """A line typed at the terminal, the prompt on it. input() edits the line only when stdout is a
    terminal: when stdout goes elsewhere, stderr's terminal stands in for it while the line is typed."""
    if _isatty(sys.stdout):
        return input(prompt)
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        return input(prompt)
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def session(
    engine: EngineLike,
    reader: RecordReader,
    renderer: Renderer,
    console: Console,
    interrupts: Interrupts,
    stats: Stats,
    *,
    chat: bool,
    name: str,
) -> int:
    """Answer lines typed at the terminal until Ctrl-D, Ctrl-C twice or SIGTERM; return the exit status
    (128 + N when a signal ended it)."""
    from ..pipeline import run

    editor = _LineEditor()
    conversation = Conversation() if chat else None
    mode = "a conversation (--no-chat: each line on its own)" if chat else "each line answered on its own"
    console.say(f"mlxpipe: {name} is ready; {mode}. Ctrl-C stops an answer, Ctrl-D quits.")
    number = 0
    after_ctrl_c = False  # the last thing was a Ctrl-C: one more at an empty prompt quits
    try:
        while True:
            try:
                with interrupts.waiting():
                    line = _read_line(PROMPT)
            except EOFError:  # Ctrl-D
                console.stream.write("\n")
                return 0
            except KeyboardInterrupt:
                signum = interrupts.signum
                empty = editor.empty()
                console.stream.write("\n")
                if (signum is not None and signum != signal.SIGINT) or (after_ctrl_c and empty):
                    return 128 + (signum or signal.SIGINT)
                interrupts.reset()
                if empty:
                    console.say("mlxpipe: (Ctrl-C again or Ctrl-D to quit)")
                after_ctrl_c = empty
                continue
            after_ctrl_c = False
            if not line.strip():
                continue
            editor.add(line)
            number += 1
            reader.count = number
            raw = line.encode("utf-8", "surrogateescape")
            record: Record | BadRecord = reader.parse(TERMINAL, number, raw)
            if conversation is not None:
                record = conversation.turn(record)
            for event in run([record], engine, interrupts):
                stats.add(event)
                if isinstance(event, Error):
                    console.say(event.message())
                    if not renderer.jsonl:
                        continue  # no empty answer line on a terminal
                console.mark_cut(event, inline=not renderer.jsonl and renderer.stream)
                renderer.write(event)
                if conversation is not None:
                    conversation.saw(event)
            if interrupts.signum is not None and interrupts.signum != signal.SIGINT:  # SIGTERM, SIGHUP
                return 128 + interrupts.signum
            if interrupts.signum is not None:  # Ctrl-C ended the answer: back to the prompt
                interrupts.reset()
                after_ctrl_c = True
    finally:
        editor.close()
