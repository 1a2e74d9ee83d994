"""A model folder's tokenizer without transformers: ``tokenizer.json`` read by ``tokenizers``, the chat
template rendered with jinja2 the way transformers renders it, and mlx-lm's streaming detokenizers.

Importing transformers takes most of a second (mlx-lm's own loader does); this covers the folders whose
tokenizer is a plain ``PreTrainedTokenizerFast`` (what mlxpipe's GGUF conversions write) and answers as
mlx-lm's ``TokenizerWrapper`` does (tests/test_tokenizer.py compares them). :func:`load` returns None for any
other folder, and a conversation this renderer does not cover goes to transformers' own (imported then).
"""

from __future__ import annotations

import codecs
import copy
import itertools
import json
import re
from collections.abc import Sequence
from datetime import datetime
from functools import cache
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

__all__ = ["FastTokenizer", "finalize_whole", "load"]

_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_THINK_PAIRS = (
    ("<think>", "</think>"),
    ("<longcat_think>", "</longcat_think>"),
    ("<|think:start|>", "<|think:end|>"),
)
# Vocabularies whose thinking marks are several tokens (mlx-lm encodes them): left to mlx-lm's wrapper.
_MULTI_TOKEN_THINKING = (("<|channel>", "<channel|>"), ("<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"))
# Message fields transformers renames before rendering (reasoning under its several names): left to it.
_REASONING = ("reasoning_content", "thinking", "reasoning")
_PLAIN = (str, int, float, bool, type(None))


def load(folder: str, eos_token_ids: Sequence[int] = ()) -> FastTokenizer | None:
    """The tokenizer of ``folder`` when this module covers it (see the module's docstring), else None.

    ``eos_token_ids``: the model config's, as mlx-lm's loader passes them.
    """
    root = Path(folder)
    try:
        config = json.loads((root / "tokenizer_config.json").read_text(encoding="utf-8"))
        backend = Tokenizer.from_file(str(root / "tokenizer.json"))
        # The decoder as tokenizer.json spells it (what mlx-lm picks the detokenizer by), without reading
        # the whole file's JSON in Python.
        decoder = json.loads(backend.decoder.__getstate__()) if backend.decoder is not None else None
    except Exception:  # unreadable or not ours (tokenizers raises plain Exceptions): mlx-lm's loader says why
        return None
    template = config.get("chat_template")
    if (
        not isinstance(config, dict)
        or config.get("tokenizer_class") != "PreTrainedTokenizerFast"
        or any(
            k in config
            for k in ("auto_map", "chat_template_type", "tool_parser_type", "added_tokens_decoder")
        )
        or config.get("add_eos_token")
        or not isinstance(template, str | None)
        or (template is not None and re.search(r"\{%-?\s*generation\s*-?%\}", template))
        or any(
            (root / name).exists()
            for name in ("chat_template.jinja", "chat_template.json", "special_tokens_map.json")
        )
    ):
        return None
    specials = {k: _content(config[k]) or "" for k in _SPECIAL_KEYS if config.get(k) is not None}
    if any(backend.token_to_id(v) is None for v in specials.values()):
        return None
    if any(all(backend.token_to_id(t) is not None for t in marks) for marks in _MULTI_TOKEN_THINKING):
        return None
    return FastTokenizer(backend, decoder, specials, template, eos_token_ids, root)


def _content(token: Any) -> str | None:
    if isinstance(token, str):
        return token
    if isinstance(token, dict) and isinstance(token.get("content"), str):
        return str(token["content"])
    return None


