"""A good Unix citizen: --version and help, colour and progress on a terminal, interactive use on a real
pseudo-terminal (Ctrl-C included), SIGTERM."""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import json
import os
import pty
import re
import select
import signal
import struct
import subprocess
import sys
import termios
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
from conftest import MLXPIPE, REPO, cli_env, interrupt_a_story, run_cli, seed_cache, start_cli

from mlxpipe import __version__
from mlxpipe.cli.signals import Interrupts
from mlxpipe.cli.term import Console, count_records
from mlxpipe.records import BadRecord

RED_ERROR = b"mlxpipe: \x1b[1;31merror\x1b[0m"


def open_pty() -> tuple[int, int]:
    """A pseudo-terminal (master, slave) of 24 rows and 100 columns, like a real window."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    return master, slave


def read_until(fd: int, done: Callable[[bytes], bool], buf: bytes = b"", timeout: float = 240) -> bytes:
    """Read ``fd`` into ``buf`` until ``done(buf)``, end of file or ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not done(buf) and time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.5)
        if ready:
            try:
                data = os.read(fd, 4096)
            except OSError:  # EIO: every slave end is closed, the child is gone
                break
            if not data:
                break
            buf += data
    return buf


def until_eof(buf: bytes) -> bool:
    return False


def spawn_on_pty(
    args: list[str], slave: int, env: dict[str, str], stdin: int = subprocess.DEVNULL
) -> subprocess.Popen[bytes]:
    """Start ``mlxpipe ARGS`` with stderr on the terminal ``slave`` and stdout into a pipe."""
    p = subprocess.Popen(
        [*MLXPIPE, *args], stdin=stdin, stdout=subprocess.PIPE, stderr=slave, env=env, cwd=REPO
    )
    os.close(slave)
    return p


# --- fast: no model ---------------------------------------------------------------------------------


def test_a_signal_at_any_moment_of_the_wait_for_input_ends_it_with_no_read_and_no_record_lost() -> None:
    # Python runs a signal's handler between any two bytecodes. Run the real handler at each line of
    # Interrupts.guard in turn (a line tracer raises what it raises, as a handler would): after the signal no
    # record may be read (a terminal would block forever: seen on an H200 under load), and every record read
    # must still be handed on.
    guard = Interrupts.guard.__code__

    def run(at: int) -> tuple[list[int], list[int], bool, int]:
        interrupts = Interrupts()
        read: list[int] = []
        read_after_signal = False
        lines = 0

        def records() -> Iterator[BadRecord]:
            nonlocal read_after_signal
            for i in range(1, 4):
                read_after_signal |= interrupts.signum is not None
                read.append(i)
                yield BadRecord(i, "-", i, None, "bad")

        def trace(frame: FrameType, event: str, _arg: object) -> Any:
            nonlocal lines
            if frame.f_code is not guard:
                return None
            if event == "line":
                lines += 1
                if lines == at:
                    interrupts._handle(signal.SIGINT, frame)
            return trace

        sys.settrace(trace)
        try:
            handed_on = [record.index for record in interrupts.guard(records())]
        finally:
            sys.settrace(None)
        return read, handed_on, read_after_signal, lines

    read, handed_on, _, lines = run(at=0)
    assert read == handed_on == [1, 2, 3]
    for at in range(1, lines + 1):
        read, handed_on, read_after_signal, _ = run(at)
        assert not read_after_signal, f"a record was read after the signal at line event {at}"
        assert handed_on == read, f"a record read was not handed on (signal at line event {at})"


def test_version_and_python_dash_m() -> None:
    r = run_cli(["--version"])
    assert r.returncode == 0
    assert r.stdout.decode() == f"mlxpipe {__version__}\n"
    assert r.stderr == b""


