"""Structured output (issue 9): JSON schemas, choices, regexes and Lark grammars on the real model."""

from __future__ import annotations

import json
import math
import re

import jsonschema
import pytest
from conftest import run_cli

from mlxpipe import constrain
from mlxpipe.events import Done

REVIEWS = [
    "Loved it, five stars.",
    "Awful, broke in a day.",
    "Great value, works well.",
    "Terrible support, never again.",
    "Best purchase this year.",
    "Cheap plastic, cracked fast.",
    "Fantastic sound quality.",
    "Arrived late and damaged.",
    "Does exactly what I wanted.",
    "Waste of money.",
    "Super comfy shoes.",
    "Battery died after a week.",
    "My kids adore it.",
    "Smells bad, returned it.",
    "Fast delivery, nice box.",
    "Too small and flimsy.",
    "Excellent, highly recommend.",
    "Stopped working, useless.",
    "Pretty and sturdy.",
    "Worst app ever.",
]
SENTIMENT = {
    "type": "object",
    "properties": {
        "sentiment": {"enum": ["positive", "negative"]},
        "stars": {"type": "integer", "minimum": 1, "maximum": 5},
    },
    "required": ["sentiment", "stars"],
    "additionalProperties": False,
}


def events(stdout: bytes) -> list[dict]:
    return [json.loads(line) for line in stdout.decode().splitlines()]


# ---------------------------------------------------------------------------------------------
# Fast: building constraints, usage errors (no model is loaded), the wire format


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--json-schema", '{"type": "strin"}'], "--json-schema: invalid json schema: Invalid type: strin"),
        (["--json-schema", '{"type": "object",'], "--json-schema: json schema is not valid JSON"),
        (["--json-schema", "/no/such/schema.json"], "--json-schema: cannot read json schema file"),
        (["--regex", "([a-z"], "--regex: invalid regex"),
        (["--choices", "a,,b"], "--choices: choices must be a non-empty list"),
        (["--choices", "a,b,a"], "--choices: choices must not repeat a label"),
        (["--choices", "a,b", "--regex", "x"], "--choices and --regex cannot be used together"),
    ],
)
def test_bad_constraint_is_a_usage_error_before_any_work(args: list[str], message: str) -> None:
    r = run_cli([*args, "-m", "/no/such/model.gguf"], input="never read\n")  # a model error would be 3
    assert r.returncode == 2
    assert r.stdout == b""
    err = r.stderr.decode()
    assert err.startswith("mlxpipe: error: " + message) and err.count("\n") == 1


def test_bad_lark_grammar_file_is_a_usage_error(tmp_path) -> None:
    grammar = tmp_path / "g.lark"
    grammar.write_text("start: undefined_rule\n")
    r = run_cli(["--grammar", str(grammar), "-m", "/no/such/model.gguf"], input="")
    assert r.returncode == 2 and r.stdout == b""
    assert r.stderr.decode().startswith("mlxpipe: error: --grammar: invalid grammar: unknown name")


def test_json_schema_argument_reads_a_file_or_inline_json(tmp_path) -> None:
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(SENTIMENT))
    assert constrain.json_schema_argument(str(path)) == constrain.json_schema_argument(json.dumps(SENTIMENT))
    assert constrain.json_schema_argument(str(path)).kind == "json_schema"


def test_record_fields_give_a_constraint_or_a_reason() -> None:
    assert constrain.from_record({"prompt": "x"}) is None
    assert constrain.from_record({"choices": ["yes", "no"]}).labels == ("yes", "no")  # type: ignore[union-attr]
    assert constrain.from_record({"choices": "yes, no"}).labels == ("yes", "no")  # type: ignore[union-attr]
    for bad, reason in [
        ({"json_schema": "{}"}, "'json_schema' must be a JSON object"),
        ({"json_schema": {"type": "nope"}}, "invalid json schema"),
        ({"choices": [1, 2]}, "non-empty strings"),
        ({"choices": ["a"], "json_schema": {}}, "not both"),
    ]:
        with pytest.raises(constrain.ConstraintError, match=reason):
            constrain.from_record(bad)


def test_choice_probabilities_are_a_softmax_of_log_probabilities() -> None:
    probs = constrain.normalized({"a": math.log(0.2), "b": math.log(0.6), "c": -math.inf})
    assert probs == pytest.approx({"a": 0.25, "b": 0.75, "c": 0.0})