class FastTokenizer:
    """What mlxpipe asks of mlx-lm's ``TokenizerWrapper``, from ``tokenizers`` and jinja2 alone."""

    def __init__(
        self,
        backend: Tokenizer,
        decoder: Any,
        specials: dict[str, str],
        template: str | None,
        eos_token_ids: Sequence[int],
        folder: Path,
    ) -> None:
        self.backend_tokenizer = backend
        self.specials = specials
        self.chat_template = template
        self.has_chat_template = template is not None
        self.bos_token = specials.get("bos_token")
        self.eos_token = specials.get("eos_token")
        self.model_max_length = 0  # set by the engine; kept for the wrapper's interface
        self.eos_token_ids = set(eos_token_ids)
        if self.eos_token is not None:
            self.eos_token_ids.add(backend.token_to_id(self.eos_token) or 0)  # (load checked it is there)
        # As mlx-lm: a template is told whether thinking is on, on when the vocabulary has its marks.
        self.has_thinking = any(all(backend.token_to_id(t) is not None for t in p) for p in _THINK_PAIRS)
        self._folder = folder
        self._detokenizer = _detokenizer_for(decoder, self)
        self._full: Any = None

    def __len__(self) -> int:
        return int(self.backend_tokenizer.get_vocab_size(with_added_tokens=True))

    def get_vocab(self) -> dict[str, int]:
        """Every token's id, added tokens included."""
        return dict(self.backend_tokenizer.get_vocab(with_added_tokens=True))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """``text``'s token ids (the post-processor's BOS with ``add_special_tokens``)."""
        return list(self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """The text of ``ids``."""
        return str(self.backend_tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        """Each id's token string (as the vocabulary spells it)."""
        return [self.backend_tokenizer.id_to_token(i) or "" for i in ids]

    @property
    def detokenizer(self) -> Any:
        """A fresh streaming detokenizer (mlx-lm's kind for this decoder)."""
        detokenizer = copy.copy(self._detokenizer)
        detokenizer.reset()
        return detokenizer

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = False,
        tokenize: bool = True,
        **kwargs: Any,
    ) -> Any:
        """The conversation rendered by the chat template (and tokenized), as mlx-lm's wrapper renders it."""
        kwargs.setdefault("enable_thinking", self.has_thinking)
        if self.chat_template is None or not _plain(messages) or not _plain(kwargs):
            return self._transformers().apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tokenize=tokenize, **kwargs
            )
        if any(m.get(k) is not None for m in messages for k in _REASONING):
            return self._transformers().apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tokenize=tokenize, **kwargs
            )
        text = _compiled(self.chat_template).render(
            messages=messages,
            tools=None,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **{**self.specials, **kwargs},
        )
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def _transformers(self) -> Any:
        """mlx-lm's wrapper of transformers' tokenizer for this folder (imported on first need)."""
        if self._full is None:
            from mlx_lm.utils import load_tokenizer

            self._full = load_tokenizer(self._folder, eos_token_ids=sorted(self.eos_token_ids))
            self._full.model_max_length = self.model_max_length  # the engine's: no warning of its own
        return self._full


def _plain(value: Any) -> bool:
    """Whether ``value`` is plain JSON data (what transformers passes a template unchanged)."""
    if type(value) in _PLAIN:
        return True
    if type(value) is dict:
        return all(type(k) is str and _plain(v) for k, v in value.items())
    if type(value) is list:
        return all(_plain(v) for v in value)
    return False


@cache
def _compiled(template: str) -> jinja2.Template:
    """``template`` compiled in the environment transformers renders chat templates in."""

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        x: Any,
        ensure_ascii: bool = False,
        indent: Any = None,
        separators: Any = None,
        sort_keys: bool = False,
    ) -> str:
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def strftime_now(format: str) -> str:
        return datetime.now().strftime(format)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(template)


# Streaming detokenizers: mlx-lm's (mlx_lm/tokenizer_utils.py), which that module cannot be imported for.


class _Detokenizer:
    text: str
    tokens: list[int]
    offset: int

    def reset(self) -> None:
        self.offset = 0
        self.text = ""
        self.tokens = []

    def add_token(self, token: int) -> None:
        raise NotImplementedError

    def finalize(self) -> None:
        raise NotImplementedError

    @property
    def last_segment(self) -> str:
        """The text since the last time this was read."""
        text = self.text
        segment = text[self.offset :]
        self.offset = len(text)
        return segment


