"""Structured output's cost per token: the same records decoded with and without a JSON-schema constraint.

Each record is answered twice in a row, unconstrained then constrained (alternating which goes first from
record to record, so drift in machine load hits both alike), on one loaded engine. Decode speed is
mlx-lm's generation tok/s (prompt processing excluded); the script prints both aggregates and their ratio,
plus the time spent in the constraint's logits processor itself.

    python bench/structured.py [--records N] [--max-tokens N] [--model MODEL]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from dataclasses import replace
from typing import Any

from mlxpipe import constrain
from mlxpipe.engine import Engine
from mlxpipe.errors import RecordError
from mlxpipe.events import Chunk, Done
from mlxpipe.records import Record, Settings

SCHEMA = {
    "type": "object",
    "properties": {
        "sentiment": {"enum": ["positive", "negative", "neutral"]},
        "summary": {"type": "string", "maxLength": 200},
        "keywords": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 5},
    },
    "required": ["sentiment", "summary", "keywords"],
    "additionalProperties": False,
}
REVIEWS = [
    "The battery lasts two days and the screen is gorgeous, but the camera struggles at night.",
    "Customer service never answered my emails and the blender leaked on the first use.",
    "A solid, quiet dishwasher. Installation took an hour and the manual was clear.",
    "These headphones are comfortable for hours; the noise cancelling is only average.",
    "The novel starts slowly, then the last hundred pages are impossible to put down.",
    "Cheap zipper, the backpack tore within a month of light use. Not recommended.",
    "Great little cafe: friendly staff, excellent espresso, too few seats at lunchtime.",
    "The update made the app slower and removed the dark mode I relied on every night.",
]


def answer(engine: Engine, record: Record) -> tuple[int, float, bool]:
    """Tokens decoded, mlx-lm's decode tok/s, and whether the record ended in a done event."""
    tokens, tps = 0, 0.0
    try:
        for event in engine.generate(record):
            if isinstance(event, (Chunk, Done)):
                tokens, tps = event.tokens, event.tps
    except RecordError:  # cut at max tokens: an error line in the real command, but the tokens were decoded
        return tokens, tps, False
    return tokens, tps, True


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--records", type=int, default=len(REVIEWS))
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--model", default=None)
    args = parser.parse_args()

    engine = Engine.load(args.model)
    constraint = constrain.json_schema(SCHEMA)
    assert engine.constraints.grammars is not None  # built once up front (~0.4 s), as a run pays it once

    # The constraint's own CPU work per token (llguidance's mask and the unpacking into a bool array).
    mask_seconds = [0.0]
    for name in ("mask", "consume"):
        method = getattr(constrain.Matcher, name)

        def timed(self: Any, *a: Any, _method: Any = method) -> Any:
            t = time.perf_counter()
            out = _method(self, *a)
            mask_seconds[0] += time.perf_counter() - t
            return out

        setattr(constrain.Matcher, name, timed)

    base = Settings(max_tokens=args.max_tokens)
    totals = {"plain": [0, 0.0], "schema": [0, 0.0]}  # tokens, decode seconds
    complete = 0
    # One warm-up record so first-call compilation is paid by neither side.
    warm = Record(0, "bench", 0, 0, None, replace(base, max_tokens=4), prompt="Hi")
    answer(engine, warm)
    for i in range(args.records):
        text = REVIEWS[i % len(REVIEWS)]
        prompt = f"Review: {text}\nDescribe the review as JSON with sentiment, summary and keywords."
        plain = Record(i + 1, "bench", i + 1, i + 1, None, base, prompt=prompt)
        schema = Record(
            i + 1, "bench", i + 1, i + 1, None, replace(base, constraint=constraint), prompt=prompt
        )
        order = [("plain", plain), ("schema", schema)]
        for name, record in order if i % 2 == 0 else order[::-1]:
            tokens, tps, finished = answer(engine, record)
            # mlx-lm's tps counts from the first generated token, so prompt processing is left out.
            totals[name][0] += tokens
            totals[name][1] += tokens / tps if tps else 0.0
            complete += name == "schema" and finished

    plain_tps = totals["plain"][0] / totals["plain"][1]
    schema_tps = totals["schema"][0] / totals["schema"][1]
    overhead = plain_tps / schema_tps - 1
    info = engine.info()
    print(
        f"machine: {platform.machine()} {platform.system()}, {os.cpu_count()} cores, mlx {info['device']}, "
        f"model dtype {info.get('dtype', '?')}"
    )
    print(f"records: {args.records}, max tokens {args.max_tokens}, schema answers complete: {complete}")
    print(f"unconstrained: {totals['plain'][0]} tokens, {plain_tps:.2f} tok/s")
    print(f"json schema:   {totals['schema'][0]} tokens, {schema_tps:.2f} tok/s")
    print(f"constraint overhead per token: {overhead * 100:+.1f}% (goal <= 15%)")
    mask_ms = 1000 * mask_seconds[0] / max(totals["schema"][0], 1)
    print(f"llguidance mask + unpacking: {mask_ms:.3f} ms/token of {1000 / schema_tps:.1f} ms/token")
    print(
        json.dumps(
            {"plain_tps": plain_tps, "schema_tps": schema_tps, "overhead": overhead, "mask_ms": mask_ms}
        )
    )


if __name__ == "__main__":
    main()
