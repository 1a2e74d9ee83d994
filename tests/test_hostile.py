"""Nothing lost under a hostile environment (issue 20), fast: the real command line with the fake engine
(tests/fakecli.py) against real OS objects: non-blocking pipes, /dev/full, closed descriptors, FIFOs, a FILE
removed mid-run, EIO from /proc/self/mem, a file size limit, names in any bytes, control characters.

Every test checks the documented exit status, that no traceback was printed and that every record is
accounted for: on stdout (or the --resume FILE) as whole lines, or in the one-line error that says why not.
"""

from __future__ import annotations

import array
import fcntl
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import termios
import threading
import time
from pathlib import Path

import pytest
from conftest import REPO, cli_env

from mlxpipe.cli.streams import write_all
from mlxpipe.events import Error, decode_tps

FAKECLI = [sys.executable, str(REPO / "tests" / "fakecli.py")]
MODES = [pytest.param(["--batch", "1"], id="sequential"), pytest.param(["--batch", "3"], id="batch")]
EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_OUTPUT = 0, 1, 2, 4


def fake(args: list[str], **kwargs: object) -> subprocess.CompletedProcess[bytes]:
    """Run the real command line with the fake engine; stdout and stderr captured unless given."""
    if "stdout" not in kwargs and "stderr" not in kwargs and "capture_output" not in kwargs:
        kwargs["capture_output"] = True
    return subprocess.run([*FAKECLI, *args], env=cli_env(), cwd=REPO, timeout=120, **kwargs)  # type: ignore[call-overload, no-any-return]


def sh(script: str, **env: str) -> subprocess.CompletedProcess[bytes]:
    """Run ``script`` in bash with ``$MLXPIPE`` the fake command line; says its own status as ``rc=N``."""
    return subprocess.run(
        ["bash", "-c", script],
        capture_output=True,
        env=cli_env(MLXPIPE=" ".join(FAKECLI), **env),
        cwd=REPO,
        timeout=120,
    )


def lines(data: bytes) -> list[dict]:
    """Every line of JSONL output, each of which must be whole JSON."""
    assert data == b"" or data.endswith(b"\n"), data[-200:]
    return [json.loads(x) for x in data.split(b"\n")[:-1]]


def finals(data: bytes) -> list[dict]:
    return [e for e in lines(data) if e["event"] in ("done", "error")]


def wait_until_full(fd: int, p: subprocess.Popen[bytes]) -> None:
    """Wait until the pipe read at ``fd`` holds what a pipe holds (so the writer has met a full pipe)."""
    avail = array.array("i", [0])
    while p.poll() is None:
        fcntl.ioctl(fd, termios.FIONREAD, avail)
        if avail[0] >= 60_000:  # of 64 KiB
            return
        time.sleep(0.01)


def no_traceback(err: bytes) -> None:
    assert b"Traceback" not in err and b"Exception ignored" not in err, err.decode(errors="replace")


def jsonl_input(path: Path, n: int, bad: tuple[int, ...] = ()) -> Path:
    """``n`` records with ids r1…rN; those numbered in ``bad`` have a prompt that is not a string."""
    path.write_text(
        "".join(
            json.dumps({"id": f"r{i}", "prompt": 5 if i in bad else f"p{i}"}) + "\n" for i in range(1, n + 1)
        )
    )
    return path


# ---------------------------------------------------------------------------------------------
# 1. A write may write less than asked, or nothing; a read may have nothing yet


