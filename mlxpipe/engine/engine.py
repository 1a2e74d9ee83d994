"""The engine: a loaded model that turns records into typed events (the only room that runs mlx-lm).

Layering follows mlx-lm's own: ``stream_generate`` yields token-level responses; :meth:`Engine.generate`
adds what a pipe needs on top (chat templates, per-record sampling and seeds, stop strings held back
until decided, interruption, structured output) and yields :mod:`mlxpipe.events`. :meth:`Engine.batch`
does the same for many records at once (:mod:`.batch`).
"""

from __future__ import annotations

import hashlib
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.models import llama

from .. import models
from ..cpu import blas, gemv, kernels, layers, memory, quantized
from ..errors import ModelError, first_line
from ..events import Chunk, Done
from ..paths import cache_dir
from ..records import Record
from . import loader, sampling
from .batch import Batch, auto_size
from .constraints import Constraints
from .dtype import (
    STORED_VERSION,
    KeptFile,
    accelerator,
    apply_dtype,
    available_memory,
    choose_dtype,
    dequantize_layers,
    is_quantized,
)
from .generate import generation_stream, greedy_argmax
from .prefix import PrefixCache
from .prompts import Prompts
from .sequential import answer

__all__ = ["Engine"]

# mlx-lm's Llama MLP (SmolLM2's, among others) computes down_proj(swiglu(gate_proj(x), up_proj(x))), its
# decoder layer returns one array, and its attention is the one mlxpipe.cpu.layers reproduces.
layers.SWIGLU_MLPS.add(llama.MLP)
layers.DECODER_LAYERS.add(llama.TransformerBlock)
layers.ATTENTIONS.add(llama.Attention)
# Projections of one input computed as one product on a CPU (mlxpipe.cpu.quantized.fuse).
_FUSED: dict[type, tuple[str, ...]] = {
    llama.Attention: ("q_proj", "k_proj", "v_proj"),
    llama.MLP: ("gate_proj", "up_proj"),
}

# Prompt tokens per forward pass. mlx has no CPU attention kernel: its fallback scores every query-key pair of
# a chunk, masked ones too, so on a CPU prompts are read in smaller chunks than mlx-lm's default (which stands
# on a GPU; bench/RESULTS.md).
_CPU_PREFILL_STEP = 256
_GPU_PREFILL_STEP = 2048


