"""A model folder → mlx-lm's model and a tokenizer, without importing transformers where the folder allows.

``mlx_lm``'s package ``__init__`` imports its loader and generate loop, which import transformers (most of a
second). The model classes (``mlx_lm.models``), caches and samplers do not need it, so on import this module
registers the ``mlx_lm`` package without running its ``__init__``; the first use of a name the ``__init__``
defines (``mlx_lm.load``, ``mlx_lm.stream_generate``) runs it then, as a plain ``import mlx_lm`` would have.

:func:`load` builds the model as ``mlx_lm.utils.load_model`` does for the folders it covers (mlxpipe's GGUF
conversions: a plain config, affine quantization, one of the converter's architectures) with the tokenizer of
:mod:`.tokenizer`; any other folder goes to ``mlx_lm.load``.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import os
import sys
import threading
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.nn.layers.quantized import quantize

from . import tokenizer as fast_tokenizer

__all__ = ["load"]

# What mlxpipe's GGUF converter writes (models/gguf/config.py), none of them renamed by mlx-lm's loader.
_MODEL_TYPES = {"llama", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3"}


class _Deferred(types.ModuleType):
    """The ``mlx_lm`` package before its ``__init__`` ran: its submodules import as usual."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name not in ("__version__", "__all__"):
            raise AttributeError(name)  # what the import system probes: the package stays deferred
        self.__class__ = types.ModuleType  # type: ignore[assignment]  # once: now the plain package
        spec = self.__spec__
        assert spec is not None and spec.loader is not None
        spec.loader.exec_module(self)
        return getattr(self, name)


def _defer_mlx_lm() -> None:
    if "mlx_lm" in sys.modules:
        return
    spec = importlib.util.find_spec("mlx_lm")
    if spec is None or spec.loader is None:
        return  # not installed: the engine's own import reports it
    package = importlib.util.module_from_spec(spec)
    package.__class__ = _Deferred
    sys.modules["mlx_lm"] = package
    # What the deferred __init__ does first, for submodules imported without it (mlx_lm.generate): quiets
    # transformers' advisory lines on stderr.
    os.environ["TRANSFORMERS_NO_ADVISORY_WARNINGS"] = "1"


_defer_mlx_lm()


def load(folder: str, trust_remote_code: bool = False) -> tuple[Any, Tokenizing]:
    """``folder``'s model (its weights read lazily: the caller evaluates them) and
    its tokenizer's loading, for the caller to start when it is about to wait on mlx (see
    :class:`Tokenizing`); raises what ``mlx_lm.load`` raises."""
    from . import gemma2  # (here: mlx_lm's package must be deferred before its models are imported)

    root = Path(folder)
    gemma2.install()  # mlx-lm's Gemma 2 lacks its sliding window and fails to batch: mlxpipe's in its place
    loaded = _load_plain(root)
    if loaded is None:
        import mlx_lm

        # Both explicit: transformers would otherwise ask on the terminal, reading our stdin.
        model, tokenizer, *_ = mlx_lm.load(
            folder,
            tokenizer_config={"trust_remote_code": trust_remote_code},
            trust_remote_code=trust_remote_code,
            lazy=True,  # evaluated by the caller: layers whose packed copies are kept are never read
        )
        return model, Tokenizing(lambda: tokenizer)
    model, config = loaded
    eos = config.get("eos_token_id")

    def fast() -> Any:
        return fast_tokenizer.load(folder, [eos] if isinstance(eos, int) else list(eos or []))

    def slow() -> Any:
        from mlx_lm.utils import load_tokenizer as mlx_lm_tokenizer  # transformers: for other tokenizers

        return mlx_lm_tokenizer(root, {"trust_remote_code": trust_remote_code}, eos_token_ids=eos)

    return model, Tokenizing(slow, fast)


class Tokenizing:
    """A tokenizer being loaded: ``start()`` parses its file on a thread, ``result()`` waits for it.

    Started just before the caller waits on mlx (the float32 weights): tokenizers holds the GIL while it
    parses, so it overlaps only with work that releases it, and mlx's evaluation does. A daemon thread: an
    interrupted start-up never waits for it. What the thread cannot load (``fast`` gives None or fails) is
    loaded by ``slow`` on the caller's thread.
    """

    def __init__(self, slow: Callable[[], Any], fast: Callable[[], Any] | None = None) -> None:
        self._slow, self._fast = slow, fast
        self._loaded: Any = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Begin loading the fast tokenizer on a thread (nothing when there is none)."""
        if self._fast is not None and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="tokenizer", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        with contextlib.suppress(Exception):  # not ours after all: the slow path says why, if it fails too
            self._loaded = self._fast() if self._fast is not None else None

    def result(self) -> Any:
        """The tokenizer (started here if ``start`` was not called); raises what the slow path raises."""
        self.start()
        if self._thread is not None:
            self._thread.join()
        return self._loaded if self._loaded is not None else self._slow()


def _load_plain(root: Path) -> tuple[Any, dict[str, Any]] | None:
    """What ``mlx_lm.utils.load_model`` builds (and its config) for a folder this path covers; None for any
    other folder."""
    try:
        config = json.loads((root / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    files = sorted(root.glob("model*.safetensors"))
    plain = (
        isinstance(config, dict)
        and config.get("model_type") in _MODEL_TYPES
        and not any(k in config for k in ("model_file", "quantization_config", "quantize_activations"))
        and isinstance(config.get("quantization", {}), dict)
        and files
        and not (root / "generation_config.json").exists()
        and not (root / "hf_quant_config.json").exists()
    )
    if not plain:
        return None
    weights: dict[str, Any] = {}
    for file in files:
        weights.update(mx.load(str(file)))  # type: ignore[arg-type]  # (a dict for safetensors)
    arch = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    model = arch.Model(arch.ModelArgs.from_dict(config))
    if hasattr(model, "sanitize"):
        weights = model.sanitize(weights)
    if (quantization := config.get("quantization")) is not None:
        layers = _quantized_layers(model, quantization, weights)
        if layers is None:
            return None
        quantize(
            model,
            group_size=quantization["group_size"],
            bits=quantization["bits"],
            class_predicate=lambda path, _: layers.get(path, False),
        )
    model.eval()
    model.load_weights(list(weights.items()), strict=True)
    return model, config  # its weights read from the file when first evaluated


def _quantized_layers(
    model: Any, quantization: dict[str, Any], weights: dict[str, Any]
) -> dict[str, Any] | None:
    """Each layer to quantize → its parameters, as mlx-lm's loader infers them (affine only: None else)."""
    if quantization.get("mode", "affine") != "affine":
        return None
    layers: dict[str, Any] = {}
    for path, m in model.named_modules():
        if path in quantization:
            layers[path] = quantization[path]
        elif hasattr(m, "to_quantized") and f"{path}.scales" in weights:
            scales = weights[f"{path}.scales"]
            if scales.dtype == mx.uint8 or f"{path}.global_scale" in weights:
                return None  # mxfp/nvfp modes: mlx-lm's loader knows them
            in_dims = m.weight.shape[-1]
            bits = weights[f"{path}.weight"].shape[-1] * 32 // in_dims
            layers[path] = {"group_size": in_dims // scales.shape[-1], "bits": bits, "mode": "affine"}
    return layers
