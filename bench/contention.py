"""One stream's decode speed with 1 and with 2 OpenBLAS threads, on a quiet CPU and beside a busy process.

    python bench/contention.py [--records 3] [--max-tokens 96]
    python bench/contention.py --batch 1,2,16,auto [--records 32] [--max-tokens 32]

With ``--batch``: the whole command's wall time (model load included) on the same records at each batch
size, with mlxpipe's own thread choice, quiet and beside a busy process; each size's busy throughput
against its quiet one and against ``--batch 1`` beside the same busy process (issue 19's goals: >= 60% and
never slower). Greedy texts are compared with ``--batch 1``'s.

Runs the real command (``mlxpipe --out jsonl``, greedy) on the same records in each of four settings and
prints the median decode tok/s (the done events' ``tps``). "busy": one other process spins on one core
meanwhile, as a second job on a shared machine would. 1 thread is mlxpipe's default for a single stream; 2 is
OpenBLAS's own default on this 2-core machine (``OPENBLAS_NUM_THREADS=2``).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import time

PROMPTS = [
    "Write a long story about a dragon who learns to paint.",
    "Explain how a refrigerator works to a ten-year-old.",
    "Describe a walk through a busy market in the morning.",
]


def spin(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def decode_tps(threads: int, busy: bool, records: int, max_tokens: int) -> float:
    env = {**os.environ, "OPENBLAS_NUM_THREADS": str(threads)}
    cmd = [sys.executable, "-m", "mlxpipe", "--out", "jsonl", "--temp", "0", "--max-tokens", str(max_tokens)]
    stdin = "\n".join(PROMPTS[i % len(PROMPTS)] for i in range(records)) + "\n"
    hog = multiprocessing.Process(target=spin, args=(600,)) if busy else None
    if hog:
        hog.start()
    try:
        out = subprocess.run(cmd, input=stdin, capture_output=True, text=True, env=env, check=True).stdout
    finally:
        if hog:
            hog.terminate()
            hog.join()
    done = [e for e in map(json.loads, out.splitlines()) if e["event"] == "done"]
    return statistics.median(e["tps"] for e in done)


def whole_run(batch: str, busy: bool, records: int, max_tokens: int) -> tuple[float, int, list[str]]:
    """(wall seconds, generated tokens, texts) of the whole command at ``--batch batch``."""
    cmd = [sys.executable, "-m", "mlxpipe", "--out", "jsonl", "--no-stream", "-n", str(max_tokens)]
    cmd += ["--batch", batch]
    stdin = "\n".join(f"{PROMPTS[i % len(PROMPTS)]} ({i})" for i in range(records)) + "\n"
    hog = multiprocessing.Process(target=spin, args=(900,)) if busy else None
    if hog:
        hog.start()
    try:
        start = time.perf_counter()
        out = subprocess.run(cmd, input=stdin, capture_output=True, text=True, check=True).stdout
        wall = time.perf_counter() - start
    finally:
        if hog:
            hog.terminate()
            hog.join()
    done = [e for e in map(json.loads, out.splitlines()) if e["event"] == "done"]
    return wall, sum(e["tokens"] for e in done), [e["text"] for e in done]


def batches(sizes: list[str], records: int, max_tokens: int) -> None:
    print(
        "| --batch | quiet wall | quiet tok/s | busy wall | busy tok/s | busy / quiet | busy / batch 1 busy "
        "| texts as --batch 1 |"
    )
    print("|---|---|---|---|---|---|---|---|")
    base: dict[bool, float] = {}
    texts: list[str] = []
    for size in sizes:
        got = {busy: whole_run(size, busy, records, max_tokens) for busy in (False, True)}
        rate = {busy: got[busy][1] / got[busy][0] for busy in got}
        base = base or rate
        texts = texts or got[False][2]
        same = sum(a == b for a, b in zip(got[False][2], texts, strict=True))
        print(
            f"| {size} | {got[False][0]:.1f} s | {rate[False]:.1f} | {got[True][0]:.1f} s | {rate[True]:.1f} "
            f"| {rate[True] / rate[False]:.2f} | {rate[True] / base[True]:.2f} | {same}/{len(texts)} |",
            flush=True,
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--batch", help="comma-separated --batch values (1 first): whole-command mode")
    args = parser.parse_args()
    print(f"load average before: {os.getloadavg()[0]:.2f}", flush=True)
    if args.batch:
        batches(args.batch.split(","), args.records, args.max_tokens)
        print(f"load average after: {os.getloadavg()[0]:.2f}")
        return 0
    results = {}
    for busy in (False, True):
        for threads in (1, 2):
            tps = decode_tps(threads, busy, args.records, args.max_tokens)
            results[busy, threads] = tps
            where = "beside a busy process" if busy else "quiet"
            print(f"{threads} OpenBLAS thread(s), {where:<22} {tps:6.1f} tok/s", flush=True)
    for busy in (False, True):
        ratio = results[busy, 1] / results[busy, 2]
        print(f"{'busy' if busy else 'quiet'}: 1 thread / 2 threads = {ratio:.2f}x")
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
