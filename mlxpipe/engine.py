"""The engine: the only module that runs mlx-lm. It turns records into typed events.

Layering follows mlx-lm's own: ``stream_generate`` yields token-level responses; :meth:`Engine.generate`
adds what a pipe needs on top (chat templates, per-record sampling and seeds, stop strings held back
until decided, interruption, structured output) and yields :mod:`mlxpipe.events`. :meth:`Engine.batch`
does the same for many records at once through mlx-lm's ``BatchGenerator`` (continuous batching).

Shared prefixes: a record's prompt is split into the part that does not depend on its own content
(chat template, system prompt, the literal text before a ``--template``'s first field) and the rest.
The first part's KV cache is computed once and reused (see :meth:`Engine.prefix_for`). The split depends
only on the record itself, never on its neighbours, so an answer does not change with what came before.
"""

# ruff: noqa: E402  (blas.setup() has to run before the first import of mlx)
from __future__ import annotations

import os
import sys
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from . import blas

blas.setup()  # before mlx is first imported: it decides which BLAS mlx's matmuls bind to

import mlx.core as mx
import mlx_lm
from mlx.nn.layers.base import Module
from mlx.nn.layers.quantized import QuantizedEmbedding, QuantizedLinear
from mlx.utils import tree_flatten
from mlx_lm.generate import BatchGenerator, TextStateMachine, generation_stream
from mlx_lm.models import llama
from mlx_lm.models.cache import KVCache, can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, make_logits_processors, make_sampler
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.utils import dequantize_model

from . import cpu_fast, gemv, models
from .events import Chunk, Done, Error
from .io import Record

# mlx-lm's Llama MLP (SmolLM2's, among others) computes down_proj(swiglu(gate_proj(x), up_proj(x))), and its
# decoder layer returns one array.
cpu_fast.SWIGLU_MLPS.add(llama.MLP)
cpu_fast.DECODER_LAYERS.add(llama.TransformerBlock)

if TYPE_CHECKING:
    from .constrain import Constraint, Grammars, Matcher

# The typed boundary: mlx-lm's samplers and logits processors map arrays to arrays.
Sampler = Callable[[mx.array], mx.array]
Processor = Callable[[mx.array, mx.array], mx.array]

MIN_PREFIX_TOKENS = 16  # shorter shared prefixes are not worth a cache entry
PREFIX_CACHE_ENTRIES = 4  # distinct prefixes kept (system prompts / templates in one run); LRU
_PROBES = ("\ue000", "\ue001")  # private-use characters: no prompt's own text tokenizes like them
# Prompt tokens per forward pass. mlx has no CPU attention kernel: its fallback scores every query-key pair
# of a chunk, masked ones too, with a slow exp, so on a CPU a 2,048-token prompt is read 1.7x faster in
# chunks of 256 than in mlx-lm's default 2,048 (bench/RESULTS.md). On a GPU mlx-lm's default stands.
_CPU_PREFILL_STEP = 256
_GPU_PREFILL_STEP = 2048
_CHOICES_STEP = 512  # at most, when scoring --choices (bounds attention memory)


class RecordError(ValueError):
    """A record that this model cannot answer (too long, no chat template, …): an error line, not a crash."""


def _never() -> bool:
    return False


