"""SIGINT, SIGTERM and SIGHUP: the first ends the record in flight cleanly, a second exits at once.

SIGHUP (the terminal or the ssh session closed) is taken as SIGTERM is. A signal ignored at the start stays
ignored: ``nohup``'s SIGHUP, the SIGINT a shell ignores for ``mlxpipe … &`` in a script.

The process ends the Unix way (:func:`die`): once the interrupted record's line is written and flushed, the
handler is reset and the signal raised again, so the parent sees "killed by SIGINT" (a shell's ``for`` loop
stops; ``$?`` is 130, 143 for SIGTERM). Until the model is loaded there is nothing to finish: the command
(``mlxpipe/__main__.py``) starts with the default disposition, so a signal then ends the process at once,
with no traceback, whatever import is under way. :func:`mlxpipe.cli.main` itself returns 128 + N (the
Python API); :func:`exit_process` turns that into the death by the signal.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from types import FrameType
from typing import NoReturn

from ..records import BadRecord, Record

__all__ = ["QUIT_SIGNALS", "Interrupts", "die", "exit_process", "reraise_at_exit"]

# The signals that end a run (cleanly, then at once); SIGINT alone means "stop this answer" interactively.
QUIT_SIGNALS = tuple(
    getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name)
)

_reraise: int | None = None  # the signal the process ends by, once main returns (set by reraise_at_exit)


def reraise_at_exit(signum: int) -> None:
    """Have :func:`exit_process` end the process by ``signum`` (the run it stopped has finished)."""
    global _reraise
    _reraise = signum


def exit_process(status: int) -> NoReturn:
    """End the process: by the signal that stopped the run when there was one, else with ``status``."""
    if _reraise is not None:
        die(_reraise)
    # The interpreter's teardown (freeing the model, mlx's threads) costs ~0.1 s a run and writes nothing:
    # once stdout and stderr are flushed, the process ends without it.
    try:
        if sys.stdout is not None:  # None: Python found descriptor 1 closed at start
            sys.stdout.flush()
    except BrokenPipeError:  # a reader that left: as everywhere, not a failure
        pass
    except (OSError, ValueError):
        status = status or 1
    with contextlib.suppress(OSError, ValueError):
        if sys.stderr is not None:
            sys.stderr.flush()
    os._exit(status)


def die(signum: int, flush: bool = True) -> NoReturn:
    """End the process by ``signum`` itself: its handler reset to the default, the signal raised again.

    ``flush`` first writes what stdout and stderr hold (not when exiting at once: the main thread may be
    in the middle of a write, holding the stream's lock).
    """
    if flush:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
    try:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signum, signal.SIG_DFL)
        else:  # Python's signal.signal works only in the main thread; the C library's works anywhere
            import ctypes

            libc = ctypes.CDLL(None)
            libc.signal.argtypes = [ctypes.c_int, ctypes.c_void_p]
            libc.signal.restype = ctypes.c_void_p
            libc.signal(signum, None)  # SIG_DFL
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signum})
        signal.pthread_kill(threading.get_ident(), signum)  # to this thread: delivered before it returns
    except (OSError, ValueError, AttributeError):
        pass
    os._exit(128 + signum)  # a platform where that failed


class Interrupts:
    """SIGINT, SIGTERM and SIGHUP: the first ends the record in flight cleanly, a second exits at once."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.reading = False  # blocked on input: nothing in flight, so stop right away
        self.handled = 0  # signals whose handler has run
        self.seen = 0  # signals the watcher thread has counted
        self.base = 0  # self.seen at the last reset: a second signal after it exits at once
        self.watched = False  # this instance's signals are counted by the watcher thread

    def install(self) -> None:
        for signum in QUIT_SIGNALS:
            if signal.getsignal(signum) is signal.SIG_IGN:
                continue  # nohup's SIGHUP, a shell's SIGINT for `mlxpipe … &`, a parent's choice: kept
            signal.signal(signum, self._handle)
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
        self.watched = True
        main = threading.main_thread().ident
        nudge = getattr(signal, "SIGWINCH", None)  # ignored by default, so ours to catch
        if nudge is not None:
            signal.signal(nudge, lambda _signum, _frame: None)

        def watch() -> None:
            while True:
                seen = self.seen - self.base
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
                    self.seen += signum in QUIT_SIGNALS
                    if self.seen - self.base >= 2:
                        die(signum, flush=False)

        threading.Thread(target=watch, name="mlxpipe-signals", daemon=True).start()

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        self.handled += 1
        if self.signum is not None:
            die(signum, flush=False)
        self.signum = signum
        if self.reading:
            raise KeyboardInterrupt

    def reset(self) -> None:
        """Forget the signal taken (interactive mode: Ctrl-C ended an answer; the session goes on)."""
        if self.watched:
            # The watcher counts from the wakeup pipe, a moment after the handler ran: wait for it to have
            # counted what was handled, so that its count starts again from the same place.
            deadline = time.monotonic() + 1.0
            while self.seen < self.handled and time.monotonic() < deadline:
                time.sleep(0.005)
            self.base = self.seen
        self.signum = None

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        """Around a blocking read (a line typed at a prompt): a signal during it raises KeyboardInterrupt."""
        self.reading = threading.current_thread() is threading.main_thread()
        try:
            if self.signum is not None:  # taken before `reading` went up: never block after it
                raise KeyboardInterrupt
            yield
        finally:
            self.reading = False

    def signal_number(self) -> int | None:
        """The signal that stopped the run, if any."""
        return self.signum

    def __call__(self) -> bool:
        return self.signum is not None

    def guard(self, records: Iterable[Record | BadRecord]) -> Iterator[Record | BadRecord]:
        """Mark the time spent waiting for input, so a signal then needs no record to finish."""
        it = iter(records)
        # Only the main thread can be interrupted this way; --batch reads on a helper thread instead
        # and the pipeline polls the flag while it waits.
        main = threading.current_thread() is threading.main_thread()
        while True:
            record: Record | BadRecord | None = None
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
