"""Ollama model names (``ollama:NAME[:TAG]``) → the GGUF blob in Ollama's local store.

The store is ``$OLLAMA_MODELS`` (default ``~/.ollama/models``):
``manifests/<registry>/<namespace>/<name>/<tag>`` is a JSON manifest whose layer of media type
``application/vnd.ollama.image.model`` names the GGUF by digest, stored as ``blobs/sha256-<hex>``. The other
layers (template, params, system, license) are not read: the chat template comes from the GGUF itself and
sampling from mlxpipe's own options.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from ..errors import ModelError

__all__ = ["PREFIX", "blob", "models_dir"]

PREFIX = "ollama:"
_REGISTRY = "registry.ollama.ai"
_MODEL_LAYER = "application/vnd.ollama.image.model"
_DIGEST = re.compile(r"^sha256[:-]([0-9a-f]{64})$")


def models_dir() -> Path:
    """Ollama's model store: ``$OLLAMA_MODELS``, else ``~/.ollama/models``."""
    return Path(os.environ.get("OLLAMA_MODELS") or "~/.ollama/models").expanduser()


def _manifest_path(name: str) -> tuple[Path, str]:
    """``NAME[:TAG]`` (NAME may be ``ns/name`` or ``host/ns/name``) → its manifest path and the full name."""
    base, sep, tag = name.rpartition(":")
    if not sep or "/" in tag:
        base, tag = name, ""
    tag = tag or "latest"
    parts = [p for p in base.split("/") if p]
    if not parts or len(parts) > 3 or any(p in (".", "..") for p in parts):
        raise ModelError(f"not an Ollama model name: {name!r} (want NAME, NAME:TAG or NAMESPACE/NAME:TAG)")
    if len(parts) == 1:
        parts = [_REGISTRY, "library", *parts]
    elif len(parts) == 2:
        parts = [_REGISTRY, *parts]
    return models_dir() / "manifests" / Path(*parts) / tag, f"{base}:{tag}"


def blob(name: str) -> Path:
    """The GGUF file of the Ollama model ``name`` (``NAME[:TAG]``, tag ``latest`` by default).

    Raises ModelError naming what is missing: the store, the manifest, its model layer or the blob.
    """
    manifest, full = _manifest_path(name)
    if not manifest.is_file():
        store = models_dir()
        where = "OLLAMA_MODELS" if os.environ.get("OLLAMA_MODELS") else "default store; set OLLAMA_MODELS"
        if not store.is_dir():
            raise ModelError(f"no Ollama model store at {store} ({where}); cannot find ollama:{full}")
        raise ModelError(f"Ollama model {full!r} is not pulled (no manifest {manifest}); ollama pull {full}")
    try:
        data = json.loads(manifest.read_text(encoding="utf-8"))
        layers = data["layers"]
        digests = [layer["digest"] for layer in layers if layer.get("mediaType") == _MODEL_LAYER]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ModelError(f"cannot read Ollama manifest {manifest}: {e}") from None
    if not digests:
        raise ModelError(f"Ollama manifest {manifest} has no model layer ({_MODEL_LAYER})")
    m = _DIGEST.match(str(digests[0]))
    if not m:
        raise ModelError(f"Ollama manifest {manifest} has an unknown digest {digests[0]!r}")
    path = models_dir() / "blobs" / f"sha256-{m.group(1)}"
    if not path.is_file():
        raise ModelError(f"Ollama model {full!r}: its model blob is missing ({path}); ollama pull {full}")
    return path