class Engine:
    """A loaded model and tokenizer, ready to answer records one after another."""

    def __init__(
        self,
        model: Any,
        tokenizer: TokenizerWrapper,
        source: models.ModelSource,
        folder: str,
        dtype: str = "quantized",
        dtype_reason: str = "as loaded",
    ) -> None:
        # model is an mlx.nn.Module, which mlx's package does not export to type checkers.
        self.model = model
        self.tokenizer = tokenizer
        self.source = source
        self.folder = folder
        self.dtype = dtype
        self.dtype_reason = dtype_reason
        self.cpu_fast_paths: list[str] = []  # layers swapped by mlxpipe.cpu_fast (set by load)
        self.quantized_rows = 0  # weight matrices whose one-row products read quantized bytes (set by load)
        self.context_length = int(models.describe(source, folder).get("context_length") or 0)
        self.reuse_prefix = True
        self.prefill_step = _CPU_PREFILL_STEP if _accelerator() is None else _GPU_PREFILL_STEP
        self._prefixes: OrderedDict[tuple[int, ...], list[Any]] = OrderedDict()
        self._probed: OrderedDict[Any, tuple[int, ...]] = OrderedDict()
        self._grammars: Grammars | None = None
        self.vocab_size = len(tokenizer.get_vocab())
        # We check prompt length against the context ourselves, on the record's error line; the
        # tokenizer's own warning about it would be a stray line on stderr.
        tokenizer.model_max_length = sys.maxsize

    @classmethod
    def load(
        cls, spec: str | None = None, dtype: str = "auto", batch: int = 1, *, trust_remote_code: bool = False
    ) -> Engine:
        """Resolve ``spec`` (see :func:`mlxpipe.models.resolve`) and load it, or raise ``ModelError``.

        ``dtype`` is one of :data:`DTYPES`; :func:`choose_dtype` says what ``auto`` picks for ``batch``
        records generating at once. A model or tokenizer that ships its own Python code is refused unless
        ``trust_remote_code``.
        """
        source = models.resolve(spec)
        folder = models.materialize(source)
        try:
            # Both explicit: transformers would otherwise ask on the terminal, reading our stdin.
            loaded = mlx_lm.load(
                folder,
                tokenizer_config={"trust_remote_code": trust_remote_code},
                trust_remote_code=trust_remote_code,
            )  # typed as a 2- or 3-tuple (return_config); we ask for two
            model, tokenizer = loaded[0], loaded[1]
        except Exception as exc:  # mlx-lm and huggingface_hub raise many kinds; the user needs one line
            if not trust_remote_code and "trust_remote_code" in str(exc):
                raise models.ModelError(
                    f"model {source.spec!r} needs to run its own Python code to load; "
                    "pass --trust-remote-code if you trust it"
                ) from None
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise models.ModelError(f"cannot load model {source.spec!r}: {first}") from None
        used, reason = choose_dtype(model, dtype, batch)
        # Float32 on a CPU computes from the dequantized weights; one-row products can still read the
        # quantized ones (mlxpipe.gemv), which the dequantizing would otherwise drop.
        quantized = _quantized_forms(model) if used == "float32" and gemv.quantized_available() else {}
        engine = cls(apply_dtype(model, used), tokenizer, source, folder, used, reason)
        engine.quantized_rows = _attach_quantized(engine, quantized)
        # mx.fast's norms and RoPE have no CPU kernels, mlx's CPU exp is slow: on a CPU, compiled stand-ins
        # (bench/cpu_fast.py).
        if _accelerator() is None and cpu_fast.enabled():
            engine.cpu_fast_paths = cpu_fast.apply(engine.model)
        return engine

    def info(self) -> dict[str, Any]:
        """What ``--model-info`` prints: the model's description, compute device, dtype, BLAS, fast paths."""
        info = models.describe(self.source, self.folder)
        info["device"] = str(mx.default_device())
        info["dtype"] = self.dtype
        info["dtype_reason"] = self.dtype_reason
        info["blas"] = blas.setup().info()
        threads = blas.threads()
        if threads is not None:
            info["blas"]["threads"] = threads  # now: 1 while one stream decodes, else the default
        info["cpu_fast_paths"] = self.cpu_fast_paths
        info["quantized_rows"] = self.quantized_rows
        return info

    # -----------------------------------------------------------------------------------------

    def encode(self, record: Record) -> list[int]:
        """The prompt tokens for ``record``: chat template applied unless ``raw`` or the model has none.

        Raises :class:`RecordError` when the record cannot fit the model's context.
        """
        n = record.settings.max_tokens
        if self.context_length and n > self.context_length:
            raise RecordError(
                f"'max_tokens' is {n}, more than the model's context of {self.context_length} tokens"
            )
        return self._checked(self._tokens(record))

    def _tokens(self, record: Record, content: str | None = None) -> list[int]:
        """``record``'s prompt tokens; ``content`` replaces its own text (the last message's content)."""
        s = record.settings
        tok = self.tokenizer
        use_template = tok.has_chat_template and not s.raw
        if record.messages is not None:
            if not use_template:
                raise RecordError("'messages' need a chat template (the model has none, or --raw was given)")
            messages = [dict(m) for m in record.messages]
            if content is not None and messages:
                messages[-1]["content"] = content
        elif use_template:
            messages = [{"role": "user", "content": (record.prompt or "") if content is None else content}]
        else:
            prompt = (record.prompt or "") if content is None else content
            tokens: list[int] = tok.encode(
                prompt, add_special_tokens=tok.bos_token is None or not prompt.startswith(tok.bos_token)
            )
            return tokens
        if s.system is not None and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": s.system})
        try:
            tokens = tok.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, **dict(s.chat_template_args)
            )
        except Exception as exc:  # jinja errors from the model's own template
            raise RecordError(f"chat template failed: {exc}") from None
        return list(tokens)

    def _checked(self, tokens: list[int]) -> list[int]:
        if not tokens:
            raise RecordError("empty prompt")
        if self.context_length and len(tokens) >= self.context_length:
            raise RecordError(
                f"prompt is {len(tokens)} tokens, longer than the model's context of "
                f"{self.context_length} tokens"
            )
        return tokens

    # The one place each record's sampling is decided; every generation path (sequential or batched) uses it.
    def sampler_for(self, record: Record) -> Sampler:
        """mlx-lm's sampler for ``record``'s settings.

        With a seed, the sampler carries its own PRNG key, so the record's draws do not depend on other
        records sampled before it or beside it in a batch.
        """
        s = record.settings
        top_k = s.top_k if s.top_k < self.vocab_size else 0  # keeping every token is no top-k at all
        if s.temperature == 0 or s.seed is None:
            return make_sampler(temp=s.temperature, top_p=s.top_p, min_p=s.min_p, top_k=top_k)
        return _SeededSampler(s.seed, s.temperature, s.top_p, s.min_p, top_k)

    def processors_for(self, record: Record) -> list[Processor]:
        """mlx-lm logits processors for ``record``: repetition penalty, then its constraint's token mask."""
        s = record.settings
        processors = list(make_logits_processors(repetition_penalty=s.repetition_penalty))
        if s.constraint is not None:
            processors.append(self._mask_processor(self._matcher(s.constraint)))
        return processors

    # -----------------------------------------------------------------------------------------
    # Structured output: llguidance (in mlxpipe.constrain) decides the allowed tokens; here they are
    # applied with mx.where, which runs on every backend (llguidance's own mlx helper is Metal-only).

    @property
    def grammars(self) -> Grammars:
        """llguidance's view of this model's tokenizer, built on first use."""
        if self._grammars is None:
            from .constrain import ConstraintError, Grammars

            try:
                self._grammars = Grammars(
                    getattr(self.tokenizer, "_tokenizer", self.tokenizer), self.tokenizer.eos_token_ids
                )
            except ConstraintError as exc:
                raise RecordError(str(exc)) from None
        return self._grammars

    def _matcher(self, constraint: Constraint) -> Matcher:
        from .constrain import ConstraintError

        try:
            return self.grammars.matcher(constraint)
        except ConstraintError as exc:
            raise RecordError(str(exc)) from None

    @staticmethod
    def _mask_processor(matcher: Matcher) -> Callable[[Any, Any], Any]:
        """A logits processor that keeps only the tokens ``matcher`` allows next."""
        seen: int | None = None  # tokens already accounted for: the prompt, then each sampled token

        def process(tokens: Any, logits: Any) -> Any:
            nonlocal seen
            if seen is None:
                seen = tokens.size  # the first call sees the prompt alone
            elif tokens.size > seen:
                matcher.consume(tokens[seen:].tolist())
                seen = tokens.size
            allowed = mx.array(matcher.mask(logits.shape[-1]))
            return mx.where(allowed, logits, mx.array(-mx.inf, dtype=logits.dtype))

        return process

    def finish_fields(self, record: Record, text: str, finish_reason: str) -> dict[str, Any]:
        """Extra :class:`Done` fields for a finished answer under ``record``'s constraint ({} without one).

        ``json`` for a JSON schema. Raises :class:`RecordError` when the answer is incomplete (max tokens,
        a stop string, an interrupt). Every decoding path (sequential, batched) calls it for its done events;
        choice lists never decode (see :meth:`choose`).
        """
        from . import constrain

        constraint = record.settings.constraint
        if constraint is None:
            return {}
        try:
            return constrain.finish(self.grammars, constraint, text, finish_reason)
        except constrain.ConstraintError as exc:
            raise RecordError(str(exc)) from None

    def label_logprobs(
        self, prompt: list[int], labels: tuple[str, ...], cache: list[Any] | None = None, cached: int = 0
    ) -> dict[str, float]:
        """Each label's log probability as the start of the answer: the sum of its tokens' log probabilities.

        The prompt is run once (after the ``cached`` tokens already in ``cache``, a shared prefix); each
        label's tokens (as the tokenizer encodes the label alone) then run on that cache, trimmed back
        after each label.
        """
        if cache is None:
            cache, cached = make_prompt_cache(self.model), 0
        self._prefill(cache, prompt[:-1], start=cached, step=min(_CHOICES_STEP, self.prefill_step))
        scores: dict[str, float] = {}
        for label in labels:
            ids = list(self.tokenizer.encode(label, add_special_tokens=False))
            logits = self.model(mx.array([prompt[-1], *ids[:-1]])[None], cache=cache)[0].astype(mx.float32)
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            scores[label] = logprobs[mx.arange(len(ids)), mx.array(ids)].sum().item()
            if can_trim_prompt_cache(cache):
                trim_prompt_cache(cache, len(ids))
            else:  # a cache that cannot be trimmed: run the prompt again for the next label
                return {**scores, **self.label_logprobs(prompt, labels[len(scores) :])}
        return scores

    def choose(self, record: Record, tokens: list[int]) -> Iterator[Chunk | Done]:
        """Answer a choice-list record by scoring every label (see :mod:`mlxpipe.events`), no decoding loop.

        The answer is the most probable label (temperature 0), or one drawn from the label probabilities
        sharpened by the temperature; top-p, top-k and min-p do not apply. So the chosen label always
        agrees with the probabilities reported beside it.
        """
        from .constrain import normalized

        labels = record.settings.constraint.labels if record.settings.constraint else ()
        started = time.perf_counter()
        cached, cache = self.prefix_for(record, tokens)
        logprobs = self.label_logprobs(tokens, labels, cache, cached)
        seconds = time.perf_counter() - started
        temp = record.settings.temperature
        if temp == 0:
            label = max(labels, key=lambda x: logprobs[x])  # the first label wins a tie
        else:
            scaled = mx.array([logprobs[x] for x in labels]) / temp
            seed = record.settings.seed  # its own key, as in sampler_for: neighbours do not change the draw
            key = mx.random.key(seed) if seed is not None else None
            drawn: int = mx.random.categorical(scaled, key=key).item()  # type: ignore[assignment]
            label = labels[drawn]
        count = len(self.tokenizer.encode(label, add_special_tokens=False))
        scored = sum(len(self.tokenizer.encode(x, add_special_tokens=False)) for x in labels)
        tps = (len(tokens) + scored) / seconds if seconds > 0 else 0.0
        yield Chunk(record.index, record.id, label, count, tps)
        yield Done(
            record.index,
            record.id,
            label,
            "stop",
            count,
            tps,
            len(tokens),
            tps,
            int(mx.get_peak_memory()),
            record.input,
            choices=normalized(logprobs),
        )

    # -----------------------------------------------------------------------------------------
    # Shared prefixes

    def prefix_for(self, record: Record, tokens: list[int]) -> tuple[int, list[Any] | None]:
        """How many of ``tokens`` come from a cached prefix, and a private copy of that prefix's KV cache.

        The prefix is the part of the prompt that does not depend on the record's own text: the chat
        template's opening, the system prompt, earlier messages and ``record.lead``. It is found by
        rendering the record with two different probe texts in place of its own and taking the common
        tokens (so BPE merges at the boundary are respected). ``(0, None)`` when there is none worth reusing.
        """
        if not self.reuse_prefix:
            return 0, None
        # At least one token must remain to start generation.
        n = _common_prefix(self._probe(record), tokens[:-1])
        if n < MIN_PREFIX_TOKENS:
            return 0, None
        key = tuple(tokens[:n])
        cache = self._prefixes.get(key)
        if cache is None:
            cache = make_prompt_cache(self.model)
            if not all(type(c) is KVCache for c in cache):
                return 0, None  # sliding-window or recurrent caches cannot be shared by slicing
            self._prefill(cache, key)
            self._prefixes[key] = cache
            if len(self._prefixes) > PREFIX_CACHE_ENTRIES:
                self._prefixes.popitem(last=False)
        self._prefixes.move_to_end(key)
        return n, [_copy_kv(c, n) for c in cache]

    def _prefill(self, cache: list[Any], tokens: Sequence[int], start: int = 0, step: int = 0) -> None:
        """Run ``tokens[start:]`` into ``cache``, ``step`` tokens (default :attr:`prefill_step`) per pass."""
        step = step or self.prefill_step
        for at in range(start, len(tokens), step):
            self.model(mx.array(list(tokens[at : at + step]))[None], cache=cache)
            mx.eval([c.state for c in cache])

    def _probe(self, record: Record) -> tuple[int, ...]:
        s = record.settings
        messages = tuple(tuple(sorted(m.items())) for m in record.messages[:-1]) if record.messages else None
        key = (s.system, s.raw, repr(sorted(s.chat_template_args.items())), record.lead, messages)
        found = self._probed.get(key)
        if found is None:
            try:
                a, b = (self._tokens(record, record.lead + p) for p in _PROBES)
            except RecordError:
                a = b = []
            found = tuple(a[: _common_prefix(a, b)])
            self._probed[key] = found
            if len(self._probed) > 64:
                self._probed.popitem(last=False)
        return found

    # -----------------------------------------------------------------------------------------

    def generate(self, record: Record, should_stop: Callable[[], bool] = _never) -> Iterator[Chunk | Done]:
        """Stream one record: zero or more :class:`Chunk` events, then exactly one :class:`Done`.

        Raises :class:`RecordError` before the first event when the record cannot be answered.
        ``should_stop`` is polled once per token; when it turns true the record ends as "interrupted".
        """
        blas.use_threads(1)
        s = record.settings
        tokens = self.encode(record)
        if s.constraint is not None and s.constraint.kind == "choices":
            yield from self.choose(record, tokens)
            return
        started = time.perf_counter()
        cached, cache = self.prefix_for(record, tokens)
        processors = self.processors_for(record)
        if cached and processors:
            # stream_generate shows them only the tokens it was given; the batched path passes the cached
            # prefix as all_tokens. Both must see the whole prompt (a repetition penalty looks back).
            processors = [_after(tokens[:cached], processors)]
        stops = StopStrings(s.stop)
        text: list[str] = []
        responses = mlx_lm.stream_generate(
            self.model,
            self.tokenizer,
            tokens[cached:],
            max_tokens=s.max_tokens,
            sampler=self.sampler_for(record),
            logits_processors=processors,
            prompt_cache=cache,
            prefill_step_size=self.prefill_step,
        )
        prompt_tps = 0.0
        try:
            for r in responses:
                if r.generation_tokens == 1:  # the whole prompt, the reused prefix included, over its time
                    prompt_tps = len(tokens) / max(time.perf_counter() - started, 1e-9)
                segment, finish = stops.feed(r.text, r.finish_reason)
                if finish is None and should_stop():
                    segment, finish = segment + stops.flush(), "interrupted"
                if segment:
                    text.append(segment)
                    yield Chunk(record.index, record.id, segment, r.generation_tokens, r.generation_tps)
                if finish is not None:
                    extra = self.finish_fields(record, "".join(text), finish)
                    yield Done(
                        record.index,
                        record.id,
                        "".join(text),
                        finish,
                        r.generation_tokens,
                        r.generation_tps,
                        len(tokens),
                        prompt_tps,
                        int(r.peak_memory * 1e9),
                        record.input,
                        **extra,
                    )
                    return
        finally:
            responses.close()  # ends generation at once when our consumer stops early

    def batch(self, size: int) -> Batch:
        """A :class:`Batch` of up to ``size`` records generating together."""
        blas.use_threads(size)
        return Batch(self, size)


