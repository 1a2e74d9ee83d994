"""A record → its prompt tokens: the chat template, the system prompt, the checks against the context.

Also the probe that finds where a record's own text begins (:meth:`Prompts.shared_head`), so the part before
it can be computed once and shared (:mod:`.prefix`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from ..errors import RecordError
from ..records import Record

__all__ = ["Prompts", "common_prefix"]

_PROBES = ("\ue000", "\ue001")  # private-use characters: no prompt's own text tokenizes like them
_PROBED_ENTRIES = 64  # distinct record shapes (system prompt, template, earlier messages) remembered


class Prompts:
    """Encodes records for one tokenizer and context length."""

    def __init__(self, tokenizer: Any, context_length: int) -> None:
        self.tokenizer = tokenizer
        self.context_length = context_length
        self._probed: OrderedDict[Any, tuple[int, ...]] = OrderedDict()

    def encode(self, record: Record) -> list[int]:
        """The prompt tokens for ``record``: chat template applied unless ``raw`` or the model has none.

        Raises :class:`RecordError` when the record cannot fit the model's context.
        """
        n = record.settings.max_tokens
        if self.context_length and n > self.context_length:
            raise RecordError(
                f"'max_tokens' is {n}, more than the model's context of {self.context_length} tokens"
            )
        return self._checked(self.tokens(record))

    def tokens(self, record: Record, content: str | None = None) -> list[int]:
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

    def shared_head(self, record: Record) -> tuple[int, ...]:
        """The tokens every record like ``record`` starts with, whatever its own text: the chat template's
        opening, the system prompt, earlier messages and ``record.lead``.

        Found by rendering the record with two different probe texts in place of its own and taking the
        common tokens (so BPE merges at the boundary are respected).
        """
        s = record.settings
        messages = tuple(tuple(sorted(m.items())) for m in record.messages[:-1]) if record.messages else None
        key = (s.system, s.raw, repr(sorted(s.chat_template_args.items())), record.lead, messages)
        found = self._probed.get(key)
        if found is None:
            try:
                a, b = (self.tokens(record, record.lead + p) for p in _PROBES)
            except RecordError:
                a = b = []
            found = tuple(a[: common_prefix(a, b)])
            self._probed[key] = found
            if len(self._probed) > _PROBED_ENTRIES:
                self._probed.popitem(last=False)
        return found


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n
