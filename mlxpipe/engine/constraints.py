"""Structured output on the engine's side: llguidance (:mod:`mlxpipe.constrain`) decides which tokens are
allowed; here a record's constraint becomes a matcher for its token mask, and a finished answer is checked."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..errors import ConstraintError, RecordError
from ..records import Record

if TYPE_CHECKING:
    from ..constrain import Grammars, Matcher

__all__ = ["Constraints"]


class Constraints:
    """One tokenizer's constraint machinery, built on first use (llguidance is imported only then)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._grammars: Grammars | None = None

    @property
    def grammars(self) -> Grammars:
        """llguidance's view of the tokenizer."""
        if self._grammars is None:
            from ..constrain import Grammars

            try:
                self._grammars = Grammars(
                    getattr(self.tokenizer, "_tokenizer", self.tokenizer), self.tokenizer.eos_token_ids
                )
            except ConstraintError as exc:
                raise RecordError(str(exc)) from None
        return self._grammars

    def matcher(self, record: Record) -> Matcher | None:
        """A fresh matcher for ``record``'s constraint (None without one); raises :class:`RecordError`."""
        constraint = record.settings.constraint
        if constraint is None:
            return None
        try:
            return self.grammars.matcher(constraint)
        except ConstraintError as exc:
            raise RecordError(str(exc)) from None

    def finish_fields(self, record: Record, text: str, finish_reason: str) -> dict[str, Any]:
        """Extra done fields for a finished answer under ``record``'s constraint ({} without one): ``json``
        for a JSON schema. Raises :class:`RecordError` when the answer is incomplete (max tokens, a stop
        string, an interrupt)."""
        from .. import constrain

        constraint = record.settings.constraint
        if constraint is None:
            return {}
        try:
            return constrain.finish(self.grammars, constraint, text, finish_reason)
        except ConstraintError as exc:
            raise RecordError(str(exc)) from None
