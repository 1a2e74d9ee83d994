"""The pipe end to end: the real command on the real embedded model (issue 3's must-show list)."""

from __future__ import annotations

import json
import signal
import subprocess
import time

import pytest
from conftest import MLXPIPE, REPO, cli_env, run_cli, start_cli

pytestmark = pytest.mark.model

PARIS = "What is the capital of France?"


def events(stdout: bytes) -> list[dict]:
    return [json.loads(line) for line in stdout.decode().splitlines()]


def test_lines_to_text_streams_one_answer_per_line() -> None:
    r = run_cli(["-n", "12"], input=f"{PARIS}\n\n  \r\nSay hello.\r\n")
    assert r.returncode == 0, r.stderr
    assert r.stderr == b""
    lines = r.stdout.decode().split("\n")
    assert lines[-1] == "" and len(lines) == 3  # two answers, blank lines skipped
    assert "Paris" in lines[0]


def test_jsonl_events_carry_every_field_and_chunks_join_to_done() -> None:
    rec = {"id": "q1", "prompt": PARIS, "extra": [1, 2]}
    r = run_cli(["--jsonl", "-n", "30"], input=json.dumps(rec) + "\n")
    assert r.returncode == 0, r.stderr
    evs = events(r.stdout)
    chunks, done = evs[:-1], evs[-1]
    assert chunks and all(c["event"] == "chunk" for c in chunks)
    for c in chunks:
        assert set(c) == {"event", "id", "text", "tokens", "tps"}
        assert c["id"] == "q1" and isinstance(c["tokens"], int) and isinstance(c["tps"], float)
    assert [c["tokens"] for c in chunks] == sorted(c["tokens"] for c in chunks)
    assert set(done) == {
        "event",
        "id",
        "text",
        "finish_reason",
        "tokens",
        "tps",
        "prompt_tokens",
        "prompt_tps",
        "peak_memory",
        "input",
    }
    assert done["event"] == "done" and done["id"] == "q1"
    assert "".join(c["text"] for c in chunks) == done["text"]
    assert "Paris" in done["text"]
    assert done["finish_reason"] == "stop"  # EOS came before max tokens
    assert done["tokens"] < 30 and done["prompt_tokens"] > 5
    assert isinstance(done["peak_memory"], int) and done["peak_memory"] > 1_000_000  # bytes, not GB
    assert done["input"] == rec


def test_no_stream_length_stop_string_and_malformed_line() -> None:
    lines = [
        json.dumps({"id": "long", "prompt": "Write a long story about a dragon.", "max_tokens": 5}),
        '{"id": "broken", "prompt": ',
        json.dumps({"id": "cut", "prompt": PARIS, "stop": " Paris"}),
        json.dumps("What is the capital of France?"),
    ]
    r = run_cli(["--jsonl", "--no-stream", "-n", "30", "-"], input="\n".join(lines) + "\n")
    assert r.returncode == 1  # one record failed, the others were done
    out = events(r.stdout)
    assert len(out) == 4  # exactly one line per record, in input order
    assert [e["id"] for e in out] == ["long", 2, "cut", 4]
    assert [e["event"] for e in out] == ["done", "error", "done", "done"]
    assert out[0]["finish_reason"] == "length" and out[0]["tokens"] == 5
    assert out[1]["file"] == "<stdin>" and out[1]["line"] == 2 and "invalid json" in out[1]["error"].lower()
    assert out[2]["finish_reason"] == "stop" and out[2]["text"] == "The capital of France is"
    assert "Paris" in out[3]["text"] and out[3]["input"] == "What is the capital of France?"
    err = r.stderr.decode().strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mlxpipe: error (at <stdin>:2): ")


def test_stop_string_is_never_half_printed() -> None:
    rec = {"prompt": PARIS, "stop": ["Paris."]}
    r = run_cli(["--jsonl", "-n", "30"], input=json.dumps(rec) + "\n")
    evs = events(r.stdout)
    assert evs[-1]["finish_reason"] == "stop"
    assert "Par" not in "".join(e["text"] for e in evs[:-1])
    assert evs[-1]["text"] == "The capital of France is "


def test_seed_is_applied_per_record(batch_is_exact: bool) -> None:
    prompt = "Invent a name for a cat."
    args = ["--out", "jsonl", "--no-stream", "--temp", "1.0", "--seed", "7", "-n", "8"]
    if not batch_is_exact:  # a batch's rows round differently there: the same seed can sample apart
        args += ["--batch", "1"]
    together = events(run_cli(args, input=f"Say something.\n{prompt}\n{prompt}\n").stdout)
    alone = events(run_cli(args, input=f"{prompt}\n").stdout)
    assert together[1]["text"] == together[2]["text"] == alone[0]["text"]


def test_unknown_flag_is_a_usage_error() -> None:
    r = run_cli(["--xyzzy"], input="")
    assert r.returncode == 2
    assert r.stdout == b""
    assert r.stderr == b"mlxpipe: error: unknown option --xyzzy\nTry 'mlxpipe --help'.\n"


