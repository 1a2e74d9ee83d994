"""Nothing skipped, nothing misplaced, nothing split (issue 39, sections 3-6): the real command on real
files, signals and terminals. Record ids never make a record skipped, output line N answers input line N,
an answer cut inside a multi-byte character never ends in U+FFFD, and the smaller faults found on the way."""

from __future__ import annotations

import itertools
import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, cli_env, interrupt_a_story, run_cli, start_cli

FAKECLI = [sys.executable, str(REPO / "tests" / "fakecli.py")]


def _fake(args: list[str], input: bytes = b"", **env: str) -> subprocess.CompletedProcess[bytes]:
    """The real command line with the fake engine (tests/fakecli.py)."""
    return subprocess.run(
        [*FAKECLI, *args], input=input, capture_output=True, env=cli_env(**env), cwd=REPO, timeout=120
    )


def _events(stdout: bytes) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines()]


# ---------------------------------------------------------------------------------------------
# 3. Record ids never collide

# Records 4 and 7 have no id, so their number is their id: 4 is record 1's explicit id, and record 6's
# "x" repeats record 5's; record 8 takes the number of record 2, which has none. The later of each pair
# is refused.
COLLIDING = [
    {"id": 4, "prompt": "a"},
    {"prompt": "b"},
    {"prompt": "c"},
    {"prompt": "d"},
    {"id": "x", "prompt": "e"},
    {"id": "x", "prompt": "f"},
    {"prompt": "g"},
    {"id": 2, "prompt": "h"},
    {"id": "4", "prompt": "i"},  # a string: not the integer 4
]
REFUSED = {4, 6, 8}  # record numbers


def _write_colliding(path: Path) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in COLLIDING))
    return path


def test_a_record_whose_id_an_earlier_one_has_is_refused_not_skipped(tmp_path: Path) -> None:
    data = _write_colliding(tmp_path / "in.jsonl")
    r = _fake(["--jsonl", "--no-stream", str(data)])
    assert r.returncode == 1 and b"Traceback" not in r.stderr
    finals = _events(r.stdout)
    assert len(finals) == len(COLLIDING)  # one final line each, in input order
    assert [f["line"] for f in finals if f["event"] == "error"] == sorted(REFUSED)
    assert [f["input"]["prompt"] for f in finals if f["event"] == "done"] == ["a", "b", "c", "e", "g", "i"]
    err = r.stderr.decode()
    assert f"error (at {data}:4): id 4 is already the id of the record at {data}:1; ids must be unique" in err
    assert f'(at {data}:6): id "x" is already the id of the record at {data}:5' in err
    assert f"(at {data}:8): id 2 is already the id of record 2, which has no 'id'" in err


@pytest.mark.parametrize("batch", ["1", "3"])
def test_resume_never_skips_a_record_for_another_records_id(tmp_path: Path, batch: str) -> None:
    data = _write_colliding(tmp_path / "in.jsonl")
    out = tmp_path / "out.jsonl"
    first = _fake(["--jsonl", "--batch", batch, "--resume", str(out), str(data)])
    assert first.returncode == 1 and first.stdout == b""
    lines = _events(out.read_bytes())
    assert sorted(e["line"] for e in lines if e["event"] == "error") == sorted(REFUSED)
    assert sum(e["event"] == "done" for e in lines) == len(COLLIDING) - len(REFUSED)
    # Again: the done records are skipped, each refused one is refused again (never taken as done).
    again = _fake(["--jsonl", "--batch", batch, "--resume", str(out), str(data)])
    assert again.returncode == 1
    more = _events(out.read_bytes())[len(lines) :]
    assert sorted(e["line"] for e in more) == sorted(REFUSED)
    assert all(e["event"] == "error" for e in more)


def test_text_output_carries_no_id_and_refuses_none(tmp_path: Path) -> None:
    data = _write_colliding(tmp_path / "in.jsonl")
    r = _fake(["--in", "jsonl", "--one-line", str(data)])
    assert r.returncode == 0 and r.stdout.count(b"\n") == len(COLLIDING)


# ---------------------------------------------------------------------------------------------
# 4. Line N answers line N