def test_help_has_examples_in_the_epilog() -> None:
    r = run_cli(["-h"])
    assert r.returncode == 0
    help_text = r.stdout.decode()
    examples = help_text.split("\nexamples:\n", 1)[1]
    assert "mlxpipe --jsonl" in examples and "| jq" in examples
    assert "exit status:" in help_text and "man mlxpipe" in help_text


@pytest.mark.parametrize(
    ("extra_env", "coloured"), [({}, True), ({"NO_COLOR": "1"}, False), ({"TERM": "dumb"}, False)]
)
def test_error_prefix_is_coloured_only_on_a_terminal(extra_env: dict[str, str], coloured: bool) -> None:
    args = ["--template", "{x}", "--template-file", "t.txt"]  # a usage error: found before any model loads
    master, slave = open_pty()
    env = cli_env(**{"TERM": "xterm-256color", **extra_env})
    if not extra_env:
        env.pop("NO_COLOR", None)
    p = spawn_on_pty(args, slave, env, stdin=subprocess.DEVNULL)
    on_terminal = read_until(master, until_eof, timeout=60)
    out, _ = p.communicate(timeout=60)
    os.close(master)
    assert p.returncode == 2
    assert out == b""
    assert (RED_ERROR in on_terminal) is coloured
    assert b"cannot be used together" in on_terminal
    if not coloured:
        assert b"\x1b[" not in on_terminal
    piped = run_cli(args, env=env)  # the same error into a pipe: never coloured
    assert piped.stderr == b"mlxpipe: error: --template and --template-file cannot be used together\n"


def test_progress_total_counts_records_as_the_reader_does(tmp_path: Path) -> None:
    lines, nul = tmp_path / "a.txt", tmp_path / "b.txt"
    lines.write_bytes(b"one\n\n  \r\ntwo\nthree")  # blank lines skipped, a last line without newline counted
    nul.write_bytes(b"x\ny\0\0z\0")
    assert count_records([str(lines)], null=False, max_bytes=100) == 3
    assert count_records([str(lines), str(lines)], null=False, max_bytes=100) == 6
    assert count_records([str(nul)], null=True, max_bytes=100) == 2
    assert count_records([str(lines), "-"], null=False, max_bytes=100) is None  # stdin: read only once
    assert count_records([], null=False, max_bytes=100) is None


def test_console_colours_only_the_error_word(tmp_path: Path) -> None:
    with open(tmp_path / "err", "w+") as f:
        console = Console(f, colour=True)
        console.say("mlxpipe: error (at x.txt:3): bad")
        console.say("mlxpipe[rank 1]: error: lost")
        console.say("mlxpipe: 2 records, 1 failed")
        Console(f, colour=False).say("mlxpipe: error: plain")
        f.seek(0)
        assert f.read().splitlines() == [
            "mlxpipe: \x1b[1;31merror\x1b[0m (at x.txt:3): bad",
            "mlxpipe[rank 1]: \x1b[1;31merror\x1b[0m: lost",
            "mlxpipe: 2 records, 1 failed",
            "mlxpipe: error: plain",
        ]


def test_unknown_option_is_one_line_coloured_on_a_terminal() -> None:
    master, slave = open_pty()
    env = cli_env(TERM="xterm")
    env.pop("NO_COLOR", None)
    p = spawn_on_pty(["--no-such-flag"], slave, env)
    on_terminal = read_until(master, until_eof, timeout=60)
    p.communicate(timeout=60)
    os.close(master)
    assert p.returncode == 2
    assert on_terminal.startswith(RED_ERROR + b": unknown option --no-such-flag")
    assert on_terminal.endswith(b"\r\nTry 'mlxpipe --help'.\r\n") and on_terminal.count(b"\r\n") == 2


# --- the real model ---------------------------------------------------------------------------------


