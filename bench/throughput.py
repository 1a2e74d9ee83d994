"""Throughput of --batch: the same records, greedy, max tokens 32, at batch sizes 1, 4, 8, 16 and 32.

    flock -x /tmp/mlxpipe-cpu.lock python bench/throughput.py [--records 64] [--sizes 1,4,8,16,32]

One process, one loaded model (the CLI's default load), every size run on the same records through
``mlxpipe.run`` (the CLI's own path, input order kept). Prints wall time, aggregate generated tokens per
second and the speed-up over batch 1, and how many answers differ from batch 1's (float rounding under
batching: see bench/RESULTS.md).
"""

from __future__ import annotations

import argparse
import os
import platform
import time

from mlxpipe import Engine, records_from_objects, run
from mlxpipe.events import Done
from mlxpipe.records import Settings

TOPICS = [
    "the sea",
    "mountains",
    "coffee",
    "bicycles",
    "libraries",
    "volcanoes",
    "owls",
    "rain",
    "bread",
    "chess",
    "trains",
    "the moon",
    "gardens",
    "honey",
    "glaciers",
    "lanterns",
    "foxes",
    "jazz",
    "deserts",
    "maps",
    "clocks",
    "whales",
    "tea",
    "bridges",
    "snow",
    "violins",
    "comets",
    "forests",
    "lighthouses",
    "cheese",
    "kites",
    "rivers",
    "bees",
    "castles",
    "thunder",
    "pianos",
    "islands",
    "mushrooms",
    "robots",
    "autumn",
    "sailing",
    "candles",
    "penguins",
    "pottery",
    "caves",
    "tigers",
    "umbrellas",
    "wolves",
    "markets",
    "poetry",
    "fireworks",
    "apples",
    "deserts at night",
    "telescopes",
    "ferns",
    "dolphins",
    "windmills",
    "silk",
    "marathons",
    "origami",
    "volcanic islands",
    "cactus flowers",
    "paper boats",
    "city parks",
    "old radios",
    "northern lights",
]


def answers(engine: Engine, prompts: list[str], batch: int) -> tuple[float, list[Done]]:
    records = records_from_objects(prompts, Settings(max_tokens=32))
    start = time.perf_counter()
    done = [e for e in run(records, engine, batch=batch) if isinstance(e, Done)]
    return time.perf_counter() - start, done


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=64)
    parser.add_argument("--sizes", default="1,4,8,16,32")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    prompts = [f"Write two sentences about {TOPICS[n % len(TOPICS)]}." for n in range(args.records)]

    engine = Engine.load()
    info = engine.info()
    print(
        f"# {platform.machine()}, {os.cpu_count()} cores, device {info.get('device')}, "
        f"model {info.get('spec')}, weights {info.get('dtype', info.get('quantization'))}"
    )
    print(f"# {len(prompts)} records, greedy, max tokens 32")
    answers(engine, prompts[:2], 2)  # warm-up: first-call allocations and kernel set-up
    base_wall = 0.0
    base_texts: list[str] = []
    print("| batch | wall s | tokens | aggregate tok/s | speed-up | answers differing from batch 1 |")
    print("|---|---|---|---|---|---|")
    for size in sizes:
        wall, done = answers(engine, prompts, size)
        tokens = sum(d.tokens for d in done)
        texts = [d.text for d in done]
        if not base_texts:
            base_wall, base_texts = wall, texts
        differ = sum(a != b for a, b in zip(texts, base_texts, strict=True))
        print(
            f"| {size} | {wall:.1f} | {tokens} | {tokens / wall:.1f} | {base_wall / wall:.2f}x "
            f"| {differ}/{len(texts)} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