def test_done_event_carries_json_only_when_there_is_a_parsed_answer() -> None:
    plain = Done(1, 1, "hi", "stop", 1, 1.0, 1, 1.0, 1, "q").to_dict()
    assert "json" not in plain and "choices" not in plain
    null = Done(1, 1, "null", "stop", 1, 1.0, 1, 1.0, 1, "q", json=None, has_json=True).to_dict()
    assert "json" in null and null["json"] is None
    chosen = Done(1, 1, "no", "stop", 1, 1.0, 1, 1.0, 1, "q", choices={"yes": 0.25, "no": 0.75}).to_dict()
    assert chosen["choices"] == {"yes": 0.25, "no": 0.75}


def test_done_event_with_structured_fields_crosses_ranks_intact() -> None:
    from mlxpipe.distributed import decode_event, encode_event

    done = Done(1, 1, "null", "stop", 1, 1.0, 1, 1.0, 1, "q", json=None, has_json=True, choices={"a": 1.0})
    assert decode_event(json.loads(json.dumps(encode_event(done)))) == done


# ---------------------------------------------------------------------------------------------
# The real model through the real command


@pytest.mark.model
def test_twenty_records_all_parse_and_validate_against_the_schema() -> None:
    lines = "".join(f"Review: {text}\n" for text in REVIEWS)
    args = ["--raw", "--template", "{line}\nJSON:", "--json-schema", json.dumps(SENTIMENT), "--batch", "20"]
    r = run_cli([*args, "--out", "jsonl", "--no-stream", "-n", "16"], input=lines, timeout=600)
    assert r.returncode == 0, r.stderr
    assert r.stderr == b""
    out = events(r.stdout)
    assert len(out) == 20 and [e["id"] for e in out] == list(range(1, 21))
    for e in out:
        assert e["event"] == "done" and e["finish_reason"] == "stop"
        assert json.loads(e["text"]) == e["json"]
        jsonschema.validate(e["json"], SENTIMENT)


@pytest.mark.model
def test_choices_pick_the_right_label_on_clear_cut_reviews() -> None:
    reviews = {
        "Absolutely wonderful film, I loved every minute.": "positive",
        "Terrible, boring, a waste of money.": "negative",
    }
    lines = "".join(f'Is this review positive, negative or neutral? "{text}"\n' for text in reviews)
    r = run_cli(["--choices", "positive,negative,neutral", "--out", "jsonl"], input=lines)
    assert r.returncode == 0, r.stderr
    out = [e for e in events(r.stdout) if e["event"] == "done"]
    assert [e["text"] for e in out] == list(reviews.values())
    for e in out:
        probs = e["choices"]
        assert set(probs) == {"positive", "negative", "neutral"}
        assert sum(probs.values()) == pytest.approx(1.0, abs=1e-4)
        assert max(probs, key=probs.get) == e["text"]  # the answer agrees with its probabilities


@pytest.mark.model
def test_regex_answers_are_dates_in_text_mode() -> None:
    r = run_cli(
        ["--regex", r"\d{4}-\d{2}-\d{2}", "-n", "16"],
        input="What date is Christmas Day in 2024? Answer as YYYY-MM-DD.\n",
    )
    assert r.returncode == 0, r.stderr
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}\n", r.stdout.decode())


@pytest.mark.model
def test_lark_grammar_file(tmp_path) -> None:
    grammar = tmp_path / "count.lark"
    grammar.write_text('start: NUMBER " " UNIT\nNUMBER: /[1-9][0-9]?/\nUNIT: "legs" | "wings"\n')
    r = run_cli(["--grammar", str(grammar), "--raw", "-n", "8"], input="How many legs does a dog have?\n")
    assert r.returncode == 0, r.stderr
    assert re.fullmatch(r"[1-9][0-9]? (legs|wings)\n", r.stdout.decode())


