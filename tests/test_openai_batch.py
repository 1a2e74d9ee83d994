"""OpenAI Batch API files (issue 41): request lines in, Batch API output lines out, each parsed with the
``openai`` package's own types; ``--resume`` of an interrupted ``--out openai`` job."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO, cli_env, run_cli, start_cli

from mlxpipe.reader import records_from_objects
from mlxpipe.records import BadRecord, Record

openai_types = pytest.importorskip("openai.types")
chat_types = pytest.importorskip("openai.types.chat")

FAKECLI = [sys.executable, str(REPO / "tests" / "fakecli.py")]


def chat(cid: str, text: str, **body: Any) -> dict[str, Any]:
    """A chat request line, as OpenAI's docs show it."""
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": text}]
    return {
        "custom_id": cid,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": "gpt-4o-mini", "messages": messages, **body},
    }


def completion(cid: str, prompt: str, **body: Any) -> dict[str, Any]:
    """A legacy completions request line."""
    return {
        "custom_id": cid,
        "method": "POST",
        "url": "/v1/completions",
        "body": {"model": "gpt-3.5-turbo-instruct", "prompt": prompt, **body},
    }


SCHEMA = {"type": "string", "enum": ["yes", "no"]}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "yn", "schema": SCHEMA, "strict": True}}

# (request line, None for an answer or a piece of its error message)
CASES: list[tuple[dict[str, Any], str | None]] = [
    (chat("c-1", "Say hi.", max_tokens=6), None),
    (completion("c-2", "Once upon a time", max_tokens=6, stop=["\n", "."]), None),
    (chat("c-3", "Is water wet? Answer yes or no.", response_format=JSON_SCHEMA, max_tokens=8), None),
    (chat("c-4", "Say hi.", max_completion_tokens=4, temperature=0.7, top_p=0.9, seed=3, stop="x"), None),
    ({**chat("c-5", "x"), "url": "/v1/embeddings"}, "only /v1/chat/completions and /v1/completions"),
    ({**chat("c-6", "x"), "method": "GET"}, "only POST"),
    (chat("c-7", "x", n=0), "'n' must be an integer in [1, 128]"),
    (chat("c-8", "x", tools=[{"type": "function", "function": {"name": "f"}}]), "'body.tools'"),
    (chat("c-9", "x", logit_bias={"50256": -100}), "'body.logit_bias'"),
    (chat("c-1", "duplicate"), "ids must be unique"),
    (chat("c-11", "x", max_tokens=0), "'max_tokens' must be an integer"),
    (completion("c-12", ["one", "two"]), "one request, one prompt"),
    ({"custom_id": "c-13", "method": "POST", "body": {"prompt": "x"}}, "'url' null is not supported"),
]


def batch_file(tmp_path: Path, lines: list[dict[str, Any]]) -> Path:
    path = tmp_path / "batch.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def check_output(stdout: bytes, requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every line a Batch API output line, in input order, its body parsed by openai's own types."""
    lines = [json.loads(line) for line in stdout.splitlines()]
    assert [line["custom_id"] for line in lines] == [r["custom_id"] for r in requests]
    assert len({line["id"] for line in lines}) == len(lines)
    for line, request in zip(lines, requests, strict=True):
        assert set(line) == {"id", "custom_id", "response", "error"}
        if line["response"] is None:
            assert set(line["error"]) == {"code", "message"} and line["error"]["message"]
            continue
        assert line["error"] is None and line["response"]["status_code"] == 200
        assert line["response"]["request_id"]
        body = line["response"]["body"]
        if request["url"] == "/v1/chat/completions":
            parsed: Any = chat_types.ChatCompletion.model_validate(body)
            assert parsed.choices[0].message.role == "assistant"
            assert isinstance(parsed.choices[0].message.content, str)
        else:
            parsed = openai_types.Completion.model_validate(body)
            assert isinstance(parsed.choices[0].text, str)
        assert parsed.choices[0].finish_reason in ("stop", "length")
        assert parsed.usage is not None
        assert parsed.usage.total_tokens == parsed.usage.prompt_tokens + parsed.usage.completion_tokens
        assert body["mlxpipe"]["peak_memory"] >= 0
    return lines


def fake(args: list[str], **kwargs: Any) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [*FAKECLI, *args], capture_output=True, env=cli_env(), cwd=REPO, timeout=60, **kwargs
    )


