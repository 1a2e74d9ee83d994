"""Fast tests of the reader, templates, the pipeline and rendering (fake engine, no model)."""

from __future__ import annotations

import io as stdio
import json

import pytest

from mlxpipe import cli
from mlxpipe.cli.render import Renderer
from mlxpipe.errors import UsageError
from mlxpipe.events import Chunk, Done, Error
from mlxpipe.pipeline import run
from mlxpipe.reader import InputFormat, RecordReader
from mlxpipe.records import BadRecord, Record, Settings, Template


def read(data: bytes, **fmt) -> list[Record | BadRecord]:
    return list(RecordReader(InputFormat(**fmt), Settings()).read("in.txt", stdio.BytesIO(data)))


def test_lines_strip_newline_and_cr_and_skip_blank_lines_but_count_them() -> None:
    recs = read(b"first\r\n\n   \nsecond\nlast without newline")
    assert [(r.prompt, r.line, r.index) for r in recs] == [
        ("first", 1, 1),
        ("second", 4, 2),
        ("last without newline", 5, 3),
    ]


def test_nul_separated_records_keep_newlines() -> None:
    recs = read(b"one\ntwo\0three\0", null=True)
    assert [r.prompt for r in recs] == ["one\ntwo", "three"]


def test_jsonl_fields_ids_and_per_record_settings() -> None:
    data = b"\n".join(
        [
            json.dumps({"id": "a", "prompt": "p", "max_tokens": 5, "temperature": 0.5, "stop": "x"}).encode(),
            json.dumps("bare string").encode(),
            json.dumps({"messages": [{"role": "user", "content": "hi"}], "system": "be brief"}).encode(),
            b'{"question": "q"}',
        ]
    )
    a, b, c, d = read(data, jsonl=True)
    assert isinstance(a, Record) and a.id == "a" and a.settings.max_tokens == 5
    assert a.settings.temperature == 0.5 and a.settings.stop == ("x",)
    assert isinstance(b, Record) and b.prompt == "bare string" and b.id == 2 and b.input == "bare string"
    assert isinstance(c, Record) and c.messages and c.settings.system == "be brief"
    assert isinstance(d, BadRecord) and d.line == 4 and "'prompt'" in d.error


def test_prompt_key() -> None:
    (rec,) = read(b'{"question": "why?"}\n', jsonl=True, prompt_key="question")
    assert isinstance(rec, Record) and rec.prompt == "why?"


@pytest.mark.parametrize(
    ("line", "needle"),
    [
        (b'{"prompt": ', "invalid json"),
        (b"[1, 2]", "not an array"),
        (b'{"prompt": 3}', "must be a string"),
        (b'{"prompt": "p", "max_tokens": 0}', "max_tokens"),
        (b'{"prompt": "p", "temperature": "hot"}', "temperature"),
        (b'{"prompt": "p", "stop": [1]}', "stop"),
        (b'{"messages": "hi"}', "messages"),
        (b'{"prompt": "\xff"}', "utf-8"),
    ],
)
def test_bad_jsonl_records_become_errors_naming_the_line(line: bytes, needle: str) -> None:
    recs = read(b'"good"\n' + line + b'\n"good again"\n', jsonl=True)
    assert [type(r).__name__ for r in recs] == ["Record", "BadRecord", "Record"]
    bad = recs[1]
    assert isinstance(bad, BadRecord) and bad.line == 2 and bad.file == "in.txt"
    assert needle in bad.error.lower()


def test_template_fills_fields_and_keeps_double_braces_literal() -> None:
    t = Template.parse("Classify {text} as {{json}} for {n}")
    assert t.render({"text": "this", "n": 3}) == "Classify this as {json} for 3"
    (rec,) = read(b'{"text": "abc"}\n', jsonl=True, template=Template.parse("Say {text}"))
    assert isinstance(rec, Record) and rec.prompt == "Say abc"
    (missing,) = read(b'{"other": 1}\n', jsonl=True, template=Template.parse("Say {text}"))
    assert isinstance(missing, BadRecord) and "'text'" in missing.error


@pytest.mark.parametrize("bad", ["{x.__class__}", "{x[0]}", "{x!r}", "{x:>10}", "{", "{0}", "{}"])
def test_template_allows_only_plain_names(bad: str) -> None:
    with pytest.raises(UsageError):
        Template.parse(bad)


def test_pipeline_gives_one_final_event_per_record_in_order(fake_engine) -> None:
    fake_engine.enqueue(["one two", "three"])
    recs = read(b'"a"\nnot json\n"b"\n', jsonl=True)
    events = list(run(recs, fake_engine))
    finals = [e for e in events if isinstance(e, (Done, Error))]
    assert [(type(e).__name__, e.index) for e in finals] == [("Done", 1), ("Error", 2), ("Done", 3)]
    assert "".join(e.text for e in events if isinstance(e, Chunk) and e.index == 1) == "one two"


def render(events, **kw) -> bytes:
    out = stdio.BytesIO()
    opts = {"jsonl": False, "stream": True, "one_line": False, "null": False} | kw
    r = Renderer(out, **opts)
    for e in events:
        r.write(e)
    return out.getvalue()


EVENTS = [
    Chunk(1, 1, "a\nb", 1, 1.0),
    Chunk(1, 1, " c", 2, 1.0),
    Done(1, 1, "a\nb c", "stop", 2, 1.0, 3, 3.0, 10, "p"),
    Error(2, 2, "f", 2, "bad"),
]


def test_render_text_one_line_null_and_jsonl() -> None:
    assert render(EVENTS) == b"a\nb c\n\n"
    assert render(EVENTS, one_line=True) == b"a b c\n\n"
    assert render(EVENTS, null=True) == b"a\nb c\0\0"
    assert render(EVENTS, stream=False) == b"a\nb c\n\n"
    lines = [json.loads(x) for x in render(EVENTS, jsonl=True).splitlines()]
    assert [x["event"] for x in lines] == ["chunk", "chunk", "done", "error"]
    no_stream = [json.loads(x) for x in render(EVENTS, jsonl=True, stream=False).splitlines()]
    assert [x["event"] for x in no_stream] == ["done", "error"]


def test_error_message_format() -> None:
    assert Error(3, "x", "prompts.jsonl", 7, "boom").message() == "mlxpipe: error (at prompts.jsonl:7): boom"


def test_usage_errors_exit_2_before_loading_a_model(capsys, tmp_path) -> None:
    assert cli.main(["--template", "{a.b}"]) == 2
    assert cli.main(["--template", "{question}"]) == 2  # lines mode only has {text} (or {line})
    assert cli.main([str(tmp_path / "missing.txt")]) == 2
    assert cli.main(["--template", "x", "--template-file", "y"]) == 2
    assert cli.main(["--temp", "-1"]) == 2
    err = capsys.readouterr().err
    assert "mlxpipe: error: cannot open" in err and "Traceback" not in err