def test_write_all_finishes_on_a_full_non_blocking_pipe() -> None:
    r, w = os.pipe()
    os.set_blocking(w, False)
    data = bytes(range(256)) * 8192  # 2 MiB: thirty-odd times what the pipe holds
    got = bytearray()

    def drain() -> None:
        while chunk := os.read(r, 4096):  # small reads: the writer finds the pipe full again and again
            got.extend(chunk)

    reader = threading.Thread(target=drain)
    reader.start()
    with open(w, "wb", buffering=0) as out:
        write_all(out, data)
    reader.join(timeout=60)
    os.close(r)
    assert bytes(got) == data


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("stream", [[], ["--no-stream"]], ids=["stream", "no-stream"])
def test_non_blocking_stdout_and_a_slow_reader_get_every_line(
    tmp_path: Path, mode: list[str], stream: list[str]
) -> None:
    inp = tmp_path / "in.jsonl"
    inp.write_text(
        "".join(json.dumps({"id": i, "prompt": "p", "pad": "x" * 20_000}) + "\n" for i in range(10))
    )
    r, w = os.pipe()
    os.set_blocking(w, False)  # as a parent like Node leaves it: the file description is shared
    p = subprocess.Popen(
        [*FAKECLI, "--jsonl", *stream, *mode, str(inp)],
        stdout=w,
        stderr=subprocess.PIPE,
        env=cli_env(),
        cwd=REPO,
    )
    os.close(w)
    wait_until_full(r, p)  # the reader is slow: mlxpipe meets a full non-blocking pipe
    with open(r, "rb") as out:
        data = out.read()
    err = p.stderr.read() if p.stderr else b""
    assert p.wait(timeout=60) == EXIT_OK, err
    no_traceback(err)
    done = finals(data)
    assert [e["id"] for e in done] == list(range(10))
    assert all(e["input"]["pad"] == "x" * 20_000 for e in done)


@pytest.mark.parametrize("mode", MODES)
def test_non_blocking_stdin_whose_writer_pauses_is_waited_for(mode: list[str]) -> None:
    r, w = os.pipe()
    os.set_blocking(r, False)
    p = subprocess.Popen(
        [*FAKECLI, "--jsonl", "--no-stream", *mode],
        stdin=r,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=cli_env(),
        cwd=REPO,
    )
    os.close(r)
    assert p.stdout and p.stderr
    os.write(w, b'"first"\n')
    first = json.loads(p.stdout.readline())  # answered while the writer pauses: the input has not ended
    assert first["id"] == 1 and first["event"] == "done"
    os.write(w, b'"second"\n"third"')  # the last without a newline: it counts when the input ends
    os.close(w)
    rest, err = p.communicate(timeout=60)
    assert p.returncode == EXIT_OK, err
    no_traceback(err)
    assert [e["input"] for e in finals(rest)] == ["second", "third"]