class _Naive(_Detokenizer):
    """mlx-lm's ``NaiveStreamingDetokenizer``: decodes the tokens since the last line break."""

    def __init__(self, tokenizer: FastTokenizer) -> None:
        self._tokenizer = tokenizer
        probe = tokenizer.encode("a ,b", add_special_tokens=False)
        self._clean_spaces = " ," not in tokenizer.decode(probe)
        self.reset()

    def reset(self) -> None:
        self.offset = 0
        self.tokens = []
        self._text = ""
        self._current_tokens: list[int] = []
        self._current_text = ""

    def add_token(self, token: int) -> None:
        self._current_tokens.append(token)
        self.tokens.append(token)

    def finalize(self) -> None:
        self._text += self._tokenizer.decode(self._current_tokens)
        self._current_tokens = []
        self._current_text = ""

    @property
    def text(self) -> str:  # type: ignore[override]
        if self._current_tokens:
            self._current_text = self._tokenizer.decode(self._current_tokens)
            if self._current_text.endswith("\ufffd"):  # an incomplete character: maybe several replacements
                self._current_text = self._current_text.rstrip("\ufffd")
            elif self._clean_spaces and self._current_text and self._current_text[-1] == " ":
                self._current_text = self._current_text[:-1]
        if self._current_text and self._current_text[-1] == "\n":
            self._text += self._current_text
            self._current_tokens.clear()
            self._current_text = ""
        return self._text + self._current_text


class _SentencePiece(_Detokenizer):
    """mlx-lm's ``SPMStreamingDetokenizer``: ``\u2581`` is a space, ``<0xXX>`` a byte."""

    _sep = "\u2581".encode()

    def __init__(self, tokenizer: FastTokenizer, trim_space: bool = True) -> None:
        self.trim_space = trim_space
        self._token = tokenizer.backend_tokenizer.id_to_token  # looked up per token, not mapped up front
        self.reset()

    def _bytes(self, token: int) -> bytes:
        t = self._token(token) or ""
        return bytes([int(t[3:5], 16)]) if t.startswith("<0x") else t.encode()  # byte tokens: their hex

    def reset(self) -> None:
        self.offset = 0
        self._unflushed = b""
        self.text = ""
        self.tokens = []

    def _try_flush(self, force: bool = False) -> None:
        text = self._unflushed.replace(self._sep, b" ").decode("utf-8", "replace")
        if not force and text.endswith("\ufffd"):
            return
        if not self.text and self.trim_space and text and text[0] == " ":
            text = text[1:]
        self.text += text
        self._unflushed = b""

    def add_token(self, token: int) -> None:
        self.tokens.append(token)
        self._unflushed += self._bytes(token)
        self._try_flush()

    def finalize(self) -> None:
        self._try_flush(force=True)
        self._unflushed = b""


@cache
def _byte_decoder() -> dict[str, int]:
    """GPT-2's printable stand-ins for bytes → the bytes."""
    char_to_bytes = {}
    limits = [0, ord("!"), ord("~") + 1, ord("¡"), ord("¬") + 1, ord("®"), ord("ÿ") + 1]
    n = 0
    for i, (start, stop) in enumerate(itertools.pairwise(limits)):
        if i % 2 == 0:
            for b in range(start, stop):
                char_to_bytes[chr(2**8 + n)] = b
                n += 1
        else:
            for b in range(start, stop):
                char_to_bytes[chr(b)] = b
    return char_to_bytes


