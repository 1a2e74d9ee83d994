"""Hugging Face repo ids: found in the local cache first, downloaded only where the network answers.

The cache layout is huggingface_hub's: ``$HF_HUB_CACHE`` (default ``$HF_HOME/hub``, ``$HF_HOME`` defaulting
to ``$XDG_CACHE_HOME/huggingface`` or ``~/.cache/huggingface``) / ``models--OWNER--NAME`` with ``refs/main``
naming a folder under ``snapshots/``. Reading it needs no huggingface_hub import: a cached id loads at once.
"""

from __future__ import annotations

import os
import socket
import threading
from pathlib import Path
from urllib.parse import urlparse

from ..errors import ModelError

__all__ = ["download", "hub_cache", "offline", "snapshot"]

# What mlx-lm itself fetches for a model (mlx_lm.utils): weights, configs, tokenizer files.
_PATTERNS = ["*.json", "*.safetensors", "*.py", "tokenizer.model", "*.tiktoken", "tiktoken.model", "*.txt",
             "*.jsonl", "*.jinja"]  # fmt: skip
_PROBE_SECONDS = 3.0


def hub_cache() -> Path:
    """The Hugging Face hub cache folder, as huggingface_hub computes it from the environment."""
    if cache := os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE"):
        return Path(cache).expanduser()
    home = os.environ.get("HF_HOME")
    if not home:
        xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        home = os.path.join(xdg, "huggingface")
    return Path(home).expanduser() / "hub"


def offline() -> bool:
    """True when ``HF_HUB_OFFLINE`` (or the older ``TRANSFORMERS_OFFLINE``) asks for no network at all."""
    return any(
        os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")
        for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    )


def snapshot(repo_id: str, revision: str = "main") -> Path | None:
    """The cached snapshot folder of ``repo_id`` holding a config.json, or None when it is not cached.

    ``refs/<revision>`` is preferred; otherwise the most recently written snapshot with a config.json.
    """
    repo = hub_cache() / ("models--" + repo_id.replace("/", "--"))
    snapshots = repo / "snapshots"
    try:
        commit = (repo / "refs" / revision).read_text(encoding="utf-8").strip()
    except OSError:
        commit = ""
    if commit and (snapshots / commit / "config.json").is_file():
        return snapshots / commit
    try:
        candidates = [p for p in snapshots.iterdir() if (p / "config.json").is_file()]
    except OSError:
        return None
    return max(candidates, key=lambda p: p.stat().st_mtime) if candidates else None


def download(repo_id: str) -> Path:
    """Download ``repo_id`` into the hub cache and return its snapshot folder.

    Raises ModelError at once when offline, and within seconds when the hub's host does not answer (no DNS or
    TCP timeout wait), naming where the cache was looked for and how to fetch the model.
    """
    where = hub_cache() / ("models--" + repo_id.replace("/", "--"))
    fetch = f"fetch it with: hf download {repo_id} (or huggingface-cli download {repo_id})"
    if offline():
        raise ModelError(
            f"model {repo_id!r} is not in the Hugging Face cache ({where}) and HF_HUB_OFFLINE is set; {fetch}"
        )
    endpoint = os.environ.get("HF_ENDPOINT") or "https://huggingface.co"
    if not _reachable(endpoint):
        raise ModelError(
            f"model {repo_id!r} is not in the Hugging Face cache ({where}) "
            f"and {endpoint} cannot be reached; {fetch}"
        )
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id, allow_patterns=_PATTERNS))
    except Exception as e:  # huggingface_hub raises many kinds (HTTP, not found, gated): one line
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ModelError(f"cannot download model {repo_id!r} from {endpoint}: {first}") from None


def _reachable(endpoint: str) -> bool:
    """Whether a TCP connection to the endpoint's host opens within a few seconds (DNS included)."""
    url = urlparse(endpoint)
    host = url.hostname
    if not host:
        return False
    port = url.port or (80 if url.scheme == "http" else 443)
    result: list[bool] = []

    def probe() -> None:
        try:
            with socket.create_connection((host, port), timeout=_PROBE_SECONDS):
                result.append(True)
        except OSError:
            result.append(False)

    # getaddrinfo has no timeout of its own: a daemon thread lets us stop waiting for it.
    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(_PROBE_SECONDS)
    return bool(result and result[0])
