"""The standard descriptors held safe, and the one writer every line goes through.

A parent may hand mlxpipe a non-blocking stdout (Node, some CI runners), a stderr whose reader is gone, a
full disk or closed descriptors. :func:`write_all` writes every byte or raises: it loops over short writes
and, where a non-blocking descriptor has no room (``write`` returns ``None``), waits until it has.
:func:`hold_standard_fds` keeps a closed 0, 1 or 2 from being taken by the next file opened (a ``--resume``
FILE on descriptor 1 would get stray output): it puts there a descriptor on which every read or write
fails with ``EBADF``, so the closed stream is reported like any other failing one.
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import select
import sys
from typing import IO, cast

__all__ = ["OutputError", "hold_standard_fds", "raw_of", "raw_stdout", "wait_ready", "write_all"]


class OutputError(Exception):
    """Data could not be written to ``name`` (stdout other than a closed pipe, or the ``--resume`` FILE)."""

    def __init__(self, name: str, exc: OSError) -> None:
        self.name = name
        self.reason = exc.strerror or type(exc).__name__
        super().__init__(f"cannot write to {name}: {self.reason}")


def hold_standard_fds() -> None:
    """Put a placeholder on each of descriptors 0, 1 and 2 that is closed.

    The placeholder is ``/dev/null`` opened the wrong way round (stdin write-only, stdout and stderr
    read-only), so using it fails with ``EBADF`` instead of silently reading nothing or losing data.
    """
    for fd, flags in ((0, os.O_WRONLY), (1, os.O_RDONLY), (2, os.O_RDONLY)):
        try:
            os.fstat(fd)
        except OSError as exc:
            if exc.errno != errno.EBADF:
                continue
            try:
                held = os.open(os.devnull, flags)
            except OSError:
                return
            if held != fd:  # a lower descriptor was free too: that one is held next round
                os.dup2(held, fd, inheritable=False)
                os.close(held)


def raw_of(stream: object) -> IO[bytes] | None:
    """The raw byte stream under a text stream like ``sys.stderr``, or None (None, or no such layer).

    With ``PYTHONUNBUFFERED`` the binary layer is itself raw: writing through the text layer would then
    drop what a full non-blocking descriptor did not take, silently.
    """
    buffer = getattr(stream, "buffer", None)
    raw = getattr(buffer, "raw", buffer if isinstance(buffer, io.RawIOBase) else None)
    return cast("IO[bytes] | None", raw)


def raw_stdout() -> IO[bytes]:
    """stdout unbuffered: each write is one ``write(2)``, ``None`` when a non-blocking one is full.

    The raw stream under ``sys.stdout`` when it has one (a test may put its own there), else descriptor 1.
    """
    raw = raw_of(sys.stdout)
    if raw is None:
        return open(1, "wb", buffering=0, closefd=False)  # sys.stdout is None when 1 was closed
    with contextlib.suppress(OSError):
        sys.stdout.flush()  # nothing should be there; if it is, it goes first
    return raw


def wait_ready(fd: int, write: bool) -> None:
    """Wait until ``fd`` can be written (``write``) or read without blocking (a non-blocking descriptor)."""
    poll = getattr(select, "poll", None)
    if poll is None:  # pragma: no cover - every Unix has poll
        select.select([] if write else [fd], [fd] if write else [], [])
        return
    waiter = poll()
    waiter.register(fd, select.POLLOUT if write else select.POLLIN)
    waiter.poll()  # an error or hang-up also ends the wait: the next write or read reports it


def write_all(out: IO[bytes], data: bytes) -> None:
    """Write all of ``data`` to ``out`` and flush it, or raise ``OSError``.

    A short write is followed by the rest; a write that took nothing because a non-blocking descriptor is
    full (``None``, or ``BlockingIOError`` from a buffered stream) waits until it has room.
    """
    view = memoryview(data)
    while view:
        try:
            written = out.write(view)
        except BlockingIOError as exc:  # a buffered stream: it says how much it took
            written = exc.characters_written
            if not written:
                wait_ready(out.fileno(), write=True)
                continue
        if written is None:
            wait_ready(out.fileno(), write=True)
            continue
        view = view[written:]
    while True:
        try:
            out.flush()
            return
        except BlockingIOError:
            wait_ready(out.fileno(), write=True)
