"""Throughput of --batch: the same records, greedy, max tokens 32, at batch sizes 1, 4, 8, 16 and 32.

    flock -x /tmp/mlxpipe-cpu.lock python bench/throughput.py [--records 64] [--sizes 1,4,8,16,32]
    flock -x /tmp/mlxpipe-cpu.lock python bench/throughput.py --whole --records 256 --sizes 1,default

``--whole``: the real command as a user runs it on a file (``mlxpipe --out jsonl --no-stream -n 32 FILE``,
model load included), ``default`` meaning no ``--batch`` flag at all (issue 19's annotation-job goal). A size
may carry environment settings after ``+`` (``--sizes 1,default,1+MLXPIPE_INT8=on,default+MLXPIPE_INT8=on``):
answers are then compared with the first run that has the same settings.

One process, one loaded model (the CLI's default load), every size run on the same records through
``mlxpipe.run`` (the CLI's own path, input order kept). Prints wall time, aggregate generated tokens per
second and the speed-up over batch 1, and how many answers differ from batch 1's (float rounding under
batching: see bench/RESULTS.md).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
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


def whole(prompts: list[str], sizes: list[str]) -> None:
    """Each size as the whole command on a file of the prompts; wall time, tok/s, texts against the first."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "records.txt")
        with open(path, "w", encoding="utf-8") as f:
            f.write("".join(p + "\n" for p in prompts))
        load = os.getloadavg()[0]
        print(f"# {len(prompts)} records, greedy, max tokens 32, whole command; load {load:.2f}")
        print("| --batch | wall s | tokens | aggregate tok/s | speed-up | answers differing from the first |")
        print("|---|---|---|---|---|---|")
        base_wall, base_texts = 0.0, {}
        for entry in sizes:
            size, *settings = entry.split("+")
            env = dict(os.environ, **dict(s.split("=", 1) for s in settings))
            flag = [] if size == "default" else ["--batch", size]
            cmd = [sys.executable, "-m", "mlxpipe", "--out", "jsonl", "--no-stream", "-n", "32", *flag, path]
            start = time.perf_counter()
            out = subprocess.run(
                cmd, capture_output=True, text=True, check=True, stdin=subprocess.DEVNULL, env=env
            )
            wall = time.perf_counter() - start
            done = [e for e in map(json.loads, out.stdout.splitlines()) if e["event"] == "done"]
            tokens, texts = sum(e["tokens"] for e in done), [e["text"] for e in done]
            base_wall = base_wall or wall
            first = base_texts.setdefault(tuple(settings), texts)
            differ = sum(a != b for a, b in zip(texts, first, strict=True))
            print(
                f"| {entry} | {wall:.1f} | {tokens} | {tokens / wall:.1f} | {base_wall / wall:.2f}x "
                f"| {differ}/{len(texts)} |",
                flush=True,
            )
        print(f"# load average after: {os.getloadavg()[0]:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=64)
    parser.add_argument("--sizes", default="1,4,8,16,32")
    parser.add_argument("--whole", action="store_true", help="the real command on a file, one process a size")
    args = parser.parse_args()
    prompts = [f"Write two sentences about {TOPICS[n % len(TOPICS)]}." for n in range(args.records)]
    if args.whole:
        whole(prompts, args.sizes.split(","))
        return
    sizes = [int(s) for s in args.sizes.split(",")]

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
