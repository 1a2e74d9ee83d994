"""What changes on a terminal: colour and the progress display. Both live on stderr only, never stdout.

Every line said is one line: control characters in it (from file names, schemas, library messages) are
shown escaped (``\\n``, ``\\x1b``), as are bytes of a name that are not UTF-8 (``\\xff``), so nothing
can forge a second line or reach the terminal raw. A stderr that fails (a closed descriptor, a reader gone,
a full disk) never stops the run: :attr:`Console.lost` says so, and the exit status is then 4.

Colour follows https://no-color.org and ``TERM=dumb``. Progress (records done, of the total when the input
is files; tok/s; elapsed) is drawn with tqdm only when stderr is a terminal and stdout is not (on a shared
terminal the streamed answers are the progress), and never with ``--quiet``.
"""

from __future__ import annotations

import os
import re
import sys
import time
from collections.abc import Callable
from typing import IO, Any

from ..events import Chunk, Done, Event
from ..reader import split_records
from .streams import raw_of, write_all

RED_BOLD, DIM, RESET = "\033[1;31m", "\033[2m", "\033[0m"
_ERROR = re.compile(r"^(mlxpipe[^:]*: )error\b")  # "mlxpipe[rank 2]: error" too
_REDRAW_SECONDS = 0.25  # the bar's tok/s and elapsed move while a long record streams


def colour_enabled(stream: IO[str] | None) -> bool:
    """Colour only on a terminal, never with a non-empty ``NO_COLOR`` or with ``TERM=dumb``."""
    if os.environ.get("NO_COLOR") or os.environ.get("TERM") == "dumb":
        return False
    return _isatty(stream)


def _isatty(stream: IO[str] | None) -> bool:
    try:
        return stream is not None and stream.isatty()
    except (OSError, ValueError):  # closed
        return False


# C0 and C1 controls and DEL; lone surrogates are the bytes of a name that were not UTF-8 (surrogateescape).
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff]")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(match: re.Match[str]) -> str:
    char = match.group()
    code = ord(char)
    if 0xDC80 <= code <= 0xDCFF:  # surrogateescape: the byte it stands for
        return f"\\x{code - 0xDC00:02x}"
    if code > 0xFF:
        return f"\\u{code:04x}"
    return _NAMED.get(char, f"\\x{code:02x}")


def printable(line: str) -> str:
    """``line`` with control characters and undecodable bytes escaped: safe to show on a terminal."""
    return _UNSAFE.sub(_escape, line)


def count_records(files: list[str], null: bool, max_bytes: int) -> int | None:
    """How many records the inputs hold (blank lines skipped, as the reader does); None when any is not
    a regular file (stdin, a pipe), since those can be read only once."""
    if not files or any(name == "-" or not os.path.isfile(name) for name in files):
        return None
    sep = b"\0" if null else b"\n"
    total = 0
    try:
        for name in files:
            with open(name, "rb") as f:
                total += sum(1 for _, raw in split_records(f, sep, max_bytes) if raw is None or raw.strip())
    except OSError:  # the run reports an input it cannot read; the bar just has no total
        return None
    return total


class Progress:
    """A one-line progress display on stderr, erased when closed."""

    def __init__(self, total: int | None, stream: IO[str]) -> None:
        from tqdm import tqdm  # imported only when a terminal will show it

        try:
            width, height = os.get_terminal_size(stream.fileno())
        except (OSError, ValueError):
            width = height = 0
        # A terminal that reports no size (a fresh pty, `script`, `docker exec -t` before a resize) would get
        # an empty bar, or none (tqdm draws nothing with no rows, and re-reads them when following resizes):
        # what is missing is assumed, 80 columns and 24 rows, and resizes are then not followed.
        size: dict[str, Any] = (
            {"dynamic_ncols": True} if width and height else {"ncols": width or 80, "nrows": height or 24}
        )
        self.bar = tqdm(total=total, desc="mlxpipe", unit=" records", file=stream, leave=False, **size)
        self.stream = stream
        self.started = self.drawn = time.perf_counter()
        self.tokens_done = 0
        self.in_flight: dict[int, int] = {}  # record index -> tokens so far (several when batching)

    def update(self, event: Event) -> None:
        """Count a chunk's tokens, or a finished record."""
        if isinstance(event, Chunk):
            self.in_flight[event.index] = event.tokens
        else:
            self.in_flight.pop(event.index, None)
            if isinstance(event, Done):
                self.tokens_done += event.tokens
        now = time.perf_counter()
        tokens = self.tokens_done + sum(self.in_flight.values())
        self.bar.set_postfix_str(f"{tokens / max(now - self.started, 1e-9):.1f} tok/s", refresh=False)
        if not isinstance(event, Chunk) and (event.sample is None or event.sample == event.samples - 1):
            self.bar.update(1)  # a record's last answer (tqdm redraws, rate-limited)
        elif now - self.drawn >= _REDRAW_SECONDS:
            self.drawn = now
            self.bar.refresh()

    def write(self, line: str) -> None:
        """Print a line on stderr above the bar."""
        self.bar.write(line, file=self.stream)

    def close(self) -> None:
        self.bar.close()


