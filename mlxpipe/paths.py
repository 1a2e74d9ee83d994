"""Where mlxpipe keeps files of its own."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["cache_dir"]


def cache_dir() -> Path:
    """Converted models and compiled kernels: $XDG_CACHE_HOME/mlxpipe, by default ~/.cache/mlxpipe."""
    base = os.environ.get("XDG_CACHE_HOME") or ""
    # The XDG spec says a relative value is invalid and must be ignored.
    root = Path(base) if os.path.isabs(base) else Path.home() / ".cache"
    return root / "mlxpipe"