def test_non_blocking_stderr_gets_every_error_line() -> None:
    n = 3000  # about 250 kB of messages: more than a pipe holds
    data = b"".join(b'{"id": %d, "prompt": 5}\n' % i for i in range(n))
    r, w = os.pipe()
    os.set_blocking(w, False)
    p = subprocess.Popen(
        [*FAKECLI, "--jsonl"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=w,
        env=cli_env(),
        cwd=REPO,
    )
    os.close(w)
    err = bytearray()

    def drain() -> None:
        wait_until_full(r, p)  # a slow reader: mlxpipe meets a full non-blocking pipe
        with open(r, "rb") as f:
            err.extend(f.read())

    reader = threading.Thread(target=drain)
    reader.start()
    out, _ = p.communicate(data, timeout=60)
    reader.join(timeout=60)
    assert p.returncode == EXIT_FAILED
    assert len(finals(out)) == n
    said = bytes(err).decode().splitlines()
    assert len(said) == n and all(x.startswith("mlxpipe: error (at <stdin>:") for x in said)


# ---------------------------------------------------------------------------------------------
# 2. Only a broken stdout means "the reader has enough"


@pytest.mark.parametrize("mode", MODES)
def test_stdout_on_a_full_device_is_a_one_line_error_and_exit_4(tmp_path: Path, mode: list[str]) -> None:
    inp = jsonl_input(tmp_path / "in.jsonl", 5)
    with open("/dev/full", "wb") as full:
        r = fake(["--jsonl", *mode, str(inp)], stdout=full, stderr=subprocess.PIPE)
    assert r.returncode == EXIT_OUTPUT
    assert r.stderr.decode() == (
        "mlxpipe: error: cannot write to stdout: No space left on device; the records after the last whole "
        "line were not written\n"
    )


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("stderr", ["reader-gone", "/dev/full", "closed"])
def test_a_failing_stderr_loses_no_record_and_exits_4(tmp_path: Path, mode: list[str], stderr: str) -> None:
    inp = jsonl_input(tmp_path / "in.jsonl", 7, bad=(2,))
    if stderr == "reader-gone":  # the reader of stderr has gone: EPIPE on the first message
        rfd, wfd = os.pipe()
        os.close(rfd)
        r = fake(["--jsonl", *mode, str(inp)], stdout=subprocess.PIPE, stderr=wfd)
        os.close(wfd)
        out, status = r.stdout, r.returncode
    else:
        redirect = "2>/dev/full" if stderr == "/dev/full" else "2>&-"
        run = f"$MLXPIPE --jsonl {' '.join(mode)} {inp} {redirect}"
        r = sh(f'out=$({run}); rc=$?; printf "%s\\n" "$out"; echo "rc=$rc"')
        *body, last = r.stdout.decode().split("\n")[:-1]
        out, status = ("\n".join(body) + "\n").encode(), int(last.removeprefix("rc="))
        no_traceback(r.stderr)
    assert status == EXIT_OUTPUT
    assert [(e["id"], e["event"]) for e in finals(out)] == [
        (f"r{i}", "error" if i == 2 else "done") for i in range(1, 8)
    ]


def test_a_closed_stderr_with_nothing_to_say_is_fine(tmp_path: Path) -> None:
    inp = jsonl_input(tmp_path / "in.jsonl", 3)
    r = sh(f'out=$($MLXPIPE --jsonl {inp} 2>&-); rc=$?; printf "%s\\n" "$out"; echo "rc=$rc"')
    assert r.stdout.decode().splitlines()[-1] == "rc=0"
    assert len(finals(("\n".join(r.stdout.decode().splitlines()[:-1]) + "\n").encode())) == 3


@pytest.mark.parametrize("mode", MODES)
def test_a_closed_stdout_is_an_error_unless_output_goes_to_the_resume_file(
    tmp_path: Path, mode: list[str]
) -> None:
    inp, out = jsonl_input(tmp_path / "in.jsonl", 4), tmp_path / "out.jsonl"
    m = " ".join(mode)
    r = sh(f'$MLXPIPE --jsonl {m} {inp} >&-; echo "rc=$?" >&2')
    assert r.stderr.decode() == (
        "mlxpipe: error: cannot write to stdout: Bad file descriptor; the records after the last whole line "
        "were not written\nrc=4\n"
    )
    # With --resume nothing goes to stdout: a closed 1 must not become FILE's descriptor, nor matter.
    r = sh(f'$MLXPIPE --jsonl {m} --resume {out} {inp} >&-; echo "rc=$?" >&2')
    assert r.stderr.decode() == "rc=0\n"
    assert [e["id"] for e in finals(out.read_bytes())] == ["r1", "r2", "r3", "r4"]


def _limit_file_size(limit: int) -> None:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails with EFBIG
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))


@pytest.mark.parametrize("mode", MODES)
def test_resume_file_that_cannot_grow_keeps_whole_lines_and_a_rerun_finishes(
    tmp_path: Path, mode: list[str]
) -> None:
    inp, out = jsonl_input(tmp_path / "in.jsonl", 30), tmp_path / "out.jsonl"
    args = [*FAKECLI, "--jsonl", *mode, "--resume", str(out), str(inp)]
    # 2,000 bytes: a line is about 200, so a write is cut short in the middle of one (a short write)
    r = subprocess.run(
        args,
        capture_output=True,
        env=cli_env(),
        cwd=REPO,
        timeout=60,
        preexec_fn=lambda: _limit_file_size(2000),
    )
    assert r.returncode == EXIT_OUTPUT and r.stdout == b""
    assert r.stderr.decode() == (
        f"mlxpipe: error: cannot write to --resume file {out}: File too large; the records after the last "
        "whole line were not written\n"
    )
    first = finals(out.read_bytes())  # whole lines only: the cut-short one was taken back
    assert 0 < len(first) < 30
    r = subprocess.run(args, capture_output=True, env=cli_env(), cwd=REPO, timeout=60)
    assert r.returncode == EXIT_OK and r.stderr == b""
    assert [e["id"] for e in finals(out.read_bytes())] == [f"r{i}" for i in range(1, 31)]


