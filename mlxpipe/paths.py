"""Where mlxpipe keeps files of its own."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["cache_dir", "state_dir"]


def cache_dir() -> Path:
    """Converted models and compiled kernels: $XDG_CACHE_HOME/mlxpipe, by default ~/.cache/mlxpipe."""
    base = os.environ.get("XDG_CACHE_HOME") or ""
    # The XDG spec says a relative value is invalid and must be ignored.
    root = Path(base) if os.path.isabs(base) else Path.home() / ".cache"
    return root / "mlxpipe"


def state_dir() -> Path:
    """What a user's sessions leave (the interactive history): $XDG_STATE_HOME/mlxpipe, by default
    ~/.local/state/mlxpipe."""
    base = os.environ.get("XDG_STATE_HOME") or ""
    root = Path(base) if os.path.isabs(base) else Path.home() / ".local" / "state"
    return root / "mlxpipe"