class Engine:
    """A loaded model and tokenizer, ready to answer records one after another or in batches."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        source: models.ModelSource,
        folder: str,
        dtype: str = "quantized",
        dtype_reason: str = "as loaded",
    ) -> None:
        # model is an mlx.nn.Module, which mlx's package does not export to type checkers; tokenizer is
        # mlx-lm's TokenizerWrapper or the engine's own (.tokenizer.FastTokenizer), which answers alike.
        self.model = model
        self.tokenizer = tokenizer
        self.source = source
        self.folder = folder
        self.dtype = dtype
        self.dtype_reason = dtype_reason
        self.cpu_fast_paths: list[str] = []  # layers swapped by mlxpipe.cpu.layers (set by load)
        self.argmax: Callable[[mx.array], mx.array] = greedy_argmax  # a greedy step's pick (set by load)
        self.quantized_rows = 0  # weight matrices whose one-row products read quantized bytes (set by load)
        self.dequantized = False  # a quantized model computed from float32 copies (set by load)
        self.batch_choice: dict[str, Any] | None = None  # what --batch auto chose and why (set by auto_batch)
        self.context_length = models.context_length(folder)
        self.reuse_prefix = True
        self.prefill_step = _CPU_PREFILL_STEP if accelerator() is None else _GPU_PREFILL_STEP
        self.prompts = Prompts(tokenizer, self.context_length)
        self.prefixes = PrefixCache(model, self.prefill_step, _prefix_files(self))
        self.constraints = Constraints(tokenizer)
        self.vocab_size = len(tokenizer)
        # We check prompt length against the context ourselves, on the record's error line; the
        # tokenizer's own warning about it would be a stray line on stderr.
        tokenizer.model_max_length = sys.maxsize

    @classmethod
    def load(
        cls,
        spec: str | None = None,
        dtype: str = "auto",
        batch: int = 1,
        *,
        trust_remote_code: bool = False,
        on_convert: Callable[[str, int, int], None] | None = None,
    ) -> Engine:
        """Resolve ``spec`` (see :func:`mlxpipe.models.resolve`) and load it, or raise ``ModelError``.

        ``dtype`` is one of :data:`.dtype.DTYPES`; :func:`.dtype.choose_dtype` says what ``auto`` picks for
        ``batch`` records generating at once. A model or tokenizer that ships its own Python code is refused
        unless ``trust_remote_code``. ``on_convert(name, done, total)`` is told how far a GGUF's first
        conversion is.
        """
        source = models.resolve(spec)
        models.report_conversion(on_convert)
        try:
            folder = models.materialize(source)
        finally:
            models.report_conversion(None)
        # A GGUF conversion's float32 matrices are kept in the cache: reading them beats dequantizing. A kept
        # file is read on a thread from here on, while the model is built and the tokenizer parsed.
        tag = f"float32-{STORED_VERSION}-mlx{getattr(mx, '__version__', '')}.safetensors"
        path = models.derived_file(folder, tag)
        wants_float32 = dtype == "float32" or (dtype == "auto" and not kernels.available())
        kept = KeptFile(path) if path is not None and accelerator() is None and wants_float32 else None
        try:
            model, tokenizing = loader.load(folder, trust_remote_code)
        except Exception as exc:  # mlx-lm and huggingface_hub raise many kinds; the user needs one line
            raise _load_error(source.spec, exc, trust_remote_code) from None
        used, reason = choose_dtype(model, dtype, batch)
        was_quantized = is_quantized(model)
        # Float32 on a CPU computes from the dequantized weights; one-row products can still read the
        # quantized ones (mlxpipe.cpu.gemv), which the dequantizing would otherwise drop.
        forms = quantized.forms(model) if used == "float32" and gemv.quantized_available() else {}
        stored = (kept or KeptFile(path)) if used == "float32" and path is not None else None
        tokenizing.start()  # its file is parsed while mlx reads or computes the weights
        matrices = _to_kernels(model, folder) if used == "quantized" else []
        # joined as one matrix while dequantizing: fusing them afterwards would copy them
        joined = quantized.joinable(model, forms, _FUSED) if forms and layers.enabled() else {}
        model = apply_dtype(model, used, stored, joined)
        mx.eval(model.parameters())  # (the loader's are read lazily)
        try:
            tokenizer = tokenizing.result()
        except Exception as exc:
            raise _load_error(source.spec, exc, trust_remote_code) from None
        engine = cls(model, tokenizer, source, folder, used, reason)
        engine.dequantized = bool(forms) or (used == "float32" and was_quantized)
        _speed_up(engine, forms, joined, matrices)
        return engine

    def info(self) -> dict[str, Any]:
        """What ``--model-info`` prints: the model's description, compute device, dtype, BLAS, fast paths."""
        info = models.describe(self.source, self.folder)
        info["device"] = str(mx.default_device())
        info["dtype"] = self.dtype
        info["dtype_reason"] = self.dtype_reason
        info["blas"] = blas.setup().info()
        info["malloc"] = memory.keep_freed_memory()
        threads = blas.threads()
        if threads is not None:
            info["blas"]["threads"] = threads  # now: 1 while one stream decodes, else the default
        info["cpu_fast_paths"] = self.cpu_fast_paths
        info["quantized_rows"] = self.quantized_rows
        # the 8-bit parts of the integer products (MLXPIPE_INT8; a CPU with VNNI), when quantized kernels run
        info["int8_activations"] = gemv.int8_activations() if self.quantized_rows else 0
        if self.batch_choice is not None:
            info["batch"] = self.batch_choice
        return info

    def slow_paths(self) -> list[str]:
        """Missing CPU fast paths that this model pays for, one line each with the cause and the fix
        (:func:`mlxpipe.cpu.blas.slow_paths`); only when it computes in float32 on a CPU, else empty."""
        if self.dtype != "float32" or accelerator() is not None:
            return []
        lines = []
        built = kernels.load()
        if self.dequantized and self.dtype_reason.startswith("auto") and built.startswith("not built: "):
            cause = built.removeprefix("not built: ")
            fix = kernels.build_fix() or "it is tried again once the compiler or mlxpipe changes"
            lines.append(
                f"the quantized weights are computed from float32 copies, 4x their memory: {cause}; {fix}"
            )
        return lines + blas.slow_paths()

    def auto_batch(self, max_tokens: int, interactive: bool) -> int:
        """What ``--batch auto`` means for this run (1 when reading a terminal); recorded for ``info``."""
        if interactive:
            size, why = 1, "input is a terminal: one record at a time"
        else:
            size, why = auto_size(self.model, max_tokens, available_memory(), accelerator() is not None)
        self.batch_choice = {"size": size, "auto": True, "reason": why}
        return size

    # What each record gets; every generation path (sequential or batched) asks here.

    def encode(self, record: Record) -> list[int]:
        """The prompt tokens for ``record`` (:meth:`.prompts.Prompts.encode`); raises :class:`RecordError`."""
        return self.prompts.encode(record)

    def prefix_for(self, record: Record, tokens: list[int]) -> tuple[int, list[Any] | None]:
        """How many of ``tokens`` come from a cached shared prefix, and a private copy of its KV cache."""
        if not self.reuse_prefix:
            return 0, None
        head = self.prompts.shared_head(record)
        if record.samples > 1:  # a record's samples share its whole prompt, computed once for all of them
            self.prefixes.split(head, tokens)  # (its shared start first: other records use it too)
            return self.prefixes.split(tokens[:-1], tokens, keep=False)
        return self.prefixes.split(head, tokens)

    def budget(self, record: Record, tokens: list[int]) -> tuple[int, bool]:
        """The most tokens ``record`` may generate after its prompt ``tokens``, and whether the model's
        context (what the prompt leaves of it) is the limit rather than its max_tokens: then an answer that
        reaches it ends with finish_reason "context", never running past the context."""
        room = self.context_length - len(tokens) if self.context_length else None
        if room is not None and room < record.settings.max_tokens:
            return max(room, 1), True
        return record.settings.max_tokens, False

    def sampler_for(self, record: Record) -> sampling.Sampler:
        """mlx-lm's sampler for ``record`` (see :func:`.sampling.sampler_for`)."""
        return sampling.sampler_for(record.settings, self.vocab_size)

    def processors_for(self, record: Record) -> list[sampling.Processor]:
        """mlx-lm logits processors for ``record``: repetition penalty, then its constraint's token mask."""
        return sampling.processors_for(record.settings, self.constraints.matcher(record))

    def finish_fields(self, record: Record, text: str, finish_reason: str) -> dict[str, Any]:
        """Extra :class:`Done` fields for a finished answer (:meth:`.constraints.Constraints.finish_fields`).

        Every decoding path (sequential, batched) calls it for its done events; choice lists never decode.
        """
        return self.constraints.finish_fields(record, text, finish_reason)

    # Generating

    def generate(
        self, record: Record, should_stop: Callable[[], bool] | None = None
    ) -> Iterator[Chunk | Done]:
        """Stream one record: zero or more :class:`Chunk` events, then exactly one :class:`Done`
        (:func:`.sequential.answer`). Raises :class:`RecordError` before the first event when the record
        cannot be answered; ``should_stop`` is polled once per token (true: the record ends "interrupted")."""
        blas.use_threads(1)
        yield from answer(self, record, should_stop)

    def batch(self, size: int) -> Batch:
        """A :class:`.batch.Batch` of up to ``size`` records generating together."""
        blas.use_threads(size)
        return Batch(self, size)