def test_a_reader_of_stdout_that_goes_away_is_still_quiet(tmp_path: Path) -> None:
    inp = jsonl_input(tmp_path / "in.jsonl", 2000, bad=(1,))
    r = sh(
        f'$MLXPIPE --jsonl {inp} 2>{tmp_path / "err"} | head -c 100 >/dev/null; echo "rc=${{PIPESTATUS[0]}}"'
    )
    assert r.stdout == b"rc=0\n"
    assert (
        tmp_path / "err"
    ).read_bytes() == b"mlxpipe: error (at %s:1): 'prompt' must be a string, not a number\n" % bytes(inp)


# ---------------------------------------------------------------------------------------------
# 3. Input that fails mid-run: an error line for that input, and the run goes on


@pytest.mark.parametrize("mode", MODES)
def test_a_file_with_an_io_error_is_one_error_line_and_the_next_file_is_read(
    tmp_path: Path, mode: list[str]
) -> None:
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("one\ntwo\n")
    b.write_text("three\n")
    r = fake(["--out", "jsonl", *mode, str(a), "/proc/self/mem", str(b)])
    no_traceback(r.stderr)
    assert r.returncode == EXIT_FAILED
    out = finals(r.stdout)
    assert [(e["id"], e["event"]) for e in out] == [(1, "done"), (2, "done"), (3, "error"), (4, "done")]
    assert out[2] == {
        "event": "error",
        "id": 3,
        "file": "/proc/self/mem",
        "line": 1,
        "error": "cannot read /proc/self/mem: Input/output error",
    }
    assert (
        r.stderr.decode()
        == "mlxpipe: error (at /proc/self/mem:1): cannot read /proc/self/mem: Input/output error\n"
    )


@pytest.mark.parametrize("mode", MODES)
def test_a_file_removed_before_its_turn_is_one_error_line(tmp_path: Path, mode: list[str]) -> None:
    fifo, gone, last = tmp_path / "fifo", tmp_path / "gone.txt", tmp_path / "last.txt"
    os.mkfifo(fifo)
    gone.write_text("never read\n")
    last.write_text("last\n")
    p = subprocess.Popen(
        [*FAKECLI, "--out", "jsonl", "--no-stream", *mode, str(fifo), str(gone), str(last)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=cli_env(),
        cwd=REPO,
    )
    assert p.stdout
    with open(fifo, "wb", buffering=0) as w:  # the start's checks did not open the FIFO (that would hang)
        w.write(b"first\n")
        assert json.loads(p.stdout.readline())["input"] == "first"  # FIFO's turn: gone.txt still there
        gone.unlink()
    out, err = p.communicate(timeout=60)
    no_traceback(err)
    assert p.returncode == EXIT_FAILED
    assert [(e["file"] if e["event"] == "error" else e["input"]) for e in finals(out)] == [str(gone), "last"]
    assert err.decode() == f"mlxpipe: error (at {gone}:1): cannot read {gone}: No such file or directory\n"


def test_a_closed_stdin_is_one_error_line() -> None:
    r = sh('$MLXPIPE --jsonl <&-; echo "rc=$?"')
    assert r.stdout.decode() == (
        '{"event":"error","id":1,"file":"<stdin>","line":1,"error":"cannot read <stdin>: '
        'Bad file descriptor"}\nrc=1\n'
    )
    assert r.stderr == b"mlxpipe: error (at <stdin>:1): cannot read <stdin>: Bad file descriptor\n"


def test_special_files_as_input(tmp_path: Path) -> None:
    sock = tmp_path / "sock"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(sock))
        r = fake([str(sock)])
    assert (
        r.returncode == EXIT_USAGE
        and r.stderr == f"mlxpipe: error: cannot open {sock}: is a socket, not a file\n".encode()
    )
    r = fake([str(tmp_path)])
    assert (
        r.returncode == EXIT_USAGE
        and r.stderr == f"mlxpipe: error: cannot open {tmp_path}: Is a directory\n".encode()
    )
    r = fake(["--out", "jsonl", "/dev/null"])  # a device: read like a file (this one is empty)
    assert r.returncode == EXIT_OK and r.stdout == b"" and r.stderr == b""


