"""CPU speed, kept apart from the core: an optimized BLAS, one-row kernels, faster layers (Linux CPUs).

- :mod:`.blas`: loads an optimized BLAS in place of the reference one the Linux ``mlx-cpu`` wheel bundles.
- :mod:`.gemv` (with ``gemv.c``): one-row matrix products, from the quantized bytes where the engine attached
  them (:mod:`.quantized`).
- :mod:`.layers`: compiled stand-ins for mlx-lm layers that have no CPU kernel.
- :mod:`.memory`: glibc's malloc set to reuse freed buffers (mlx's arrays are malloc'd one by one).

Importing this package makes mlx safe to import: the BLAS has to be loaded *before* mlx is first imported
(it decides what mlx's matmuls bind to), so :func:`.blas.setup` runs here, once, and every room that imports
mlx comes through this package first (the engine package imports it; others call :func:`mlx_core`). On other
platforms setup does nothing.
"""

import sys
from typing import Any

from ..errors import NoBackend, first_line
from .blas import setup
from .memory import keep_freed_memory

setup()
keep_freed_memory()

# What Linux says when mlx's library is missing: plain `mlx` ships the Python module, and `mlx-cpu` or
# `mlx-cuda-*` the libmlx.so it links to (ImportError: "libmlx.so: cannot open shared object file: ...").
_NO_BACKEND = "mlx has no backend here; install 'mlxpipe[cpu]' (or [cuda13])"


def mlx_core() -> Any:
    """``mlx.core``, imported after the BLAS was set up (for rooms outside the engine that need mlx).

    Raises :class:`~mlxpipe.errors.NoBackend`, with one line saying what to install, when mlx cannot be
    imported.
    """
    try:
        import mlx.core
    except ImportError as exc:
        raise NoBackend(backend_problem(exc)) from exc
    return mlx.core


def backend_problem(exc: ImportError) -> str:
    """Why ``import mlx.core`` failed, as one line that names the fix where it is known."""
    if sys.platform == "linux" and "libmlx" in str(exc):
        return _NO_BACKEND
    return f"mlx could not be imported: {first_line(exc)}"