def _after(head: Sequence[int], processors: list[Processor]) -> Processor:
    """One processor running ``processors`` in order, each seeing ``head`` before the tokens it is given."""
    before = mx.array(list(head))

    def process(tokens: Any, logits: Any) -> Any:
        tokens = mx.concatenate([before, tokens])  # once a step, whatever the number of processors
        for processor in processors:
            logits = processor(tokens, logits)
        return logits

    return process


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _copy_kv(cache: Any, n: int) -> Any:
    """A KV cache holding the first ``n`` positions of ``cache``; its first update allocates new memory,
    so the shared original is never written."""
    copy = KVCache()
    copy.keys = cache.keys[..., :n, :]
    copy.values = cache.values[..., :n, :]
    copy.offset = n
    return copy


class _SeededSampler:
    """mlx-lm's sampling chain (top-p, min-p, top-k, then temperature) drawing from its own PRNG key."""

    def __init__(self, seed: int, temp: float, top_p: float, min_p: float, top_k: int) -> None:
        self.key = mx.random.key(seed)
        self.temp, self.top_p, self.min_p, self.top_k = temp, top_p, min_p, top_k

    def __call__(self, logprobs: Any) -> Any:
        if 0 < self.top_p < 1.0:
            logprobs = apply_top_p(logprobs, self.top_p)
        if self.min_p != 0.0:
            logprobs = apply_min_p(logprobs, self.min_p, 1)
        if self.top_k > 0:
            logprobs = apply_top_k(logprobs, self.top_k)
        self.key, draw = mx.random.split(self.key)
        return mx.random.categorical(logprobs * (1.0 / self.temp), key=draw)


