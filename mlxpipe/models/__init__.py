"""Find, convert and describe the model mlxpipe runs.

A model spec resolves to a :class:`ModelSource` (:mod:`.source`: the embedded SmolLM2 GGUF, a GGUF file, an
MLX model folder or a Hugging Face hub id); :func:`materialize` (:mod:`.cache`) turns it into what
``mlx_lm.load`` accepts, converting GGUF files (:mod:`.gguf`) into a cached MLX model folder on first use;
:func:`describe` (:mod:`.describe`) summarizes it for ``--model-info``.

Nothing here imports ``mlx`` or ``mlx_lm`` at import time, so ``--help`` stays instant.
"""

from typing import Any

from ..errors import ModelError
from .cache import CONVERTER_VERSION, derived_file, materialize, report_conversion
from .describe import context_length, describe
from .source import EMBEDDED_NAME, ModelSource, resolve


def __getattr__(name: str) -> Any:
    # convert_gguf imports numpy (a tenth of a second): only when asked for, not on every model load.
    if name == "convert_gguf":
        from .gguf import convert_gguf

        return convert_gguf
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "CONVERTER_VERSION",
    "EMBEDDED_NAME",
    "ModelError",
    "ModelSource",
    "context_length",
    "convert_gguf",
    "derived_file",
    "describe",
    "materialize",
    "report_conversion",
    "resolve",
]
