"""Structured output: answers held to a JSON schema, a list of choices, a regex or a Lark grammar.

A :class:`Constraint` is a grammar compiled (by llguidance) and checked when it is made, so a bad
one is found before any generation: a usage error on the command line, an error line for a record's
own ``json_schema`` or ``choices``. :class:`Grammars` is llguidance's view of one model's tokenizer;
it makes a :class:`Matcher` per record, which gives the allowed-token mask for each decoding step,
and checks a finished answer. This module uses llguidance and numpy only; the engine applies the
masks to the model's logits (it is the one module running mlx).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Mapping, Sequence
from copy import copy
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from .errors import ConstraintError

if TYPE_CHECKING:
    import llguidance
    import numpy as np
    from llguidance._lib import JsonCompileOptions


def _lg() -> Any:
    """llguidance (and numpy, which its bitmasks use), imported on first use: a run without a constraint
    starts without them."""
    import llguidance
    import llguidance.numpy

    return llguidance


# Compact JSON (no free whitespace): fewer tokens, and a small model cannot drift into endless
# newlines. A schema's own "x-guidance" options override these defaults.
_JSON_DEFAULTS: JsonCompileOptions = {"whitespace_flexible": False}


@dataclass(frozen=True)
class Constraint:
    """A compiled, validated grammar and what it was made from.

    ``kind`` is "json_schema", "choices", "regex" or "grammar"; ``grammar`` is llguidance's grammar
    text; ``labels`` holds the choices (empty for other kinds).
    """

    kind: str
    grammar: str
    labels: tuple[str, ...] = ()


class _Bytes:
    """A tokenizer of 256 one-byte tokens and an EOS, for llguidance: enough to learn, before any model is
    loaded, whether a grammar admits any answer at all (every model's tokenizer can spell any bytes)."""

    eos_token_id = 256
    bos_token_id = None
    tokens: ClassVar[list[bytes]] = [bytes([i]) for i in range(256)] + [b"</s>"]
    special_token_ids: ClassVar[list[int]] = [256]

    def __call__(self, data: bytes) -> list[int]:
        return list(data)


@functools.cache
def _byte_tokenizer() -> llguidance.LLTokenizer:
    tokenizer: llguidance.LLTokenizer = _lg().LLTokenizer(_lg().TokenizerWrapper(_Bytes()))
    return tokenizer


def _checked(kind: str, grammar: str, labels: tuple[str, ...] = ()) -> Constraint:
    problem = _lg().LLMatcher.validate_grammar(grammar)
    if problem:
        first = problem.strip().splitlines()[0].removeprefix("at 1(8): ")
        raise ConstraintError(f"invalid {kind.replace('_', ' ')}: {first}")
    # A grammar no answer satisfies ('[^\s\S]', a schema that is only a $ref loop): its matcher is stopped
    # in error before the first byte. Refused now, not after loading the model, record after record.
    tokenizer = _byte_tokenizer()
    probe = _lg().LLMatcher(tokenizer, grammar, log_level=0)
    if not probe.is_error():  # the first mask is where an empty grammar shows
        _lg().numpy.fill_next_token_bitmask(
            probe, _lg().numpy.allocate_token_bitmask(1, tokenizer.vocab_size)
        )
    if probe.is_error():
        raise ConstraintError(f"{kind.replace('_', ' ')} admits no answer: {_reason(probe.get_error())}")
    return Constraint(kind, grammar, labels)


def _reason(error: str) -> str:
    """llguidance's error, on one line: its first line, or what "stopped with no way on" means."""
    first = (error.strip().splitlines() or [""])[0].removeprefix("at 1(8): ")
    if not first or first.startswith(("NoExtension", "<state>")):
        return "nothing can match it"
    return first


@functools.lru_cache(maxsize=256)  # JSONL records often repeat one schema; compiling it once is enough
def _json_schema(text: str) -> Constraint:
    try:
        grammar = _lg().LLMatcher.grammar_from_json_schema(text, defaults=_JSON_DEFAULTS)
    except ValueError as exc:
        raise ConstraintError(f"invalid json schema: {exc}") from None
    return _checked("json_schema", grammar)


def json_schema(schema: Mapping[str, Any] | bool) -> Constraint:
    """A constraint from a JSON schema (a parsed object)."""
    if not isinstance(schema, (Mapping, bool)):
        raise ConstraintError("a json schema must be a JSON object")
    return _json_schema(json.dumps(schema))  # key order kept: it is the order of the answer's fields


def json_schema_argument(text: str) -> Constraint:
    """``--json-schema SCHEMA``: inline JSON when it starts with ``{``, else the name of a file holding it."""
    if text.lstrip().startswith("{"):
        source = text
    else:
        try:
            with open(text, encoding="utf-8") as f:
                source = f.read()
        except (OSError, UnicodeDecodeError) as exc:
            raise ConstraintError(f"cannot read json schema file {text}: {exc}") from None
    try:
        schema = json.loads(source)
    except json.JSONDecodeError as exc:
        raise ConstraintError(f"json schema is not valid JSON: {exc}") from None
    return json_schema(schema)


def choices(labels: Iterable[str]) -> Constraint:
    """A constraint whose answer is exactly one of ``labels``."""
    labels = tuple(labels)
    if not labels or not all(isinstance(x, str) and x for x in labels):
        raise ConstraintError("choices must be a non-empty list of non-empty strings")
    if len(set(labels)) != len(labels):
        raise ConstraintError("choices must not repeat a label")
    # JSON string escapes are valid Lark string literals (llguidance's own "choice" format does this).
    lark = "start: " + " | ".join(json.dumps(x) for x in labels)
    return _checked("choices", _lg().LLMatcher.grammar_from_lark(lark), labels)


def choices_argument(text: str) -> Constraint:
    """``--choices A,B,C``: comma-separated labels, surrounding spaces dropped."""
    return choices(x.strip() for x in text.split(","))


def regex(pattern: str) -> Constraint:
    """A constraint whose answer matches ``pattern`` as a whole (Rust regex syntax)."""
    return _checked("regex", _lg().LLMatcher.grammar_from_regex(pattern))


def lark_file(path: str) -> Constraint:
    """``--grammar FILE``: a Lark grammar (llguidance's dialect; the rule ``start`` is the answer)."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConstraintError(f"cannot read grammar file {path}: {exc}") from None
    return _checked("grammar", _lg().LLMatcher.grammar_from_lark(text))


RECORD_FIELDS = ("json_schema", "choices")
"""JSONL fields by which a record brings its own constraint (overriding the command line's)."""


def from_record(obj: Mapping[str, Any]) -> Constraint | None:
    """The constraint a JSONL record asks for in its own fields, or None; raise ConstraintError if bad."""
    present = [name for name in RECORD_FIELDS if name in obj]
    if len(present) > 1:
        raise ConstraintError("a record can have 'json_schema' or 'choices', not both")
    if "json_schema" in obj:
        value = obj["json_schema"]
        if not isinstance(value, dict):
            raise ConstraintError("'json_schema' must be a JSON object")
        return json_schema(value)
    if "choices" in obj:
        value = obj["choices"]
        if isinstance(value, str):
            return choices_argument(value)
        if not isinstance(value, list):
            raise ConstraintError("'choices' must be a list of strings")
        return choices(value)
    return None


# ---------------------------------------------------------------------------------------------
# Per model and per record


class Matcher:
    """One record's place in its grammar: feed it the tokens generated so far, ask which may come next."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int, eos: Sequence[int]) -> None:
        self._matcher = matcher
        self._bitmask = _lg().numpy.allocate_token_bitmask(1, vocab_size)
        self._eos = list(eos)

    def consume(self, tokens: Iterable[int]) -> None:
        """Advance past tokens that were sampled under this matcher's masks."""
        for token in tokens:
            self._matcher.consume_token(token)

    def mask(self, width: int) -> np.ndarray[Any, np.dtype[np.bool_]]:
        """Which of ``width`` logits may be sampled next: a bool array (EOS only once the grammar is done)."""
        import numpy as np

        allowed = np.zeros(width, dtype=np.bool_)
        if self._matcher.is_error():  # cannot happen with its own masks; end the answer, the check reports it
            allowed[[t for t in self._eos if t < width]] = True
            return allowed
        _lg().numpy.fill_next_token_bitmask(self._matcher, self._bitmask)
        # Bit i of 32-bit word j is token 32*j+i: little-endian bytes unpack in that order.
        bits = np.unpackbits(self._bitmask.astype("<i4", copy=False).view(np.uint8), bitorder="little")
        n = min(width, bits.size)
        allowed[:n] = bits[:n]
        return allowed


class Grammars:
    """llguidance's view of one model's tokenizer (built once, ~0.4 s); makes and checks per-record state.

    ``tokenizer`` is a Hugging Face fast tokenizer (what mlx-lm's wrapper holds), ``eos`` the ids that end
    generation.
    """

    def __init__(self, tokenizer: Any, eos: Iterable[int]) -> None:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise ConstraintError("structured output needs a fast (tokenizers-based) tokenizer")
        # What llguidance.hf.from_tokenizer does, without importing transformers (its import notice).
        backend = copy(backend)
        backend.no_padding()
        backend.no_truncation()
        self.eos = sorted(set(eos))
        self.tokenizer = _lg().LLTokenizer(backend.to_str(), eos_token=self.eos)

    def matcher(self, constraint: Constraint) -> Matcher:
        """A fresh matcher at the start of ``constraint``'s grammar."""
        m = _lg().LLMatcher(self.tokenizer, constraint.grammar, log_level=0)
        if m.is_error():
            raise ConstraintError(f"invalid {constraint.kind.replace('_', ' ')}: {m.get_error()}")
        return Matcher(m, self.tokenizer.vocab_size, self.eos)

    def complete(self, constraint: Constraint, text: str, finish_reason: str = "stop") -> bool:
        """Whether ``text`` is a whole answer of ``constraint``'s grammar (checked afresh from the text)."""
        return self.problem(constraint, text, finish_reason) is None

    def problem(self, constraint: Constraint, text: str, finish_reason: str) -> str | None:
        """Why ``text``, ended for ``finish_reason``, is not a whole answer of ``constraint``; None if it is.

        An answer cut by max tokens ("length") is whole only when the grammar is *stopped* there (nothing
        could follow): merely accepting (``-12`` of a number, which ``-12345`` continues) is not enough.
        Ended otherwise (EOS, a stop string, an interrupt), it is whole when the grammar accepts it.
        """
        m = _lg().LLMatcher(self.tokenizer, constraint.grammar, log_level=0)
        if not m.is_error():  # the first mask is where an empty grammar shows
            _lg().numpy.fill_next_token_bitmask(
                m, _lg().numpy.allocate_token_bitmask(1, self.tokenizer.vocab_size)
            )
        if m.is_error():  # no answer at all: say so, not "ended by a stop string"
            return f"{constraint.kind.replace('_', ' ')} admits no answer: {_reason(m.get_error())}"
        if not m.consume_tokens(self.tokenizer.tokenize_str(text)) or m.is_error():
            return "answer does not match the constraint"
        whole = m.is_accepting() and (finish_reason not in ("length", "context") or m.is_stopped())
        if whole:
            return None
        return INCOMPLETE.get(finish_reason, "answer incomplete")


INCOMPLETE = {
    "length": "answer incomplete: max tokens reached",
    "context": "answer incomplete: the model's context is full",
    "interrupted": "answer incomplete: interrupted",
    "stop": "answer incomplete: ended by a stop string or the end of the answer",
}


def finish(grammars: Grammars, constraint: Constraint, text: str, finish_reason: str) -> dict[str, Any]:
    """The done event's extra fields for a finished answer: ``json`` (and ``has_json``) for a JSON schema.

    Raises ConstraintError when ``text`` is not a complete answer (cut by max tokens, a stop string or
    an interrupt): such a record is an error line, never a partial answer passed off as done.
    """
    problem = grammars.problem(constraint, text, finish_reason)
    if problem is not None:
        raise ConstraintError(problem)
    if constraint.kind != "json_schema":
        return {}
    try:
        return {"json": json.loads(text), "has_json": True}
    except (json.JSONDecodeError, RecursionError) as exc:
        raise ConstraintError(f"answer is not valid JSON: {exc}") from None


def normalized(logprobs: Mapping[str, float]) -> dict[str, float]:
    """Softmax of per-label log probabilities: each label's share of the probability of all labels."""
    import numpy as np

    if not logprobs:
        return {}
    top = max(logprobs.values())
    if top == -np.inf:
        return {k: 1 / len(logprobs) for k in logprobs}
    weights = {k: float(np.exp(v - top)) for k, v in logprobs.items()}
    total = sum(weights.values())
    return {k: round(w / total, 6) for k, w in weights.items()}


__all__ = [
    "RECORD_FIELDS",
    "Constraint",
    "ConstraintError",
    "Grammars",
    "Matcher",
    "choices",
    "choices_argument",
    "finish",
    "from_record",
    "json_schema",
    "json_schema_argument",
    "lark_file",
    "normalized",
    "regex",
]
