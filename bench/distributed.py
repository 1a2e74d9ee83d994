"""Records over ranks: one process vs ``mlx.launch -n 2 --backend ring`` on this machine, side by side.

    flock -x /tmp/mlxpipe-cpu.lock python bench/distributed.py [--records 16] [--max-tokens 16]

Both runs are the real command on the same file (greedy, --no-stream JSONL), model load included, as a
user would time them. Prints wall time, generated tokens per second and the ratio to one process, whether
the answers are the same, and the cost of one protocol round (two all_gathers of a 1 KB frame) measured
alone. On one host the two ranks share its cores, so this measures the protocol's overhead and the gain
from two model instances there, not what more hosts give (each adds its own cores).
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
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LAUNCH = Path(sys.executable).with_name("mlx.launch")
TOPICS = ["the sea", "mountains", "coffee", "bicycles", "libraries", "volcanoes", "owls", "rain"]

ROUNDS = """
import time
from mlxpipe.distributed import Ranks
ranks = Ranks.init()
frame = b"x" * 1024
ranks.gather(frame)
started = time.perf_counter()
for _ in range(200):
    ranks.gather(frame)
if ranks.rank == 0:
    print((time.perf_counter() - started) / 200 * 1000)
"""


def launch(args: list[str]) -> list[str]:
    return [str(LAUNCH), "-n", "2", "--backend", "ring", "--python", sys.executable, "--", *args]


def timed(cmd: list[str], env: dict[str, str]) -> tuple[float, bytes]:
    started = time.perf_counter()
    r = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, env=env, cwd=REPO, check=True)
    return time.perf_counter() - started, r.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()
    env = dict(os.environ, PYTHONPATH=str(REPO))
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "in.jsonl"
        lines = [
            json.dumps({"id": i, "prompt": f"Write one sentence about {TOPICS[i % len(TOPICS)]}."})
            for i in range(args.records)
        ]
        data.write_text("\n".join(lines) + "\n")
        cmd = ["-m", "mlxpipe", "--jsonl", "--no-stream", "-n", str(args.max_tokens), str(data)]
        one_s, one_out = timed([sys.executable, *cmd], env)
        two_s, two_out = timed(launch(cmd), env)
        round_ms = float(timed(launch(["-c", ROUNDS]), env)[1])

    def texts(out: bytes) -> list[tuple[object, str]]:
        return [(e["id"], e["text"]) for e in map(json.loads, out.splitlines())]

    tokens = sum(json.loads(line)["tokens"] for line in one_out.splitlines())
    day, cores = time.strftime("%Y-%m-%d"), os.cpu_count()
    print(f"# {day}, {platform.machine()}, {cores} cores, {args.records} records,")
    print(f"# max tokens {args.max_tokens}, greedy; wall includes model load")
    print("| run | wall s | generated tok/s | vs one process |")
    print("|---|---|---|---|")
    print(f"| one process | {one_s:.1f} | {tokens / one_s:.1f} | 1.00 |")
    print(f"| mlx.launch -n 2 --backend ring | {two_s:.1f} | {tokens / two_s:.1f} | {one_s / two_s:.2f} |")
    same = texts(one_out) == texts(two_out)
    print(f"answers identical, in the same order: {same}")
    print(f"one protocol round (two all_gathers of a 1 KB frame, loopback): {round_ms:.2f} ms")


if __name__ == "__main__":
    main()
