"""The files mlxpipe keeps for itself in its cache: made aside, checked, published whole, never left behind.

Every file is made in a :class:`Scratch` folder (locked by its owner while it lives, removed on the way out,
on SIGINT/SIGTERM/SIGHUP too where their action is still the default), then published by rename with what
proves it whole written last:

- one file (a compiled library, a derived file): :func:`publish_file` writes ``NAME.sum`` beside it (size,
  a SHA-256 of its content or of its first and last 64 KiB, the inputs it was made from); :func:`check_file`;
- a folder (a GGUF conversion): :func:`write_manifest` into it before it is renamed into place, then
  :func:`check_manifest` (each file's size, mtime and first and last 64 KiB: hashing 4 GB at every start
  would cost seconds, and a file rewritten in place gets a new mtime);
- a safetensors file that is rewritten's mtime changes on use (prefix caches): its SHA-256 sealed in its own
  metadata (:func:`seal_metadata`, :func:`seal_safetensors`, :func:`check_safetensors`).

:func:`build` compiles a library with these, under a time limit, and remembers a failure in a marker that
is retried when its cause may be gone (space freed, another compiler, a day later). :func:`clean_stale`
removes what a dead process left: scratch folders whose lock is free, and older temporary names after an hour.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from types import FrameType
from typing import Any, Literal

__all__ = [
    "DEFAULT_TIMEOUT",
    "TIMEOUT_ENV",
    "BuildError",
    "Scratch",
    "build",
    "check_file",
    "check_manifest",
    "check_safetensors",
    "clean_stale",
    "compiler_identity",
    "find_compiler",
    "free_bytes",
    "noexec",
    "publish_file",
    "scratch",
    "seal_metadata",
    "seal_safetensors",
    "write_manifest",
]

SCRATCH_PREFIX = ".tmp-lk-"  # a scratch folder, locked (flock) by its living owner
# Temporary names without a lock (older versions' and the derived files'): stale after an hour, far longer
# than any conversion or build takes.
LEGACY_TEMPS = (".tmp-*", ".gemv-*", ".prefix-*")
STALE_SECONDS = 3600
MANIFEST = ".mlxpipe-manifest.json"  # a folder's manifest, inside it
SUM_SUFFIX = ".sum"  # a file's manifest, beside it
SEAL_KEY = "mlxpipe.sha256"  # a sealed safetensors file's metadata: the SHA-256 of its data
_PLACEHOLDER = "0" * 64
_EDGE = 64 << 10  # bytes hashed at each end of a large file
TIMEOUT_ENV = "MLXPIPE_CC_TIMEOUT"
DEFAULT_TIMEOUT = 120.0  # seconds a compiler may take (gemv.c's build: bench/RESULTS.md#r-build)
RETRY_SECONDS = 86400  # a failure marker older than this is tried again
SPACE_FREED = 64 << 20  # this much more free space than at the failure: tried again
LOW_SPACE = 16 << 20  # a build failing with less than this free failed for lack of space


class BuildError(OSError):
    """A library that could not be built or used: ``cause`` and ``fix`` (one line each); ``str()`` joins
    them as a notice does."""

    def __init__(self, cause: str, fix: str = "") -> None:
        super().__init__(f"{cause}; {fix}" if fix else cause)
        self.cause, self.fix = cause, fix


# ---- scratch folders ------------------------------------------------------------------------------------

_live: list[Scratch] = []
_live_lock = threading.Lock()
_SIGNALS = tuple(getattr(signal, n) for n in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, n))
_installed: dict[int, Any] = {}  # the handlers this module put in place of the default, while scratches live


class Scratch:
    """A private folder in ``folder`` (``.tmp-lk-*``) for making files before they are published; locked
    while its owner lives, so :func:`clean_stale` never takes a living run's. :meth:`close` (or leaving the
    ``with`` block) removes it and what is left in it; so does SIGINT, SIGTERM or SIGHUP while their action
    is the default (the process then ends by the signal), and the next run where the process was killed."""

    def __init__(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        clean_stale(folder)
        while True:
            path = Path(tempfile.mkdtemp(prefix=SCRATCH_PREFIX, dir=folder))
            fd = os.open(path, os.O_RDONLY)
            with contextlib.suppress(OSError):  # a filesystem without locks: removed by age instead
                fcntl.flock(fd, fcntl.LOCK_EX)
            # A cleaner may have taken it between mkdtemp and flock (it saw a free lock): start again.
            with contextlib.suppress(OSError):
                if os.stat(path).st_ino == os.fstat(fd).st_ino:
                    break
            os.close(fd)
        self.path = path
        self._fd: int | None = fd
        self._groups: list[int] = []  # process groups working in it (a compiler), killed with it
        with _live_lock:
            _live.append(self)
        _guard_signals()

    def __enter__(self) -> Scratch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def adopt(self, pgid: int) -> None:
        """Kill process group ``pgid`` with this folder if the process ends by a signal meanwhile."""
        self._groups.append(pgid)

    def release(self, pgid: int) -> None:
        """Process group ``pgid`` has ended."""
        with contextlib.suppress(ValueError):
            self._groups.remove(pgid)

    def close(self) -> None:
        """Remove the folder and what is left in it (what was published has been renamed out)."""
        for pgid in self._groups:
            with contextlib.suppress(OSError):
                os.killpg(pgid, signal.SIGKILL)
        self._groups.clear()
        shutil.rmtree(self.path, ignore_errors=True)
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        with _live_lock:
            if self in _live:
                _live.remove(self)
        _unguard_signals()


@contextlib.contextmanager
def scratch(folder: Path) -> Iterator[Path]:
    """A :class:`Scratch` in ``folder`` as a ``with`` block: its path, removed on the way out."""
    with Scratch(folder) as s:
        yield s.path


def _guard_signals() -> None:
    """Where SIGINT, SIGTERM or SIGHUP would end the process at once (their default action), have them
    remove the scratch folders first."""
    if threading.current_thread() is not threading.main_thread():
        return
    for signum in _SIGNALS:
        if signum not in _installed and signal.getsignal(signum) == signal.SIG_DFL:
            signal.signal(signum, _remove_and_die)
            _installed[signum] = signal.SIG_DFL


def _unguard_signals() -> None:
    with _live_lock:
        if _live:
            return
    if threading.current_thread() is not threading.main_thread():
        return
    for signum in list(_installed):
        if signal.getsignal(signum) is _remove_and_die:
            signal.signal(signum, signal.SIG_DFL)
        del _installed[signum]


def _remove_and_die(signum: int, _frame: FrameType | None) -> None:
    with _live_lock:
        live = list(_live)
    for s in live:
        s.close()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def clean_stale(folder: Path) -> None:
    """Remove from ``folder`` what dead processes left: scratch folders whose lock is free, and older
    temporary names (``.tmp-*``, ``.gemv-*``, ``.prefix-*``) not touched for an hour. Never raises."""
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return
    cutoff = time.time() - STALE_SECONDS
    for entry in entries:
        path = Path(entry.path)
        if entry.name.startswith(SCRATCH_PREFIX):
            _remove_if_unlocked(path)
        elif any(path.match(p) for p in LEGACY_TEMPS):
            with contextlib.suppress(OSError):
                if entry.stat(follow_symlinks=False).st_mtime < cutoff:
                    _remove(path)


def _remove_if_unlocked(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:  # its owner lives
        os.close(fd)
        return
    except OSError:  # a filesystem without locks (some NFS): its age tells instead
        stale = os.fstat(fd).st_mtime < time.time() - STALE_SECONDS
        if not stale:
            os.close(fd)
            return
    try:
        _remove(path)
    finally:
        os.close(fd)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            path.unlink()


# ---- checking what was published ------------------------------------------------------------------------


def _edges(path: Path, size: int) -> str:
    """A SHA-256 of a file's first and last 64 KiB (all of it when smaller)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        digest.update(f.read(_EDGE))
        if size > 2 * _EDGE:
            f.seek(size - _EDGE)
        digest.update(f.read(_EDGE))
    return digest.hexdigest()


