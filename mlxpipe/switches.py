"""The environment variables that turn something off (MLXPIPE_BLAS, MLXPIPE_GEMV, MLXPIPE_CPU_FAST,
MLXPIPE_CALM_LAUNCHER) or on (MLXPIPE_INT8): one reading of "off", and of "on", for all."""

from __future__ import annotations

import os

__all__ = ["OFF", "ON", "setting", "turned_off", "turned_on"]

OFF = frozenset({"off", "0", "no", "false", "none"})
ON = frozenset({"on", "1", "yes", "true"})


def setting(name: str) -> str:
    """The variable's value, stripped ("" when unset)."""
    return os.environ.get(name, "").strip()


def turned_off(name: str) -> bool:
    """Whether the variable says off (off, 0, no, false, none; any case)."""
    return setting(name).lower() in OFF


def turned_on(name: str) -> bool:
    """Whether the variable says on (on, 1, yes, true; any case)."""
    return setting(name).lower() in ON