@pytest.mark.model
def test_progress_on_a_terminal_stderr_never_on_stdout(tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("What is the capital of France?\n\nSay hi.\n")
    master, slave = open_pty()
    p = spawn_on_pty(["-n", "6", str(prompts)], slave, cli_env(TERM="xterm"))
    on_terminal = read_until(master, until_eof)
    out, _ = p.communicate(timeout=60)
    os.close(master)
    assert p.returncode == 0
    assert b"/2 [" in on_terminal  # records done out of the total: two records, the blank line skipped
    assert b"tok/s" in on_terminal and b"records/s" in on_terminal
    assert on_terminal.endswith(b"\r")  # erased at the end
    assert out.count(b"\n") == 2 and b"Paris" in out
    assert b"\r" not in out and b"tok/s" not in out and b"\x1b" not in out


@pytest.mark.model
def test_quiet_shows_no_progress_and_errors_keep_their_colour(tmp_path: Path) -> None:
    data = tmp_path / "data.jsonl"
    data.write_text('{"prompt": "Say hi.", "max_tokens": 3}\n{"prompt": \n')
    master, slave = open_pty()
    env = cli_env(TERM="xterm")
    env.pop("NO_COLOR", None)
    p = spawn_on_pty(["--jsonl", "-q", str(data)], slave, env)
    on_terminal = read_until(master, until_eof)
    out, _ = p.communicate(timeout=60)
    os.close(master)
    assert p.returncode == 1
    assert on_terminal.startswith(RED_ERROR + f" (at {data}:2): ".encode())
    assert on_terminal.count(b"\n") == 1 and b"records" not in on_terminal
    assert [json.loads(line)["event"] for line in out.splitlines()][-2:] == ["done", "error"]


@contextlib.contextmanager
def on_terminal(
    argv: list[str], env: dict[str, str] | None = None, cwd: Path = REPO
) -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    """``argv`` with stdin, stdout and stderr on a terminal it controls (so Ctrl-C works), in a session of
    its own. Yields the process and the terminal's master end; afterwards the process is gone and the
    terminal closed."""
    master, slave = open_pty()
    p = subprocess.Popen(
        argv,
        stdin=slave,
        stdout=slave,
        stderr=slave,
        env=env or cli_env(TERM="xterm"),
        cwd=cwd,
        start_new_session=True,
        preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0),
    )
    os.close(slave)
    try:
        yield p, master
    finally:
        if p.poll() is None:
            p.kill()
        os.close(master)


@contextlib.contextmanager
def interactive(args: list[str], state: Path) -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    """mlxpipe with no FILE on a terminal: interactive mode, its history kept under ``state``."""
    with on_terminal([*MLXPIPE, *args], cli_env(TERM="xterm", XDG_STATE_HOME=str(state))) as (p, tty):
        yield p, tty


READY = b"is ready"


def prompts(n: int) -> Callable[[bytes], bool]:
    """True once the terminal shows its ``n``-th prompt after the banner, waiting for a line."""
    return lambda buf: READY in buf and buf.split(READY, 1)[1].count(b"\r\n> ") >= n and buf.endswith(b"> ")


def turns(screen: bytes) -> list[bytes]:
    """What came after each prompt, the typed line's echo included (readline's escapes dropped)."""
    plain = re.sub(rb"\x1b\[[0-9;?]*[A-Za-z]", b"", screen.split(READY, 1)[1])
    return plain.split(b"\r\n> ")[1:]


def streaming(screen: bytes) -> bool:
    """True once the answer to the last line typed is showing some text."""
    lines = turns(screen)[-1].split(b"\r\n") if READY in screen else []
    return len(lines) >= 2 and len(lines[1]) > 20


def other_threads(pid: int) -> list[int]:
    return sorted(int(t) for t in os.listdir(f"/proc/{pid}/task") if int(t) != pid)