def _whole(path: Path) -> str:
    with open(path, "rb") as f:
        return _rest(f)


def _rest(f: Any) -> str:
    """The SHA-256 of what is left to read of ``f`` (hashlib.file_digest is Python 3.11's)."""
    digest = hashlib.sha256()
    while chunk := f.read(1 << 20):
        digest.update(chunk)
    return digest.hexdigest()


def _describe(path: Path, *, whole: bool) -> dict[str, Any]:
    st = path.stat()
    entry: dict[str, Any] = {"size": st.st_size}
    if whole:
        entry["sha256"] = _whole(path)
    else:
        entry["mtime_ns"] = st.st_mtime_ns
        entry["edges"] = _edges(path, st.st_size)
    return entry


def _differs(path: Path, entry: Mapping[str, Any]) -> str | None:
    """Why ``path`` is not the file ``entry`` describes; None when it is."""
    try:
        st = path.stat()
        if st.st_size != entry["size"]:
            return f"{path.name} is {st.st_size} bytes, {entry['size']} were written"
        if "mtime_ns" in entry and st.st_mtime_ns != entry["mtime_ns"]:
            return f"{path.name} was changed after it was written"
        if "edges" in entry and _edges(path, st.st_size) != entry["edges"]:
            return f"{path.name}'s content is not what was written"
        if "sha256" in entry and _whole(path) != entry["sha256"]:
            return f"{path.name}'s content is not what was written"
    except (OSError, KeyError, TypeError) as e:
        return f"{path.name} cannot be checked ({e})"
    return None


