"""Many records generating together through mlx-lm's ``BatchGenerator`` (continuous batching).

Each record keeps what the sequential path gives it (its own detokenizer, sampler, processors, max tokens,
stop strings and counts), so its events have the same form as :func:`.sequential.answer`'s. Where mlx-lm's
batch would do more work than the answers need: a greedy batch's step takes the logits' argmax with no
log-softmax (:class:`_ArgmaxSteps`); an ended record's row, KV cache included, is taken by the next record
instead of every cache being copied as records leave and join (:class:`_TakenRows`); a joining record's
last prompt token is read in the batch's next step, not in a step of its own (:class:`_Primed`).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache
from mlx_lm.sample_utils import greedy_sampler

from ..errors import RecordError
from ..events import Chunk, Done, Error, decode_tps
from ..records import Record
from .choices import choose
from .generate import greedy_argmax
from .kit import Kit
from .sampling import StopStrings
from .tokenizer import finalize_whole

__all__ = ["AUTO_CPU", "AUTO_GPU", "CPU_KV_STEP", "Batch", "auto_size"]

# --batch auto's sizes per backend: past them throughput stops growing (bench/throughput.py, also beside a
# busy process on a CPU).
AUTO_CPU = 64
AUTO_GPU = 64
_PROMPT_ALLOWANCE = 512  # prompt tokens assumed per record when sizing the KV caches


def auto_size(model: Any, max_tokens: int, free_memory: int | None, on_gpu: bool) -> tuple[int, str]:
    """``--batch auto`` for a run that does not read a terminal: the backend's size, lowered until the KV
    caches of that many records (``max_tokens`` + a prompt allowance each, float32) take at most half of
    ``free_memory``; the size and why."""
    size = AUTO_GPU if on_gpu else AUTO_CPU
    why = f"the size for {'a GPU' if on_gpu else 'a CPU'}"
    args: Any = getattr(model, "args", None)
    layers = getattr(args, "num_hidden_layers", None)
    heads = getattr(args, "num_key_value_heads", None) or getattr(args, "num_attention_heads", None)
    hidden, all_heads = getattr(args, "hidden_size", None), getattr(args, "num_attention_heads", None)
    dim = getattr(args, "head_dim", None) or (hidden // all_heads if hidden and all_heads else None)
    if free_memory and isinstance(layers, int) and isinstance(heads, int) and isinstance(dim, int):
        per_record = 2 * layers * heads * dim * 4 * (max_tokens + _PROMPT_ALLOWANCE)
        fits = max(1, free_memory // 2 // per_record)
        if fits < size:
            size = fits
            why = f"the KV caches of {fits} records fit in half the free memory"
    return size, why


# A batch's KV caches on a CPU grow by this many positions: with mlx-lm's 256 every right-padded prefill
# allocates, copies and rolls several times the buffer it needs.
CPU_KV_STEP = 64


@functools.cache
def _tune_cpu_caches() -> None:
    """mlx-lm's ``BatchKVCache`` for a CPU, in this process: grown ``CPU_KV_STEP`` positions at a time, and
    after a right-padded prefill only its filled positions rolled (not the buffer past them). The same
    numbers: only the left padding the roll makes (masked, never attended to) holds other values."""
    from mlx_lm.models.cache import BatchKVCache

    BatchKVCache.step = CPU_KV_STEP
    roll = BatchKVCache.finalize

    def finalize(self: Any) -> None:
        if self._right_padding is not None and self.keys is not None:
            self.keys = self.keys[..., : self._idx, :]
            self.values = self.values[..., : self._idx, :]
        roll(self)  # type: ignore[no-untyped-call]

    BatchKVCache.finalize = finalize  # type: ignore[method-assign]


# Off only in bench/batch_steps.py, to measure mlx-lm's own step beside _Greedy's.
GREEDY_ARGMAX = True
_NO_LOGPROBS = mx.zeros((0,))  # what a step that skipped the log-softmax hands back as a row's logprobs


@functools.cache
def _prompt_batch() -> Any:
    """The classes below, made on first use (``mlx_lm.generate`` imports transformers: only when batching)."""
    from mlx_lm.generate import GenerationBatch, PromptProcessingBatch

    class _Primed(GenerationBatch):
        """Records whose prompts are read but for their last token, which is their next input: the decoding
        batch computes it in its next step, in rows that would be computed anyway (mlx-lm's batch would
        compute it in a step of its own, a model call per wave of records)."""

        def _step(self) -> tuple[list[int], list[mx.array]]:  # (GenerationBatch.__init__ calls it)
            b: Any = self
            b._next_logprobs = [_NO_LOGPROBS] * len(b.uids)
            return [], []

    class _Prompts(PromptProcessingBatch):
        """mlx-lm's prompts being read, whose records move on to decoding as :class:`_Primed`, and without a
        copy of their KV caches when all of them move (mlx-lm's split copies them twice)."""

        def _hand_over(self) -> None:
            """Leave no record here: their lists now belong to another batch."""
            self.uids, self.prompt_cache, self.tokens, self.samplers = [], [], [], []
            self.logits_processors, self.max_tokens, self.stop_sequences = [], [], []

        def split(self, indices: list[int]) -> Any:
            if sorted(indices) != list(range(len(self.uids))):
                return super().split(indices)
            whole = PromptProcessingBatch.__new__(type(self))
            whole.__dict__.update(self.__dict__)
            self._hand_over()
            return whole

        def generate(self, tokens: list[list[int]]) -> Any:
            # mlx-lm's PromptProcessingBatch.generate, but the batch it makes has not stepped
            if any(len(t) > 1 for t in tokens):
                self.prompt([t[:-1] for t in tokens])
            last = mx.array([t[-1] for t in tokens], dtype=mx.uint32)  # the dtype of a sampled token
            primed = _Primed(
                self.model,
                self.uids,
                last,
                self.prompt_cache,
                self.tokens,
                self.samplers,
                self.fallback_sampler,
                self.logits_processors,
                self.stop_sequences,
                self.max_tokens,
            )
            self._hand_over()
            return primed

    return _Prompts, _Primed


if TYPE_CHECKING:  # what the mixins below extend: mlx-lm's decoding batch (imported when batching only)
    from mlx_lm.generate import GenerationBatch as _Decoding
else:
    _Decoding = object


class _TakenRows(_Decoding):
    """mlx-lm's decoding batch, whose ended records leave their rows in place (uid ``None``: computed,
    never reported) for the next records to take: mlx-lm's ``filter`` and ``extend`` copy every layer's KV
    cache each time a record ends or joins. Once an eighth of the rows have stayed free for ``STALE_STEPS``
    steps (the end of the input), or before a step that would run a free row's sampler or processors, the
    free rows are dropped with mlx-lm's ``filter``. A record's numbers depend neither on its row nor on its
    neighbours. A joining record's prompt's last token is read in the batch's next step (it is *priming*).
    """

    STALE_STEPS = 4
    PADDING_CUT = 32  # positions: a cut copies every KV cache, as a filter does
    primed_type: type = type(None)  # the batches whose records join priming (set by _greedy_batch)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._steps = 0
        self._freed: dict[int, int] = {}  # free row → the step it was freed at
        self._priming: set[int] = set()  # records whose next input is their prompt's last token

    def __len__(self) -> int:
        return sum(uid is not None for uid in self.uids)

    def end(self, uids: set[int]) -> list[int]:
        """Free the rows of these records (an early stop, an interrupt); the uids found here."""
        found = []
        for i, uid in enumerate(self.uids):
            if uid in uids:
                found.append(uid)
                self._free(i)
        return found

    def _free(self, row: int) -> None:
        b: Any = self  # mlx-lm types uids as list[int]; a free row's is None
        self._priming.discard(b.uids[row])
        b.uids[row] = None
        self._freed[row] = self._steps

    def compact(self) -> None:
        """Drop the free rows (mlx-lm's filter: a copy of every KV cache)."""
        live = [i for i, uid in enumerate(self.uids) if uid is not None]
        if len(live) < len(self.uids):
            super().filter(live)
        self._freed.clear()

    def next(self) -> list[Any]:
        # mlx-lm's GenerationBatch.next, with free rows skipped and ended rows freed, not filtered out
        b: Any = self
        if self._freed:
            stale = sum(self._steps - at > self.STALE_STEPS for at in self._freed.values())
            if len(self) == 0 or 8 * stale >= len(b.uids) or not b._only_argmax():  # (_ArgmaxSteps's)
                self.compact()
        if not b.uids:
            return []
        tokens, logprobs = self._step()
        self._steps += 1
        responses = []
        for i, uid in enumerate(b.uids):
            if uid is None:
                continue
            if uid in self._priming:  # this step read its prompt's last token: its first token is next
                self._priming.discard(uid)
                continue
            responses.append(self._response(i, tokens[i], logprobs[i]))
            if responses[-1].finish_reason is not None:
                self._free(i)
        return responses

    def _response(self, row: int, token: int, logprobs: mx.array) -> Any:
        """Row ``row``'s record's token, counted, and whether it ends the record (as mlx-lm's next)."""
        b: Any = self
        finish_reason = None
        b._num_tokens[row] += 1
        if b._num_tokens[row] >= b.max_tokens[row]:
            finish_reason = "length"
        if b._matchers[row].advance(token):
            finish_reason = "stop"
        return b.Response(
            uid=b.uids[row],
            token=token,
            logprobs=logprobs,
            finish_reason=finish_reason,
            prompt_cache=None,
            all_tokens=b.tokens[row] if finish_reason else None,
        )

    def extend(self, batch: Any) -> None:
        uids: list[int] = batch.uids
        free = sorted(self._freed)
        # (no live row: mlx-lm's filter drops them all and its extend takes the new caches, no copy)
        if len(self) and batch.uids and len(free) >= len(batch.uids) and self._fits(batch):
            self._place(free[: len(batch.uids)], batch)
        else:
            self.compact()
            super().extend(batch)  # type: ignore[no-untyped-call]
        if isinstance(batch, self.primed_type):  # its records' prompts' last tokens are still to be read
            self._priming.update(uids)

    def _fits(self, batch: Any) -> bool:
        """Whether ``batch``'s records can be put into free rows: every list one per row, and KV caches of
        mlx-lm's plain batch kind no longer than this batch's."""
        b: Any = self
        rows = len(b.uids)
        mine = (b.tokens, b.samplers, b.logits_processors, b.max_tokens, b.stop_sequences, b._next_logprobs)
        theirs = (batch.samplers, batch.logits_processors, batch._next_logprobs)
        return (
            all(len(x) == rows for x in mine)
            and all(len(x) == len(batch.uids) for x in theirs)
            and len(b.prompt_cache) == len(batch.prompt_cache) > 0
            and all(
                _plain_kv(c) and _plain_kv(o) and o._idx <= c._idx
                for c, o in zip(b.prompt_cache, batch.prompt_cache, strict=True)
            )
        )

    def _place(self, rows: list[int], batch: Any) -> None:
        """Put ``batch``'s records into the free ``rows``: each layer's keys and values right-justified
        at the write position (the positions before it masked as left padding), as mlx-lm's extend
        right-justifies them."""
        b: Any = self
        at = mx.array(rows)
        for c, o in zip(b.prompt_cache, batch.prompt_cache, strict=True):
            n, start = o._idx, c._idx - o._idx
            c.keys[at, :, start : c._idx, :] = o.keys[..., :n, :]
            c.values[at, :, start : c._idx, :] = o.values[..., :n, :]
            # fresh arrays: RoPE's table keeps the offsets array it last saw by identity
            offset, left = mx.array(c.offset), mx.array(c.left_padding)
            offset[at] = o.offset
            left[at] = o.left_padding + start
            c.offset, c.left_padding = offset, left
        tokens = mx.array(b._next_tokens)
        tokens[at] = batch._next_tokens.astype(tokens.dtype)
        b._next_tokens = tokens
        for j, i in enumerate(rows):
            del self._freed[i]
            for name in _PER_ROW:
                getattr(b, name)[i] = getattr(batch, name)[j]
        self._drop_common_padding()

    def _drop_common_padding(self) -> None:
        """Cut the positions that every record's row pads (mlx-lm's filter does it as rows leave): else
        each wave of records would lengthen every later step's attention."""
        b: Any = self
        padding = b.prompt_cache[0].left_padding.tolist()
        cut = min(p for p, uid in zip(padding, b.uids, strict=True) if uid is not None)
        if cut < self.PADDING_CUT:
            return
        for c in b.prompt_cache:
            c.keys, c.values = c.keys[..., cut:, :], c.values[..., cut:, :]
            c._idx -= cut
            c.left_padding = mx.maximum(c.left_padding - cut, 0)  # a free row's: masks nothing it needs
            c.offset = mx.minimum(c.offset, c._idx)  # a free row's position stays inside RoPE's table


# What a record keeps in each row of mlx-lm's decoding batch: moved into a free row when it joins.
_PER_ROW = (
    "uids",
    "tokens",
    "samplers",
    "logits_processors",
    "max_tokens",
    "stop_sequences",
    "_next_logprobs",
    "_token_context",
    "_num_tokens",
    "_matchers",
)


def _plain_kv(cache: Any) -> bool:
    """A KV cache of mlx-lm's plain batch kind, holding keys (rows can be copied into it)."""
    return type(cache) is BatchKVCache and cache.keys is not None


class _ArgmaxSteps(_Decoding):
    """mlx-lm's decoding batch, whose steps skip the log-softmax over the vocabulary while every row is
    greedy with no logits processor: the argmax of the logits is the argmax of the log-probabilities, and
    no event carries log-probabilities. Any other batch steps as mlx-lm's does."""

    argmax: Callable[[mx.array], mx.array] = staticmethod(greedy_argmax)  # the engine's (Batch sets it)

    def _only_argmax(self) -> bool:
        """Every row greedy with no logits processor: a step needs only the logits' argmax."""
        b: Any = self
        return (
            bool(b.samplers) and not any(b.logits_processors) and all(s is greedy_sampler for s in b.samplers)
        )

    def _step(self) -> tuple[list[int], list[mx.array]]:
        b: Any = self  # mlx-lm's attributes, typed loosely there
        if not GREEDY_ARGMAX or not self._only_argmax():
            return super()._step()
        # mlx-lm's GenerationBatch._step without the logsumexp, which costs a large part of a CPU step
        b._current_tokens = b._next_tokens
        b._current_logprobs = b._next_logprobs
        inputs = b._current_tokens
        b._next_tokens = self.argmax(self._logits(inputs))
        b._next_logprobs = [_NO_LOGPROBS] * len(b.uids)
        # mlx-lm's order: start computing the next step, then wait for this one's tokens
        mx.async_eval(b._next_tokens)  # type: ignore[no-untyped-call]
        mx.eval(inputs, b._current_logprobs)
        tokens: list[int] = inputs.tolist()
        for seen, token in zip(b.tokens, tokens, strict=True):
            seen.append(token)
        return tokens, b._current_logprobs

    def _logits(self, inputs: mx.array) -> mx.array:
        """The model's last logits for one token per row. Every layer's cache has the same positions (they
        step together): the CPU's RoPE gathers its rows once a step for the caches naming them alike
        (mlxpipe.cpu.layers.SAME_POSITIONS), not per layer."""
        b: Any = self
        same = object()
        for c in b.prompt_cache:
            c.same_positions = same
        try:
            logits: mx.array = b.model(inputs[:, None], cache=b.prompt_cache)[:, -1, :]
        finally:
            for c in b.prompt_cache:
                c.same_positions = None
        return logits


@functools.cache
def _greedy_batch() -> Any:
    """The batch every decoding row joins: mlx-lm's ``GenerationBatch`` with :class:`_TakenRows` and
    :class:`_ArgmaxSteps`, made on first use (``mlx_lm.generate`` imports transformers: only when
    batching)."""
    from mlx_lm.generate import GenerationBatch

    class _Greedy(_TakenRows, _ArgmaxSteps, GenerationBatch):
        primed_type = _prompt_batch()[1]

    return _Greedy


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
    context_bound: bool = False  # the model's context, not max_tokens, limits the answer


class Batch:
    """Records generating together through mlx-lm's ``BatchGenerator`` (continuous batching).

    :meth:`add` a record whenever a slot is free; :meth:`step` advances every record by one token and
    returns the events that produced, in the same form as :meth:`Engine.generate` (per record: chunks,
    then one done). Each record keeps its own detokenizer, sampler, stop strings, max tokens and counts.
    """

    def __init__(self, engine: Kit, size: int) -> None:
        self.engine = engine
        self.size = size
        from mlx_lm.generate import BatchGenerator  # imports transformers: only when batching

        from .dtype import accelerator

        if accelerator() is None:
            _tune_cpu_caches()

        self._eos = set(engine.tokenizer.eos_token_ids)
        self._gen = BatchGenerator(
            engine.model,
            stop_tokens=[[t] for t in sorted(self._eos)],
            completion_batch_size=size,
            prefill_batch_size=size,
            prefill_step_size=engine.prefill_step,
        )
        # Every decoding row joins this one batch (mlx-lm extends it), so its steps are _Greedy's; records
        # join it from _Prompts, their prompts' last tokens not yet read.
        self._gen._generation_batch = _greedy_batch().empty(engine.model, self._gen.sampler)
        self._gen._generation_batch.argmax = engine.argmax
        prompts = _prompt_batch()[0]
        self._gen._prompt_batch = prompts.empty(
            engine.model, self._gen.sampler, prefill_step_size=engine.prefill_step
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
            self._ready.extend(choose(self.engine, record, tokens))  # scored at once; no token to decode
            self._ready_records += 1
            return
        inserted = time.perf_counter()
        cached, cache = self.engine.prefix_for(record, tokens)
        budget, bound = self.engine.budget(record, tokens)
        (uid,) = self._gen.insert(
            [tokens[cached:]],
            max_tokens=[budget],
            caches=[cache] if cache is not None else None,
            all_tokens=[tokens[:cached]],  # logits processors see the whole prompt, as in sequential mode
            samplers=[self.engine.sampler_for(record)],
            logits_processors=[self.engine.processors_for(record)],
        )
        detokenizer = self.engine.tokenizer.detokenizer  # a fresh copy per record
        self._slots[uid] = _Slot(record, detokenizer, StopStrings(s.stop), len(tokens), inserted)
        self._slots[uid].context_bound = bound

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
                finalize_whole(slot.detokenizer)
            segment, finish = slot.stops.feed(slot.detokenizer.last_segment, finish)
            events.extend(self._emit(r.uid, slot, segment, finish, now))
            if finish is not None and r.finish_reason is None:
                ended.append(r.uid)  # a stop string ended it; BatchGenerator would go on
        if ended:
            self._remove(ended)
        return events

    def _remove(self, uids: list[int]) -> None:
        """Stop these records: their decoding rows freed in place, mlx-lm's remove for the rest."""
        found = set(self._gen._generation_batch.end(set(uids)))
        if rest := [uid for uid in uids if uid not in found]:
            self._gen.remove(rest)

    def interrupt(self) -> list[Chunk | Done | Error]:
        """End every record in flight as "interrupted", oldest first."""
        events = self._take_ready()
        now = time.perf_counter()
        self._remove(list(self._slots))
        for uid, slot in sorted(self._slots.items(), key=lambda item: item[1].record.index):
            finalize_whole(slot.detokenizer)
            segment, finish = slot.stops.feed(slot.detokenizer.last_segment, None)
            if finish is None:
                segment, finish = segment + slot.stops.flush(), "interrupted"
            events.extend(self._emit(uid, slot, segment, finish, now))
        self.close()
        return events

    def close(self) -> None:
        """Drop every record in flight and release the generator."""
        if self._slots:
            self._remove(list(self._slots))
            self._slots.clear()
        self._gen.close()

    def _emit(
        self, uid: int, slot: _Slot, segment: str, finish: str | None, now: float
    ) -> list[Chunk | Done | Error]:
        rec = slot.record
        tps = decode_tps(slot.tokens, slot.first, now)  # 0.0 for a first token: one token has no rate
        events: list[Chunk | Done | Error] = []
        if segment:
            slot.text.append(segment)
            events.append(Chunk(rec.index, rec.id, segment, slot.tokens, tps, rec.sample, rec.samples))
        if finish is not None:
            del self._slots[uid]
            if finish == "length" and slot.context_bound:
                finish = "context"
            try:
                extra = self.engine.finish_fields(rec, "".join(slot.text), finish)
            except RecordError as exc:
                events.append(Error.about(rec, str(exc)))
                return events
            events.append(
                Done(
                    index=rec.index,
                    id=rec.id,
                    text="".join(slot.text),
                    finish_reason=finish,
                    tokens=slot.tokens,
                    tps=tps,
                    prompt_tokens=slot.prompt_tokens,
                    prompt_tps=slot.prompt_tps,
                    peak_memory=int(mx.get_peak_memory()),
                    input=rec.input,
                    **extra,
                    sample=rec.sample,
                    samples=rec.samples,
                )
            )
        return events