# ---------------------------------------------------------------------------------------------
# 4. --resume FILE that is not ours, or not a file


def test_resume_refuses_notes_without_a_newline_and_leaves_them(tmp_path: Path) -> None:
    inp, notes = jsonl_input(tmp_path / "in.jsonl", 2), tmp_path / "notes.txt"
    notes.write_bytes(b"precious notes, no newline at end")
    r = fake(["--jsonl", "--resume", str(notes), str(inp)])
    assert r.returncode == EXIT_USAGE and r.stdout == b""
    assert r.stderr.decode() == (
        f"mlxpipe: error: --resume file {notes}:1 is not mlxpipe JSONL output (its last line is not an "
        "mlxpipe event cut short); refusing to cut or append to it\n"
    )
    assert notes.read_bytes() == b"precious notes, no newline at end"


@pytest.mark.parametrize(
    ("tail", "ours"),
    [
        (b'{"event":"done","id":"r', True),
        (b'{"ev', True),
        (b"{", True),
        (b"notes", False),
        (b'{"id": 1', False),
    ],
)
def test_resume_cuts_only_a_tail_that_is_the_start_of_an_event(
    tmp_path: Path, tail: bytes, ours: bool
) -> None:
    inp, out = jsonl_input(tmp_path / "in.jsonl", 2), tmp_path / "out.jsonl"
    whole = b'{"event":"done","id":"r1","text":"x","finish_reason":"stop"}\n'
    out.write_bytes(whole + tail)
    r = fake(["--jsonl", "--resume", str(out), str(inp)])
    no_traceback(r.stderr)
    if ours:
        assert r.returncode == EXIT_OK
        assert r.stderr.decode() == f"mlxpipe: {out}: cut off a torn last line ({len(tail)} bytes)\n"
        assert [e["id"] for e in finals(out.read_bytes())] == ["r1", "r2"]
    else:
        assert r.returncode == EXIT_USAGE and out.read_bytes() == whole + tail


def test_resume_refuses_special_files_and_its_own_input(tmp_path: Path) -> None:
    inp = jsonl_input(tmp_path / "in.jsonl", 2)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for special in ("/dev/null", "/dev/full", str(fifo)):  # a FIFO must not hang, /dev/null not swallow
        r = fake(["--jsonl", "--resume", special, str(inp)])
        assert r.returncode == EXIT_USAGE and r.stdout == b"", special
        assert (
            r.stderr.decode()
            == f"mlxpipe: error: --resume file {special} is not a regular file (a FIFO, device or socket)\n"
        )
    done = tmp_path / "done.jsonl"
    done.write_text('{"event":"done","id":"r1","text":"x","finish_reason":"stop"}\n')
    before = done.read_bytes()
    message = (
        f"mlxpipe: error: --resume file {done} is also an input of this run: it would read its own output\n"
    )
    r = fake(["--jsonl", "--resume", str(done), str(inp), str(done)])
    assert r.returncode == EXIT_USAGE and r.stderr.decode() == message
    with open(done, "rb") as stdin:
        r = fake(["--jsonl", "--resume", str(done)], stdin=stdin, capture_output=True)
    assert r.returncode == EXIT_USAGE and r.stderr.decode() == message
    assert done.read_bytes() == before


