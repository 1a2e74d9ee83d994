"""``--resume FILE``: finish a job from its own JSONL output after a crash, ``kill -9`` or Ctrl-C.

FILE is the output of earlier runs of the same command (same inputs, same ``id``s). On start it is read
once: every record whose ``id`` has a ``done`` line (finish_reason other than "interrupted") is skipped
(with several samples, each sample whose ``id`` and ``sample`` have one; in OpenAI output, a record whose
line, with every choice, has a response); the others (never reached, cut off, or failed with an ``error``
line) are run again and their final lines appended to FILE. So after any number of interruptions, rerunning
the same command until it exits 0 leaves FILE with exactly one ``done`` line per record. A record's latest
line is its result (an error line may be followed by a done line for the same ``id`` when a retry succeeds).

Each line is written with one ``write`` and is never buffered, so a kill can leave at most the last line
torn; such a line (no final newline) is cut off here before anything is appended, but only when it is
recognisably the start of an mlxpipe event (``{"event":"`` or a prefix of it) or of an OpenAI Batch API
output line (``--out openai``; there a record is done when its line has a ``response``). A file that is not
mlxpipe output (a whole line that is not a JSON event object, or a torn tail that is not the start of one)
is refused, never appended to or cut. So is a FILE that is not a regular file (a FIFO, a device, a socket:
they would hang, swallow the output or never end) and a FILE that is also one of the inputs (the run would
read its own output). A line that cannot be written whole (a full disk, a file size limit) is cut back off,
so FILE still ends in a whole line. The file is locked while in use (where the platform has ``fcntl``), so
two runs cannot interleave.
Records without an ``id`` field are known by their record number, so the input must not change
between runs. A record whose id an earlier record already has is an error line
(:func:`mlxpipe.reader.unique_ids`), which is never skipped, so no record is taken as done for another's.
Under ``mlx.launch`` rank 0 reads FILE and shares the done ids with every rank (:meth:`ResumeFile.share`).
"""

from __future__ import annotations

import errno
import io
import json
import os
import stat
from collections.abc import Callable, Iterable
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


def sample_key(rid: Any, sample: int) -> str:
    """The key a record's sample is known by in FILE (``--samples``: each has its own done line)."""
    return json.dumps([rid, sample], ensure_ascii=False)


@dataclass
class ResumeFile:
    """An open resume file: the ids already done, and the append-only stream new lines go to."""

    path: str
    out: IO[bytes] | None  # None on the helper ranks of an mlx.launch job: rank 0 writes
    done: set[str] = field(default_factory=set)
    torn_bytes: int = 0  # size of the torn last line that was cut off, 0 when there was none

    @classmethod
    def open(cls, path: str, inputs: Iterable[str] = ()) -> ResumeFile:
        """Open (or create) ``path``, lock it, read what is done and cut off a torn last line.

        ``inputs`` are the run's input FILEs (``-`` is stdin): ``path`` must not be one of them. Raises
        :class:`UsageError` when the file cannot be used.
        """
        try:
            # O_NONBLOCK: opening a FIFO must not wait for a writer; a regular file ignores it.
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_NONBLOCK, 0o666)
        except OSError as exc:
            raise UsageError(f"cannot open --resume file {path}: {exc.strerror}") from None
        try:
            _check_kind(fd, path, inputs)
            os.set_blocking(fd, True)
            if fcntl is not None:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    raise UsageError(f"--resume file {path} is in use by another mlxpipe") from None
            done, good_end, size = _scan(path)
            if good_end < size:
                os.ftruncate(fd, good_end)
            # Unbuffered: each line reaches the file in the write call that carries it.
            out = _WholeLines(fd, "ab")
        except BaseException:
            os.close(fd)
            raise
        return cls(path, out, done, size - good_end)

    def share(self, broadcast: Callable[[bytes], bytes]) -> None:
        """Under ``mlx.launch``: take rank 0's done ids (every rank must skip the same records).

        ``broadcast`` gives rank 0's bytes on every rank (:func:`mlxpipe.distributed.broadcast`).
        """
        self.done = set(json.loads(broadcast(json.dumps(sorted(self.done)).encode())))

    def is_done(self, rid: Any, sample: int | None = None) -> bool:
        """Whether the record with id ``rid`` already has a done line in the file (its line with every
        choice, in OpenAI output), or its sample ``sample`` one."""
        return record_key(rid) in self.done or (sample is not None and sample_key(rid, sample) in self.done)


class _WholeLines(io.FileIO):
    """FILE's append-only stream: each write puts its line in whole, or cuts FILE back to where it was."""

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        start = os.lseek(self.fileno(), 0, os.SEEK_END)
        done = 0
        try:
            while done < len(view):
                written = super().write(view[done:])
                if not written:  # a regular file takes something or raises; never loop on nothing
                    raise OSError(errno.EIO, "nothing written")
                done += written
        except OSError:
            os.ftruncate(self.fileno(), start)  # no torn line left behind
            raise
        return done


def _check_kind(fd: int, path: str, inputs: Iterable[str]) -> None:
    """Refuse a FILE that is not a regular file, or that is also one of the inputs."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise UsageError(f"--resume file {path} is not a regular file (a FIFO, device or socket)")
    for name in inputs:
        try:
            other = os.fstat(0) if name == "-" else os.stat(name)
        except OSError:
            continue  # an input that cannot be read is reported as such
        if (other.st_dev, other.st_ino) == (st.st_dev, st.st_ino):
            raise UsageError(
                f"--resume file {path} is also an input of this run: it would read its own output"
            )


# What a torn last line may be: the start of a line mlxpipe writes (compact JSON, "event" first).
_EVENT_START = b'{"event":"'
_STARTS = (_EVENT_START, b'{"id":"batch_req_')  # and of an OpenAI Batch API output line (--out openai)


def _scan(path: str) -> tuple[set[str], int, int]:
    """Read ``path``: the keys of done records, the end of its last whole line, and its size."""
    done: set[str] = set()
    good_end = 0
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            if not line.endswith(b"\n"):
                # torn: the kill came in the middle of writing it. Cut only what is surely ours.
                if not any(line.startswith(start) or start.startswith(line) for start in _STARTS):
                    raise UsageError(
                        f"--resume file {path}:{number} is not mlxpipe JSONL output (its last line is not "
                        "an mlxpipe event cut short); refusing to cut or append to it"
                    )
                break
            good_end += len(line)
            if not line.strip():
                continue
            try:
                event = json.loads(line)
            except ValueError:
                event = None
            if isinstance(event, dict) and "custom_id" in event and "response" in event:  # --out openai
                if event["response"] is not None:
                    done.add(record_key(event["custom_id"]))
                continue
            if not isinstance(event, dict) or event.get("event") not in ("chunk", "done", "error", "summary"):
                raise UsageError(
                    f"--resume file {path}:{number} is not mlxpipe JSONL output; refusing to append to it"
                )
            if event["event"] == "done" and event.get("finish_reason") != "interrupted":
                sample = event.get("sample")
                rid = event.get("id")
                done.add(record_key(rid) if sample is None else sample_key(rid, sample))
        size = f.seek(0, os.SEEK_END)
    return done, good_end, size
