"""The README's cookbook, run for real: every marked recipe on small inputs, on the embedded model."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import REPO, cli_env

RECIPE = re.compile(r"^<!-- recipe: ([\w-]+) -->\n```(\w+)\n(.*?)^```$", re.M | re.S)
MAX_TOKENS = "8"  # appended to every mlxpipe command line of a recipe: small, so the whole cookbook is quick


def recipes() -> dict[str, tuple[str, str]]:
    """Recipe name -> (language of the block, its text), in README order."""
    found = RECIPE.findall((REPO / "README.md").read_text())
    return {name: (lang, body) for name, lang, body in found}


QUESTIONS = "What is the capital of France?\nSay hello.\n"
REVIEWS = [
    {"id": 1, "review": "The soup was cold and the waiter was rude.", "stars": 1},
    {"id": 2, "review": "A wonderful evening with lovely food.", "stars": 5},
]

# Input files each recipe is given.
FILES: dict[str, dict[str, str]] = {
    "annotate": {"reviews.jsonl": "".join(json.dumps(r) + "\n" for r in REVIEWS)},
    "jq-events": {
        "questions.jsonl": '{"id": "q1", "prompt": "What is the capital of France?"}\n'
        '{"id": "q2", "prompt": "Say hello."}\n'
    },
    "grep-stream": {"questions.txt": QUESTIONS},
    "paste": {"questions.txt": QUESTIONS},
    "xargs": {"notes/a.txt": "What is the capital of France?\n", "notes/b.txt": "Say hello.\n"},
    "makefile": {"a.txt": "What is the capital of France?\n", "b.txt": "Say hello.\n"},
    "while-read": {"questions.txt": QUESTIONS},
    "csv-template": {"products.csv": "mug,red\nlamp,green\n"},
    "choices": {"reviews.txt": "".join(f"{r['review']}\n" for r in REVIEWS)},
    "openai-batch": {
        "batch.jsonl": "".join(
            json.dumps(
                {
                    "custom_id": f"task-{n}",
                    "method": "POST",
                    "url": "/v1/chat/completions",
                    "body": {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": q}]},
                }
            )
            + "\n"
            for n, q in enumerate(QUESTIONS.splitlines())
        )
    },
}


def check_annotate(d: Path, out: str) -> None:
    rows = [json.loads(line) for line in (d / "annotated.jsonl").read_text().splitlines()]
    assert len(rows) == len(REVIEWS)
    for row, review in zip(rows, REVIEWS, strict=True):
        assert {k: row[k] for k in review} == review  # every field kept
        assert isinstance(row["mood"], str) and row["mood"].strip()


def check_jq_events(d: Path, out: str) -> None:
    rows = [line.split("\t") for line in out.splitlines()]
    assert [r[0] for r in rows] == ["q1", "q2"]
    assert all(int(r[1]) > 0 for r in rows)
    assert "Paris" in rows[0][2]


def check_grep_stream(d: Path, out: str) -> None:
    lines = out.splitlines()
    assert lines  # grep exits 1 on no match, which fails the recipe anyway
    assert all("paris" in line.lower() for line in lines)


def check_paste(d: Path, out: str) -> None:
    rows = [line.split("\t") for line in (d / "side-by-side.tsv").read_text().splitlines()]
    assert [r[0] for r in rows] == QUESTIONS.splitlines()
    assert all(len(r) == 2 and r[1].strip() for r in rows)
    assert "Paris" in rows[0][1]


def check_xargs(d: Path, out: str) -> None:
    a, b = ((d / "notes" / f"{n}.txt.answer").read_text() for n in "ab")
    assert "Paris" in a
    assert b.count("\n") == 1 and b.strip()


def check_makefile(d: Path, out: str) -> None:
    for name in ("a", "b"):
        (done,) = [json.loads(line) for line in (d / f"{name}.json").read_text().splitlines()]
        assert done["event"] == "done" and done["text"]
    assert run_make(d, "-q").returncode == 0  # everything is up to date
    later = max((d / f"{n}.json").stat().st_mtime for n in "ab") + 10
    os.utime(d / "b.txt", (later, later))  # b.txt changed
    plan = run_make(d, "-n").stdout
    assert "b.txt" in plan and "a.txt" not in plan  # only b.json is redone


def check_while_read(d: Path, out: str) -> None:
    lines = out.splitlines()
    assert [line.split(": ", 1)[0] for line in lines] == ["1", "2"]
    assert "Paris" in lines[0]


def check_csv_template(d: Path, out: str) -> None:
    lines = out.splitlines()
    assert len(lines) == 2 and all(line.strip() for line in lines)


def check_choices(d: Path, out: str) -> None:
    labels = out.splitlines()
    assert len(labels) == len(REVIEWS) and set(labels) <= {"positive", "negative"}


def check_openai_batch(d: Path, out: str) -> None:
    rows = [line.split("\t") for line in out.splitlines()]
    assert [r[0] for r in rows] == ["task-0", "task-1"]
    assert "Paris" in rows[0][1]
    results = [json.loads(line) for line in (d / "results.jsonl").read_text().splitlines()]
    assert all(r["error"] is None and r["response"]["status_code"] == 200 for r in results)


CHECKS: dict[str, Callable[[Path, str], None]] = {
    "annotate": check_annotate,
    "jq-events": check_jq_events,
    "grep-stream": check_grep_stream,
    "paste": check_paste,
    "xargs": check_xargs,
    "makefile": check_makefile,
    "while-read": check_while_read,
    "csv-template": check_csv_template,
    "choices": check_choices,
    "openai-batch": check_openai_batch,
}


def recipe_env(d: Path) -> dict[str, str]:
    """PATH with an ``mlxpipe`` that runs this checkout with small max tokens."""
    bin_dir = d / ".bin"
    bin_dir.mkdir()
    wrapper = bin_dir / "mlxpipe"
    wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m mlxpipe "$@" -n {MAX_TOKENS}\n')
    wrapper.chmod(0o755)
    return cli_env(PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")


def run_make(d: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = cli_env(PATH=f"{d / '.bin'}{os.pathsep}{os.environ['PATH']}")  # the wrapper test_recipe made
    return subprocess.run(["make", *args], cwd=d, env=env, capture_output=True, text=True, timeout=300)


def test_cookbook_has_eight_recipes_each_checked() -> None:
    names = list(recipes())
    assert len(names) >= 8
    assert sorted(names) == sorted(CHECKS), "every recipe needs input FILES and a check in this file"


@pytest.mark.model
@pytest.mark.parametrize("name", list(CHECKS))
def test_recipe(name: str, tmp_path: Path) -> None:
    lang, body = recipes()[name]
    tools = {"jq", "make", "xargs", "paste", "grep"} & set(re.findall(r"[\w.-]+", body))
    missing = [t for t in tools if shutil.which(t) is None]
    if missing:
        pytest.skip(f"not installed: {', '.join(missing)}")
    for rel, text in FILES[name].items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    env = recipe_env(tmp_path)
    if lang == "make":
        (tmp_path / "Makefile").write_text(body)
        r = subprocess.run(["make"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    else:
        assert lang == "sh"
        script = "set -euo pipefail\n" + body
        r = subprocess.run(
            ["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
        )
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    CHECKS[name](tmp_path, r.stdout)