def test_consumer_that_stops_reading_ends_quietly(tmp_path) -> None:
    err = tmp_path / "err"
    script = (
        f"yes 'Tell me a long story about the sea.' | head -n 20 | {' '.join(MLXPIPE)} -n 100 2>{err} "
        '| head -c 5; echo " ${PIPESTATUS[2]}"'
    )
    r = subprocess.run(["bash", "-c", script], capture_output=True, env=cli_env(), cwd=REPO, timeout=300)
    out = r.stdout.decode()
    assert out.endswith(" 0\n"), out  # mlxpipe's own exit status
    assert len(out) == 5 + len(" 0\n")
    assert err.read_bytes() == b""


def test_answer_streams_before_stdin_closes() -> None:
    p = start_cli(["-n", "20"])
    assert p.stdin and p.stdout
    try:
        p.stdin.write(f"{PARIS}\n".encode())
        p.stdin.flush()
        answer = p.stdout.readline().decode()  # stdin is still open: the answer must come anyway
        assert "Paris" in answer
        assert p.poll() is None
    finally:
        p.stdin.close()
        p.wait(timeout=60)
    assert p.returncode == 0


def test_python_api_yields_the_same_events(engine) -> None:
    from mlxpipe import records_from_objects, run

    evs = list(run(records_from_objects([PARIS, {"prompt": "Hi", "max_tokens": 2}, {"nope": 1}]), engine))
    finals = [e for e in evs if e.kind in ("done", "error")]
    assert [e.kind for e in finals] == ["done", "done", "error"]
    assert "Paris" in finals[0].text and finals[1].finish_reason == "length"


def test_sigint_ends_the_record_with_a_done_line_and_the_process_by_sigint() -> None:
    p = start_cli(["--jsonl", "-n", "200", "--batch", "1"])
    assert p.stdin and p.stdout
    p.stdin.write(b'"Write a long story about a dragon."\n"Second."\n')
    p.stdin.close()
    first = p.stdout.readline()  # generation has started
    assert json.loads(first)["event"] == "chunk"
    time.sleep(0.3)
    p.send_signal(signal.SIGINT)
    rest = p.stdout.read()
    p.wait(timeout=60)
    assert p.returncode == -signal.SIGINT  # killed by SIGINT, as the shell sees it: $? is 130
    lines = events(first + rest)
    assert lines[-1]["event"] == "done" and lines[-1]["finish_reason"] == "interrupted"
    assert sum(e["event"] == "done" for e in lines) == 1  # the second record was never started
    assert p.stderr.read() == b"mlxpipe: interrupted after 1 record (1 cut short)\n"  # type: ignore[union-attr]


def test_null_template_one_line_and_stats() -> None:
    r = run_cli(
        ["-z", "-n", "6", "--template", "Answer briefly: {line}", "--stats"], input=f"{PARIS}\0Hi\nthere\0"
    )
    assert r.returncode == 0
    answers = r.stdout.split(b"\0")
    assert len(answers) == 3 and answers[-1] == b"" and b"Paris" in answers[0]
    assert r.stderr.decode().startswith("mlxpipe: 2 records, 0 failed, ")
    r = run_cli(["--one-line", "-n", "30"], input="Write a two-line poem.\nSay hi.\n")
    lines = r.stdout.decode().split("\n")
    assert len(lines) == 3 and lines[2] == ""  # exactly one output line per input line


def test_raw_system_and_messages() -> None:
    recs = [
        {"id": "raw-messages", "messages": [{"role": "user", "content": "hi"}]},
        {"id": "raw", "prompt": "The capital of France is", "max_tokens": 3},
    ]
    r = run_cli(["--jsonl", "--no-stream", "--raw"], input="\n".join(json.dumps(x) for x in recs) + "\n")
    first, second = events(r.stdout)
    assert r.returncode == 1
    assert first["event"] == "error" and "chat template" in first["error"]
    assert second["event"] == "done" and second["prompt_tokens"] == 5  # no template around it


def test_system_prompt_goes_into_the_chat_template(engine) -> None:
    from dataclasses import replace

    from mlxpipe.reader import records_from_objects

    (rec,) = records_from_objects([PARIS])
    with_system = replace(rec, settings=replace(rec.settings, system="Always answer in French."))
    text = engine.tokenizer.decode(engine.encode(with_system))
    assert "Always answer in French." in text and PARIS in text
    assert "Always answer in French." not in engine.tokenizer.decode(engine.encode(rec))


def test_prompts_from_the_command_line_and_a_slurped_document() -> None:
    r = run_cli(["-n", "8", "-p", PARIS, "-p", "Say hi."])
    assert r.returncode == 0 and r.stderr == b""
    lines = r.stdout.decode().split("\n")
    assert len(lines) == 3 and "Paris" in lines[0] and lines[2] == ""
    memo = "The meeting moved to Tuesday at 10.\nBring the slides.\n"
    slurped = run_cli(["--slurp", "-p", "When is the meeting?", "--jsonl", "-n", "16"], input=memo)
    (done,) = [e for e in events(slurped.stdout) if e["event"] == "done"]
    assert done["input"] == "When is the meeting?\n\n" + memo.rstrip("\n")  # instruction, then the document
    assert "Tuesday" in done["text"]


def test_tps_is_zero_until_there_are_two_tokens() -> None:
    r = run_cli(["--jsonl", "-n", "4", "-p", "Count to five."])
    chunks = [e for e in events(r.stdout) if e["event"] == "chunk"]
    assert [c["tokens"] for c in chunks] == [1, 2, 3, 4]
    assert chunks[0]["tps"] == 0.0 and all(c["tps"] > 0 for c in chunks[1:])
