"""The environment variables that turn something off (MLXPIPE_BLAS, MLXPIPE_GEMV, MLXPIPE_CPU_FAST,
MLXPIPE_CALM_LAUNCHER, MLXPIPE_INT8): one reading of "off" for all."""

from __future__ import annotations

import os

__all__ = ["OFF", "setting", "turned_off"]

OFF = frozenset({"off", "0", "no", "false", "none"})


def setting(name: str) -> str:
    """The variable's value, stripped ("" when unset)."""
    return os.environ.get(name, "").strip()


def turned_off(name: str) -> bool:
    """Whether the variable says off (off, 0, no, false, none; any case)."""
    return setting(name).lower() in OFF