@pytest.mark.model
def test_interactive_banner_prompt_conversation_history_and_ctrl_d(tmp_path: Path) -> None:
    with interactive(["-n", "12", "--out", "jsonl", "--no-stream"], tmp_path) as (p, tty):
        screen = read_until(tty, prompts(1))
        banner = screen.split(b"\r\n")[0].decode()
        assert banner.startswith("mlxpipe: SmolLM2-135M-Instruct") and "a conversation" in banner
        assert "Ctrl-D quits" in banner
        os.write(tty, b"My name is Bob.\n")
        screen = read_until(tty, prompts(2), screen)
        os.write(tty, b"What is my name?\n")
        screen = read_until(tty, prompts(3), screen)
        os.write(tty, b"\x1b[A\n")  # the up arrow: the line before, from the history
        screen = read_until(tty, prompts(4), screen)
        os.write(tty, b"\x04")  # Ctrl-D at an empty prompt
        screen = read_until(tty, until_eof, screen)
        assert p.wait(timeout=60) == 0
    done = [json.loads(t.split(b"\r\n")[1]) for t in turns(screen)[:3]]
    assert [d["input"] for d in done] == ["My name is Bob.", "What is my name?", "What is my name?"]
    # The second turn's prompt holds the first turn and its answer: the chat template saw the whole history.
    assert done[1]["prompt_tokens"] > done[0]["prompt_tokens"] + done[0]["tokens"]
    assert done[2]["prompt_tokens"] > done[1]["prompt_tokens"] + done[1]["tokens"]
    history = (tmp_path / "mlxpipe" / "history").read_text().splitlines()
    assert history == ["My name is Bob.", "What is my name?"]  # a line repeated is kept once, as in bash
    assert b"Traceback" not in screen


@pytest.mark.model
def test_interactive_ctrl_c_stops_the_answer_and_twice_at_an_empty_prompt_quits(tmp_path: Path) -> None:
    with interactive(["-n", "200", "--no-chat"], tmp_path) as (p, tty):
        screen = read_until(tty, prompts(1))
        assert b"each line answered on its own" in screen
        os.write(tty, b"Write a long story about a dragon.\n")
        screen = read_until(tty, streaming, screen)  # streaming
        os.write(tty, b"\x03")  # Ctrl-C, delivered by the terminal as SIGINT
        screen = read_until(tty, prompts(2), screen)
        assert p.poll() is None  # the answer stopped, the session goes on
        os.write(tty, b"Say hello.\n")
        screen = read_until(tty, prompts(3), screen)
        os.write(tty, b"\x03")  # at an empty prompt: a hint
        screen = read_until(tty, prompts(4), screen)
        assert b"(Ctrl-C again or Ctrl-D to quit)" in turns(screen)[-2]
        os.write(tty, b"\x03")  # again: quit, by SIGINT as a shell expects
        screen = read_until(tty, until_eof, screen)
        assert p.wait(timeout=60) == -signal.SIGINT
    story, hello = turns(screen)[:2]
    assert story.startswith(b"Write a long story about a dragon.\r\n") and story.count(b"\r\n") == 1
    assert len(story) < 600  # far short of 200 tokens: stopped
    assert hello.startswith(b"Say hello.\r\n") and hello.split(b"\r\n")[1].strip()
    assert b"Traceback" not in screen and b"tok/s" not in screen  # no progress when stdout is the terminal