def _write_json(path: Path, data: Mapping[str, Any]) -> None:
    """``data`` at ``path``, whole or not at all (a temporary name renamed into place)."""
    tmp = path.with_name(f".tmp-{os.getpid()}-{path.name}")
    try:
        tmp.write_text(json.dumps(data, sort_keys=True) + "\n", encoding="utf-8")
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    return data if isinstance(data, dict) else None


def publish_file(made: Path, target: Path, inputs: Mapping[str, str], *, whole: bool = True) -> None:
    """Rename ``made`` (in a scratch folder of ``target``'s filesystem) to ``target``, then write its
    manifest ``target.sum`` last: size, the SHA-256 of its content (``whole``; else of its first and last
    64 KiB with its mtime, for files too large to hash at every start) and ``inputs``. Raises OSError."""
    entry = _describe(made, whole=whole)
    os.replace(made, target)
    if not whole:
        entry["mtime_ns"] = target.stat().st_mtime_ns  # a rename keeps it; said again after it to be sure
    _write_json(target.with_name(target.name + SUM_SUFFIX), {"file": entry, "inputs": dict(inputs)})


def check_file(target: Path, inputs: Mapping[str, str] | None = None) -> str | None:
    """Why ``target`` is not whole (missing, no manifest, another size or content, made from other
    ``inputs`` where given); None when it is what :func:`publish_file` published."""
    if not target.is_file():
        return f"{target.name} does not exist"
    manifest = _read_json(target.with_name(target.name + SUM_SUFFIX))
    if manifest is None or not isinstance(manifest.get("file"), dict):
        return f"{target.name} has no manifest (cut short, or made by an older mlxpipe)"
    if inputs is not None and manifest.get("inputs") != dict(inputs):
        return f"{target.name} was made from other inputs"
    return _differs(target, manifest["file"])


def discard_file(target: Path) -> None:
    """Remove ``target`` and its manifest (the manifest first: no reader takes the file for whole)."""
    for path in (target.with_name(target.name + SUM_SUFFIX), target):
        with contextlib.suppress(OSError):
            path.unlink()


def write_manifest(folder: Path, inputs: Mapping[str, str]) -> None:
    """Describe every file in ``folder`` (size, mtime, first and last 64 KiB) in its manifest, written last,
    before the folder is renamed into place."""
    files = {
        str(p.relative_to(folder)): _describe(p, whole=False)
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != MANIFEST
    }
    _write_json(folder / MANIFEST, {"files": files, "inputs": dict(inputs)})


