"""Shared-prefix reuse: records built from one ~500-token instruction template, prompt processing per record
with and without reusing the prefix's KV cache, side by side.

    flock -x /tmp/mlxpipe-cpu.lock python bench/prefix.py [--records 16]

Records are read the way the CLI reads them (``--in jsonl --template 'INSTRUCTIONS… {text}'``) and answered
with max tokens 1, so the time to the first token is the prompt processing. Sequential (--batch 1) and
batched (--batch 8) are both measured. "with reuse" includes building the prefix cache once, on the first
record.
"""

from __future__ import annotations

import argparse
import io as pyio
import json
import os
import platform
import statistics
import time

from mlxpipe import Engine, run
from mlxpipe.events import Done
from mlxpipe.reader import InputFormat, RecordReader
from mlxpipe.records import Settings, Template

RULES = [
    "Read the whole text before deciding; do not label from the first sentence alone.",
    "Label the author's attitude, not the topic: a calm report about a disaster is neutral.",
    "Sarcasm counts as the attitude it expresses, usually negative, even when the words are positive.",
    "Mixed texts take the label of their conclusion; if there is no conclusion, label them mixed.",
    "Questions without an opinion are neutral; rhetorical questions carry the opinion they imply.",
    "Ignore spelling mistakes, emoji and capital letters when they do not change the meaning.",
    "Quoted opinions of other people do not count unless the author agrees or disagrees with them.",
    "Prices, dates and numbers are facts; only words that judge them count as opinion.",
    "A complaint that ends in thanks for a fix is positive; one that ends in a threat to leave is negative.",
    "If the text is not in English, label it as you would its translation.",
]
INSTRUCTIONS = (
    "You are an annotator for a customer-feedback study. For each text below, give exactly one label: "
    "positive, negative, neutral or mixed. Follow these rules, in this order of importance.\n"
    + "\n".join(f"{n}. {rule}" for n, rule in enumerate(RULES * 2, 1))
    + "\nAnswer with the label only, in lower case, with no explanation.\n\n"
)
TEXTS = [
    "The delivery was late but the support team sorted it out in minutes. Thanks!",
    "Great, another update that breaks the login page. Just what I needed.",
    "The store opens at nine on weekdays and at ten on Saturdays.",
    "I love the new design, though the search is slower than before.",
    "Worst purchase this year; returning it tomorrow.",
    "Does the battery last a full day?",
    "Five stars, would buy again.",
    "My friend says it is overpriced, but I think it is worth every cent.",
]


def records(n: int) -> list:
    fmt = InputFormat(jsonl=True, template=Template.parse(INSTRUCTIONS + "Text: {text}\nLabel:"))
    reader = RecordReader(fmt, Settings(max_tokens=1))
    data = "".join(json.dumps({"text": TEXTS[k % len(TEXTS)] + f" (#{k})"}) + "\n" for k in range(n))
    return list(reader.read("<bench>", pyio.BytesIO(data.encode())))


def measure(engine: Engine, n: int, reuse: bool, batch: int) -> tuple[float, list[float], list[Done]]:
    engine.reuse_prefix = reuse
    engine.prefixes.clear()  # each measurement starts cold: the prefix is built inside it
    start = time.perf_counter()
    done = [e for e in run(records(n), engine, batch=batch) if isinstance(e, Done)]
    wall = time.perf_counter() - start
    return wall, [d.prompt_tokens / d.prompt_tps for d in done], done


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=16)
    args = parser.parse_args()
    engine = Engine.load()
    info = engine.info()
    recs = records(1)
    prompt_tokens = len(engine.encode(recs[0]))
    shared, _ = engine.prefix_for(recs[0], engine.encode(recs[0]))
    print(
        f"# {platform.machine()}, {os.cpu_count()} cores, device {info.get('device')}, "
        f"model {info.get('spec')}"
    )
    print(f"# {args.records} records, {prompt_tokens} prompt tokens each, {shared} of them a shared prefix")
    measure(engine, 2, False, 1)  # warm-up
    print("| mode | per-record prompt time, no reuse | with reuse | ratio | wall no reuse | wall reuse |")
    print("|---|---|---|---|---|---|")
    for batch in (1, 8):
        wall_off, ttft_off, done_off = measure(engine, args.records, False, batch)
        wall_on, ttft_on, done_on = measure(engine, args.records, True, batch)
        same = sum(a.text == b.text for a, b in zip(done_off, done_on, strict=True))
        if batch == 1:  # per record: the time to its first token
            off, on = statistics.mean(ttft_off), statistics.mean(ttft_on)
        else:  # records overlap: the batch's wall time shared out
            off, on = wall_off / args.records, wall_on / args.records
        print(
            f"| --batch {batch} | {off * 1000:.0f} ms | {on * 1000:.0f} ms | {off / on:.1f}x "
            f"| {wall_off:.1f} s | {wall_on:.1f} s |  (same first token: {same}/{args.records})",
            flush=True,
        )


if __name__ == "__main__":
    main()
