"""``--resume FILE``: finish a job from its own JSONL output after a crash, ``kill -9`` or Ctrl-C.

FILE is the output of earlier runs of the same command (same inputs, same ``id``s). On start it is
read once: every record whose ``id`` has a ``done`` line (finish_reason other than "interrupted") is
skipped; the others (never reached, cut off, or failed with an ``error`` line) are run again and their
final lines appended to FILE. So after any number of interruptions, rerunning the same command until
it exits 0 leaves FILE with exactly one ``done`` line per record. A record's latest line is its
result (an error line may be followed by a done line for the same ``id`` when a retry succeeds).

Each line is written with one ``write`` and is never buffered, so a kill can leave at most the last
line torn; such a line (no final newline) is cut off here before anything is appended. A file that
is not mlxpipe output (a line that is not a JSON event object) is refused, never appended to. The
file is locked while in use (where the platform has ``fcntl``), so two runs cannot interleave.
Records without an ``id`` field are known by their record number, so the input must not change
between runs; with ``id`` fields, the ids must be unique.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO, Any

from .errors import UsageError

try:  # not on Windows; there the lock is simply not taken
    import fcntl
except ImportError:  # pragma: no cover
    fcntl = None  # type: ignore[assignment]


def record_key(rid: Any) -> str:
    """The key a record is known by in FILE: its id as JSON, so the id ``1`` and the id ``"1"`` differ."""
    return json.dumps(rid, ensure_ascii=False)


@dataclass
class ResumeFile:
    """An open resume file: the ids already done, and the append-only stream new lines go to."""

    path: str
    out: IO[bytes] | None  # None on the helper ranks of an mlx.launch job: rank 0 writes
    done: set[str] = field(default_factory=set)
    torn_bytes: int = 0  # size of the torn last line that was cut off, 0 when there was none

    @classmethod
    def open(cls, path: str) -> ResumeFile:
        """Open (or create) ``path``, lock it, read what is done and cut off a torn last line.

        Raises :class:`UsageError` when the file cannot be used.
        """
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o666)
        except OSError as exc:
            raise UsageError(f"cannot open --resume file {path}: {exc.strerror}") from None
        try:
            if fcntl is not None:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    raise UsageError(f"--resume file {path} is in use by another mlxpipe") from None
            done, good_end, size = _scan(path)
            if good_end < size:
                os.ftruncate(fd, good_end)
            # Unbuffered: each line reaches the file in the write call that carries it.
            out = os.fdopen(fd, "ab", buffering=0)
        except BaseException:
            os.close(fd)
            raise
        return cls(path, out, done, size - good_end)

    def share(self, broadcast: Callable[[bytes], bytes]) -> None:
        """Under ``mlx.launch``: take rank 0's done ids (every rank must skip the same records).

        ``broadcast`` gives rank 0's bytes on every rank (:func:`mlxpipe.distributed.broadcast`).
        """
        self.done = set(json.loads(broadcast(json.dumps(sorted(self.done)).encode())))

    def is_done(self, rid: Any) -> bool:
        """Whether the record with id ``rid`` already has a done line in the file."""
        return record_key(rid) in self.done


def _scan(path: str) -> tuple[set[str], int, int]:
    """Read ``path``: the keys of done records, the end of its last whole line, and its size."""
    done: set[str] = set()
    good_end = 0
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            if not line.endswith(b"\n"):
                break  # torn: the kill came in the middle of writing it
            good_end += len(line)
            if not line.strip():
                continue
            try:
                event = json.loads(line)
            except ValueError:
                event = None
            if not isinstance(event, dict) or event.get("event") not in ("chunk", "done", "error"):
                raise UsageError(
                    f"--resume file {path}:{number} is not mlxpipe JSONL output; refusing to append to it"
                )
            if event["event"] == "done" and event.get("finish_reason") != "interrupted":
                done.add(record_key(event.get("id")))
        size = f.seek(0, os.SEEK_END)
    return done, good_end, size