@dataclass
class _Slot:
    """One record in a batch: everything the sequential path keeps for it."""

    record: Record
    detokenizer: Any
    stops: StopStrings
    prompt_tokens: int
    inserted: float
    first: float = 0.0
    prompt_tps: float = 0.0
    tokens: int = 0
    text: list[str] = field(default_factory=list)


class Batch:
    """Records generating together through mlx-lm's ``BatchGenerator`` (continuous batching).

    :meth:`add` a record whenever a slot is free; :meth:`step` advances every record by one token and
    returns the events that produced, in the same form as :meth:`Engine.generate` (per record: chunks,
    then one done). Each record keeps its own detokenizer, sampler, stop strings, max tokens and counts.
    """

    def __init__(self, engine: Engine, size: int) -> None:
        self.engine = engine
        self.size = size
        self._eos = set(engine.tokenizer.eos_token_ids)
        self._gen = BatchGenerator(
            engine.model,
            stop_tokens=[[t] for t in sorted(self._eos)],
            completion_batch_size=size,
            prefill_batch_size=size,
            prefill_step_size=engine.prefill_step,
        )
        self._slots: dict[int, _Slot] = {}
        self._ready: list[Chunk | Done | Error] = []  # events of records answered without decoding (choices)
        self._ready_records = 0

    def __len__(self) -> int:
        return len(self._slots) + self._ready_records

    def _take_ready(self) -> list[Chunk | Done | Error]:
        events, self._ready, self._ready_records = self._ready, [], 0
        return events

    def add(self, record: Record) -> None:
        """Start ``record``; raises :class:`RecordError` when it cannot be answered."""
        s = record.settings
        tokens = self.engine.encode(record)
        if s.constraint is not None and s.constraint.kind == "choices":
            self._ready.extend(self.engine.choose(record, tokens))  # scored at once; no token to decode
            self._ready_records += 1
            return
        inserted = time.perf_counter()
        cached, cache = self.engine.prefix_for(record, tokens)
        (uid,) = self._gen.insert(
            [tokens[cached:]],
            max_tokens=[s.max_tokens],
            caches=[cache] if cache is not None else None,
            all_tokens=[tokens[:cached]],  # logits processors see the whole prompt, as in sequential mode
            samplers=[self.engine.sampler_for(record)],
            logits_processors=[self.engine.processors_for(record)],
        )
        detokenizer = self.engine.tokenizer.detokenizer  # a fresh copy per record
        self._slots[uid] = _Slot(record, detokenizer, StopStrings(s.stop), len(tokens), inserted)

    def step(self) -> list[Chunk | Done | Error]:
        """Generate one token for every record in flight; return the resulting events.

        A constrained record whose answer ends incomplete gets an :class:`Error` instead of a done.
        """
        events = self._take_ready()
        ended: list[int] = []
        for r in self._gen.next_generated() if self._slots else ():
            slot = self._slots[r.uid]
            now = time.perf_counter()
            slot.tokens += 1
            if slot.tokens == 1:
                slot.first = now
                slot.prompt_tps = slot.prompt_tokens / max(now - slot.inserted, 1e-9)
            if r.finish_reason == "stop" and r.token in self._eos:
                finish: str | None = "stop"  # the EOS token's text is not emitted, as in stream_generate
            else:
                slot.detokenizer.add_token(r.token)
                finish = r.finish_reason
            if finish is not None:
                slot.detokenizer.finalize()
            segment, finish = slot.stops.feed(slot.detokenizer.last_segment, finish)
            events.extend(self._emit(r.uid, slot, segment, finish, now))
            if finish is not None and r.finish_reason is None:
                ended.append(r.uid)  # a stop string ended it; BatchGenerator would go on
        if ended:
            self._gen.remove(ended)
        return events

    def interrupt(self) -> list[Chunk | Done | Error]:
        """End every record in flight as "interrupted", oldest first."""
        events = self._take_ready()
        now = time.perf_counter()
        self._gen.remove(list(self._slots))
        for uid, slot in sorted(self._slots.items(), key=lambda item: item[1].record.index):
            slot.detokenizer.finalize()
            segment, finish = slot.stops.feed(slot.detokenizer.last_segment, None)
            if finish is None:
                segment, finish = segment + slot.stops.flush(), "interrupted"
            events.extend(self._emit(uid, slot, segment, finish, now))
        self.close()
        return events

    def close(self) -> None:
        """Drop every record in flight and release the generator."""
        if self._slots:
            self._gen.remove(list(self._slots))
            self._slots.clear()
        self._gen.close()

    def _emit(
        self, uid: int, slot: _Slot, segment: str, finish: str | None, now: float
    ) -> list[Chunk | Done | Error]:
        rec = slot.record
        tps = slot.tokens / max(now - slot.first, 1e-9) if slot.tokens else 0.0
        events: list[Chunk | Done | Error] = []
        if segment:
            slot.text.append(segment)
            events.append(Chunk(rec.index, rec.id, segment, slot.tokens, tps))
        if finish is not None:
            del self._slots[uid]
            try:
                extra = self.engine.finish_fields(rec, "".join(slot.text), finish)
            except RecordError as exc:
                events.append(Error(rec.index, rec.id, rec.file, rec.line, str(exc)))
                return events
            peak = int(mx.get_peak_memory())
            events.append(
                Done(
                    rec.index,
                    rec.id,
                    "".join(slot.text),
                    finish,
                    slot.tokens,
                    tps,
                    slot.prompt_tokens,
                    slot.prompt_tps,
                    peak,
                    rec.input,
                    **extra,
                )
            )
        return events


