"""The engine: the only module that runs mlx-lm. It turns records into typed events.

Layering follows mlx-lm's own: ``stream_generate`` yields token-level responses; :meth:`Engine.generate`
adds what a pipe needs on top (chat templates, per-record sampling and seeds, stop strings held back
until decided, interruption) and yields :mod:`mlxpipe.events`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import mlx.core as mx
import mlx_lm
from mlx_lm.generate import TextStateMachine
from mlx_lm.sample_utils import make_logits_processors, make_sampler

from . import models
from .events import Chunk, Done
from .io import Record


class RecordError(ValueError):
    """A record that this model cannot answer (too long, no chat template, …): an error line, not a crash."""


def _never() -> bool:
    return False


class Engine:
    """A loaded model and tokenizer, ready to answer records one after another."""

    def __init__(self, model: Any, tokenizer: Any, source: models.ModelSource, folder: str) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.source = source
        self.folder = folder
        self.context_length = int(models.describe(source, folder).get("context_length") or 0)

    @classmethod
    def load(cls, spec: str | None = None) -> Engine:
        """Resolve ``spec`` (see :func:`mlxpipe.models.resolve`) and load it, or raise ``ModelError``."""
        source = models.resolve(spec)
        folder = models.materialize(source)
        try:
            loaded = mlx_lm.load(folder)  # typed as a 2- or 3-tuple (return_config); we ask for two
            model, tokenizer = loaded[0], loaded[1]
        except Exception as exc:  # mlx-lm and huggingface_hub raise many kinds; the user needs one line
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise models.ModelError(f"cannot load model {source.spec!r}: {first}") from None
        return cls(model, tokenizer, source, folder)

    def info(self) -> dict[str, Any]:
        """What ``--model-info`` prints: the model's description plus the compute device."""
        info = models.describe(self.source, self.folder)
        info["device"] = str(mx.default_device())
        return info

    # -----------------------------------------------------------------------------------------

    def encode(self, record: Record) -> list[int]:
        """The prompt tokens for ``record``: chat template applied unless ``raw`` or the model has none."""
        s = record.settings
        tok = self.tokenizer
        use_template = tok.has_chat_template and not s.raw
        if record.messages is not None:
            if not use_template:
                raise RecordError("'messages' need a chat template (the model has none, or --raw was given)")
            messages = [dict(m) for m in record.messages]
        elif use_template:
            messages = [{"role": "user", "content": record.prompt or ""}]
        else:
            prompt = record.prompt or ""
            tokens: list[int] = tok.encode(
                prompt, add_special_tokens=tok.bos_token is None or not prompt.startswith(tok.bos_token)
            )
            return self._checked(tokens)
        if s.system is not None and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": s.system})
        try:
            tokens = tok.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, **dict(s.chat_template_args)
            )
        except Exception as exc:  # jinja errors from the model's own template
            raise RecordError(f"chat template failed: {exc}") from None
        return self._checked(list(tokens))

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
    def sampler_for(self, record: Record) -> Callable[[Any], Any]:
        """mlx-lm's sampler for ``record``'s settings."""
        s = record.settings
        return make_sampler(temp=s.temperature, top_p=s.top_p, min_p=s.min_p, top_k=s.top_k)

    def processors_for(self, record: Record) -> list[Callable[[Any, Any], Any]]:
        """mlx-lm logits processors for ``record`` (repetition penalty; later, constraints)."""
        return list(make_logits_processors(repetition_penalty=record.settings.repetition_penalty))

    def generate(self, record: Record, should_stop: Callable[[], bool] = _never) -> Iterator[Chunk | Done]:
        """Stream one record: zero or more :class:`Chunk` events, then exactly one :class:`Done`.

        Raises :class:`RecordError` before the first event when the record cannot be answered.
        ``should_stop`` is polled once per token; when it turns true the record ends as "interrupted".
        """
        s = record.settings
        tokens = self.encode(record)
        if s.seed is not None:
            mx.random.seed(s.seed)  # per record, so an answer does not depend on its position in the input
        stops = StopStrings(s.stop)
        text: list[str] = []
        responses = mlx_lm.stream_generate(
            self.model,
            self.tokenizer,
            tokens,
            max_tokens=s.max_tokens,
            sampler=self.sampler_for(record),
            logits_processors=self.processors_for(record),
        )
        try:
            for r in responses:
                segment, finish = stops.feed(r.text, r.finish_reason)
                if finish is None and should_stop():
                    segment, finish = segment + stops.flush(), "interrupted"
                if segment:
                    text.append(segment)
                    yield Chunk(record.index, record.id, segment, r.generation_tokens, r.generation_tps)
                if finish is not None:
                    yield Done(
                        record.index,
                        record.id,
                        "".join(text),
                        finish,
                        r.generation_tokens,
                        r.generation_tps,
                        r.prompt_tokens,
                        r.prompt_tps,
                        int(r.peak_memory * 1e9),
                        record.input,
                    )
                    return
        finally:
            responses.close()  # ends generation at once when our consumer stops early


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