@pytest.mark.model
@pytest.mark.skipif(not hasattr(ctypes.CDLL(None), "tgkill"), reason="needs tgkill (glibc >= 2.30)")
def test_ctrl_c_taken_by_another_thread_still_reaches_the_prompt_and_the_answer(tmp_path: Path) -> None:
    # The kernel may hand a process's SIGINT to any thread that does not block it (mlx, OpenBLAS and the CUDA
    # runtime start many). CPython 3.12 runs its handler only when the main thread next checks, which a thread
    # blocked reading the terminal never does (the H200's hang): the prompt must still wake up, and an answer
    # in flight still stop.
    libc = ctypes.CDLL(None)
    with interactive(["-n", "200", "--stats"], tmp_path) as (p, tty):
        screen = read_until(tty, prompts(1))
        assert libc.tgkill(p.pid, other_threads(p.pid)[-1], signal.SIGINT) == 0
        screen = read_until(tty, prompts(2), screen)
        assert b"(Ctrl-C again or Ctrl-D to quit)" in screen
        os.write(tty, b"Write a long story about a dragon.\n")
        screen = read_until(tty, streaming, screen)
        assert libc.tgkill(p.pid, other_threads(p.pid)[-1], signal.SIGINT) == 0
        screen = read_until(tty, prompts(3), screen)
        assert libc.tgkill(p.pid, other_threads(p.pid)[-1], signal.SIGINT) == 0  # right after: quits
        screen = read_until(tty, until_eof, screen, timeout=60)
        assert p.wait(timeout=60) == -signal.SIGINT
    assert b"Traceback" not in screen and b"mlxpipe: 1 record, 0 failed" in screen


@pytest.mark.model
def test_an_answer_cut_by_max_tokens_is_marked_on_the_terminal_only() -> None:
    argv = ["-n", "3", "-p", "Write a long story about a dragon."]
    with on_terminal([*MLXPIPE, *argv], cli_env(TERM="xterm", NO_COLOR="1")) as (p, tty):
        screen = read_until(tty, until_eof)
        assert p.wait(timeout=60) == 0
    piped = run_cli(argv)
    assert piped.stdout.count(b"\n") == 1 and b"cut" not in piped.stdout + piped.stderr  # data unchanged
    assert screen == piped.stdout.rstrip(b"\n") + b" [cut at 3 tokens: --max-tokens]\r\n"


@pytest.mark.model
def test_a_shell_loop_stops_at_the_first_ctrl_c(tmp_path: Path) -> None:
    # bash goes on with a loop when its child exits 130, and stops only when the child was killed by SIGINT.
    command = " ".join(MLXPIPE) + " -n 200 -p 'Write a long story about a dragon.'"
    script = f"for i in 1 2 3; do {command} > out.$i; echo ran $i >> ran; done; echo loop ended >> ran"
    with on_terminal(["bash", "-c", script], cli_env(TERM="xterm"), cwd=tmp_path) as (p, tty):
        screen = b""
        deadline = time.monotonic() + 240
        while not ((tmp_path / "out.1").exists() and (tmp_path / "out.1").stat().st_size > 20):
            assert time.monotonic() < deadline and p.poll() is None
            screen = read_until(tty, until_eof, screen, timeout=0.2)
        os.write(tty, b"\x03")
        screen = read_until(tty, until_eof, screen)
        ran = (tmp_path / "ran").read_text() if (tmp_path / "ran").exists() else ""
        assert p.wait(timeout=60) == -signal.SIGINT, (ran, screen)  # bash ended by SIGINT, as it should
    assert not (tmp_path / "ran").exists() and not (tmp_path / "out.2").exists()
    assert (
        b"mlxpipe: interrupted after 1 of 1 record (1 cut short)\r\n" in screen and b"Traceback" not in screen
    )


def test_a_background_command_of_a_script_keeps_the_sigint_its_shell_ignores(tmp_path: Path) -> None:
    # A non-interactive shell starts `cmd &` with SIGINT (and SIGQUIT) ignored, so that the terminal's Ctrl-C,
    # sent to the whole process group, stops only the foreground command: mlxpipe keeps that SIG_IGN.
    command = " ".join(MLXPIPE) + " --jsonl -n 200 -p 'Write a long story about a dragon.'"
    script = f"{command} > out 2> err & echo $! > pid; wait $!; echo $? > status"
    shell = subprocess.Popen(["bash", "-c", script], env=cli_env(), cwd=tmp_path)
    deadline = time.monotonic() + 240
    while not (tmp_path / "out").exists() or b'"event":"chunk"' not in (tmp_path / "out").read_bytes():
        assert time.monotonic() < deadline and shell.poll() is None
        time.sleep(0.05)
    os.kill(int((tmp_path / "pid").read_text()), signal.SIGINT)  # in the middle of the answer
    assert shell.wait(timeout=240) == 0
    assert (tmp_path / "status").read_text() == "0\n", (tmp_path / "err").read_text()
    done = [e for e in map(json.loads, (tmp_path / "out").read_text().splitlines()) if e["event"] == "done"]
    assert len(done) == 1 and done[0]["finish_reason"] in ("length", "stop"), done  # not "interrupted"
    assert (tmp_path / "err").read_text() == ""