# --dtype: the weights' type for computing. "quantized" keeps quantized layers as the model folder has them.
DTYPES = ("auto", "float32", "float16", "bfloat16", "quantized")
_FLOATS = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
_QUANTIZED = (QuantizedLinear, QuantizedEmbedding)


def _accelerator() -> str | None:
    """The GPU backend mlx computes on by default (metal or cuda), or None on a CPU."""
    if mx.default_device() != mx.gpu:
        return None
    if mx.metal.is_available():
        return "metal"
    cuda = getattr(mx, "cuda", None)  # mlx.core.cuda exists only in newer mlx builds
    return "cuda" if cuda is not None and cuda.is_available() else "gpu"


def _quantized_forms(model: Any) -> dict[str, tuple[Any, ...]]:
    """Each affine-quantized layer's (packed weight, float32 scales, float32 biases, bits, group size).

    Casts the layers' scales and biases to float32 in place: :func:`apply_dtype` dequantizes from those
    (its own cast is then free: the same dtype gives the same array).
    """
    forms = {}
    for name, m in model.named_modules():
        if isinstance(m, _QUANTIZED) and getattr(m, "mode", "affine") == "affine" and "biases" in m:
            m.update({k: m[k].astype(mx.float32) for k in ("scales", "biases")})
            forms[name] = (m.weight, m["scales"], m["biases"], m.bits, m.group_size)
    mx.eval([f[:3] for f in forms.values()])
    return forms


