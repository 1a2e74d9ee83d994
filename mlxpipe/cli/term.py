"""What changes on a terminal: colour and the progress display. Both live on stderr only, never stdout.

Colour follows https://no-color.org and ``TERM=dumb``. Progress (records done, of the total when the input
is files; tok/s; elapsed) is drawn with tqdm only when stderr is a terminal and stdout is not (on a shared
terminal the streamed answers are the progress), and never with ``--quiet``.
"""

from __future__ import annotations

import os
import re
import sys
import time
from typing import IO

from ..events import Chunk, Done, Event
from ..reader import split_records

RED_BOLD, DIM, RESET = "\033[1;31m", "\033[2m", "\033[0m"
_ERROR = re.compile(r"^(mlxpipe[^:]*: )error\b")  # "mlxpipe[rank 2]: error" too
_REDRAW_SECONDS = 0.25  # the bar's tok/s and elapsed move while a long record streams


def colour_enabled(stream: IO[str]) -> bool:
    """Colour only on a terminal, never with a non-empty ``NO_COLOR`` or with ``TERM=dumb``."""
    if os.environ.get("NO_COLOR") or os.environ.get("TERM") == "dumb":
        return False
    return stream.isatty()


def count_records(files: list[str], null: bool, max_bytes: int) -> int | None:
    """How many records the inputs hold (blank lines skipped, as the reader does); None when any is not
    a regular file (stdin, a pipe), since those can be read only once."""
    if not files or any(name == "-" or not os.path.isfile(name) for name in files):
        return None
    sep = b"\0" if null else b"\n"
    total = 0
    for name in files:
        with open(name, "rb") as f:
            total += sum(1 for _, raw in split_records(f, sep, max_bytes) if raw is None or raw.strip())
    return total


class Progress:
    """A one-line progress display on stderr, erased when closed."""

    def __init__(self, total: int | None, stream: IO[str]) -> None:
        from tqdm import tqdm  # imported only when a terminal will show it

        try:
            width = os.get_terminal_size(stream.fileno()).columns
        except (OSError, ValueError):
            width = 0
        # A terminal that reports no width (a fresh pty) would get an empty bar: assume 80 columns.
        size = {"dynamic_ncols": True} if width else {"ncols": 80}
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
        if not isinstance(event, Chunk):
            self.bar.update(1)  # tqdm redraws, rate-limited
        elif now - self.drawn >= _REDRAW_SECONDS:
            self.drawn = now
            self.bar.refresh()

    def write(self, line: str) -> None:
        """Print a line on stderr above the bar."""
        self.bar.write(line, file=self.stream)

    def close(self) -> None:
        self.bar.close()


class Console:
    """stderr for humans: one-line messages, a coloured error prefix and the progress display."""

    def __init__(self, stream: IO[str] | None = None, colour: bool | None = None) -> None:
        self.stream = stream or sys.stderr
        self.colour = colour_enabled(self.stream) if colour is None else colour
        self.progress: Progress | None = None
        self.name = "mlxpipe"  # under mlx.launch, ranks other than 0 name themselves: "mlxpipe[rank 2]"

    def start_progress(
        self, files: list[str], null: bool, max_bytes: int, quiet: bool, total: int | None = None
    ) -> None:
        """Show progress if stderr is a terminal, stdout is not and ``quiet`` is false; ``total`` records
        when known (-p), else counted in ``files`` when they are regular files."""
        if quiet or not self.stream.isatty() or sys.stdout.isatty():
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
        if not (inline and isinstance(event, Done) and event.finish_reason == "length"):
            return
        if not (self.stream.isatty() and sys.stdout.isatty()):
            return
        mark = f" [cut at {event.tokens} tokens: --max-tokens]"
        self.stream.write(f"{DIM}{mark}{RESET}" if self.colour else mark)
        self.stream.flush()

    def track(self, event: Event) -> None:
        """Feed an event to the progress display (a no-op without one)."""
        if self.progress is not None:
            self.progress.update(event)

    def say(self, line: str) -> None:
        """Write one line to stderr; an ``mlxpipe: error`` prefix is coloured when colour is on."""
        if line.startswith("mlxpipe:") and self.name != "mlxpipe":
            line = self.name + line.removeprefix("mlxpipe")
        if self.colour:
            line = _ERROR.sub(rf"\1{RED_BOLD}error{RESET}", line, count=1)
        if self.progress is not None:
            self.progress.write(line)
        else:
            print(line, file=self.stream, flush=True)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.close()
            self.progress = None