def check_manifest(folder: Path) -> str | None:
    """Why ``folder`` is not what its manifest describes (no manifest, a file missing, cut short or changed);
    None when it is."""
    manifest = _read_json(folder / MANIFEST)
    if manifest is None or not isinstance(manifest.get("files"), dict) or not manifest["files"]:
        return "it has no manifest"
    for name, entry in manifest["files"].items():
        why = _differs(folder / name, entry) if isinstance(entry, dict) else f"{name}: a damaged manifest"
        if why is not None:
            return why
    return None


# ---- sealed safetensors files ----------------------------------------------------------------------------


def seal_metadata(metadata: Mapping[str, str] | None = None) -> dict[str, str]:
    """``metadata`` with room for the seal: save the file with it, then call :func:`seal_safetensors`."""
    return {**(metadata or {}), SEAL_KEY: _PLACEHOLDER}


def _header(f: Any, size: int) -> tuple[int, dict[str, Any]]:
    length = int.from_bytes(f.read(8), "little")
    if not 0 < length <= size - 8:
        raise ValueError("its header's length is out of bounds")
    header = json.loads(f.read(length))
    if not isinstance(header, dict):
        raise ValueError("its header is not a JSON object")
    return length, header


def _data_digest(f: Any, start: int) -> str:
    f.seek(start)
    return _rest(f)


def seal_safetensors(path: Path) -> None:
    """Write the SHA-256 of the data of ``path`` (saved with :func:`seal_metadata`) into its header, in place
    of the placeholder (same length). Raises OSError or ValueError."""
    with open(path, "r+b") as f:
        size = os.fstat(f.fileno()).st_size
        length, _ = _header(f, size)
        f.seek(8)
        raw = f.read(length)
        at = raw.find(f'"{SEAL_KEY}":"{_PLACEHOLDER}"'.encode())
        if at < 0:
            raise ValueError("no placeholder for the seal in its header")
        digest = _data_digest(f, 8 + length)
        f.seek(8 + at + len(f'"{SEAL_KEY}":"'))
        f.write(digest.encode())


def check_safetensors(path: Path) -> str | None:
    """Why the safetensors file ``path`` is not whole (its size is not what its header's offsets say, no
    seal, its data's SHA-256 is not the sealed one); None when it is."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            length, header = _header(f, size)
            ends = [int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"]
            if 8 + length + max(ends, default=0) != size:
                return f"{path.name} is {size} bytes, its header says {8 + length + max(ends, default=0)}"
            sealed = (header.get("__metadata__") or {}).get(SEAL_KEY)
            if not isinstance(sealed, str) or sealed == _PLACEHOLDER:
                return f"{path.name} is not sealed"
            if _data_digest(f, 8 + length) != sealed:
                return f"{path.name}'s data is not what was written"
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
        return f"{path.name} cannot be read ({e})"
    return None


# ---- compiled libraries ------------------------------------------------------------------------------


def find_compiler(env: str = "CC", names: tuple[str, ...] = ("cc", "gcc")) -> str | None:
    """The compiler ``$env`` names, else the first of ``names`` on PATH; None when there is none."""
    wanted = os.environ.get(env)
    for name in ([wanted] if wanted else []) + list(names):
        found = shutil.which(name)
        if found:
            return found
    return None


def compiler_identity(compiler: str) -> str:
    """What tells this compiler from another, as a short hex key: the path it was found at, the file that path
    resolves to (``cc`` → ``gcc-12``) and that file's size and mtime (an upgrade changes them). Its
    ``--version`` is not asked: that would cost a process at every start that finds a marker."""
    real = os.path.realpath(compiler)
    st = os.stat(real)
    text = f"{compiler}\0{real}\0{st.st_size}\0{st.st_mtime_ns}"
    return hashlib.sha256(text.encode("utf-8", "surrogateescape")).hexdigest()[:12]


def free_bytes(folder: Path) -> int:
    """Bytes free for this user on ``folder``'s filesystem (0 when it cannot be told)."""
    try:
        st = os.statvfs(folder)
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize


def noexec(folder: Path) -> bool:
    """Whether ``folder``'s filesystem is mounted noexec (a library there cannot be mapped to run)."""
    flag = getattr(os, "ST_NOEXEC", 0)
    try:
        return bool(flag and os.statvfs(folder).f_flag & flag)
    except OSError:
        return False


def _timeout(default: float) -> float:
    """``MLXPIPE_CC_TIMEOUT`` where it is a positive number of seconds, else ``default``."""
    try:
        value = float(os.environ.get(TIMEOUT_ENV) or default)
    except ValueError:
        return default
    return value if value > 0 else default


def _library_whole(path: Path) -> str | None:
    """Why the compiled library ``path`` is not whole: empty, not ELF or Mach-O, or an ELF file shorter than
    its section headers' end; None when it looks whole."""
    try:
        data = path.read_bytes()
    except OSError as e:
        return f"it cannot be read ({e.strerror})"
    if not data:
        return "it is empty"
    if data[:4] == b"\x7fELF" and len(data) >= 64 and data[4] == 2:  # 64-bit ELF
        order: Literal["little", "big"] = "little" if data[5] == 1 else "big"
        shoff = int.from_bytes(data[0x28:0x30], order)
        shentsize, shnum = int.from_bytes(data[0x3A:0x3C], order), int.from_bytes(data[0x3C:0x3E], order)
        if shoff + shentsize * shnum > len(data):
            return "it is cut short"
        return None
    if data[:4] in (b"\x7fELF", b"\xcf\xfa\xed\xfe", b"\xca\xfe\xba\xbe"):
        return None
    return "it is not a shared library"


def _remembered(marker: Path, folder: Path) -> str | None:
    """The failure ``marker`` remembers, or None (and it removed) where its cause may be gone: a day has
    passed, space was freed since, or it cannot be read."""
    data = _read_json(marker)
    if data is None:
        if marker.exists():
            with contextlib.suppress(OSError):
                marker.unlink()
        return None
    try:
        old = time.time() - marker.stat().st_mtime > RETRY_SECONDS
        freed = free_bytes(folder) > int(data.get("free", 0)) + SPACE_FREED
        message = str(data["message"])
    except (OSError, KeyError, TypeError, ValueError):
        old, freed, message = True, False, ""
    if old or freed:
        with contextlib.suppress(OSError):
            marker.unlink()
        return None
    return message


def _die_with_parent() -> None:
    """In the compiler's process (Linux): killed when mlxpipe dies, even by SIGKILL, instead of writing on."""
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _said(stderr: str, returncode: int) -> str:
    lines = stderr.strip().splitlines()
    # The first line that says "error" (gcc starts with "In function ...:"), else the first.
    return next((x for x in lines if "error" in x.lower()), lines[0] if lines else f"exit {returncode}")


def build(
    target: Path,
    command: Callable[[Path], list[str]],
    compiler: str,
    inputs: Mapping[str, str],
    *,
    timeout: float = DEFAULT_TIMEOUT,
) -> Path:
    """``target`` (a shared library in the cache) checked and returned, else compiled first and published.

    ``command(out)``: the compiler's argv that writes the library to ``out``; it runs in a scratch folder
    under a time limit (``MLXPIPE_CC_TIMEOUT`` seconds where set, else ``timeout``), in a session of its own
    (killed with its children on the limit or a signal). ``compiler``: its path, whose
    :func:`compiler_identity` keys the failure marker. ``inputs``: what the library was made from (source
    hash, versions, platform), kept in its manifest; a library whose manifest, size or content differs is
    built again. ``target``'s name must change with the source. Raises :class:`BuildError` (cause and fix)
    when it cannot be built or used here; a compiler's failure is remembered in ``NAME.IDENTITY.failed`` and
    tried again with another compiler, after a day, or once more space is free.
    """
    folder = target.parent
    folder.mkdir(parents=True, exist_ok=True)
    if noexec(folder):
        raise BuildError(
            f"the cache folder {folder} is on a filesystem mounted noexec, where a library cannot be loaded",
            "set XDG_CACHE_HOME to a folder on another filesystem",
        )
    if check_file(target, inputs) is None:
        return target
    if target.exists() or target.with_name(target.name + SUM_SUFFIX).exists():
        discard_file(target)  # damaged or made from other inputs: built again
    name = Path(compiler).name
    marker = folder / f"{target.name}.{compiler_identity(compiler)}.failed"
    remembered = _remembered(marker, folder)
    if remembered is not None:
        raise BuildError(
            f"{remembered} (remembered in {marker})",
            f"it is tried again with another compiler, once space is freed or after a day; delete {marker} "
            "to try now",
        )
    limit = _timeout(timeout)
    with Scratch(folder) as room:
        out = room.path / target.name
        returncode, stderr = _compile(command, out, room, name, limit)
        broken = None if returncode != 0 else _library_whole(out)
        if returncode == 0 and broken is None:
            try:
                publish_file(out, target, inputs)
            except OSError as e:
                raise _space_or(
                    folder, f"{target.name} could not be published: {e.strerror}", str(e)
                ) from None
            return target
    raise _failed(name, marker, limit, returncode, stderr, broken)