def _attach_quantized(engine: Engine, forms: dict[str, tuple[Any, ...]]) -> int:
    """Attach each dequantized float32 matrix of ``engine`` to its quantized form; how many were."""
    modules = dict(engine.model.named_modules())
    attached = []
    for name, (q, scales, biases, bits, group_size) in forms.items():
        weight = getattr(modules.get(name), "weight", None)
        usable = weight is not None and weight.dtype == mx.float32 and weight.ndim == 2
        if usable and gemv.attach(weight, q, scales, biases, bits, group_size):
            attached.append(weight)
    if attached:  # registered for as long as the engine lives
        weakref.finalize(engine, gemv.detach, attached, _settle)
    return len(attached)


def _settle() -> None:
    """Wait for the work mlx has queued on the streams mlxpipe uses (it computes a step ahead)."""
    mx.synchronize()
    mx.synchronize(generation_stream)


def _is_quantized(model: Any) -> bool:
    return any(isinstance(m, _QUANTIZED) for _, m in model.named_modules())


def _available_memory() -> int | None:
    """Bytes of memory free for the model: MemAvailable on Linux, else physical memory; None if unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None


def _gpu_memory() -> int | None:
    """Bytes of GPU memory free for the model (CUDA's free memory, Metal's working set); None if unknown."""
    device_info = getattr(mx, "device_info", None)  # mlx.core.device_info exists only in newer mlx builds
    if device_info is None:
        return None
    try:
        info = device_info()
    except (RuntimeError, ValueError):
        return None
    for key in ("free_memory", "max_recommended_working_set_size", "memory_size", "total_memory"):
        value = info.get(key)
        if isinstance(value, int) and value > 0:
            return value
    return None


def _parameter_count(model: Any) -> int:
    """Logical weights in ``model``; a quantized layer counts the values it packs, not its uint32 words."""
    total = 0
    for _, m in model.named_modules():
        if isinstance(m, _QUANTIZED):
            total += m.scales.size * m.group_size + (m.bias.size if "bias" in m else 0)
        elif not tree_flatten(m.children(), is_leaf=lambda x: isinstance(x, Module)):
            leaves: Any = tree_flatten(m.parameters())
            total += sum(int(v.size) for _, v in leaves)
    return total


def choose_dtype(model: Any, requested: str, batch: int = 1) -> tuple[str, str]:
    """The dtype to compute in for ``requested`` (one of :data:`DTYPES`), ``batch`` records at once; and why.

    ``auto``: on CUDA with ``batch`` > 1, bfloat16 when the bfloat16 weights fit in half the free GPU memory
    (on an H200 the cost of mlx's quantized matmuls grows with the batch: a 1B model's decode step took 3 ms
    for one record and 61 ms for 128, against 3 and 6 ms in bfloat16; bench/RESULTS.md). Otherwise on a GPU
    the quantized weights (about as fast for one stream there, and 2-4x less memory). On a CPU float32
    (mlx's quantized CPU kernels are slow and do not batch: float32 was faster even with the reference BLAS,
    and far faster with OpenBLAS; bench/RESULTS.md) when the float32 weights fit in half the free memory.
    """
    if requested not in DTYPES:
        raise models.ModelError(f"unknown dtype {requested!r} (choose from {', '.join(DTYPES)})")
    if requested != "auto":
        return requested, "asked for with --dtype"
    accelerator = _accelerator()
    if accelerator == "cuda" and batch > 1:
        need = _parameter_count(model) * 2
        free = _gpu_memory()
        if free is not None and need > free // 2:
            gb = need / 1e9
            return (
                "quantized",
                f"auto on cuda: bfloat16 weights ({gb:.1f} GB) exceed half the free GPU memory",
            )
        return (
            "bfloat16",
            "auto on cuda with --batch: bfloat16 weights (quantized matmuls do not batch there)",
        )
    if accelerator is not None:
        return "quantized", f"auto on {accelerator}: quantized weights"
    need = _parameter_count(model) * 4
    free = _available_memory()
    if free is not None and need > free // 2:
        return "quantized", f"auto on cpu: float32 weights ({need / 1e9:.1f} GB) exceed half the free memory"
    with_blas = "the reference BLAS" if blas.setup().reference else "an optimized BLAS"
    return "float32", f"auto on cpu: float32 weights with {with_blas} (faster than quantized kernels)"


def apply_dtype(model: Any, dtype: str) -> Any:
    """Turn ``model`` into ``dtype`` in place: dequantize with mlx-lm's helper, then cast floating weights.

    ``quantized`` keeps the quantized layers; on a GPU a model with float32 parameters (a GGUF's norms, say)
    has its floating parameters cast to bfloat16 too, so that activations are not computed in float32.
    """
    if dtype == "quantized":
        leaves: Any = tree_flatten(model.parameters())
        if _accelerator() is not None and any(v.dtype == mx.float32 for _, v in leaves):
            model.set_dtype(mx.bfloat16)
            mx.eval(model.parameters())
        return model
    if _is_quantized(model):
        if dtype == "float32":
            # Dequantized in float32: scale * q + bias as the file has them, not rounded to the scales'
            # float16 (and so the same weights as the quantized one-row products of mlxpipe.gemv).
            for _, m in model.named_modules():
                if isinstance(m, _QUANTIZED):
                    m.update({k: m[k].astype(mx.float32) for k in ("scales", "biases") if k in m})
        model = dequantize_model(model)
    model.set_dtype(_FLOATS[dtype])
    mx.eval(model.parameters())
    return model


class StopStrings:
    """Cuts a stream of text at the first stop string, holding back text that could begin one.

    Built on mlx-lm's :class:`TextStateMachine`: a stop string moves it to the end state.
    """

    def __init__(self, stops: tuple[str, ...]) -> None:
        self._state = TextStateMachine({"normal": [(w, None) for w in stops]}).make_state() if stops else None

    def feed(self, text: str, finish: str | None) -> tuple[str, str | None]:
        """Take the next segment; return the text safe to emit and the finish reason, if any."""
        if self._state is None:
            return text, finish
        self._state, segments = TextStateMachine.split(self._state, text)
        safe = "".join(t for _, t in segments)
        if self._state[0] is None:  # a stop string matched: it and everything after it are dropped
            return safe, "stop"
        if finish is not None:
            safe += self.flush()
        return safe, finish

    def flush(self) -> str:
        """Release the held-back text (the stream ended without completing a stop string)."""
        if self._state is None:
            return ""
        self._state, held, _ = TextStateMachine.flush(self._state)
        return str(held)