# Blank and whitespace-only lines, a CRLF blank, a line that is not UTF-8 (a failed record), and blank lines
# at the end: every one of them gets its output line.
LINES = [b"What is 2+2?", b"", b"   ", b"\r", b"Name a colour.", b"\xff\xfe bad", b"Say hi.", b"", b""]


@pytest.mark.model
@pytest.mark.parametrize("batch", ["1", "4"])
def test_one_line_gives_every_input_line_its_output_line(tmp_path: Path, batch: str) -> None:
    questions = tmp_path / "questions.txt"
    questions.write_bytes(b"\n".join(LINES) + b"\n")
    r = run_cli(["-n", "3", "--one-line", "--batch", batch, str(questions)])
    assert r.returncode == 1  # the line that is not UTF-8
    out = r.stdout.split(b"\n")
    assert out[-1] == b"" and len(out) - 1 == len(LINES)
    for line, answer in zip(LINES, out, strict=False):
        answered = line.strip() and not line.startswith(b"\xff")
        assert bool(answer) == bool(answered), (line, answer)
    # The README's recipe pairs each question with its own answer.
    pasted = subprocess.run(
        ["sh", "-c", f"paste {questions} - | cut -f1"], input=r.stdout, capture_output=True, check=True
    )
    assert pasted.stdout.split(b"\n")[:-1] == LINES


@pytest.mark.model
def test_with_z_every_input_record_gets_its_output_record(tmp_path: Path) -> None:
    data = b"\0".join([b"Say hi.", b"", b" \n ", b"Name a fruit.\nOne word.", b""]) + b"\0"
    for extra in ([], ["--one-line"]):
        r = run_cli(["-z", "-n", "3", *extra], input=data)
        assert r.returncode == 0, r.stderr
        out = r.stdout.split(b"\0")
        assert len(out) == 6 and out[-1] == b""
        assert [bool(o) for o in out[:-1]] == [True, False, False, True, False]


def test_blank_lines_are_kept_across_files_errors_and_an_empty_run(tmp_path: Path) -> None:
    a, b = tmp_path / "a.txt", tmp_path / "b.jsonl"
    a.write_bytes(b"one\n\n\n")
    b.write_bytes(b'\n"two"\n{"prompt": 3}\n\n')
    r = _fake(["--in", "jsonl", "--one-line", str(a), str(b)])
    # a.txt read as JSONL: "one" is not JSON (an error, an empty line); b's third record a bad prompt.
    assert r.returncode == 1
    assert r.stdout == b"\n\n\n\necho: two\n\n\n"
    assert _fake(["--one-line"], input=b"\n \n\n").stdout == b"\n\n\n"  # no record at all: no model
    assert _fake(["--one-line", "--batch", "2", "-z"], input=b"\0a\0\0").stdout == b"\0echo: a\0\0"
    # JSONL and plain text output keep to records: blank lines are not records there.
    assert _fake(["--jsonl", "--no-stream"], input=b'\n"x"\n\n').stdout.count(b"\n") == 1
    assert _fake([], input=b"x\n\ny\n").stdout == b"echo: x\necho: y\n"


# ---------------------------------------------------------------------------------------------
# 5. No half characters


@pytest.mark.model
@pytest.mark.parametrize("batch", ["1", "4"])
def test_an_answer_cut_inside_a_character_ends_at_the_last_whole_one(tmp_path: Path, batch: str) -> None:
    # The embedded model repeats accented, CJK and emoji text; its byte-level tokens split those characters,
    # so cuts after 1..12 tokens fall inside several of them (one process, a record per cut point).
    prompt = "Répète exactement: 🌸🌸 café 東京 🇫🇷 naïve"
    data = tmp_path / "cuts.jsonl"
    data.write_text("".join(json.dumps({"prompt": prompt, "max_tokens": n}) + "\n" for n in range(1, 13)))
    r = run_cli(["--jsonl", "--batch", batch, str(data)])
    assert r.returncode == 0, r.stderr
    events = _events(r.stdout)
    done = [e for e in events if e["event"] == "done"]
    assert [d["tokens"] for d in done] == list(range(1, 13))
    for d in done:
        chunks = "".join(e["text"] for e in events if e["event"] == "chunk" and e["id"] == d["id"])
        assert "\ufffd" not in d["text"] and chunks == d["text"], d
        assert done[-1]["text"].startswith(d["text"])  # a cut drops the unfinished character, nothing else
    # Some cut fell inside a character: one more token added no text.
    texts = [d["text"] for d in done]
    assert any(a == b for a, b in itertools.pairwise(texts))
    assert any(ord(c) > 0xFFFF for c in texts[-1])  # an emoji was answered whole (4 bytes, several tokens)


