"""Nothing skipped, nothing misplaced, nothing split (issue 39, sections 3-6): the real command on real
files, signals and terminals. Record ids never make a record skipped, output line N answers input line N,
an answer cut inside a multi-byte character never ends in U+FFFD, and the smaller faults found on the way."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import run_cli


def _events(stdout: bytes) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines()]


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
    assert any(a == b for a, b in zip(texts, texts[1:], strict=False))
    assert any(ord(c) > 0xFFFF for c in texts[-1])  # an emoji was answered whole (4 bytes, several tokens)