def conversion_progress(stream: IO[str] | None) -> Callable[[str, int, int], None] | None:
    """A progress line for a GGUF's first conversion, on a terminal only (None elsewhere): the file's bytes
    converted so far, erased when done."""
    if stream is None or not _isatty(stream):
        return None
    bars: dict[str, Any] = {}

    def told(name: str, done: int, total: int) -> None:
        bar = bars.get(name)
        if bar is None:
            from tqdm import tqdm

            try:
                width = os.get_terminal_size(stream.fileno()).columns
            except (OSError, ValueError):
                width = 0
            size = {"dynamic_ncols": True} if width else {"ncols": 80}
            desc = f"mlxpipe: converting {name} (once)"
            bar = bars[name] = tqdm(
                total=total, desc=desc, unit="B", unit_scale=True, file=stream, leave=False, **size
            )
        bar.update(done - bar.n)
        if done >= total:
            bar.close()

    return told


class Console:
    """stderr for humans: one-line messages, a coloured error prefix and the progress display."""

    def __init__(self, stream: IO[str] | None = None, colour: bool | None = None) -> None:
        # Without a stream given, lines go to the raw stream under sys.stderr through the one writer (it may
        # be non-blocking); sys.stderr is still what the progress bar draws on, and is None when 2 was closed.
        self._raw = raw_of(sys.stderr) if stream is None else None
        self.stream = stream or sys.stderr
        self.colour = colour_enabled(self.stream) if colour is None else colour
        self.progress: Progress | None = None
        self.name = "mlxpipe"  # under mlx.launch, ranks other than 0 name themselves: "mlxpipe[rank 2]"
        self.lost: str | None = None  # why a line could not be said: stderr failed

    def start_progress(
        self, files: list[str], null: bool, max_bytes: int, quiet: bool, total: int | None = None
    ) -> None:
        """Show progress if stderr is a terminal, stdout is not and ``quiet`` is false; ``total`` records
        when known (-p), else counted in ``files`` when they are regular files."""
        if quiet or self.stream is None or not _isatty(self.stream) or os.isatty(1):
            return
        if total is None:
            total = count_records(files, null, max_bytes)
        self.progress = Progress(total, self.stream)

    @property
    def total(self) -> int | None:
        """The records the progress display counts to, when it knows."""
        total = self.progress.bar.total if self.progress is not None else None
        return int(total) if total is not None else None

    def mark_cut(self, event: Event, inline: bool) -> None:
        """After an answer that ``--max-tokens`` cut short, a mark on stderr, when stdout and stderr are the
        same terminal and the answer's text streamed there (``inline``): stdout itself is unchanged."""
        if not (inline and isinstance(event, Done) and event.finish_reason in ("length", "context")):
            return
        if self.stream is None or not (_isatty(self.stream) and os.isatty(1)):
            return
        why = "--max-tokens" if event.finish_reason == "length" else "the model's context is full"
        mark = f" [cut at {event.tokens} tokens: {why}]"
        try:
            if self._raw is not None:
                write_all(self._raw, (f"{DIM}{mark}{RESET}" if self.colour else mark).encode())
            else:
                self.stream.write(f"{DIM}{mark}{RESET}" if self.colour else mark)
                self.stream.flush()
        except OSError as exc:
            if self.lost is None:
                self.lost = exc.strerror or type(exc).__name__

    def track(self, event: Event) -> None:
        """Feed an event to the progress display (a no-op without one)."""
        if self.progress is not None:
            try:
                self.progress.update(event)
            except OSError as exc:
                self._drop_progress(exc)

    def say(self, line: str) -> None:
        """Write one line to stderr, escaped (:func:`printable`); an ``mlxpipe: error`` prefix is coloured
        when colour is on. A stderr that fails is noted in :attr:`lost`, never raised."""
        line = printable(line)
        if line.startswith("mlxpipe:") and self.name != "mlxpipe":
            line = self.name + line.removeprefix("mlxpipe")
        if self.colour:
            line = _ERROR.sub(rf"\1{RED_BOLD}error{RESET}", line, count=1)
        try:
            if self.progress is not None:
                self.progress.write(line)
            elif self._raw is not None:
                write_all(self._raw, (line + "\n").encode())
            elif self.stream is None:
                raise OSError(9, "Bad file descriptor")
            else:
                print(line, file=self.stream, flush=True)
        except OSError as exc:  # EPIPE included: only a broken stdout means "the reader has enough"
            if self.lost is None:
                self.lost = exc.strerror or type(exc).__name__

    def _drop_progress(self, exc: OSError) -> None:
        self.progress = None
        if self.lost is None:
            self.lost = exc.strerror or type(exc).__name__

    def close(self) -> None:
        """Erase the progress display, if any."""
        if self.progress is not None:
            try:
                self.progress.close()
            except OSError as exc:
                self._drop_progress(exc)
            self.progress = None