# ---------------------------------------------------------------------------------------------
# 6. Smaller things


def _start(args: list[str], hup: object = signal.SIG_DFL) -> subprocess.Popen[bytes]:
    """``mlxpipe ARGS`` with SIGHUP at ``hup`` in the child (``SIG_IGN``: as ``nohup`` starts it)."""
    return start_cli(args, preexec_fn=lambda: signal.signal(signal.SIGHUP, hup))  # type: ignore[arg-type]


@pytest.mark.model
def test_sighup_ends_the_run_as_sigterm_does_and_nohup_keeps_it_ignored() -> None:
    p = _start(["--jsonl", "-n", "200", "--batch", "1"])
    assert p.stderr
    lines = interrupt_a_story(p, signal.SIGHUP)  # the terminal closed
    assert p.wait(timeout=60) == -signal.SIGHUP  # ended by the signal, after its final line
    assert lines[-1]["event"] == "done" and lines[-1]["finish_reason"] == "interrupted"
    assert sum(e["event"] == "done" for e in lines) == 1
    assert b"mlxpipe: interrupted by SIGHUP after" in p.stderr.read()

    p = _start(["--jsonl", "-n", "24", "--batch", "1"], hup=signal.SIG_IGN)
    assert p.stdin and p.stdout and p.stderr
    p.stdin.write(b'"Write a long story about a dragon."\n"Second."\n')
    p.stdin.close()
    first = p.stdout.readline()
    p.send_signal(signal.SIGHUP)  # under nohup: nothing happens
    rest = p.stdout.read()
    assert p.wait(timeout=120) == 0, p.stderr.read()
    finals = [json.loads(line) for line in (first + rest).splitlines() if b'"done"' in line]
    assert len(finals) == 2 and all(e["finish_reason"] != "interrupted" for e in finals)


@pytest.mark.parametrize("rows_cols", [(0, 0), (0, 100), (30, 0)])
def test_a_terminal_of_no_size_still_gets_the_progress_line(
    tmp_path: Path, rows_cols: tuple[int, int]
) -> None:
    # `script`, `docker exec -t` before a resize: the pty reports 0 rows and 0 columns.
    import fcntl
    import os
    import pty
    import select
    import struct
    import termios

    data = tmp_path / "in.txt"
    data.write_text("a\nb\nc\n")
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", *rows_cols, 0, 0))
    env = cli_env()
    env.pop("COLUMNS", None), env.pop("LINES", None)
    p = subprocess.Popen([*FAKECLI, str(data)], stdout=subprocess.PIPE, stderr=slave, env=env, cwd=REPO)
    out, _ = p.communicate(timeout=120)
    shown = b""
    while select.select([master], [], [], 0.2)[0]:
        shown += os.read(master, 1 << 16)
    os.close(slave), os.close(master)
    assert p.returncode == 0 and out.count(b"\n") == 3
    assert b"/3 [" in shown and b"records/s" in shown  # the bar was drawn


def test_utf16_input_is_named_as_such(tmp_path: Path) -> None:
    text = "Say hi.\nName a colour, é.\n"
    for encoding in ("utf-16", "utf-16-le", "utf-16-be"):  # with its byte order mark, and without
        data = tmp_path / f"{encoding}.txt"
        data.write_bytes(text.encode(encoding))
        for fmt in (["--in", "lines"], ["--in", "jsonl"]):
            r = _fake([*fmt, "--out", "jsonl", str(data)])
            assert r.returncode == 1 and b"Traceback" not in r.stderr
            errors = [e["error"] for e in _events(r.stdout)]
            assert errors and all(e.startswith("the input is UTF-16, not UTF-8") for e in errors), errors
    r = _fake(["--out", "jsonl"], input=b"ab\0cd\n")  # UTF-8 with a NUL byte: still said so
    assert "NUL byte at byte 2" in _events(r.stdout)[0]["error"]


