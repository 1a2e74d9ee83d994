"""Nothing lost (issue 8), fast: fuzzing the reader and renderer, flat memory, kill -9 and --resume.

These use FakeEngine (in process, or through tests/fakecli.py, the real command line with the fake
engine in place of the model); the same invariants on the real model are in test_faults.py.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from io import BytesIO
from pathlib import Path

from conftest import REPO, FakeEngine, cli_env
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlxpipe.cli.render import Renderer
from mlxpipe.events import Done, Error
from mlxpipe.pipeline import run
from mlxpipe.reader import InputFormat, RecordReader
from mlxpipe.records import Settings

FAKECLI = [sys.executable, str(REPO / "tests" / "fakecli.py")]

# ---------------------------------------------------------------------------------------------
# Property: whatever the bytes, every record gets exactly one final line, and nothing raises.

FIELDS = [
    "prompt",
    "id",
    "messages",
    "system",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
]
FIELDS += ["stop", "json_schema", "choices"]
scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats()  # NaN and infinities included: json.dumps writes them as NaN/Infinity
    | st.text(max_size=12)
)
values = st.recursive(
    scalars,
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=5), c, max_size=3),
    max_leaves=8,
)
messages = st.lists(
    st.fixed_dictionaries({}, optional={"role": st.sampled_from(["user", "system", 1]), "content": values}),
    max_size=3,
)
objects = st.fixed_dictionaries(
    {},
    optional={
        **dict.fromkeys(FIELDS, values),
        "prompt": st.text(max_size=20) | values,
        "messages": messages | values,
        "max_tokens": st.integers(min_value=-3, max_value=9000) | values,
    },
)


def _dump(value: object, ascii_only: bool) -> bytes:
    return json.dumps(value, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")


json_line = st.builds(_dump, objects | values, st.booleans())
garbage = st.binary(max_size=30) | st.text(max_size=30).map(lambda t: t.encode("utf-8", "surrogatepass"))
mangled = st.builds(lambda b, cut: b[:cut], json_line, st.integers(0, 40))  # torn JSON
deep = st.integers(1, 200).map(lambda n: b"[" * n + b"]" * n)
line = json_line | garbage | mangled | deep | st.sampled_from([b"", b"  ", b"\r", b"\xef\xbb\xbf", b'"x"\r'])


def expected_records(data: bytes, sep: bytes, max_bytes: int) -> int:
    """How many records the input holds, counted independently of the reader."""
    pieces = data.split(sep)
    if pieces and pieces[-1] == b"":
        pieces.pop()  # the input ended with a separator
    count = 0
    for n, piece in enumerate(pieces):
        if len(piece) > max_bytes:
            count += 1
            continue
        if piece.endswith(b"\r"):
            piece = piece[:-1]
        if n == 0 and piece.startswith(b"\xef\xbb\xbf"):
            piece = piece[3:]
        count += bool(piece.strip())
    return count


FUZZ_EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "1000"))
lines_fed: list[int] = []


@settings(max_examples=FUZZ_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(
    lines=st.lists(line, min_size=10, max_size=20),
    jsonl=st.booleans(),
    null=st.booleans(),
    ending=st.sampled_from([b"", b"sep"]),
    max_bytes=st.sampled_from([1 << 20, 24]),
    stream=st.booleans(),
)
def check_any_input(
    lines: list[bytes], jsonl: bool, null: bool, ending: bytes, max_bytes: int, stream: bool
) -> None:
    """Whatever the bytes: no exception, and exactly one final event and line per record, in order."""
    lines_fed.append(len(lines))
    sep = b"\0" if null else b"\n"
    data = sep.join(lines) + (sep if ending else b"")
    reader = RecordReader(InputFormat(jsonl=jsonl, null=null, max_line_bytes=max_bytes), Settings())
    out_jsonl, out_text = BytesIO(), BytesIO()
    as_jsonl = Renderer(out_jsonl, jsonl=True, stream=stream, one_line=False, null=null)
    as_text = Renderer(out_text, jsonl=False, stream=stream, one_line=True, null=null)
    finals = []
    for event in run(reader.read("in", BytesIO(data)), FakeEngine()):  # type: ignore[arg-type]
        as_jsonl.write(event)
        as_text.write(event)
        if isinstance(event, (Done, Error)):
            finals.append(event)
    n = expected_records(data, sep, max_bytes)
    assert [e.index for e in finals] == list(range(1, n + 1))  # one each, in input order
    # Every line valid UTF-8 JSON. (Split on b"\n" only: str.splitlines would also cut at U+0085.)
    wire = [json.loads(x.decode("utf-8")) for x in out_jsonl.getvalue().split(b"\n")[:-1]]
    assert [w for w in wire if w["event"] != "chunk"] == [e.to_dict() for e in finals]
    assert all(isinstance(w["id"], (str, int)) for w in wire)
    if not null:  # (with -z, the fake engine's echo of a "\u0000" in a prompt would hold a NUL)
        assert out_text.getvalue().count(b"\n") == n  # text mode with --one-line: one line per record


def test_any_input_gives_one_final_line_per_record() -> None:
    lines_fed.clear()
    check_any_input()
    assert sum(lines_fed) >= 10 * FUZZ_EXAMPLES  # 10,000 generated input lines by default


# ---------------------------------------------------------------------------------------------
# Memory stays flat, whatever the input's length.


def _peak_rss_kb(lines: int) -> int:
    """Run the command over ``lines`` records with the fake engine; return its peak RSS (kB)."""
    feed = subprocess.Popen(
        ["bash", "-c", f'yes \'{{"prompt": "hello there", "max_tokens": 3}}\' | head -n {lines}'],
        stdout=subprocess.PIPE,
    )
    p = subprocess.Popen(
        [*FAKECLI, "--jsonl", "--no-stream"],
        stdin=feed.stdout,
        stderr=subprocess.PIPE,
        env=cli_env(FAKE_SINK="1"),
        cwd=REPO,
    )
    assert feed.stdout and p.stderr
    feed.stdout.close()
    err = p.stderr.read()
    _, status, usage = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(status)
    feed.wait()
    assert p.returncode == 0, err
    assert err.decode() == f"fakecli: {lines} lines\n"  # every record accounted for
    return usage.ru_maxrss // (1024 if sys.platform == "darwin" else 1)


def test_memory_is_flat_over_a_quarter_million_lines() -> None:
    small = _peak_rss_kb(10_000)
    large = _peak_rss_kb(250_000)
    # 25 times the input, not 4 MB more: a record's worth of 16 bytes kept would show (the peaks here were
    # 0.3 MB apart; a million lines with 16 MB, the same bound a record, took 90 s of the suite)
    assert large - small < 4 * 1024, (small, large)


# ---------------------------------------------------------------------------------------------
# kill -9 at any moment, then --resume


def _ids(path: Path) -> list[object]:
    events = [json.loads(x) for x in path.read_bytes().split(b"\n")[:-1]]  # every line whole JSON
    return [e["id"] for e in events if e["event"] == "done"]


def test_kill_at_random_moments_then_resume_does_every_record_once(tmp_path: Path) -> None:
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    ids = [f"k{n}" for n in range(300)]
    inp.write_text("".join(json.dumps({"id": i, "prompt": f"p {i}"}) + "\n" for i in ids))
    args = [*FAKECLI, "--jsonl", "--resume", str(out), str(inp)]
    env = cli_env(FAKE_DELAY="0.004")
    rng = random.Random(8)
    kills = 0
    for _ in range(30):
        p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=REPO)
        time.sleep(rng.uniform(0.2, 0.8))
        p.send_signal(signal.SIGKILL)
        p.wait()
        assert p.stdout and p.stdout.read() == b""
        if p.returncode == -signal.SIGKILL:
            kills += 1
        if out.exists() and out.read_bytes().endswith(b"\n") and rng.random() < 0.5:
            with open(out, "ab") as f:  # as a kill in the middle of a write would leave it
                f.write(out.read_bytes().splitlines()[-1][: rng.randrange(1, 20)])
        done = _ids(out) if out.exists() and out.read_bytes().endswith(b"\n") else None
        if done is not None and len(done) == len(ids):
            break
    assert kills >= 2
    for _ in range(2):  # the first run finishes the job; the second finds nothing left to do
        r = subprocess.run(args, capture_output=True, env=cli_env(), cwd=REPO, timeout=120)
        assert r.returncode == 0 and r.stdout == b"", r.stderr
        assert b"Traceback" not in r.stderr
    assert _ids(out) == ids  # each record done exactly once, in input order


def test_resume_refuses_a_file_that_is_not_its_output(tmp_path: Path) -> None:
    inp, notes = tmp_path / "in.jsonl", tmp_path / "notes.jsonl"
    inp.write_text('{"prompt": "a"}\n')
    notes.write_text('{"prompt": "a"}\n')
    r = subprocess.run(
        [*FAKECLI, "--jsonl", "--resume", str(notes), str(inp)], capture_output=True, env=cli_env(), cwd=REPO
    )
    assert r.returncode == 2 and r.stdout == b""
    assert r.stderr.decode() == (
        f"mlxpipe: error: --resume file {notes}:1 is not mlxpipe JSONL output; refusing to append to it\n"
    )
    assert notes.read_text() == '{"prompt": "a"}\n'


def test_resume_needs_jsonl_output_and_a_free_file(tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    r = subprocess.run([*FAKECLI, "--resume", str(out)], input=b"a\n", capture_output=True, env=cli_env())
    assert r.returncode == 2
    assert r.stderr == b"mlxpipe: error: --resume needs JSONL output (--out jsonl, --jsonl or --out openai)\n"
    holder = subprocess.Popen(
        [*FAKECLI, "--jsonl", "--resume", str(out)], stdin=subprocess.PIPE, env=cli_env(), cwd=REPO
    )
    try:
        while not out.exists():
            time.sleep(0.02)
        time.sleep(0.3)  # the lock is taken right after the file is created
        r = subprocess.run(
            [*FAKECLI, "--jsonl", "--resume", str(out)], input=b"", capture_output=True, env=cli_env()
        )
        assert r.returncode == 2
        assert r.stderr.decode() == f"mlxpipe: error: --resume file {out} is in use by another mlxpipe\n"
    finally:
        assert holder.stdin
        holder.stdin.close()
        holder.wait(timeout=30)
    assert holder.returncode == 0


def test_resume_redoes_failed_and_interrupted_records(tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    earlier = [
        {"event": "done", "id": 1, "text": "x", "finish_reason": "stop"},
        {"event": "error", "id": 2, "file": "<stdin>", "line": 2, "error": "boom"},
        {"event": "done", "id": 3, "text": "x", "finish_reason": "interrupted"},
        {"event": "chunk", "id": 4, "text": "x", "tokens": 1, "tps": 1.0},
    ]
    out.write_text("".join(json.dumps(e) + "\n" for e in earlier))
    r = subprocess.run(
        [*FAKECLI, "--jsonl", "--resume", str(out)],
        input=b'"a"\n"b"\n"c"\n"d"\n{"id": 1, "prompt": "again"}\n',
        capture_output=True,
        env=cli_env(),
    )
    # The last record's id is record 1's (known by its number): refused, never skipped as done (issue 39).
    assert r.returncode == 1 and r.stdout == b"" and b"id 1 is already the id of record 1" in r.stderr
    new = [json.loads(x) for x in out.read_text().splitlines()[len(earlier) :]]
    assert [(e["event"], e["id"]) for e in new] == [("done", 2), ("done", 3), ("done", 4), ("error", 1)]


def test_sigterm_mid_run_ends_by_sigterm_and_resume_finishes(tmp_path: Path) -> None:
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    ids = list(range(1, 201))
    inp.write_text("".join(json.dumps({"id": i, "prompt": f"p {i}"}) + "\n" for i in ids))
    args = [*FAKECLI, "--jsonl", "--resume", str(out), str(inp)]
    p = subprocess.Popen(args, stderr=subprocess.PIPE, env=cli_env(FAKE_DELAY="0.01"), cwd=REPO)
    while not out.exists() or out.read_bytes().count(b"\n") < 5:
        time.sleep(0.02)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=60)
    assert p.returncode == -signal.SIGTERM
    assert err.decode().startswith("mlxpipe: interrupted by SIGTERM after ")
    assert 5 <= len(_ids(out)) < len(ids)
    r = subprocess.run(args, capture_output=True, env=cli_env(), cwd=REPO, timeout=120)
    assert r.returncode == 0 and r.stderr == b""
    assert _ids(out) == ids


def test_a_reader_that_goes_away_ends_a_jsonl_run_quietly(tmp_path: Path) -> None:
    script = (
        'yes \'{"prompt": "hi"}\' | head -n 100000 | '
        f'{" ".join(FAKECLI)} --jsonl 2>{tmp_path / "err"} | head -n 3; echo " ${{PIPESTATUS[2]}}"'
    )
    r = subprocess.run(["bash", "-c", script], capture_output=True, env=cli_env(), cwd=REPO, timeout=120)
    lines = r.stdout.decode().split("\n")
    assert [json.loads(x)["event"] for x in lines[:3]] == ["chunk", "chunk", "done"]
    assert lines[3] == " 0"  # mlxpipe's own exit status
    assert (tmp_path / "err").read_bytes() == b""