def _compile(
    command: Callable[[Path], list[str]], out: Path, room: Scratch, name: str, limit: float
) -> tuple[int | None, str]:
    """Run ``command(out)`` in ``room`` (its folder, its TMPDIR), in a session of its own that is killed
    after ``limit`` seconds and once it exits; returns its exit status (None: stopped at the limit) and
    what it wrote on stderr."""
    try:
        process = subprocess.Popen(
            command(out),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            errors="replace",
            start_new_session=True,
            cwd=room.path,
            env={**os.environ, "TMPDIR": str(room.path)},  # its intermediates removed with the folder
            preexec_fn=_die_with_parent,
        )
    except OSError as e:
        raise BuildError(
            f"{name} could not be run: {e.strerror}", "check that the compiler runs (CC, CXX)"
        ) from None
    room.adopt(process.pid)
    returncode: int | None
    try:
        _, stderr = process.communicate(timeout=limit)
        returncode = process.returncode
    except subprocess.TimeoutExpired:
        returncode = None
        with contextlib.suppress(OSError):
            os.killpg(process.pid, signal.SIGKILL)
        _, stderr = process.communicate()
    room.release(process.pid)
    with contextlib.suppress(OSError):
        os.killpg(process.pid, signal.SIGKILL)  # what the compiler left running in its session
    return returncode, stderr


def _failed(
    name: str, marker: Path, limit: float, returncode: int | None, stderr: str, broken: str | None
) -> BuildError:
    """A failed build said (cause and fix), remembered in ``marker`` unless it failed for lack of space."""
    folder = marker.parent
    free = free_bytes(folder)
    if returncode is None:
        message = f"{name} took longer than {limit:g} s and was stopped"
        fix = f"it is tried again after a day or with another compiler; {TIMEOUT_ENV}=SECONDS allows longer"
    elif broken is not None:
        message = f"{name} made a library that is not whole: {broken}"
        fix = "it is tried again with another compiler, once space is freed or after a day"
    else:
        message = f"{name} failed: {_said(stderr, returncode)}"
        fix = "it is tried again with another compiler, once space is freed or after a day"
    if "No space left" in stderr or free < LOW_SPACE:
        return _space_or(folder, message, stderr)
    # Remembered, so that later runs do not pay for it again (not when the marker cannot be written).
    with contextlib.suppress(OSError):
        _write_json(marker, {"message": message, "free": free, "time": time.time()})
    return BuildError(message, fix)


def _space_or(folder: Path, message: str, said: str) -> BuildError:
    """A failure for lack of space said as such (not remembered: tried again on the next run)."""
    if "No space left" in said or free_bytes(folder) < LOW_SPACE:
        return BuildError(
            f"no space left on the device of {folder} ({free_bytes(folder) >> 20} MB free; {message})",
            "free some space: it is tried again on the next run",
        )
    return BuildError(message, "it is tried again on the next run")
