"""SIGINT and SIGTERM: the first ends the record in flight cleanly, a second exits at once."""

from __future__ import annotations

import os
import select
import signal
import threading
from collections.abc import Iterable, Iterator
from types import FrameType

from ..records import BadRecord, Record

__all__ = ["Interrupts"]


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