def test_stats_says_what_each_rate_divides() -> None:
    r = _fake(["--stats"], input=b"one two three\n")
    assert r.returncode == 0
    line = r.stderr.decode()
    # The fake engine decodes at 100 tok/s a record; the wall-time rate is another number.
    assert line.startswith("mlxpipe: 1 record, 0 failed,")
    assert "tok/s generated over the wall time, 100.0 tok/s a record decodes," in line


def test_interrupt_messages_count_the_lines_written(tmp_path: Path) -> None:
    import os
    import time

    data = tmp_path / "in.txt"
    data.write_text("".join(f"p {i}\n" for i in range(1, 101)))
    p = subprocess.Popen(
        [*FAKECLI, "--one-line", str(data)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=cli_env(FAKE_DELAY="0.05"),
        cwd=REPO,
    )
    assert p.stdout
    first = p.stdout.readline()
    time.sleep(0.1)
    os.kill(p.pid, signal.SIGTERM)
    out, err = p.communicate(timeout=60)
    assert p.returncode == -signal.SIGTERM
    written = (first + out).count(b"\n")
    noun = "record" if written == 1 else "records"
    assert err.decode().startswith(f"mlxpipe: interrupted by SIGTERM after {written} of 100 {noun}")


@pytest.mark.model
def test_an_integral_json_number_is_an_integer_setting() -> None:
    lines = b'{"prompt": "Say hi.", "max_tokens": 2.0}\n{"prompt": "Say hi.", "max_tokens": 2.5}\n'
    r = run_cli(["--jsonl", "--no-stream"], input=lines)
    first, second = _events(r.stdout)
    assert first["event"] == "done" and first["tokens"] == 2
    assert second["error"] == "'max_tokens' must be an integer in [1, 1048576], got 2.5"


def test_slurp_of_an_empty_input_is_one_records_line(tmp_path: Path) -> None:
    empty, blank, full = tmp_path / "empty", tmp_path / "blank", tmp_path / "full"
    empty.write_bytes(b"")
    blank.write_bytes(b"\n \r\n")
    full.write_bytes(b"a document\n")
    r = _fake(["--slurp", "-p", "Summarise:"], input=b"")
    assert r.returncode == 1 and r.stdout == b"\n"
    assert r.stderr == b"mlxpipe: error (at <stdin>:1): the input is empty: no document to read\n"
    r = _fake(["--slurp", "--jsonl", "--no-stream", str(empty), str(full), str(blank)])
    assert r.returncode == 1
    assert [(e["event"], e.get("file")) for e in _events(r.stdout)] == [
        ("error", str(empty)),
        ("done", None),
        ("error", str(blank)),
    ]


@pytest.mark.parametrize("batch", ["1", "4"])
def test_an_answer_never_runs_past_the_models_context(tmp_path: Path, batch: str) -> None:
    # A random model of 512 tokens' context (its tokenizer: "a " is two tokens). The record whose prompt
    # leaves fewer than max_tokens ends when the context is full, and its done event says so.
    pytest.importorskip("gguf")
    from gguf_factory import tiny_bpe, write_gguf

    model = write_gguf(tmp_path / "tiny.gguf", "llama", tiny_bpe())
    lines = "".join(json.dumps({"prompt": "a " * n, "max_tokens": 30}) + "\n" for n in (240, 250, 10))
    r = run_cli(["-m", str(model), "--raw", "--jsonl", "--no-stream", "--batch", batch], input=lines)
    assert r.returncode == 0, r.stderr
    done = _events(r.stdout)
    assert [(d["finish_reason"], d["prompt_tokens"] + d["tokens"]) for d in done] == [
        ("length", 480 + 30),
        ("context", 512),  # 500 + 12: the whole context, not a token past it
        ("length", 20 + 30),
    ]