# ---------------------------------------------------------------------------------------------
# 6. Names and messages in any bytes


@pytest.mark.parametrize("mode", MODES)
def test_a_name_in_any_bytes_round_trips_in_json_and_is_escaped_on_stderr(
    tmp_path: Path, mode: list[str]
) -> None:
    name = os.fsencode(tmp_path) + b"/caf\xe9 \x1b[2J\nmlxpipe: error: forged.jsonl"
    with open(name, "wb") as f:
        f.write(b'"ok"\n5\n')
    r = subprocess.run(
        [*FAKECLI, "--jsonl", *mode, name], capture_output=True, env=cli_env(), cwd=REPO, timeout=60
    )
    no_traceback(r.stderr)
    assert r.returncode == EXIT_FAILED
    r.stdout.decode("utf-8")  # every line valid UTF-8
    error = finals(r.stdout)[1]
    assert os.fsencode(error["file"]) == name  # the bytes, back
    said = r.stderr.decode()
    assert said.count("\n") == 1 and "\x1b" not in said  # one line; nothing raw reaches the terminal
    shown = os.fsdecode(os.fsencode(tmp_path)) + "/caf\\xe9 \\x1b[2J\\nmlxpipe: error: forged.jsonl"
    assert said == f"mlxpipe: error (at {shown}:2): a record must be a JSON object or string, not a number\n"
    event = Error(1, 1, os.fsdecode(name), 2, "x")
    assert json.loads(event.to_json().encode())["file"] == os.fsdecode(name)


def test_control_characters_in_a_schema_do_not_reach_the_terminal() -> None:
    r = fake(["--json-schema", '{"type": "\\u001b[2J\\nnumber"}'], input=b"hi\n")
    assert r.returncode == EXIT_USAGE
    assert r.stderr.count(b"\n") == 1 and b"\x1b" not in r.stderr
    assert r.stderr == b"mlxpipe: error: --json-schema: invalid json schema: Invalid type: \\x1b[2J\n"


# ---------------------------------------------------------------------------------------------
# 7. Usage errors, not tracebacks; one set of bounds for the command line and records


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--regex", "\udcff"], "--regex is not valid UTF-8 text (it holds the byte \\xff)"),
        (["--system", "a\udcfe"], "--system is not valid UTF-8 text (it holds the byte \\xfe)"),
        (["--stop", "\udcff"], "--stop is not valid UTF-8 text (it holds the byte \\xff)"),
        (["--template", "{line}\udcff"], "--template is not valid UTF-8 text (it holds the byte \\xff)"),
        (["--temp", "inf"], "--temp must be a number in [0, 100], got inf"),
        (["--temp", "1e308"], "--temp must be a number in [0, 100], got 1e+308"),
        (["--top-k", "99999999"], "--top-k must be an integer in [0, 1048576], got 99999999"),
        (["-n", "99999999"], "--max-tokens must be an integer in [1, 1048576], got 99999999"),
        (["--stop", ""], "--stop must be a non-empty string or a list of them"),
        (
            ["--repetition-penalty", "inf"],
            "--repetition-penalty must be a number above 0 and at most 100 (1 is off), got inf",
        ),
        (
            ["--repetition-penalty", "0"],
            "--repetition-penalty must be a number above 0 and at most 100 (1 is off), got 0",
        ),
        (["--template", " "], "the template gives an empty prompt"),
        (["--regex", "[^\\s\\S]"], "--regex: regex admits no answer: nothing can match it"),
        (
            ["--json-schema", '{"$ref": "#"}'],
            "--json-schema: json schema admits no answer: nothing can match it",
        ),
    ],
)
def test_bad_arguments_are_usage_errors(args: list[str], message: str) -> None:
    r = subprocess.run(
        [*FAKECLI, *[os.fsencode(a) for a in args]],
        input=b"hi\n",
        capture_output=True,
        env=cli_env(),
        cwd=REPO,
        timeout=60,
    )
    assert r.returncode == EXIT_USAGE and r.stdout == b""
    assert r.stderr.decode() == f"mlxpipe: error: {message}\n"


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"\x00\xff\xfe binary", "is not UTF-8 text (invalid byte at 1)"),
        (b"nul \x00 {line}", "is not text (it holds a NUL byte)"),
        (b"x" * (1 << 20) + b"y", "is larger than 1048576 bytes"),
    ],
    ids=["binary", "nul", "too-large"],  # the test id reaches subprocesses' environment (PYTEST_CURRENT_TEST)
)
def test_a_template_file_that_is_not_text_is_a_usage_error(
    tmp_path: Path, content: bytes, message: str
) -> None:
    f = tmp_path / "t.txt"
    f.write_bytes(content)
    r = fake(["--template-file", str(f)], input=b"hi\n")
    assert (
        r.returncode == EXIT_USAGE and r.stderr.decode() == f"mlxpipe: error: template file {f} {message}\n"
    )
    r = fake(["--template-file", "/dev/zero"], input=b"hi\n")  # endless: refused without eating memory
    assert r.returncode == EXIT_USAGE and b"larger than" in r.stderr


