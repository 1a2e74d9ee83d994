"""A :class:`ModelSource` → a folder ``mlx_lm.load`` accepts: GGUF files are converted once into the cache.

:func:`materialize`: a GGUF file or Ollama blob is converted into a folder keyed by the file and
:data:`CONVERTER_VERSION`, published whole with its manifest written last and checked at each use (a damaged
or cut-short folder is converted again); a hub id's snapshot is downloaded where it is not cached; a folder is
itself. :func:`derived_file` names where a file computed from a conversion is kept (float32 matrices, packed
copies, prefix caches).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
from collections.abc import Callable
from pathlib import Path

from .. import cachefiles
from ..errors import ModelError
from ..paths import cache_dir
from . import hub
from .source import ModelSource

__all__ = ["CONVERTER_VERSION", "derived_file", "materialize"]

# Part of the cache key: bump it whenever the converter's output changes, so old folders are not reused.
CONVERTER_VERSION = "3"
_UNSAFE = r"[^\w.-]+"  # what a file name made of a model's name or a tag does not keep


def materialize(source: ModelSource) -> str:
    """Return the folder ``mlx_lm.load`` should get: a GGUF's cached conversion, a hub id's snapshot
    (downloaded first where it is not cached and the network allows), else the folder itself."""
    if source.kind == "hub" and source.path is None:
        return str(hub.download(source.spec))
    if source.path is None:
        raise ModelError(f"model source has no path: {source.spec}")
    if source.kind in ("folder", "hub"):
        return str(source.path)
    if source.kind in ("gguf", "embedded"):
        return str(_cached_conversion(source.path))
    if source.kind == "ollama":
        return str(_cached_conversion(source.path, source.spec.partition(":")[2]))
    raise ModelError(f"unknown model source kind: {source.kind}")


def derived_file(folder: str, tag: str) -> Path | None:
    """Where a file computed from the cached conversion ``folder`` is kept (``tag`` names what and with
    which versions); None for folders that are not mlxpipe's own conversions (a hub snapshot, a user's)."""
    path = Path(folder)
    if path.parent != cache_dir() / "models":
        return None
    return cache_dir() / "derived" / f"{path.name}.{re.sub(_UNSAFE, '_', tag)}"


# Told of a conversion's progress (the GGUF's name, bytes done, bytes in all), when set: report_conversion.
_progress: Callable[[str, int, int], None] | None = None


def report_conversion(progress: Callable[[str, int, int], None] | None) -> None:
    """Have ``progress(name, done, total)`` told how far a GGUF conversion is (None: nobody)."""
    global _progress
    _progress = progress


def convert_gguf(gguf_path: Path, out: Path) -> None:
    """:func:`.gguf.convert_gguf`, imported only when a conversion is due (it imports numpy)."""
    from .gguf import convert_gguf as convert

    told = _progress
    convert(gguf_path, out, None if told is None else lambda done, total: told(gguf_path.name, done, total))


def _cache_key(gguf_path: Path) -> str:
    path = gguf_path.resolve()
    try:
        st = path.stat()
    except OSError as e:
        raise ModelError(f"no such file: {gguf_path} ({e.strerror})") from None
    text = f"{path}\0{st.st_size}\0{st.st_mtime_ns}\0{CONVERTER_VERSION}"
    return hashlib.sha256(text.encode("utf-8", "surrogateescape")).hexdigest()


def _cached_conversion(gguf_path: Path, name: str | None = None) -> Path:
    models = cache_dir() / "models"
    if name is None:
        name = gguf_path.name[: -len(".gguf")] if gguf_path.name.lower().endswith(".gguf") else gguf_path.name
    stem = re.sub(r"[^\w.-]+", "_", name)
    key = _cache_key(gguf_path)
    target = models / f"{stem}-{key[:20]}"
    inputs = {"gguf": str(gguf_path.resolve()), "key": key, "converter": CONVERTER_VERSION}
    if (target / "config.json").is_file():
        if cachefiles.check_manifest(target) is None:
            return target
        if not (target / cachefiles.MANIFEST).exists() and _intact(target):
            # Published by an older mlxpipe, before manifests: whole as far as its headers tell; adopted.
            with contextlib.suppress(OSError):
                cachefiles.write_manifest(target, inputs)
            return target
        # Cut short or changed since it was published (a full disk, a copy, a hand): convert it again.
        _discard(target)
    try:
        room = cachefiles.Scratch(models)
    except OSError as e:
        raise ModelError(f"cannot create cache folder {models}: {e}") from None
    with room:
        tmp = room.path / "model"
        try:
            tmp.mkdir()
            convert_gguf(gguf_path, tmp)
            cachefiles.write_manifest(tmp, inputs)  # last: what proves the folder whole
            try:
                # Atomic publish: readers only ever see a complete folder.
                os.rename(tmp, target)
            except OSError:
                if not (target / "config.json").is_file():
                    raise
                # Another process finished first; theirs is equivalent, use it.
        except OSError as e:
            raise ModelError(f"cannot write converted model to {models}: {e}") from None
    return target


def _intact(folder: Path) -> bool:
    """Whether ``folder``'s weights are whole: at least one safetensors file, each as long as its header
    says (an 8-byte header length, the JSON header, then the data its offsets end at)."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return False
    for path in files:
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                length = int.from_bytes(f.read(8), "little")
                if not 0 < length <= size - 8:
                    return False
                header = json.loads(f.read(length))
            ends = [
                int(info["data_offsets"][1])
                for name, info in header.items()
                if name != "__metadata__" and isinstance(info, dict)
            ]
        except (OSError, ValueError, KeyError, TypeError, IndexError):
            return False
        if 8 + length + max(ends, default=0) != size:
            return False
    return True


def _discard(target: Path) -> None:
    """Take a damaged conversion out of the way (renamed first, so no reader sees it half-deleted)."""
    try:
        with cachefiles.scratch(target.parent) as room:
            os.rename(target, room / "damaged")
    except OSError as e:
        raise ModelError(
            f"the cached conversion {target} is damaged and cannot be removed ({e.strerror}): "
            "delete that folder"
        ) from None
