"""CPU speed, kept apart from the core: an optimized BLAS, one-row kernels, faster layers (Linux CPUs).

- :mod:`.blas`: loads an optimized BLAS in place of the reference one the Linux ``mlx-cpu`` wheel bundles.
- :mod:`.gemv` (with ``gemv.c``): one-row matrix products, from the quantized bytes where the engine attached
  them (:mod:`.quantized`).
- :mod:`.layers`: compiled stand-ins for mlx-lm layers that have no CPU kernel.

Importing this package makes mlx safe to import: the BLAS has to be loaded *before* mlx is first imported
(it decides what mlx's matmuls bind to), so :func:`.blas.setup` runs here, once, and every room that imports
mlx comes through this package first (the engine package imports it; others call :func:`mlx_core`). On other
platforms setup does nothing.
"""

from typing import Any

from .blas import setup

setup()


def mlx_core() -> Any:
    """``mlx.core``, imported after the BLAS was set up (for rooms outside the engine that need mlx)."""
    import mlx.core

    return mlx.core