def test_a_blank_prompt_from_a_template_is_refused_in_lines_mode_as_in_jsonl() -> None:
    from mlxpipe.reader import InputFormat, RecordReader
    from mlxpipe.records import BadRecord, Record, Settings, Template

    reader = RecordReader(InputFormat(template=Template.parse("{line}")), Settings())
    reader.count = 1
    blank = reader.parse("t", 1, b"\t")  # read() skips blank lines; parse() is also the Python API's way in
    assert isinstance(blank, BadRecord) and blank.error == "the template gave an empty prompt"
    assert isinstance(reader.parse("t", 2, b"x"), Record)


# ---------------------------------------------------------------------------------------------
# 8. Small ones


def test_tps_has_no_rate_for_one_token() -> None:
    assert decode_tps(0, 0.0, 1.0) == 0.0
    assert decode_tps(1, 5.0, 5.0) == 0.0  # the first token: no 1e9
    assert decode_tps(2, 5.0, 5.0) == 0.0
    assert decode_tps(3, 5.0, 6.0) == 2.0


def _safetensors(path: Path, nbytes: int) -> None:
    header = json.dumps({"w": {"dtype": "U8", "shape": [nbytes], "data_offsets": [0, nbytes]}}).encode()
    path.write_bytes(len(header).to_bytes(8, "little") + header + b"\x01" * nbytes)


def test_a_damaged_cached_conversion_is_converted_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mlxpipe.models import cache
    from mlxpipe.models.source import ModelSource

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    conversions: list[Path] = []

    def convert(gguf: Path, folder: Path) -> None:
        conversions.append(folder)
        (folder / "config.json").write_text("{}")
        _safetensors(folder / "model.safetensors", 1000)

    monkeypatch.setattr(cache, "convert_gguf", convert)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    source = ModelSource("gguf", str(gguf), gguf)
    folder = Path(cache.materialize(source))
    assert cache.materialize(source) == str(folder) and len(conversions) == 1  # whole: reused
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:500])  # cut short, as a full disk or a killed copy leaves it
    assert cache.materialize(source) == str(folder) and len(conversions) == 2
    assert weights.stat().st_size > 1000
    weights.unlink()  # missing altogether
    assert cache.materialize(source) == str(folder) and len(conversions) == 3


def test_progress_total_of_a_file_that_cannot_be_read_is_unknown() -> None:
    from mlxpipe.cli.term import count_records

    assert count_records(["/proc/self/mem"], null=False, max_bytes=100) is None  # EIO: no total, no crash