def _prefix_files(engine: Engine) -> Callable[[tuple[int, ...]], Path | None]:
    """Where the KV cache of a shared prefix is kept between runs (:mod:`.prefix`), under a name that
    changes with anything that changes its numbers; None where nothing is kept (models that are not
    mlxpipe's own conversions)."""
    signature: tuple[Any, ...] | None = None

    def path(tokens: tuple[int, ...]) -> Path | None:
        nonlocal signature
        if signature is None:  # at the first prefix: the engine is loaded, its fast paths are set
            signature = _numbers_signature(engine)
        text = repr((tokens, signature))
        return models.derived_file(
            engine.folder, f"prefix-{hashlib.sha256(text.encode()).hexdigest()[:32]}.safetensors"
        )

    return path


def _numbers_signature(engine: Engine) -> tuple[Any, ...]:
    """What decides a prefix's computed numbers besides its tokens: how ``engine`` computes (dtype, device,
    fast paths, switches) and the code that does it (mlx, mlxpipe's engine and CPU rooms)."""
    here = Path(__file__).resolve().parents[1]
    files = [
        p
        for room in ("engine", "cpu")
        for p in sorted((here / room).iterdir())
        if p.suffix in (".py", ".c", ".cpp")
    ]
    files.append(Path(sys.modules[type(engine.model).__module__].__file__ or ""))  # mlx-lm's model
    code = [(str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in files if p.is_file()]
    switches = sorted((k, v) for k, v in os.environ.items() if k.startswith(("MLXPIPE_", "OPENBLAS")))
    device = (str(mx.default_device()), getattr(mx, "__version__", ""))
    return (engine.dtype, device, engine.cpu_fast_paths, engine.quantized_rows, switches, code)


def _to_kernels(model: Any, folder: str) -> list[Any]:
    """On a CPU, a quantized model's layers handed to mlxpipe's kernels, which compute from the quantized
    weights, the only copy (read from the file a layer at a time); the layers they do not take are
    dequantized, as --dtype float32 dequantizes all. The matrices registered ([] elsewhere)."""
    if accelerator() is not None or not kernels.available():
        return []
    # the packed copies kept by an earlier run of this conversion: mapped, not read and packed again
    packed_path = models.derived_file(folder, f"packed-{kernels.layout()}.bin") or _packed_path(folder)
    kept_copies = kernels.PackedFile(packed_path) if packed_path is not None else None
    matrices, refused = quantized.to_kernels(model, _FUSED, layers.enabled(), kept_copies)
    if refused:
        dequantize_layers(model, refused)
    return matrices


def _speed_up(
    engine: Engine, forms: dict[str, tuple[Any, ...]], joined: dict[str, tuple[str, ...]], matrices: list[Any]
) -> None:
    """The CPU's fast paths for a loaded engine: fused projections, one-row products from the quantized
    weights, compiled stand-ins for layers with no CPU kernel (mx.fast's norms and RoPE; mlx's CPU exp is
    slow), and the greedy argmax (mlx's CPU argmax compares one element at a time)."""
    if forms and layers.enabled():
        quantized.fuse(engine.model, forms, joined)
    engine.quantized_rows = quantized.attach(engine, engine.model, forms, _streams) + len(matrices)
    kernels.release_with(engine, matrices, lambda: quantized.settle(_streams))
    if accelerator() is None and layers.enabled():
        engine.cpu_fast_paths = layers.apply(engine.model)
        if gemv.argmax_available():
            engine.argmax = layers.argmax
            engine.cpu_fast_paths = sorted([*engine.cpu_fast_paths, "argmax"])


def _packed_path(folder: str) -> Path | None:
    """Where the kernels' packed copies of a model folder that is not mlxpipe's own conversion (a hub
    snapshot, a user's) are kept: named by the folder and its weight files' sizes and times."""
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        return None
    stats = [(str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in files]
    key = hashlib.sha256(repr(stats).encode("utf-8", "surrogateescape")).hexdigest()[:24]
    return cache_dir() / "derived" / f"{Path(folder).name}-{key}.packed-{kernels.layout()}.bin"


def _streams() -> tuple[Any, ...]:
    """The streams generation runs on: ours, and mlx-lm's when a batch has used it."""
    lm = sys.modules.get("mlx_lm.generate")
    return (generation_stream,) if lm is None else (generation_stream, lm.generation_stream)


def _load_error(spec: str, exc: Exception, trust_remote_code: bool) -> ModelError:
    """One line for what mlx-lm, transformers or huggingface_hub raised while loading ``spec``."""
    if not trust_remote_code and "trust_remote_code" in str(exc):
        return ModelError(
            f"model {spec!r} needs to run its own Python code to load; "
            "pass --trust-remote-code if you trust it"
        )
    return ModelError(f"cannot load model {spec!r}: {first_line(exc)}")