@pytest.mark.model
@pytest.mark.parametrize("batch", ["1", "3"])
def test_per_record_constraints_in_jsonl_and_the_max_tokens_cut(batch: str) -> None:
    person = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12}, "capital": {"type": "boolean"}},
        "required": ["name", "capital"],
        "additionalProperties": False,
    }
    records = [
        {"id": "city", "prompt": "Is Paris a capital city? Answer in JSON.", "json_schema": person},
        {"id": "yesno", "prompt": "Is the sky blue? Answer yes or no.", "choices": ["yes", "no"]},
        {"id": "bad", "prompt": "Anything.", "json_schema": {"type": "strin"}},
        {
            "id": "cut",
            "prompt": "Is Paris a capital city? Answer in JSON.",
            "json_schema": person,
            "max_tokens": 3,
        },
        {"id": "free", "prompt": "Say hi.", "max_tokens": 4},
    ]
    lines = "".join(json.dumps(rec) + "\n" for rec in records)
    r = run_cli(["--jsonl", "-n", "24", "--batch", batch], input=lines)
    assert r.returncode == 1  # the bad schema and the cut answer failed, the rest were done
    finals = [e for e in events(r.stdout) if e["event"] != "chunk"]
    assert [(e["id"], e["event"]) for e in finals] == [
        ("city", "done"),
        ("yesno", "done"),
        ("bad", "error"),
        ("cut", "error"),
        ("free", "done"),
    ]
    city, yesno, bad, cut, free = finals
    jsonschema.validate(city["json"], person)
    assert yesno["text"] in ("yes", "no") and set(yesno["choices"]) == {"yes", "no"}
    assert bad["error"] == "invalid json schema: Invalid type: strin"
    assert cut["error"] == "answer incomplete: max tokens reached"
    assert "json" not in free and "choices" not in free  # a record without a constraint is unchanged
    err = r.stderr.decode().splitlines()
    assert err == [
        "mlxpipe: error (at <stdin>:3): invalid json schema: Invalid type: strin",
        "mlxpipe: error (at <stdin>:4): answer incomplete: max tokens reached",
    ]


@pytest.mark.model
def test_max_tokens_cut_prints_no_partial_answer_in_text_mode() -> None:
    r = run_cli(["--json-schema", json.dumps(SENTIMENT), "-n", "3"], input="Review: Great.\n")
    assert r.returncode == 1
    assert r.stdout == b"\n"  # the record's (empty) line, never a piece of JSON
    assert r.stderr.decode() == "mlxpipe: error (at <stdin>:1): answer incomplete: max tokens reached\n"


@pytest.mark.model
@pytest.mark.parametrize("batch", ["1", "3"])
@pytest.mark.parametrize(
    ("constraint", "prompt"),
    [
        (["--json-schema", '{"type": "number"}'], "Write the number minus twelve million, digit by digit."),
        (["--regex", "[a-z ]+"], "Write a long sentence about the sea."),
    ],
    ids=["number", "regex"],
)
def test_an_answer_the_grammar_accepts_but_max_tokens_cut_is_an_error(
    batch: str, constraint: list[str], prompt: str
) -> None:
    """-12 of a number is accepted by the grammar, yet -12345 continues it: max tokens cut it (issue 20)."""
    r = run_cli(["--out", "jsonl", "-n", "3", "--batch", batch, *constraint], input=f"{prompt}\n{prompt}\n")
    assert r.returncode == 1
    finals = [e for e in events(r.stdout) if e["event"] != "chunk"]
    assert [(e["event"], e.get("error")) for e in finals] == [
        ("error", "answer incomplete: max tokens reached")
    ] * 2


@pytest.mark.model
def test_complete_at_max_tokens_only_when_the_grammar_is_stopped(engine) -> None:
    """The check itself, with the real tokenizer: stopped (nothing could follow) versus merely accepting."""
    grammars = engine.constraints.grammars
    number = constrain.json_schema({"type": "number"})
    assert grammars.problem(number, "-12", "length") == "answer incomplete: max tokens reached"
    assert grammars.problem(number, "-12", "stop") is None  # the model ended it: -12 is its answer
    three = constrain.regex("[a-z]{3}")
    assert grammars.problem(three, "abc", "length") is None  # nothing can follow: complete
    assert grammars.problem(three, "ab", "length") == "answer incomplete: max tokens reached"
    obj = constrain.json_schema(
        {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    )
    assert grammars.problem(obj, '{"a":1}', "length") is None
    assert grammars.problem(three, "a1", "stop") == "answer does not match the constraint"
