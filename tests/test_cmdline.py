"""The command line as a script sees it (issue 21): -p and --slurp, --chat, option errors, a word about
options that do nothing. Through tests/fakecli.py (the real command line, a fake engine), so no model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO, FakeEngine, cli_env, run_cli

from mlxpipe.cli.interactive import Conversation
from mlxpipe.cli.options import build_parser
from mlxpipe.events import Done
from mlxpipe.pipeline import run
from mlxpipe.reader import records_from_objects

FAKECLI = [sys.executable, str(REPO / "tests" / "fakecli.py")]


def fake(args: list[str], input: bytes | None = b"", **kwargs: Any) -> subprocess.CompletedProcess[bytes]:
    """``mlxpipe ARGS`` with the fake engine, which answers ``echo: PROMPT``."""
    return subprocess.run(
        [*FAKECLI, *args], input=input, capture_output=True, env=cli_env(), cwd=REPO, timeout=60, **kwargs
    )


def finals(out: bytes) -> list[dict[str, Any]]:
    return [e for e in map(json.loads, out.splitlines()) if e["event"] in ("done", "error")]


# --- option parsing ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--maxtokens", "5"], "unknown option --maxtokens (did you mean --max-tokens?)"),
        (["--max-token", "5"], "unknown option --max-token (did you mean --max-tokens?)"),  # no abbreviations
        (["--max-token=5"], "unknown option --max-token (did you mean --max-tokens?)"),
        (["--prompt-ke", "q"], "unknown option --prompt-ke (did you mean --prompt-key?)"),
        (["--xyzzy"], "unknown option --xyzzy"),
        (["-x"], "unknown option -x"),
    ],
)
def test_an_unknown_option_is_one_line_with_a_guess_then_where_help_is(argv: list[str], message: str) -> None:
    r = run_cli(argv, input=b"")
    assert r.returncode == 2 and r.stdout == b""
    assert r.stderr.decode() == f"mlxpipe: error: {message}\nTry 'mlxpipe --help'.\n"


def test_prompt_is_its_own_option_not_an_abbreviation_of_prompt_key() -> None:
    args = build_parser().parse_args(["--prompt", "What is 2+2?", "-p", "And 3+3?"])
    assert args.prompt == ["What is 2+2?", "And 3+3?"] and args.prompt_key == "prompt" and args.files == []


def test_help_shows_the_allowed_values_and_interactive_mode() -> None:
    r = run_cli(["--help"])
    text = " ".join(r.stdout.decode().split())  # argparse wraps lines
    assert "FORMAT is one of: lines, jsonl, openai." in text
    assert "FORMAT is one of: text, jsonl, openai." in text
    assert "TYPE is one of: auto, float32, float16, bfloat16, quantized." in text
    assert "With stdin and stderr on a terminal and no FILE or -p, mlxpipe is interactive" in text


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["-p", "Hi", "in.txt"], "-p and FILE cannot be used together"),
        (["-p", " "], "-p: empty prompt"),
        (["--slurp", "--in", "jsonl"], "--slurp reads text"),
        (["--slurp", "-p", "a", "-p", "b"], "--slurp takes one -p"),
        (["--slurp", "-p", "a", "--template", "b {text}"], "with --slurp, give -p or --template, not both"),
        (["--template", "{question}"], "in lines mode a template can only use {text} (or {line})"),
        (["--chat", "--raw"], "--chat needs the model's chat template"),
        (["--chat", "--batch", "2"], "--chat answers one turn after another"),
        (["--chat", "--in", "jsonl"], "--chat reads lines"),
    ],
)
def test_what_does_not_go_together_is_a_usage_error(argv: list[str], message: str) -> None:
    r = fake(argv)
    assert r.returncode == 2 and r.stdout == b""
    assert r.stderr.decode().startswith(f"mlxpipe: error: {message}") and r.stderr.count(b"\n") == 1


# --- -p and --slurp ---------------------------------------------------------------------------------


def test_each_prompt_is_a_record_and_stdin_is_not_read() -> None:
    p = subprocess.Popen(
        [*FAKECLI, "--jsonl", "--no-stream", "-p", "What is 2+2?", "--prompt=-1 or 1?"],
        stdin=subprocess.PIPE,  # left open: a read of stdin would wait for ever
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=cli_env(),
        cwd=REPO,
    )
    try:
        p.wait(timeout=60)
        assert p.stdout and p.stderr
        out, err = p.stdout.read(), p.stderr.read()
    finally:
        p.kill()
        assert p.stdin
        p.stdin.close()
    assert p.returncode == 0 and err == b""
    assert [(e["id"], e["text"]) for e in finals(out)] == [(1, "echo: What is 2+2?"), (2, "echo: -1 or 1?")]


def test_prompts_go_through_the_template_like_lines() -> None:
    r = fake(["-p", "Paris", "--template", "Where is {text}?", "-p", "Rome"])
    assert r.returncode == 0 and r.stdout == b"echo: Where is Paris?\necho: Where is Rome?\n"


def test_slurp_makes_the_whole_input_one_record_after_the_instruction(tmp_path: Path) -> None:
    memo = b"\xef\xbb\xbfThe meeting moved to Tuesday.\r\n\nBring {the} slides.\n\n"
    r = fake(["--slurp", "-p", "Summarise {this}:", "--jsonl"], input=memo)
    assert r.returncode == 0 and r.stderr == b""
    (done,) = finals(r.stdout)
    # The rule: the instruction, a blank line, the document (its BOM and trailing newlines dropped).
    assert done["text"] == "echo: Summarise {this}:\n\nThe meeting moved to Tuesday.\r\n\nBring {the} slides."
    (tmp_path / "a.txt").write_text("one\ntwo\n")
    (tmp_path / "b.txt").write_text("three\n")
    (tmp_path / "blank.txt").write_text("\n \n")
    files = [str(tmp_path / n) for n in ("a.txt", "blank.txt", "b.txt")]
    r = fake(["--slurp", "--template", "Count: {text}", "--out", "jsonl", *files])
    assert [e.get("text", e.get("error")) for e in finals(r.stdout)] == [
        "echo: Count: one\ntwo",
        "the input is empty: no document to read",  # one line for it, not silence (issue 39)
        "echo: Count: three",
    ]
    r = fake(["--slurp", "-n", "3"], input=b"only the document\n")
    assert r.stdout == b"echo: only the document\n"


def test_slurp_refuses_a_document_over_max_line_bytes_and_reads_it_all() -> None:
    r = fake(["--slurp", "--max-line-bytes", "10", "--jsonl"], input=b"x" * 200_000)
    assert r.returncode == 1
    assert r.stderr == b"mlxpipe: error (at <stdin>:1): input longer than --max-line-bytes (10 bytes)\n"


# --- conversations ----------------------------------------------------------------------------------


def test_a_conversation_carries_every_earlier_turn_and_drops_an_interrupted_one() -> None:
    engine = FakeEngine()
    engine.enqueue(["Hello Bob.", "Cut short", "Your name is Bob."])
    conversation = Conversation()
    records = conversation.turns(records_from_objects(["My name is Bob.", "Tell a story.", "My name?"]))
    for event in run(records, engine):
        if isinstance(event, Done) and event.text == "Cut short":  # as if Ctrl-C had ended it
            event = Done(**{**event.__dict__, "finish_reason": "interrupted"})
        conversation.saw(event)
    asked = [r.messages for r in engine.history]
    assert asked[0] == ({"role": "user", "content": "My name is Bob."},)
    assert asked[2] == (
        {"role": "user", "content": "My name is Bob."},
        {"role": "assistant", "content": "Hello Bob."},
        {"role": "user", "content": "My name?"},
    )
    assert len(conversation.history) == 4


# --- a word about options that do nothing -------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "word"),
    [
        (["--no-stream"], "mlxpipe: warning: --no-stream is for --out jsonl"),
        (["--one-line", "--out", "jsonl"], "mlxpipe: warning: --one-line has no effect with --out jsonl"),
        (["--prompt-key", "q"], "mlxpipe: warning: --prompt-key has no effect in lines mode"),
        (["--no-chat"], "mlxpipe: warning: --no-chat has no effect outside interactive mode"),
    ],
)
def test_an_option_without_effect_gets_a_word_and_the_run_goes_on(argv: list[str], word: str) -> None:
    r = fake(argv, input=b"Hi\n")
    assert r.returncode == 0 and b"echo: Hi" in r.stdout
    assert r.stderr.decode().startswith(word) and r.stderr.count(b"\n") == 1


def test_a_jsonl_file_read_as_lines_gets_a_hint(tmp_path: Path) -> None:
    data = tmp_path / "data.jsonl"
    data.write_text('{"prompt": "Hi"}\n')
    r = fake([str(data)])
    assert r.returncode == 0 and r.stdout == b'echo: {"prompt": "Hi"}\n'  # as asked: the line is the prompt
    assert r.stderr.decode() == (
        f"mlxpipe: hint: {data} is read as lines, each a prompt; "
        "for JSON records add --in jsonl (or --jsonl)\n"
    )
    assert fake(["--jsonl", str(data)]).stderr == b""


def test_empty_input_does_not_load_the_model() -> None:
    r = run_cli(["-m", "/no/such/model.gguf", "--stats"], input=b"\n  \n")  # blank lines are no records
    assert r.returncode == 0 and r.stdout == b"" and r.stderr.startswith(b"mlxpipe: 0 records, 0 failed")
    assert run_cli(["-m", "/no/such/model.gguf"], input=b"Hi\n").returncode == 3  # a record: it must load
