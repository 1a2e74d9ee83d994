"""The engine: the only room that runs mlx-lm. Records in, typed events (:mod:`mlxpipe.events`) out.

- :mod:`.engine`: :class:`Engine`: load a model, answer one record (``generate``) or open a batch.
- :mod:`.kit`: :class:`Kit`, what the ways of answering below are handed (the engine is one).
- :mod:`.sequential`: one record at a time; :mod:`.batch`: :class:`Batch`, many records at once through
  mlx-lm's ``BatchGenerator``.
- :mod:`.prompts`: a record → prompt tokens (chat template, context checks); :mod:`.prefix`: shared prefixes'
  KV caches.
- :mod:`.sampling`: samplers, logits processors, stop strings; :mod:`.choices`: choice lists scored.
- :mod:`.dtype`: which type the weights compute in (``--dtype``).
"""

from .. import cpu  # first: on Linux CPUs the BLAS must be loaded before mlx is imported

cpu.mlx_core()  # a missing backend is one line (NoBackend), not a traceback from the first `import mlx.core`

from . import loader  # noqa: F401  # before any mlx_lm import: mlx-lm's package without its __init__ (transformers)
from .batch import Batch
from .dtype import DTYPES, apply_dtype, choose_dtype
from .engine import Engine
from .sampling import StopStrings

__all__ = ["DTYPES", "Batch", "Engine", "StopStrings", "apply_dtype", "choose_dtype"]