@pytest.mark.parametrize("mode", [[], ["--batch", "3"], ["--batch", "3", "--unordered"]])
def test_batch_file_through_the_fake_cli(tmp_path: Path, mode: list[str]) -> None:
    requests = [case for case, _ in CASES]
    r = fake(["--out", "openai", str(batch_file(tmp_path, requests)), *mode])
    assert r.returncode == 1, r.stderr  # some records failed
    lines = [json.loads(line) for line in r.stdout.splitlines()]
    if "--unordered" in mode:  # the one line per record, not the order
        assert sorted(line["custom_id"] for line in lines) == sorted(r["custom_id"] for r in requests)
        return
    check_output(r.stdout, requests)
    for line, (_, expected) in zip(lines, CASES, strict=True):
        if expected is None:
            assert line["response"] is not None, line
        else:
            assert line["response"] is None and expected in line["error"]["message"], line
    stderr = r.stderr.decode()
    assert stderr.count("'model' (\"gpt-4o-mini\") is ignored") == 1
    assert "Traceback" not in stderr


def test_requests_map_onto_a_records_settings() -> None:
    records = list(records_from_objects([case for case, _ in CASES[:4]]))
    assert all(isinstance(r, Record) for r in records)
    first, second, third, fourth = records
    assert isinstance(first, Record) and first.id == "c-1" and first.settings.max_tokens == 6
    assert first.messages is not None and first.messages[0]["role"] == "system"
    assert isinstance(second, Record) and second.prompt == "Once upon a time" and second.settings.raw
    assert second.settings.stop == ("\n", ".")
    assert isinstance(third, Record) and third.settings.constraint is not None
    assert isinstance(fourth, Record) and fourth.settings.max_tokens == 4
    assert (fourth.settings.temperature, fourth.settings.top_p, fourth.settings.seed) == (0.7, 0.9, 3)
    assert fourth.settings.stop == ("x",)


def test_json_object_and_text_parts() -> None:
    line = chat("j", "x", response_format={"type": "json_object"})
    line["body"]["messages"] = [{"role": "developer", "content": [{"type": "text", "text": "Hi"}]}]
    (record,) = records_from_objects([line])
    assert isinstance(record, Record) and record.settings.constraint is not None
    assert record.messages == ({"role": "system", "content": "Hi"},)


def test_in_openai_refuses_a_plain_record() -> None:
    from io import BytesIO

    from mlxpipe.reader import InputFormat, RecordReader
    from mlxpipe.records import Settings

    reader = RecordReader(InputFormat(jsonl=True, openai=True), Settings())
    lines = b'{"prompt": "hi"}\n{"custom_id": "a", "url": "/v1/completions"}\n'
    plain, bodiless = reader.read("f", BytesIO(lines))
    assert isinstance(plain, BadRecord) and "needs 'custom_id'" in plain.error and plain.id == 1
    assert isinstance(bodiless, BadRecord) and "needs 'body'" in bodiless.error and bodiless.id == "a"


def test_resume_file_of_openai_lines_is_read(tmp_path: Path) -> None:
    requests = [chat(f"r{n}", "hi") for n in range(4)]
    inp, out = batch_file(tmp_path, requests), tmp_path / "out.jsonl"
    first = fake(["--out", "openai", str(inp)], input=None)
    lines = first.stdout.splitlines()
    out.write_bytes(b"\n".join(lines[:2]) + b"\n" + lines[2][:30])  # two done, a torn third
    r = fake(["--out", "openai", "--resume", str(out), str(inp)])
    assert r.returncode == 0, r.stderr
    assert "cut off a torn last line" in r.stderr.decode()
    check_output(out.read_bytes(), requests)


# ---------------------------------------------------------------------------------------------
# The real command on the real embedded model


@pytest.mark.model
def test_batch_file_on_the_real_model(tmp_path: Path) -> None:
    requests = [case for case, _ in CASES]
    r = run_cli(["--out", "openai", "--stats", str(batch_file(tmp_path, requests))])
    assert r.returncode == 1, r.stderr
    lines = check_output(r.stdout, requests)
    for line, (_, expected) in zip(lines, CASES, strict=True):
        assert (line["response"] is None) == (expected is not None), line
    third = lines[2]["response"]["body"]["choices"][0]["message"]["content"]
    assert json.loads(third) in ("yes", "no")  # the schema held