@pytest.fixture(scope="module")
def interpreter_start() -> float:
    """Seconds Python takes here to start and exit doing nothing (the slowest of three): a Ctrl-C in that
    time meets Python's own handler, before any code of mlxpipe has run."""
    times = []
    for _ in range(3):
        started = time.perf_counter()
        subprocess.run([sys.executable, "-c", "pass"], env=cli_env(), check=True)
        times.append(time.perf_counter() - started)
    return max(times)


@pytest.mark.parametrize("delay", [0.05, 0.3, 0.8])
@pytest.mark.model
def test_ctrl_c_at_any_moment_ends_the_process_by_sigint_without_a_traceback(
    delay: float, interpreter_start: float
) -> None:
    # Wherever it lands (the imports, the model's load, the answer), one SIGINT ends the process by SIGINT;
    # stdin stays open, so it cannot end any other way. The delays count from the interpreter's start-up.
    p = start_cli(["-n", "200"])
    assert p.stdin and p.stdout and p.stderr
    p.stdin.write(b"Write a long story about a dragon.\n")
    p.stdin.flush()
    time.sleep(interpreter_start + delay)
    p.send_signal(signal.SIGINT)
    try:
        p.wait(timeout=120)
    finally:
        p.kill()
        p.stdin.close()
    err = p.stderr.read()
    assert p.returncode == -signal.SIGINT
    # Before the load: nothing to say; after it, the record in flight was cut short or not yet read.
    assert err in (
        b"",
        b"mlxpipe: interrupted after 0 records\n",
        b"mlxpipe: interrupted after 1 record (1 cut short)\n",
    ), err


@pytest.mark.model
def test_sigterm_ends_the_record_with_a_done_line_and_the_process_by_sigterm() -> None:
    p = start_cli(["--jsonl", "-n", "200", "--batch", "1"])
    assert p.stderr
    lines = interrupt_a_story(p, signal.SIGTERM)
    assert p.wait(timeout=60) == -signal.SIGTERM  # a shell's $? is 143
    assert lines[-1]["event"] == "done" and lines[-1]["finish_reason"] == "interrupted"
    assert sum(e["event"] == "done" for e in lines) == 1  # the second record was never started
    assert p.stderr.read() == b"mlxpipe: interrupted by SIGTERM after 1 record (1 cut short)\n"


@pytest.mark.model
def test_a_first_conversion_shows_its_progress_on_a_terminal_only(tmp_path: Path) -> None:
    # The embedded GGUF converted into an empty cache: a progress line on a terminal, none in a pipe.
    for home in ("tty", "pipe"):  # the compiled libraries: only the model is new to these caches
        seed_cache(tmp_path / home, "gemv", "kernels")
    master, slave = open_pty()
    env = cli_env(XDG_CACHE_HOME=str(tmp_path / "tty"), COLUMNS="100")
    p = spawn_on_pty(["-n", "2", "-p", "hi"], slave, env)
    shown = read_until(master, until_eof)
    assert p.wait(timeout=240) == 0
    os.close(master)
    assert b"mlxpipe: converting SmolLM2-135M-Instruct.Q4_1.gguf (once)" in shown, shown
    piped = run_cli(["-n", "2", "-p", "hi"], env=cli_env(XDG_CACHE_HOME=str(tmp_path / "pipe")))
    assert piped.returncode == 0 and b"converting" not in piped.stderr
