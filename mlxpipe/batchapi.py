"""The OpenAI Batch API's JSONL, which vLLM's ``run-batch`` also reads and writes.

Input: a request line ``{"custom_id", "method": "POST", "url", "body"}`` (known by ``custom_id`` with
``body``, or every line with ``--in openai``) becomes the fields of an mlxpipe
JSONL record (:func:`request_fields`), so the reader's own checks apply to them. ``url`` is
``/v1/chat/completions`` (``body.messages``) or ``/v1/completions`` (``body.prompt``, sent without the chat
template). From ``body``: ``max_tokens`` / ``max_completion_tokens``, ``temperature``, ``top_p``, ``seed``,
``stop``, ``n`` (that many answers: the record's samples), ``response_format`` (``json_schema``: its schema;
``json_object``: any JSON object; ``text``). ``model`` is read and ignored (mlxpipe answers with the model it
loaded). Fields that change nothing (``user``, ``metadata``, ``store``, ``stream: false``, penalties of 0,
…) are ignored; any other field (``tools``, ``logit_bias``, …) makes the record an error naming it, never
silence.

Output: one Batch API output line per record (:func:`response_line`, :func:`error_line`); a record's samples
are the ``choices`` of its one line, its usage summed as OpenAI sums it (the prompt counted once).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from typing import Any

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"

_MAPPED = ("max_tokens", "temperature", "top_p", "seed", "stop", "n")
_IGNORED = {"model", "user", "metadata", "store", "service_tier", "stream_options", "parallel_tool_calls"}
# Fields accepted only at the value that changes nothing (an answer that differs would be silence).
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "stream": (False,),
    "logprobs": (False, None),
    "top_logprobs": (0, None),
    "frequency_penalty": (0,),
    "presence_penalty": (0,),
    "echo": (False,),
    "best_of": (1,),
    "tools": ([], None),
    "tool_choice": ("none", None),
    "logit_bias": ({}, None),
}


def is_request(obj: Mapping[str, Any]) -> bool:
    """Whether a JSONL object is a Batch API request line: it has ``custom_id`` and ``body`` (a record of
    mlxpipe's own never has a ``body``)."""
    return "custom_id" in obj and "body" in obj


def request_fields(obj: Mapping[str, Any]) -> tuple[dict[str, Any], bool]:
    """A request line → (an mlxpipe record's fields, whether the prompt is raw: ``/v1/completions``).

    Raise ``ValueError`` naming what is missing or not supported. The fields' values are checked by the
    reader, as any record's.
    """
    if "custom_id" not in obj:
        raise ValueError("an OpenAI batch request needs 'custom_id', 'method', 'url' and 'body'")
    fields: dict[str, Any] = {"id": obj["custom_id"]}
    method, url, body = obj.get("method", "POST"), obj.get("url"), obj.get("body")
    if method != "POST":
        raise ValueError(f"'method' {short(method)} is not supported: only POST")
    if url not in (CHAT_URL, COMPLETIONS_URL):
        raise ValueError(f"'url' {short(url)} is not supported: only {CHAT_URL} and {COMPLETIONS_URL}")
    if not isinstance(body, dict):
        raise ValueError("an OpenAI batch request needs 'body', a JSON object")
    for name, value in body.items():
        if name in ("messages", "prompt", "max_completion_tokens", "response_format", *_MAPPED, *_IGNORED):
            continue
        if name not in _NEUTRAL or value not in _NEUTRAL[name]:
            raise ValueError(f"'body.{name}' {short(value)} is not supported by mlxpipe")
    if url == CHAT_URL:
        fields["messages"] = _messages(body.get("messages"))
    else:
        fields["prompt"] = _prompt(body.get("prompt"))
    for name in _MAPPED:
        if body.get(name) is not None:
            fields[name] = body[name]
    if body.get("max_completion_tokens") is not None:
        fields["max_tokens"] = body["max_completion_tokens"]
    schema = _schema(body.get("response_format"))
    if schema is not None:
        fields["json_schema"] = schema
    return fields, url == COMPLETIONS_URL


def short(value: Any) -> str:
    """A JSON value on one short line, for messages."""
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= 40 else text[:39] + "…"


def _messages(value: Any) -> list[dict[str, Any]]:
    """``body.messages``, with content given as a list of text parts joined into one string."""
    if not isinstance(value, list):
        raise ValueError(f"a {CHAT_URL} request needs 'body.messages' (a list)")
    out = []
    for m in value:
        if isinstance(m, dict) and isinstance(m.get("content"), list):
            parts = m["content"]
            if not all(isinstance(p, dict) and p.get("type") == "text" for p in parts):
                raise ValueError("message content other than text parts is not supported by mlxpipe")
            m = {**m, "content": "".join(str(p.get("text", "")) for p in parts)}
        if isinstance(m, dict) and m.get("role") == "developer":  # OpenAI's newer name for the system role
            m = {**m, "role": "system"}
        out.append(m)
    return out


def _prompt(value: Any) -> Any:
    if isinstance(value, list) and len(value) == 1:  # a batch of one prompt; more would need several answers
        value = value[0]
    if isinstance(value, list):
        raise ValueError(
            "'body.prompt' as a list of several prompts is not supported: one request, one prompt"
        )
    return value


def _schema(value: Any) -> Any:
    """``response_format`` → a JSON schema, or None for plain text."""
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise ValueError("'response_format.json_schema' must be an object with a 'schema'")
        return spec["schema"]
    raise ValueError(
        f"'body.response_format' {short(value)} is not supported: text, json_object, json_schema"
    )


# Output ----------------------------------------------------------------------------------------------


def _finish(reason: str) -> str:
    return "stop" if reason == "stop" else "length"  # "length" and "context": the answer was cut short


def response_line(answers: Sequence[Any], model: str, number: int) -> dict[str, Any]:
    """A Batch API output line for a record's ``Done`` events, one per sample in sample order, whose
    ``input`` was a request line (``number``: a number making ids unique in the run). None of their
    ``finish_reason`` may be "interrupted"."""
    first = answers[0]
    request = first.input if isinstance(first.input, dict) else {}
    chat = request.get("url", CHAT_URL) == CHAT_URL
    choices = []
    for index, done in enumerate(answers):
        choice: dict[str, Any] = {
            "index": index,
            "finish_reason": _finish(done.finish_reason),
            "logprobs": None,
        }
        if chat:
            choice["message"] = {"role": "assistant", "content": done.text}
        else:
            choice["text"] = done.text
        choices.append(choice)
    tokens = sum(done.tokens for done in answers)
    stamp = f"{int(time.time() * 1000):x}_{number}"
    mine: dict[str, Any] = {
        "tps": round(_decode_tps(answers), 3),
        "prompt_tps": round(first.prompt_tps, 3),
        "peak_memory": max(done.peak_memory for done in answers),
        "finish_reason": first.finish_reason,
    }
    if len(answers) > 1:
        mine["finish_reasons"] = [done.finish_reason for done in answers]
    body = {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-mlxpipe-{stamp}",
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": {
            "prompt_tokens": first.prompt_tokens,  # one prompt, however many answers
            "completion_tokens": tokens,
            "total_tokens": first.prompt_tokens + tokens,
        },
        "mlxpipe": mine,
    }
    response = {"status_code": 200, "request_id": f"req-mlxpipe-{stamp}", "body": body}
    return {"id": f"batch_req_mlxpipe_{stamp}", "custom_id": first.id, "response": response, "error": None}


def _decode_tps(answers: Sequence[Any]) -> float:
    """The answers' decode rate together: their tokens after the first over their time (one answer's own
    ``tps``)."""
    if len(answers) == 1:
        return float(answers[0].tps)
    timed = [done for done in answers if done.tps > 0]
    seconds = sum((done.tokens - 1) / done.tps for done in timed)
    return sum(done.tokens - 1 for done in timed) / seconds if seconds > 0 else 0.0


def error_line(custom_id: Any, code: str, message: str, number: int) -> dict[str, Any]:
    """A Batch API output line for a record that failed."""
    stamp = f"{int(time.time() * 1000):x}_{number}"
    error = {"code": code, "message": message}
    return {"id": f"batch_req_mlxpipe_{stamp}", "custom_id": custom_id, "response": None, "error": error}