@pytest.mark.model
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_interrupted_openai_job_resumes_to_each_custom_id_once(tmp_path: Path, sig: int) -> None:
    requests = [chat(f"r{n}", "Count to twenty.", max_tokens=4 if n < 2 else 48) for n in range(6)]
    inp, out = batch_file(tmp_path, requests), tmp_path / "out.jsonl"
    args = ["--out", "openai", "--resume", str(out), str(inp)]
    p = start_cli(args)
    try:
        deadline = time.monotonic() + 240
        while (not out.exists() or out.read_bytes().count(b"\n") < 2) and p.poll() is None:
            assert time.monotonic() < deadline, "no output from the first run"
            time.sleep(0.05)
        p.send_signal(sig)
        p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == -sig
    assert 2 <= out.read_bytes().count(b"\n") < len(requests)
    r = run_cli(args)
    assert r.returncode == 0, r.stderr
    check_output(out.read_bytes(), requests)  # each custom_id once, in order, every one answered


# ---------------------------------------------------------------------------------------------
# --stats: a summary event for machines


def test_stats_with_jsonl_ends_stdout_with_a_summary_event(tmp_path: Path) -> None:
    r = fake(["--jsonl", "--no-stream", "--stats"], input=b'{"prompt": "a b"}\n{"prompt": 3}\n"c"\n')
    assert r.returncode == 1, r.stderr
    lines = [json.loads(line) for line in r.stdout.splitlines()]
    assert [e["event"] for e in lines] == ["done", "error", "done", "summary"]
    summary = lines[-1]
    assert (summary["records"], summary["failed"]) == (3, 1)
    assert summary["tokens"] == sum(e["tokens"] for e in lines if e["event"] == "done")
    assert summary["prompt_tokens"] == sum(e["prompt_tokens"] for e in lines if e["event"] == "done")
    assert summary["peak_memory"] > 0 and summary["seconds"] >= 0 and summary["batch"]
    assert {"tps", "decode_tps"} <= set(summary)
    assert "mlxpipe: 3 records, 1 failed" in r.stderr.decode()  # the stderr line stays


def test_stats_summary_is_not_written_in_text_or_openai_output_or_the_resume_file(tmp_path: Path) -> None:
    text = fake(["--stats"], input=b"a\n")
    assert text.stdout == b"echo: a\n" and b"mlxpipe: 1 record" in text.stderr
    inp = batch_file(tmp_path, [chat("a", "hi")])
    openai = fake(["--out", "openai", "--stats", str(inp)])
    assert [json.loads(line)["custom_id"] for line in openai.stdout.splitlines()] == ["a"]
    out = tmp_path / "out.jsonl"
    for _ in range(2):  # the second run reads FILE again: it holds no summary line
        r = fake(["--jsonl", "--stats", "--resume", str(out)], input=b'"x"\n')
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["event"] == "summary"
    assert [json.loads(line)["event"] for line in out.read_bytes().splitlines()] == ["done"]


@pytest.mark.model
def test_an_answer_cut_short_by_sigint_is_an_interrupted_error_line(tmp_path: Path) -> None:
    counting = ", ".join(str(n) for n in range(1, 30)) + ","  # a raw prompt that goes on, no EOS soon
    requests = [chat("short", "Say hi.", max_tokens=2), completion("long", counting, max_tokens=4000)]
    p = start_cli(["--out", "openai", str(batch_file(tmp_path, requests))])
    try:
        assert p.stdout is not None
        first = p.stdout.readline()  # the second record is under way now
        p.send_signal(signal.SIGINT)
        rest, stderr = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == -signal.SIGINT, stderr
    lines = check_output(first + rest, requests)
    assert lines[0]["response"] is not None
    assert lines[1]["response"] is None and lines[1]["error"]["code"] == "interrupted"


def test_openai_output_has_no_blank_lines_for_blank_records() -> None:
    line = json.dumps(completion("a", "x")).encode()
    for args, data in ([], b"\n\n" + line + b"\n\n"), (["-z", "--one-line"], b"\0" + line + b"\0\0"):
        r = fake(["--out", "openai", *args], input=data)
        assert r.returncode == 0, r.stderr
        assert [json.loads(x)["custom_id"] for x in r.stdout.split(b"\n")[:-1]] == ["a"], r.stdout


def test_prompt_key_does_not_hide_a_completion_requests_prompt() -> None:
    r = fake(["--out", "openai", "--prompt-key", "text"], input=json.dumps(completion("a", "x")).encode())
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["response"]["body"]["choices"][0]["text"] == "echo: x"
    r = fake(["--in", "openai", "--prompt-key", "text"], input=json.dumps(completion("a", "x")).encode())
    assert r.stderr.decode().startswith("mlxpipe: warning: --prompt-key has no effect with --in openai")
