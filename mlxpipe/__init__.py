"""mlxpipe: a Unix filter that puts a local language model (mlx-lm) into a shell pipeline.

The Python API mirrors the command line: read records, run them through an :class:`Engine`, get
events (see :mod:`mlxpipe.events` for the wire format). mlx is imported only when an engine is used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from .engine import Engine

__all__ = ["Engine", "__version__", "records_from_objects", "run"]


def __getattr__(name: str) -> Any:
    # Lazy, so that importing mlxpipe (and `mlxpipe --help`) does not pay for importing mlx.
    if name == "Engine":
        from .engine import Engine

        return Engine
    if name == "run":
        from .pipeline import run

        return run
    if name == "records_from_objects":
        from .reader import records_from_objects

        return records_from_objects
    raise AttributeError(name)