class _BytePairs(_Detokenizer):
    """mlx-lm's ``BPEStreamingDetokenizer``: byte-level BPE, text released once its UTF-8 is whole."""

    def __init__(self, tokenizer: FastTokenizer) -> None:
        self._token = tokenizer.backend_tokenizer.id_to_token  # looked up per token, not mapped up front
        self._size = len(tokenizer)
        self.reset()

    def reset(self) -> None:
        self.offset = 0
        self._unflushed = ""
        self.text = ""
        self.tokens = []

    def _decode_bytes(self, seq: str) -> str:
        byte_decoder = _byte_decoder()
        barr = bytearray()
        for c in seq:
            res = byte_decoder.get(c, False)
            if res:
                barr.append(res)
            else:
                barr.extend(bytes(c, "utf-8"))
        return barr.decode("utf-8", "replace")

    def _maybe_trim_space(self, current_text: str) -> str:
        if len(current_text) == 0 or current_text[0] != " ":
            return current_text
        if not self.text:
            return current_text[1:]
        return current_text

    def add_token(self, token: int) -> None:
        self.tokens.append(token)
        v = (self._token(token) or "") if token < self._size else "!"  # (mlx-lm's padded-vocabulary case)
        self._unflushed += v
        text = self._decode_bytes(self._unflushed)
        # Multi-byte characters wait until whole; a lone space waits for the next token.
        if not text.endswith("\ufffd") and not (len(v) == 1 and _byte_decoder().get(v[0]) == 32):
            self.text += self._maybe_trim_space(text)
            self._unflushed = ""

    def finalize(self) -> None:
        byte_decoder = _byte_decoder()
        current_text = bytearray(byte_decoder[c] for c in self._unflushed).decode("utf-8", "replace")
        self.text += self._maybe_trim_space(current_text)
        self._unflushed = ""


def _unfinished(data: bytes) -> int:
    """How many bytes at the end of ``data`` begin a UTF-8 character they do not finish (0 to 3)."""
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    decoder.decode(data[-4:], final=False)  # a character is at most 4 bytes: the tail decides
    return len(decoder.getstate()[0])


def finalize_whole(detokenizer: Any) -> None:
    """``detokenizer.finalize()``, less the bytes of a character the answer stopped in the middle of.

    mlx-lm's detokenizers (ours are copies) decode what is left with "replace", so an answer cut by max
    tokens, an interrupt or the end inside a multi-byte character ended in U+FFFD. Here those bytes are
    dropped first: the text ends at the last whole character. Works on mlx-lm's own detokenizers too.
    """
    unflushed = getattr(detokenizer, "_unflushed", None)
    if isinstance(unflushed, bytes) and unflushed:  # SentencePiece: the bytes themselves
        if cut := _unfinished(unflushed):
            detokenizer._unflushed = unflushed[:-cut]
    elif isinstance(unflushed, str) and unflushed:  # byte-level BPE: one stand-in character a byte
        stand_in = _byte_decoder()
        data = bytes(stand_in.get(c, 0x20) for c in unflushed[-4:])  # (an added token's text: whole)
        if cut := _unfinished(data):
            detokenizer._unflushed = unflushed[:-cut]
    elif getattr(detokenizer, "_current_tokens", None):  # naive: whole tokens, decoded by the tokenizer
        decode = detokenizer._tokenizer.decode
        tokens = detokenizer._current_tokens
        while tokens and decode(tokens).endswith("\ufffd"):
            tokens.pop()  # a token of bytes that make no character yet
    detokenizer.finalize()


_SPM = [
    {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
    {"type": "ByteFallback"},
    {"type": "Fuse"},
]


def _detokenizer_for(decoder: Any, tokenizer: FastTokenizer) -> _Detokenizer:
    """mlx-lm's choice of streaming detokenizer for a ``tokenizer.json`` ``decoder``."""
    if decoder == {
        "type": "Sequence",
        "decoders": [*_SPM, {"type": "Strip", "content": " ", "start": 1, "stop": 0}],
    }:
        return _SentencePiece(tokenizer)
    if decoder == {"type": "Sequence", "decoders": _SPM}:
        return _SentencePiece(tokenizer, trim_space=False)
    if isinstance(decoder, dict) and decoder.get("type") == "ByteLevel":
        return _BytePairs(tokenizer)
    return _Naive(tokenizer)
