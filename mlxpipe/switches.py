"""The environment variables that turn something off (MLXPIPE_BLAS, MLXPIPE_GEMV, MLXPIPE_KERNELS,
MLXPIPE_CPU_FAST, MLXPIPE_MALLOC, MLXPIPE_INT8, MLXPIPE_CALM_LAUNCHER, MLXPIPE_LINK): one reading of "off"
for all. ``MLXPIPE_CPU=off`` turns off every Linux CPU path of :mod:`mlxpipe.cpu` at once, leaving mlx's
portable operations alone: what a Mac computes with (``make test-portable`` runs the suite so)."""

from __future__ import annotations

import os

__all__ = ["CPU", "CPU_PATHS", "OFF", "setting", "turned_off", "turned_off_by"]

OFF = frozenset({"off", "0", "no", "false", "none"})
CPU = "MLXPIPE_CPU"
CPU_PATHS = frozenset(
    {"MLXPIPE_BLAS", "MLXPIPE_GEMV", "MLXPIPE_KERNELS", "MLXPIPE_CPU_FAST", "MLXPIPE_MALLOC", "MLXPIPE_INT8"}
)


def setting(name: str) -> str:
    """The variable's value, stripped ("" when unset)."""
    return os.environ.get(name, "").strip()


def turned_off(name: str) -> bool:
    """Whether the variable says off (off, 0, no, false, none; any case), or ``MLXPIPE_CPU`` does for one of
    the CPU paths."""
    return bool(turned_off_by(name))


def turned_off_by(name: str) -> str:
    """``NAME=value``, the setting that turns ``name`` off (its own, else ``MLXPIPE_CPU``'s for a CPU path);
    "" when none does."""
    for which in (name, CPU) if name in CPU_PATHS else (name,):
        if setting(which).lower() in OFF:
            return f"{which}={setting(which)}"
    return ""
