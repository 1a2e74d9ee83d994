"""mlxpipe: a Unix filter that puts a local language model (mlx-lm) into a shell pipeline.

The Python API mirrors the command line: read records, run them through an :class:`Engine`, get
events (see :mod:`mlxpipe.events` for the wire format). mlx is imported only when an engine is used.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_argv: list[str] = getattr(sys, "orig_argv", [])
_command = "-mmlxpipe" in _argv or any(_argv[i : i + 2] == ["-m", "mlxpipe"] for i in range(len(_argv)))
if sys.argv[:1] == ["-m"] and _command:
    # `python -m mlxpipe` is starting (runpy imports this package before it finds __main__): a signal from now
    # until the run has a record to finish ends the process at once, by the signal (see __main__.py).
    import signal

    for _signum in (signal.SIGINT, signal.SIGTERM):
        if signal.getsignal(_signum) is not signal.SIG_IGN:  # a parent's SIG_IGN (`mlxpipe … &`) stays
            signal.signal(_signum, signal.SIG_DFL)

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
